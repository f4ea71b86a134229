"""Sparse-attention policies. The registry here is the only place a policy is named.

``get(name, **params)`` builds one; ``names()`` lists them; ``resolve(policy_or_name)`` accepts
either. Each policy is a frozen dataclass (its fields are its parameters) with a ``source``, a
``budget(layout)`` and a cache that evicts for real.
"""
from __future__ import annotations

from dataclasses import fields

from .base import Budget, Policy, PolicyError, dense_entries

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
        name, args = parse_spec(policy)
        return get(name, **args)
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


def parse_spec(spec: str) -> tuple[str, dict]:
    """``"diagonal:rows=2,remainder=1"`` -> ``("diagonal", {"rows": 2, "remainder": 1})``."""
    name, _, args = spec.partition(":")
    return name, parse_args([a for a in args.split(",") if a.strip()])


def spec_params(spec: str, policy_args: dict | None = None) -> tuple[str, dict]:
    """``spec``'s name and parameters: its own settings over ``policy_args[name]`` (``--policy-arg``)."""
    name, args = parse_spec(spec)
    return name, {**(policy_args or {}).get(name, {}), **args}


def split_specs(text: str) -> list[str]:
    """``"dense;diagonal:rows=2,band=3,h2o"`` (``;`` or ``,`` between policies) -> ``["dense",
    "diagonal:rows=2,band=3", "h2o"]``: a ``key=value`` item with no ``name:`` continues the spec
    before it (policy names never hold ``=``)."""
    out: list[str] = []
    for item in (t.strip() for t in text.replace(";", ",").split(",")):
        if not item:
            continue
        if "=" in item and ":" not in item:
            if not out or ":" not in out[-1]:
                raise PolicyError(f"policy setting {item!r} must follow a 'name:key=value' spec, got {text!r}")
            out[-1] += "," + item
        else:
            out.append(item)
    return out


def _has_rho(name: str) -> bool:
    if name not in _REGISTRY:
        raise PolicyError(f"unknown policy {name!r}; choose one of {', '.join(_REGISTRY)}")
    return "rho" in {f.name for f in fields(_REGISTRY[name])}


def budget_follows(name: str, params: dict) -> bool:
    """Whether ``name`` takes a matched budget: it has a ``rho`` that ``params`` leave unset, and it is
    neither ``dense`` nor the reference ``diagonal``. Unknown names raise :class:`PolicyError`."""
    return _has_rho(name) and name not in ("dense", "diagonal") and "rho" not in params


def policy_at_budget(name: str, params: dict, target_kept: int, layout, n_layer: int = 1, n_head: int = 1):
    """The policy ``name`` (with ``params``) whose ``rho`` gives the most kept entries that do not exceed
    ``target_kept`` (entries per sequence, layer and head, prompt included).

    The policy's ``rho`` first asks for exactly ``target_kept`` (a half entry above, so its integer
    rounding lands there); that is the answer for every policy that keeps what it is asked for (the
    scored ones, ``streaming``) and for ``diagonal``, whose ``rho`` picks the most rows that fit.
    A policy that keeps more than asked (``headkv``/``ssh`` pad their slot table for broad heads)
    gets, by bisection, the largest ``rho`` whose kept fits.

    Raises
    ------
    PolicyError
        The policy has no ``rho`` parameter, or cannot keep as few as ``target_kept`` entries.
    """
    if not _has_rho(name):
        raise PolicyError(f"{name} has no rho parameter: its budget cannot be set")
    dense = dense_entries(layout)

    def build(k):  # the policy asked for k kept entries, and what it keeps
        pol = get(name, **{**params, "rho": min(1.0, (k + 0.5) / dense)})
        return pol, pol.budget(layout, n_layer, n_head).kept

    pol, kept = build(target_kept)
    if kept <= target_kept:
        return pol
    best, lo, hi = None, 1, target_kept - 1
    while lo <= hi:  # the k that fit form an interval [smallest feasible, largest that fits]: find its top
        mid = (lo + hi) // 2
        try:
            cand, kept = build(mid)
        except PolicyError:
            lo = mid + 1
            continue
        if kept <= target_kept:
            best, lo = cand, mid + 1
        else:
            hi = mid - 1
    if best is None:
        raise PolicyError(f"{name} cannot keep as few as {target_kept} of {dense} entries "
                          f"(rho {target_kept / dense:.3f}) with {params or 'its default parameters'}")
    return best


def build_policies(specs, policy_args: dict | None = None, match_budget: bool = False, layout=None,
                   n_layer: int = 1, n_head: int = 1) -> tuple[dict[str, Policy], dict]:
    """``{spec: policy}`` for each spec (``name`` or ``name:key=value,...``, its settings over
    ``policy_args[name]``), and a note on budget matching (empty without it).

    With ``match_budget`` (``layout`` needed), every policy whose ``rho`` is left unset
    (:func:`budget_follows`) keeps the most entries that fit in the reference ``diagonal``'s
    (:func:`policy_at_budget`; ``headkv`` pads its tables, so it gets a lower ``rho``): ``diagonal``
    with ``policy_args["diagonal"]`` and the settings of the first spec named ``diagonal``.
    """
    parsed = [(spec, *spec_params(spec, policy_args)) for spec in specs]
    match, target = {}, None
    if match_budget:
        diag = get("diagonal", **next((params for _, name, params in parsed if name == "diagonal"),
                                      (policy_args or {}).get("diagonal", {})))
        b = diag.budget(layout, n_layer, n_head)
        target = b.kept
        match = {"reference": "diagonal", "params": diag.params(), "kept": b.kept, "dense": b.dense, "rho": b.rho}
    built = {}
    for spec, name, params in parsed:
        if target is not None and budget_follows(name, params):
            built[spec] = policy_at_budget(name, params, target, layout, n_layer, n_head)
        else:
            built[spec] = get(name, **params)
    return built, match


from . import registry as _registry  # noqa: E402,F401  (registers the built-in policies)

__all__ = ["Budget", "Policy", "PolicyError", "budget_follows", "build_policies", "get", "names", "parse_args",
           "parse_spec", "policy_at_budget", "register_policy", "resolve", "spec_params", "split_specs"]
