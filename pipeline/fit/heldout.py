"""Held-out variances of PCA projections: the per-component scales the allocator's analytic tables
and the ECSQ fit share.

The raw second moments are made non-increasing in PCA order by isotonic regression, a shrinkage
estimate that generalizes better than the calibration eigenvalues (which over-fit the leading
components and under-state the tail).
"""
from __future__ import annotations

import numpy as np
import torch


def isotonic_decreasing(v: np.ndarray) -> np.ndarray:
    """Least-squares non-increasing fit of v (pool adjacent violators), same length."""
    means: list[float] = []
    sizes: list[int] = []
    for x in np.asarray(v, dtype=np.float64):
        means.append(float(x))
        sizes.append(1)
        while len(means) > 1 and means[-2] < means[-1]:
            n = sizes[-2] + sizes[-1]
            means[-2] = (means[-2] * sizes[-2] + means[-1] * sizes[-1]) / n
            sizes[-2] = n
            means.pop()
            sizes.pop()
    return np.repeat(means, sizes)


def heldout_variances(z: torch.Tensor) -> np.ndarray:
    """Projections (N, k) -> (k,) non-increasing per-component variances (second moments about 0)."""
    return isotonic_decreasing(z.double().square().mean(0).numpy())
