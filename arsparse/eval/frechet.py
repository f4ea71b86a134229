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

from statistics import NormalDist

import numpy as np

__all__ = ["FrechetReference", "bootstrap_distances", "delta_interval", "extrapolated_distance", "feature_stats",
           "frechet_distance", "frechet_from_features", "subset_sizes"]


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
    mu1, s1 = np.asarray(mu1, np.float64), np.atleast_2d(np.asarray(sigma1, np.float64))
    if s1.shape != (mu1.size, mu1.size):
        raise ValueError(f"shapes do not match: mu {mu1.shape}, sigma {s1.shape}")
    return FrechetReference(mu1, s1).distance(mu2, sigma2)


def frechet_from_features(a, b) -> float:
    """Fréchet distance between the Gaussians fitted to feature sets ``a`` (n, d) and ``b`` (m, d)."""
    return frechet_distance(*feature_stats(a), *feature_stats(b))


class FrechetReference:
    """A fixed reference Gaussian (mu, sigma) whose square root is computed once, for many distances to it
    (every policy, every bootstrap resample)."""

    def __init__(self, mu, sigma):
        self.mu = np.asarray(mu, np.float64)
        self.sigma = np.atleast_2d(np.asarray(sigma, np.float64))
        self._sqrt = _psd_sqrt(self.sigma)
        self._trace = float(np.trace(self.sigma))

    @classmethod
    def of(cls, features) -> "FrechetReference":
        return cls(*feature_stats(features))

    def distance(self, mu, sigma) -> float:
        """The Fréchet distance of N(mu, sigma) to the reference (as :func:`frechet_distance`)."""
        mu, s = np.asarray(mu, np.float64), np.atleast_2d(np.asarray(sigma, np.float64))
        if mu.shape != self.mu.shape or s.shape != self.sigma.shape:
            raise ValueError(f"shapes do not match: mu {mu.shape} / {self.mu.shape}, "
                             f"sigma {s.shape} / {self.sigma.shape}")
        m = self._sqrt @ s @ self._sqrt
        tr_sqrt = np.sqrt(np.clip(np.linalg.eigvalsh((m + m.T) / 2), 0, None)).sum()
        diff = mu - self.mu
        return float(diff @ diff + np.trace(s) + self._trace - 2.0 * tr_sqrt)

    def distance_of(self, features) -> float:
        return self.distance(*feature_stats(features))


def bootstrap_distances(features, ref: FrechetReference, resamples: int, seed: int = 0) -> np.ndarray:
    """Fréchet distances to ``ref`` of ``resamples`` bootstrap resamples of the rows of ``features`` (n, d).

    The resampled row indices depend on ``seed`` and n only, so feature sets that are paired row by
    row (image i of each drawn with the same seed and condition) resampled with the same seed take
    the same rows: their distances can be compared resample by resample (:func:`delta_interval`).
    """
    x = np.asarray(features, np.float64)
    if x.ndim != 2 or len(x) < 2 or resamples < 2:
        raise ValueError(f"need (n >= 2, d) features and resamples >= 2, got {x.shape} and {resamples}")
    rng = np.random.default_rng(seed)
    return np.array([ref.distance_of(x[rng.integers(0, len(x), len(x))]) for _ in range(resamples)])


def delta_interval(distances, base_distances, gap: float, level: float = 0.95) -> tuple[float, float]:
    """Normal interval ``gap ± z * sd`` of the relative gap 100 (d - base) / base (percent), ``sd`` over
    paired bootstrap distances.

    Not the bootstrap's percentiles: a resample repeats images, so it has fewer distinct ones, and
    that adds about the same to both distances, which pulls every resampled *relative* gap towards
    zero (fashion-c2i, 1,000 samples: a measured +28.6 % had percentiles [+11.7, +23.3]; across three
    sets of seeds the gap was +28.6, +29.1, +30.6). The spread of the resampled gaps is not pulled (its
    sd, 3.0 points, is at least the spread between sets of seeds), so it sets the width around the
    measured ``gap``.
    """
    d, base = np.asarray(distances, np.float64), np.asarray(base_distances, np.float64)
    if d.shape != base.shape or d.ndim != 1 or len(d) < 2 or not 0 < level < 1:
        raise ValueError(f"need paired 1-D distances (>= 2) and a level in (0, 1), got {d.shape}, {base.shape}, {level}")
    half = NormalDist().inv_cdf(0.5 + level / 2) * float(np.std(100.0 * (d - base) / np.abs(base), ddof=1))
    return float(gap - half), float(gap + half)


def subset_sizes(n: int, points: int = 8, smallest: float = 0.5) -> np.ndarray:
    """The subset sizes :func:`extrapolated_distance` fits over: ``points`` evenly spaced from ``smallest * n``
    (at least 2) to ``n``, distinct."""
    if n < 4 or points < 2 or not 0 < smallest < 1:
        raise ValueError(f"need n >= 4 rows, points >= 2 and smallest in (0, 1), got {n}, {points}, {smallest}")
    sizes = np.unique(np.linspace(max(2, round(smallest * n)), n, points).round().astype(int))
    if len(sizes) < 2:
        raise ValueError(f"{n} rows give fewer than 2 distinct subset sizes")
    return sizes


def extrapolated_distance(features, ref: FrechetReference, points: int = 8, smallest: float = 0.5,
                          seed: int = 0) -> float:
    """The Fréchet distance to ``ref`` extrapolated to infinitely many generated samples (the "FD-infinity"
    of Chong & Forsyth, *Effectively Unbiased FID and Inception Score and Where to Find Them*, CVPR 2020).

    A distance from n samples overestimates by about k / n (the covariance estimate's noise), the
    same k for every model of a feature space, which shrinks the *relative* gaps between models at
    small n. The distances of ``points`` random subsets of the rows of ``features`` (n, d), of sizes
    evenly spaced from ``smallest * n`` to n, fitted by least squares as ``d_inf + k / size``, give
    ``d_inf``. The subsets depend only on ``seed`` and n, so sets paired row by row take the same rows.
    The fit holds once the smallest subset has a few times more rows than the features have dimensions
    (Gaussians in 256 dimensions, true distance 117.5: from 1,000 samples 116.2, raw 129.9; from 250
    samples 103-143). The reference's own finite size adds a bias too (about k / m for m reference
    images: with 10,000 images in MobileNetV2 features about 1), the same for every model, which this
    leaves in.
    """
    x = np.asarray(features, np.float64)
    if x.ndim != 2:
        raise ValueError(f"need (n, d) features, got shape {x.shape}")
    sizes = subset_sizes(len(x), points, smallest)
    rng = np.random.default_rng(seed)
    dist = [ref.distance_of(x[rng.permutation(len(x))[:n]]) for n in sizes]
    design = np.stack([np.ones(len(sizes)), 1.0 / sizes], axis=1)
    (d_inf, _), *_ = np.linalg.lstsq(design, np.asarray(dist), rcond=None)
    return float(d_inf)
