"""The Fréchet distance between two Gaussians fitted to feature sets.

    d^2 = |mu1 - mu2|^2 + tr(S1) + tr(S2) - 2 tr((S1 S2)^(1/2))

``tr((S1 S2)^(1/2))`` is computed without a general (non-symmetric) matrix square root: with
``A = S1^(1/2)`` (symmetric, from an eigen-decomposition), ``S1 S2 = A (A S2)`` has the same
eigenvalues as the symmetric positive semi-definite ``A S2 A``, so the trace is the sum of the
square roots of that matrix's (clipped, non-negative) eigenvalues. This stays real and finite
for the rank-deficient covariances that few samples in many dimensions give, where ``sqrtm``
of the product returns complex noise.
"""
from __future__ import annotations

import numpy as np

__all__ = ["feature_stats", "frechet_distance", "frechet_from_features"]


def feature_stats(features) -> tuple[np.ndarray, np.ndarray]:
    """(n, d) features -> (mean (d,), covariance (d, d)) in float64 (unbiased, n - 1)."""
    x = np.asarray(features, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] < 2:
        raise ValueError(f"need (n >= 2, d) features, got shape {x.shape}")
    return x.mean(axis=0), np.atleast_2d(np.cov(x, rowvar=False))


def _psd_sqrt(s: np.ndarray) -> np.ndarray:
    w, v = np.linalg.eigh((s + s.T) / 2)
    return (v * np.sqrt(np.clip(w, 0, None))) @ v.T


def frechet_distance(mu1, sigma1, mu2, sigma2) -> float:
    """Fréchet distance (squared, as FID reports it) between N(mu1, sigma1) and N(mu2, sigma2)."""
    mu1, mu2 = np.asarray(mu1, np.float64), np.asarray(mu2, np.float64)
    s1, s2 = np.atleast_2d(np.asarray(sigma1, np.float64)), np.atleast_2d(np.asarray(sigma2, np.float64))
    if mu1.shape != mu2.shape or s1.shape != s2.shape or s1.shape != (mu1.size, mu1.size):
        raise ValueError(f"shapes do not match: mu {mu1.shape} / {mu2.shape}, sigma {s1.shape} / {s2.shape}")
    a = _psd_sqrt(s1)
    m = a @ s2 @ a
    tr_sqrt = np.sqrt(np.clip(np.linalg.eigvalsh((m + m.T) / 2), 0, None)).sum()
    diff = mu1 - mu2
    return float(diff @ diff + np.trace(s1) + np.trace(s2) - 2.0 * tr_sqrt)


def frechet_from_features(a, b) -> float:
    """Fréchet distance between the Gaussians fitted to feature sets ``a`` (n, d) and ``b`` (m, d)."""
    return frechet_distance(*feature_stats(a), *feature_stats(b))
