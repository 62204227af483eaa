"""Error tables of the DP allocator: the per-token squared error of every aligned block (size,
type) over the leading components, measured with the reference quantizers on held-out
projections (`measured_tables`) or from a Gaussian model of the calibrated spectrum
(`analytic_tables`). Computed once per basis and shared by every ratio.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from kvtc.artifacts.blocks import qtype_bits
from kvtc.kernels.codec.reference import quantize_dequantize
from kvtc.pipeline.fit.pca import Basis

FP16_REL_MSE = 2.0 ** -21 * 0.54 / 12
FP8_REL_MSE = 2.0 ** -6 * 0.54 / 12


@dataclass(frozen=True)
class ErrorTables:
    """Per-token squared error of every aligned (block size, type) over the first k components.
    errors[(s, t)]: (k // s,) f64, block b covers [b s, b s + s); variance (k,): the "none" error
    per component; beyond: calibration variance past k; rows: held-out rows used (0: analytic)."""

    p: int
    k: int
    model: str
    rows: int
    variance: np.ndarray
    errors: dict
    beyond: float
    total_variance: float

    def error(self, size: int, qtype: str, index: int) -> float:
        if qtype == "none":
            return float(self.variance[index * size:(index + 1) * size].sum())
        return float(self.errors[(size, qtype)][index])


def _tables(basis: Basis, variance: np.ndarray, errors: dict, model: str, rows: int,
            beyond: float | None = None) -> ErrorTables:
    k = variance.shape[0]
    if beyond is None:
        beyond = max(basis.total_variance - float(basis.eigenvalues[:k].sum()), 0.0)
    return ErrorTables(basis.dim, k, model, rows, variance, errors, beyond, basis.total_variance)


def measured_tables(basis: Basis, z: torch.Tensor, sizes, qtypes, chunk_elems: int = 1 << 18) -> ErrorTables:
    """z (N, k) float32 centered held-out projections -> reference-quantizer errors, mean per row."""
    n, k = z.shape
    step = max(1, chunk_elems // max(k, 1))
    errors = {(s, t): np.zeros(k // s) for s in sizes if s <= k for t in qtypes}
    variance = np.zeros(k)
    for r0 in range(0, n, step):
        zc = z[r0:r0 + step]
        variance += zc.double().square().sum(0).numpy()
        for s in sizes:
            nb = k // s
            if nb == 0:
                continue
            blocks = zc[:, :nb * s].reshape(-1, s)
            for t in qtypes:
                sq = (blocks - quantize_dequantize(blocks, t)).square_().sum(1)
                errors[(s, t)] += sq.view(-1, nb).double().sum(0).numpy()
    return _tables(basis, variance / n, {key: v / n for key, v in errors.items()}, "measured", n)


def _expected_max(lam: torch.Tensor) -> torch.Tensor:
    """lam (nb, s) variances -> (nb,) m with sum_i P(z_i > m) = 0.625 s / (s + 0.25) (Blom's
    approximation of E[max] for equal variances, generalised to unequal ones), by bisection."""
    s = lam.shape[1]
    sig = lam.clamp_min(1e-300).sqrt()
    target = 0.625 * s / (s + 0.25)
    lo, hi = torch.zeros(lam.shape[0], dtype=torch.float64), 10.0 * sig.max(dim=1).values
    for _ in range(60):
        mid = (lo + hi) / 2
        above = 0.5 * torch.erfc(mid[:, None] / sig / math.sqrt(2.0))
        big = above.sum(1) > target
        lo, hi = torch.where(big, mid, lo), torch.where(big, hi, mid)
    return (lo + hi) / 2


def analytic_tables(basis: Basis, k: int, sizes, qtypes, variances: np.ndarray | None = None) -> ErrorTables:
    """Gaussian model on the calibrated spectrum, or on `variances` (p,) measured on held-out rows. intB, block of s: range r = 2 m (m from
    `_expected_max`), step r / (2^B - 1), uniform error step^2 / 12 on the s - 2 components that
    are not the block's min or max (those two are stored exactly in fp16). fp8 e4m3: relative
    error of a 3-bit mantissa, 2^-6 E[1/m^2] / 12 with Benford mantissas (E = 0.54), on all
    components but the absmax one. Every entry adds fp16 rounding (2^-21 * 0.54 / 12 relative, as measured)."""
    source = basis.eigenvalues if variances is None else variances
    lam_all = np.asarray(source[:k], dtype=np.float64)
    errors = {}
    for s in sizes:
        nb = k // s
        if nb == 0:
            continue
        lam = torch.from_numpy(lam_all[:nb * s].reshape(nb, s).copy())
        total = lam.sum(1)
        m = _expected_max(lam) if s > 2 else torch.zeros(nb, dtype=torch.float64)
        for t in qtypes:
            if t == "fp8":
                err = total * FP8_REL_MSE * (s - 1) / s
            else:
                step = 2 * m / ((1 << qtype_bits(t)) - 1)
                err = max(s - 2, 0) * step.square() / 12
            errors[(s, t)] = (err + total * FP16_REL_MSE).numpy()
    beyond = None if variances is None or len(variances) < basis.dim else float(np.sum(variances[k:]))
    return _tables(basis, lam_all.copy(), errors, "analytic", 0, beyond)
