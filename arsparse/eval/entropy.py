"""Entropy-matched sampling temperatures: each policy sampled as sharply as dense samples.

A policy that reads part of the cache knows less about the next token, so its next-token
distribution is broader than dense's: on fashion-c2i, teacher-forced on held-out images with
guidance 2, diagonal's guided distribution carries 0.825 nats per token against dense's 0.806.
Sampled at the same temperature, its images come out rougher. :func:`matched_temperatures` finds,
for each policy, the sampling temperature at which its guided next-token distribution has, on
average over the same held-out positions, the entropy dense's has at the run's temperature. It
looks at nothing but the two models' predictions (no generated image, no Fréchet distance), and
treats every policy alike, so budget-matched comparisons stay matched.

Temperature divides the guided logits (:func:`arsparse.engine.sampling.sample`), so sampling at
temperature ``t`` is the distribution ``softmax(s * guided)`` with ``s = 1 / t``; the mean entropy
falls as ``s`` grows. It is measured on a grid of ``s`` per batch and the crossing interpolated.
Top-k and top-p truncate after the temperature; the match ignores them.
"""
from __future__ import annotations

import math

import torch
from tqdm.auto import tqdm

from .forcing import forced_guidance_pairs

__all__ = ["SCALES", "guided_entropy", "solve_scale", "match_on_grid", "matched_temperatures"]

#: Logit scales (1 / temperature) the entropy is measured at: 0.5 .. 2, log-spaced (2.3 % apart).
SCALES = torch.exp(torch.linspace(math.log(0.5), math.log(2.0), 61, dtype=torch.float64))


@torch.no_grad()
def guided_entropy(gpt, cond: torch.Tensor, tokens: torch.Tensor, policy, cfg_scale: float,
                   scales: torch.Tensor = SCALES, batch: int = 64, bar=None) -> torch.Tensor:
    """Mean entropy (nats per token) of the guided next-token distribution ``softmax(s * guided)`` for each
    ``s`` in ``scales``, teacher-forced on ``tokens`` (K, N) with conditions ``cond`` (K,) through
    ``policy``'s decode path (None = dense) -> (S,) float64.

    ``guided = uncond + cfg_scale * (cond - uncond)``, the unconditional logits from the null class, as the
    engine guides every token (:func:`arsparse.engine.sampling.guide`)."""
    total = torch.zeros(len(scales), dtype=torch.float64)
    count = 0
    for lc, lu, n in forced_guidance_pairs(gpt, cond, tokens, policy, batch):
        guided = lu + cfg_scale * (lc - lu)
        del lc, lu
        for j, s in enumerate(scales.tolist()):
            lp = (guided * s).log_softmax(-1)
            total[j] += float(-(lp.exp() * lp).sum(-1).double().sum())
        count += n
        if bar is not None:
            bar.update(1)
    return total / count


def solve_scale(scales: torch.Tensor, entropy: torch.Tensor, target: float) -> float | None:
    """The scale at which the monotone ``entropy`` curve (or any such) over ``scales`` equals ``target``, linearly
    interpolated between the two grid points around it; None when ``target`` is outside the curve."""
    s, h = scales.tolist(), entropy.tolist()
    for k in range(len(s) - 1):
        lo, hi = min(h[k], h[k + 1]), max(h[k], h[k + 1])
        if lo <= target <= hi:
            w = 0.0 if h[k] == h[k + 1] else (h[k] - target) / (h[k] - h[k + 1])
            return s[k] + w * (s[k + 1] - s[k])
    return None


def match_on_grid(policies: dict, grid: torch.Tensor, base: float, curve, batches: int, desc: str,
                  progress: bool) -> dict[str, tuple[float, float | None]]:
    """For dense and each policy of ``policies`` (names -> policy objects, None = dense), ``curve(name, policy,
    grid, bar)``: a monotone (S,) curve over ``grid``, which holds ``base`` (``batches`` passes each, counted on
    ``bar``). Returns ``{name: (its value at base, the grid value where it equals dense's value at base, None
    where out of reach)}``, dense first."""
    at_base = int((grid == base).nonzero())
    names = ["dense"] + [n for n in policies if n != "dense"]
    bar = tqdm(total=len(names) * batches, desc=desc, unit="pass", disable=not progress)
    curves = {n: curve(n, policies.get(n), grid, bar) for n in names}
    bar.close()
    target = float(curves["dense"][at_base])
    return {n: (float(c[at_base]), base if n == "dense" else solve_scale(grid, c, target)) for n, c in curves.items()}


def matched_temperatures(gpt, cond: torch.Tensor, tokens: torch.Tensor, policies: dict, cfg_scale: float | dict,
                         temperature: float, batch: int = 64, progress: bool = False) -> dict[str, dict]:
    """Per policy (``policies`` maps names to policy objects, None = dense): the sampling temperature at which
    its mean guided entropy on ``tokens`` equals dense's at ``temperature``. ``cfg_scale``: one guidance for
    every policy, or each policy's own ({name: scale}, dense's included: e.g. matched guidance scales,
    :mod:`~arsparse.eval.guidance`).

    Returns ``{name: dict(temperature=T, entropy=H)}``: ``H`` the mean guided entropy (nats per token) at the
    run's temperature, ``T`` the matched one (dense keeps ``temperature``; a policy's entropy at its ``T`` is
    dense's ``H``). ValueError when the temperature is not positive, or when a policy's curve
    never reaches dense's entropy within temperatures 0.5-2 (its temperature would be outside them).
    """
    if not temperature > 0:
        raise ValueError(f"matching entropies needs a positive sampling temperature, got {temperature} (greedy "
                         "decoding has no entropy to match)")
    base = 1.0 / temperature
    scales = torch.cat([SCALES, torch.tensor([base], dtype=torch.float64)]).unique()  # the run's own scale included
    guidance = cfg_scale if isinstance(cfg_scale, dict) else dict.fromkeys(["dense", *policies], cfg_scale)
    matched = match_on_grid(policies, scales, base,
                            lambda n, p, grid, bar: guided_entropy(gpt, cond, tokens, p, guidance[n], grid, batch, bar),
                            math.ceil(len(tokens) / batch), "entropy match", progress)
    target = matched["dense"][0]
    out = {}
    for n, (h, s) in matched.items():
        if s is None:
            raise ValueError(f"entropy match: {n}'s guided entropy ({h:.4f} nats at temperature {temperature}) does "
                             f"not reach dense's {target:.4f} for any temperature in "
                             f"{1 / float(scales[-1]):.2f}-{1 / float(scales[0]):.2f}")
        out[n] = dict(temperature=temperature if n == "dense" else 1.0 / s, entropy=h)
    return out
