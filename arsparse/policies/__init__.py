"""Sparse-attention policies. The registry here is the only place a policy is named.

``get(name, **params)`` builds one; ``names()`` lists them; ``resolve(policy_or_name)`` accepts
either. Each policy is a frozen dataclass (its fields are its parameters) with a ``source``, a
``budget(layout)`` and a cache that evicts for real.
"""
from __future__ import annotations

from dataclasses import fields

from .base import Budget, Policy, PolicyError

_REGISTRY: dict[str, type[Policy]] = {}


def register_policy(name: str):
    """Class decorator: make a policy available under ``name``."""

    def deco(cls):
        if name in _REGISTRY:
            raise ValueError(f"policy {name!r} registered twice")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def names() -> list[str]:
    return list(_REGISTRY)


def get(name: str, **params) -> Policy:
    """Build the policy ``name`` with ``params``; clear errors for unknown names and parameters."""
    if name not in _REGISTRY:
        raise PolicyError(f"unknown policy {name!r}; choose one of {', '.join(_REGISTRY)}")
    cls = _REGISTRY[name]
    allowed = [f.name for f in fields(cls)]
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise PolicyError(f"{name}: unknown parameter(s) {unknown}; allowed: {allowed or 'none'}")
    return cls(**params)


def resolve(policy) -> Policy | None:
    """A policy object, a registered name, ``"name:key=value,..."`` (e.g. ``"diagonal:rows=2,remainder=1"``)
    or None (dense engine) -> a policy object or None."""
    if policy is None or isinstance(policy, Policy):
        return policy
    if isinstance(policy, str):
        name, _, args = policy.partition(":")
        return get(name, **parse_args([a for a in args.split(",") if a.strip()]))
    raise PolicyError(f"policy must be a name or a Policy object, got {type(policy).__name__}")


def parse_args(pairs: list[str]) -> dict:
    """``["band=2", "rho=0.125"]`` -> ``{"band": 2, "rho": 0.125}`` (ints, floats, true/false, none)."""
    out = {}
    for pair in pairs:
        if "=" not in pair:
            raise PolicyError(f"policy argument {pair!r} must look like key=value")
        key, text = pair.split("=", 1)
        low = text.strip().lower()
        if low in ("true", "false"):
            value = low == "true"
        elif low in ("none", "null"):
            value = None
        else:
            try:
                value = int(text)
            except ValueError:
                try:
                    value = float(text)
                except ValueError:
                    value = text
        out[key.strip()] = value
    return out


from . import registry as _registry  # noqa: E402,F401  (registers the built-in policies)

__all__ = ["Budget", "Policy", "PolicyError", "get", "names", "parse_args", "register_policy", "resolve"]
