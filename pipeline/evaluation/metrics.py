"""Reconstruction metrics of a basis and its allocations on held-out rows.

Relative error is ||X - X_hat||_F / ||X||_F over the given raw rows and the whole p-dimensional
vector (keys in RoPE-removed space), with X_hat = mu + dequant(quant(Z)) U_r^T and
Z = (X - mu) U_r, the allocation's blocks quantized with kernels/codec/reference.py.
The Gaussian bound is reverse water-filling on the calibrated spectrum at the allocation's
budget, normalised by the same ||X||_F^2 / N, so it compares directly with the achieved error.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from kvtc.kernels.codec.reference import quantize_dequantize
from kvtc.pipeline.fit.allocator import Allocation
from kvtc.pipeline.fit.pca import Basis


INTERVAL_BLOCK = 16  # consecutive scored tokens per batch mean: neighbouring tokens' errors are correlated


def mean_interval(x: torch.Tensor, block: int = INTERVAL_BLOCK, level: float = 0.95) -> tuple[float, float]:
    """x (n,) per-token figures in text order -> the `level` interval of their mean by batch means: the mean of
    each run of `block` consecutive tokens, a Student t interval over those (n // block of them; fewer than two
    blocks: over the tokens themselves). Nearby tokens of one text are not independent, so an interval over tokens
    alone would be too narrow."""
    from scipy.stats import t as student  # noqa: PLC0415 - scipy's import is seconds; only scoring needs it

    x = x.double().flatten()
    n = x.numel()
    if n == 0:
        return math.nan, math.nan
    means = x[: n // block * block].reshape(-1, block).mean(1) if n >= 2 * block else x
    mean = float(x.mean())
    if means.numel() < 2:
        return mean, mean
    half = float(student.ppf(0.5 + level / 2, means.numel() - 1)) * float(means.std()) / math.sqrt(means.numel())
    return mean - half, mean + half


@dataclass(frozen=True)
class PositionBucket:
    """Rows whose context position is in [lo, hi)."""

    lo: int
    hi: int
    rows: int
    rel_error: float


@dataclass(frozen=True)
class Evaluation:
    """One allocation on held-out rows. pca_rel_error: the same kept components, unquantized;
    explained_variance: calibration variance fraction of the kept components."""

    ratio: float
    rel_error: float
    pca_rel_error: float
    bound_rel_error: float
    explained_variance: float
    bits_per_token: int
    kept: int
    rows: int
    by_position: tuple[PositionBucket, ...] = ()

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in ("ratio", "rel_error", "pca_rel_error", "bound_rel_error",
                                            "explained_variance", "bits_per_token", "kept", "rows")}
        d["by_position"] = [vars(b) for b in self.by_position]
        return d


def quantize_projections(z: torch.Tensor, allocation: Allocation) -> torch.Tensor:
    """z (N, >= kept) centered projections -> (N, kept) float32 after each block's round trip.
    Runs of equal (size, type) blocks are quantized in one call (rows are independent)."""
    out = torch.zeros(z.shape[0], allocation.kept, dtype=torch.float32)
    blocks = allocation.blocks
    i = 0
    while i < len(blocks):
        j = i
        while j + 1 < len(blocks) and (blocks[j + 1].size, blocks[j + 1].qtype) == (blocks[i].size, blocks[i].qtype):
            j += 1
        a, b, s = blocks[i].start, blocks[j].end, blocks[i].size
        if blocks[i].qtype != "none":
            zz = z[:, a:b].float().reshape(-1, s)
            out[:, a:b] = quantize_dequantize(zz, blocks[i].qtype).view(z.shape[0], b - a)
        i = j + 1
    return out


def waterfilling_distortion(eigenvalues: np.ndarray, bits: float, tail_variance: float = 0.0) -> float:
    """Per-token squared error of Gaussian reverse water-filling with `bits` per token on the
    spectrum eigenvalues (k,); tail_variance (variance past k) counts as fully distorted."""
    lam = np.sort(np.asarray(eigenvalues, dtype=np.float64))[::-1]
    lam = lam[lam > 0]
    if lam.size == 0 or bits <= 0:
        return float(lam.sum() + tail_variance)
    m = np.arange(1, lam.size + 1)
    theta = np.exp((np.cumsum(np.log(lam)) - 2.0 * bits * math.log(2.0)) / m)
    nxt = np.append(lam[1:], 0.0)
    ok = (theta < lam) & (theta >= nxt)
    a = int(np.argmax(ok)) if ok.any() else lam.size - 1
    return float((a + 1) * theta[a] + lam[a + 1:].sum() + tail_variance)


def default_edges(max_position: int) -> list[int]:
    """[0, 1, 2, 4, 16, 64, 256, ...] up to past max_position."""
    edges = [0, 1, 2, 4]
    while edges[-1] <= max_position:
        edges.append(edges[-1] * 4)
    return edges


def _buckets(pos: np.ndarray, err: np.ndarray, norm: np.ndarray, edges) -> tuple[PositionBucket, ...]:
    out = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        sel = (pos >= lo) & (pos < hi)
        if sel.any():
            out.append(PositionBucket(int(lo), int(hi), int(sel.sum()),
                                      math.sqrt(err[sel].sum() / max(norm[sel].sum(), 1e-300))))
    return tuple(out)


def pca_rel_error(basis: Basis, x, ks, chunk: int = 1024, projections=None) -> np.ndarray:
    """PCA-only relative error of raw rows x (N, p) with the first k components, for each k in ks.
    Uses ||x - mu||^2 - ||z_k||^2 (the residual is orthogonal to the kept components).
    projections: the rows' centered projections (N, >= max ks), if already computed."""
    ks = np.asarray(ks, dtype=np.int64)
    xt = torch.as_tensor(x, dtype=torch.float32)
    kmax = int(ks.max()) if ks.size else 0
    cum = np.zeros(kmax + 1)
    centered = total = 0.0
    mu = torch.from_numpy(basis.mean).float()
    for r in range(0, xt.shape[0], chunk):
        xc = xt[r:r + chunk]
        z = basis.project(xc, kmax) if projections is None else torch.as_tensor(projections[r:r + chunk, :kmax]).float()
        cum[1:] += np.cumsum(z.double().square().sum(0).numpy())
        centered += float((xc - mu).double().square().sum())
        total += float(xc.double().square().sum())
    return np.sqrt(np.clip(centered - cum[ks], 0.0, None) / max(total, 1e-300))


def evaluate(basis: Basis, allocations, x, positions=None, edges=None, chunk: int = 1024,
             explicit: bool = False, projections=None) -> list[Evaluation]:
    """Every allocation on raw held-out rows x (N, p); positions (N,) adds error by position
    (buckets [edges[i], edges[i+1]), default `default_edges`). The bound uses basis' spectrum:
    pass the basis before truncation for an exact bound. explicit=True forms X_hat and
    ||X - X_hat||; the default uses ||x - mu||^2 - ||z_r||^2 + ||z_r - z_hat||^2 (the residual
    is orthogonal to U_r; equal up to float32 rounding, much cheaper). projections: the rows'
    centered projections (N, >= max kept), if already computed, to skip the GEMM."""
    allocations = list(allocations)
    xt = torch.as_tensor(x, dtype=torch.float32)
    if xt.ndim != 2 or xt.shape[1] != basis.dim:
        raise ValueError(f"evaluate: rows have shape {tuple(xt.shape)}, expected (N, {basis.dim})")
    n = xt.shape[0]
    kmax = max([a.kept for a in allocations] + [0])
    if kmax > basis.k:
        raise ValueError(f"an allocation keeps {kmax} components but the basis has {basis.k}")
    zall = None if projections is None else torch.as_tensor(projections, dtype=torch.float32)
    if zall is not None and (zall.shape[0] != n or zall.shape[1] < kmax):
        raise ValueError(f"projections have shape {tuple(zall.shape)}, expected ({n}, >= {kmax})")
    mu = torch.from_numpy(basis.mean).float()
    u = torch.from_numpy(np.ascontiguousarray(basis.components[:, :kmax])).float()
    row_err = np.zeros((len(allocations), n))
    row_pca = np.zeros((len(allocations), n))
    row_norm = np.zeros(n)
    for r in range(0, n, chunk):
        xc = xt[r:r + chunk]
        xd = xc - mu
        z = xd @ u if zall is None else zall[r:r + chunk, :kmax]
        row_norm[r:r + chunk] = xc.double().square().sum(1).numpy()
        cz = torch.cumsum(z.double().square(), dim=1)
        base = xd.double().square().sum(1)
        for ai, a in enumerate(allocations):
            pca = (base - (cz[:, a.kept - 1] if a.kept else 0.0)).clamp_min(0)
            zq = quantize_projections(z, a)
            if explicit:
                err = (xd - zq @ u[:, :a.kept].T).double().square().sum(1)
            else:
                err = pca + (z[:, :a.kept] - zq).double().square().sum(1)
            row_err[ai, r:r + chunk] = err.numpy()
            row_pca[ai, r:r + chunk] = pca.numpy()
    total = max(row_norm.sum(), 1e-300)
    tail = max(basis.total_variance - float(basis.eigenvalues.sum()), 0.0)
    pos = None if positions is None else np.asarray(positions).reshape(-1)
    if pos is not None and pos.shape[0] != n:
        raise ValueError(f"positions has {pos.shape[0]} entries for {n} rows")
    if pos is not None and edges is None:
        edges = default_edges(int(pos.max()) if n else 0)
    out = []
    for ai, a in enumerate(allocations):
        bound = waterfilling_distortion(basis.eigenvalues, a.budget_bits, tail)
        by_pos = () if pos is None else _buckets(pos, row_err[ai], row_norm, edges)
        out.append(Evaluation(a.ratio, math.sqrt(row_err[ai].sum() / total), math.sqrt(row_pca[ai].sum() / total),
                              math.sqrt(bound * n / total), basis.explained_variance(a.kept), a.cost_bits,
                              a.kept, n, by_pos))
    return out
