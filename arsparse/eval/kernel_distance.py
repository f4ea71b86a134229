"""The kernel distance (KID, Bińkowski et al. 2018) between two feature sets, in any feature space.

The squared maximum mean discrepancy with the cubic polynomial kernel ``k(a, b) = (a . b / d + 1)^3``,
estimated without bias:

    MMD^2_u = sum_{i != j} k(x_i, x_j) / (s (s - 1)) + sum_{i != j} k(y_i, y_j) / (s (s - 1))
              - 2 sum_{i, j} k(x_i, y_j) / s^2

on ``s`` rows of each set, averaged over random subsets (as published KID values are). Unlike the
Fréchet distance, whose estimate from n samples is biased upwards by about k / n (BENCHMARKS.md,
session 12: that bias compressed fashion-c2i's relative gaps at 1,000 samples), its expectation does
not depend on the number of samples, on either side: a small reference (emoji-c2i's 794 held-out
images) adds noise, not an offset, and the gap of a policy to dense is not shrunk.
"""
from __future__ import annotations

import numpy as np
import torch

__all__ = ["kernel_distances"]


def kernel_distances(x, y, subsets: int = 100, subset_size: int = 1000, seed: int = 0,
                     device: torch.device | str | None = None) -> np.ndarray:
    """Unbiased MMD^2 (cubic kernel) between features ``x`` (n, d) and ``y`` (m, d) on ``subsets``
    random subsets of ``min(subset_size, n, m)`` rows of each -> the estimates (subsets,).

    The subsets are drawn from ``seed`` alone: two calls with feature sets of the same sizes use the
    same rows, so the policies of one eval are compared on the same images (paired by seed) and the
    same reference rows. Computed in float64 on ``device`` (default: the CPU).
    """
    x = torch.as_tensor(np.asarray(x), dtype=torch.float64, device=device)
    y = torch.as_tensor(np.asarray(y), dtype=torch.float64, device=device)
    if x.dim() != 2 or y.dim() != 2 or x.shape[1] != y.shape[1]:
        raise ValueError(f"need (n, d) and (m, d) features, got {tuple(x.shape)} and {tuple(y.shape)}")
    if isinstance(subsets, bool) or not isinstance(subsets, int) or subsets < 1:
        raise ValueError(f"subsets must be a positive integer, got {subsets!r}")
    s = min(subset_size, x.shape[0], y.shape[0])
    if s < 2:
        raise ValueError(f"a kernel distance needs at least 2 rows on each side, got {x.shape[0]} and {y.shape[0]}")
    d = x.shape[1]
    rng = np.random.default_rng(seed)
    out = np.empty(subsets)
    for t in range(subsets):
        a = x[torch.as_tensor(rng.choice(x.shape[0], s, replace=False), device=x.device)]  # (s, d)
        b = y[torch.as_tensor(rng.choice(y.shape[0], s, replace=False), device=y.device)]
        kaa, kbb, kab = ((u @ v.T / d + 1) ** 3 for u, v in ((a, a), (b, b), (a, b)))  # (s, s) each
        within = (kaa.sum() - kaa.diagonal().sum() + kbb.sum() - kbb.diagonal().sum()) / (s * (s - 1))
        out[t] = float(within - 2 * kab.mean())
    return out
