"""What every sparse-attention policy is: a validated dataclass with a source, a budget and a cache."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar

from ..layout import Layout


class PolicyError(ValueError):
    """A policy parameter is out of range, unknown, or does not fit the model."""


@dataclass(frozen=True)
class Budget:
    """KV entries per sequence, layer and head.

    ``read``: entries one decode step reads (mean over the image's decode steps).
    ``kept``: entries the cache must hold at once (what memory is sized for).
    ``dense``: entries dense attention keeps (prompt + every image position but the last).
    """

    read: float
    kept: int
    dense: int

    @property
    def rho(self) -> float:
        """Kept entries over dense: the memory ratio policies are matched on."""
        return self.kept / self.dense


@dataclass(frozen=True)
class Policy:
    """Base class. Subclasses are frozen dataclasses whose fields are the policy's parameters.

    ``name`` is set by :func:`arsparse.policies.register_policy`; ``source`` names the paper.
    """

    name: ClassVar[str] = ""
    source: ClassVar[str] = ""
    kind: ClassVar[str] = ""  # "offset" or "scored"

    def check(self, layout: Layout) -> None:
        """Raise :class:`PolicyError` if the parameters do not fit this layout."""

    def prepare(self, gpt) -> "Policy":
        """The policy to run on ``gpt``: ``self`` unless the policy needs the model first.

        Called by :class:`~arsparse.engine.generator.Generator` and ``GPT.logits(policy=...)``
        before use. A policy that is fitted to a model (e.g. calibrated on its attention) returns
        a new, fitted policy here; frozen policies never change in place.
        """
        return self

    def budget(self, layout: Layout) -> Budget:
        raise NotImplementedError

    def params(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def describe(self) -> dict:
        return dict(name=self.name, kind=self.kind, source=self.source, params=self.params(),
                    doc=(type(self).__doc__ or "").strip().split("\n\n")[0])


def dense_entries(layout: Layout) -> int:
    """Entries a dense cache keeps per sequence: the prompt and the N - 1 image tokens that are ever input."""
    return layout.prefix_len + layout.image_tokens - 1


def need_int(policy: str, name: str, value, lo: int, hi: int | None = None, what: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise PolicyError(f"{policy}: {name} must be an integer {rng}{what}, got {value!r}")


def need_rho(policy: str, rho, optional: bool = False) -> None:
    """rho = kept / dense entries, in (0, 1] (None allowed when ``optional``)."""
    if optional and rho is None:
        return
    if isinstance(rho, bool) or not isinstance(rho, (int, float)) or not 0 < rho <= 1:
        raise PolicyError(f"{policy}: rho (kept / dense entries) must be in (0, 1], got {rho!r}")
