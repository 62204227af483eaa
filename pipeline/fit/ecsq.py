"""Fitting the ECSQ codec mode (kernels/codec/ecsq.py) per ratio, stream and group, on held-out rows.

Scales: per-component variances of held-out projections, made non-increasing in PCA order by
isotonic regression (a shrinkage estimate that generalizes better than the calibration
eigenvalues, which over-fit the leading components and under-state the tail). Step: one global
quantizer step per ratio, found by bisection on log(step) so that the mean coded bits of
held-out tokens (the symbol models' cross-entropy plus escapes) meet the ratio's budget.
Components whose std is below `drop_below` steps are dropped (reverse water-filling: their
variance is below the quantizer's distortion step^2 / 12). Centroid offsets: measured per
component and |symbol| on held-out rows, shrunk towards the Gaussian centroid.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from scipy.special import ndtr

from kvtc.artifacts.blocks import budget_bits
from kvtc.kernels.codec.ecsq import PROBABILITY_TOTAL, SymbolModel, dequantize, quantize
from kvtc.kernels.codec.rans import MAX_RADIUS
from kvtc.pipeline.fit.heldout import heldout_variances
from kvtc.pipeline.fit.joint_budget import gaussian_bits

ESCAPE_BITS = 32


@dataclass(frozen=True)
class EcsqSettings:
    """classes_per_octave: symbol models per doubling of a component's std (model mismatch
    < 0.01 bit at 4); offsets: centroid table width C; drop_below: std in steps under which a
    component is dropped; radius_sigmas: model range in stds before the escape; fit_rows:
    held-out rows the bisection uses; prior_rows: weight of the Gaussian centroid; max_components:
    the basis budget, components the code may keep (0 = no cap); iterations, tolerance: the step's bisection,
    at most that many halvings of a bracket around the Gaussian rate's prediction, until it is that narrow."""

    classes_per_octave: int = 4
    offsets: int = 4
    drop_below: float = 12 ** -0.5
    radius_sigmas: float = 6.0
    fit_rows: int = 1024
    prior_rows: float = 16.0
    iterations: int = 28
    max_components: int = 0
    tolerance: float = 1e-4  # of the bisection on log(step): the budget is then met within a few bits

    def __post_init__(self) -> None:
        if self.classes_per_octave < 1 or self.offsets < 1 or self.iterations < 8 or self.max_components < 0:
            raise ValueError("classes_per_octave and offsets must be >= 1, iterations >= 8, max_components >= 0")
        if not 0 < self.tolerance < 1:
            raise ValueError(f"tolerance must be in (0, 1), got {self.tolerance}")
        if not (0 < self.drop_below < 1 and self.radius_sigmas >= 3 and self.fit_rows >= 16 and self.prior_rows >= 0):
            raise ValueError("need 0 < drop_below < 1, radius_sigmas >= 3, fit_rows >= 16, prior_rows >= 0")

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True)
class EcsqFit:
    """One ratio's ECSQ tables for one basis. model (kept,) indexes `models`; offsets (kept, C);
    scales (kept,) held-out std per component; bits_per_token: mean coded bits of held-out rows."""

    ratio: float
    budget_bits: int
    step: float
    scales: np.ndarray
    model: np.ndarray
    offsets: np.ndarray
    models: tuple[SymbolModel, ...]
    bits_per_token: float
    rows: int

    @property
    def kept(self) -> int:
        return int(self.model.shape[0])

    def to_table(self) -> dict:
        """What artifacts.ecsq_tables stores."""
        return {"budget_bits": self.budget_bits, "step": self.step, "kept": self.kept,
                "bits_per_token": self.bits_per_token, "heldout_rows": self.rows,
                "scales": self.scales.astype(np.float32), "model": self.model.astype(np.int32),
                "offsets": self.offsets.astype(np.float32),
                "models": [(m.radius, m.counts.astype(np.int64)) for m in self.models]}


def class_model(c: int, settings: EcsqSettings) -> SymbolModel:
    """Symbol model of class c: Gaussian of std 2^(c / classes_per_octave) steps, integer counts
    summing to about PROBABILITY_TOTAL over [-R, R] plus an escape holding the tails' mass. R is at most
    the rANS format's table radius (kernels.rans.MAX_RADIUS), which moves any wider model's tails into
    the escape when the tables are built anyway: a very fine step (a basis budget's freed bits) stores
    models of thousands of counts, not of millions."""
    std = 2.0 ** (c / settings.classes_per_octave)
    radius = min(max(1, math.ceil(settings.radius_sigmas * std)), MAX_RADIUS)
    edges = (np.arange(-radius, radius + 2) - 0.5) / std
    mass = np.diff(ndtr(edges))
    tails = 2 * ndtr(-(radius + 0.5) / std)
    counts = np.maximum(np.round(np.append(mass, tails) * PROBABILITY_TOTAL), 1).astype(np.int64)
    return SymbolModel(radius, counts)


class _RateModel:
    """Coded bits of held-out rows at a given step, with class models cached across steps."""

    def __init__(self, z: torch.Tensor, sigma: np.ndarray, settings: EcsqSettings) -> None:
        self.z, self.sigma, self.settings = z, sigma, settings
        self.cache: dict[int, SymbolModel] = {}

    def layout(self, step: float) -> tuple[int, np.ndarray, list[int]]:
        """-> kept, per-component model index, the class of each model (ascending)."""
        s = self.sigma / step
        kept = int((s > self.settings.drop_below).sum())
        if self.settings.max_components:
            kept = min(kept, self.settings.max_components)
        cpo = self.settings.classes_per_octave
        cls = np.round(cpo * np.log2(np.maximum(s[:kept], 1e-30))).astype(np.int64)
        classes = sorted(set(cls.tolist()))
        index = np.searchsorted(classes, cls)
        for c in classes:
            if c not in self.cache:
                self.cache[c] = class_model(c, self.settings)
        return kept, index, classes

    def bits(self, step: float) -> float:
        kept, index, classes = self.layout(step)
        if kept == 0:
            return 0.0
        tables, base, esc, radius, start = [], [], [], [], 0
        for c in classes:
            m = self.cache[c]
            tables.append(np.log2(m.counts.sum()) - np.log2(m.counts))
            base.append(start + m.radius)
            esc.append(start + 2 * m.radius + 1)
            radius.append(m.radius)
            start += len(m.counts)
        table = torch.from_numpy(np.concatenate(tables))
        r = torch.as_tensor(radius, dtype=torch.int64)[index]
        q = torch.round(self.z[:, :kept] / step).clamp_(-(1 << 30), 1 << 30).long()
        out = (q.abs() > r)
        idx = torch.where(out, torch.as_tensor(esc, dtype=torch.int64)[index], torch.as_tensor(base)[index] + q)
        return float(table[idx].sum() + ESCAPE_BITS * out.sum()) / self.z.shape[0]


def _gaussian_offsets(sigma_steps: np.ndarray, width: int) -> np.ndarray:
    """(kept,) std in steps -> (kept, C): |q| - E[|z| / step | bin] for a Gaussian, bins 1..C."""
    s = np.maximum(sigma_steps, 1e-6)[:, None]
    a = np.arange(1, width + 1, dtype=np.float64)[None, :]
    lo, hi = (a - 0.5) / s, (a + 0.5) / s
    hi[:, -1] = np.inf  # the last bucket pools every |q| >= C; its offset is the mean over that tail
    pdf = lambda x: np.exp(-0.5 * np.square(x)) / math.sqrt(2 * math.pi)  # noqa: E731
    mass = np.maximum(ndtr(hi) - ndtr(lo), 1e-300)
    mean_r = s * (pdf(lo) - pdf(np.where(np.isinf(hi), 0.0, hi)) * ~np.isinf(hi)) / mass
    if width > 1:
        a_mean = np.broadcast_to(a, mean_r.shape).copy()
        # mean |q| over the pooled tail is about the conditional mean of |z| itself
        a_mean[:, -1] = np.maximum(np.round(mean_r[:, -1]), width)
        return np.clip(a_mean - mean_r, -0.5, 0.5)
    return np.clip(np.round(mean_r) - mean_r, -0.5, 0.5)


def _offsets(z: torch.Tensor, step: float, sigma_steps: np.ndarray, settings: EcsqSettings,
             chunk_rows: int = 2048) -> np.ndarray:
    """Measured centroid offsets (kept, C) on all held-out rows, shrunk towards the Gaussian ones."""
    kept, width = z.shape[1], settings.offsets
    total = np.zeros((kept, width))
    count = np.zeros((kept, width))
    for r0 in range(0, z.shape[0], chunk_rows):
        zc = z[r0:r0 + chunk_rows].double() / step
        a = torch.round(zc).abs()
        bucket = (a.clamp(1, width) - 1).long()
        live = (a > 0).double()
        diff = (a - zc.abs()) * live
        tot = torch.zeros(kept, width, dtype=torch.float64).scatter_add_(1, bucket.t(), diff.t())
        cnt = torch.zeros(kept, width, dtype=torch.float64).scatter_add_(1, bucket.t(), live.t())
        total += tot.numpy()
        count += cnt.numpy()
    prior = _gaussian_offsets(sigma_steps, width)
    w = settings.prior_rows
    return np.clip((total + w * prior) / (count + w), -0.5, 0.5)


def _bracket(rate: "_RateModel", sigma: np.ndarray, budget: int, settings: EcsqSettings) -> tuple[float, float]:
    """log steps (lo, hi) around the step that spends `budget`: an octave either side of the Gaussian rate's
    prediction (`joint_budget.gaussian_bits` of the held-out stds), widened until the measured rate brackets it."""
    top = float(sigma.max()) if sigma.size else 1.0
    floor, ceil = math.log(top * 1e-5), math.log(top * 64)  # rate(floor) > budget >= rate(ceil) = ~0
    live = sigma[:settings.max_components] if settings.max_components else sigma
    a, b = floor, ceil
    for _ in range(40):  # the prediction, on the stds alone
        mid = (a + b) / 2
        a, b = (mid, b) if float(gaussian_bits(live / math.exp(mid)).sum()) > budget else (a, mid)
    lo, hi = max(floor, b - math.log(2)), min(ceil, b + math.log(2))
    while lo > floor and rate.bits(math.exp(lo)) <= budget:
        lo = max(floor, lo - 2 * math.log(2))
    while hi < ceil and rate.bits(math.exp(hi)) > budget:
        hi = min(ceil, hi + 2 * math.log(2))
    return lo, hi


def fit_ecsq(ratio: float, z: torch.Tensor, p: int, settings: EcsqSettings = EcsqSettings(),
             sigma: np.ndarray | None = None, budget: int | None = None) -> EcsqFit:
    """z (N, k) centered held-out projections of one basis of dimension p -> the ratio's ECSQ fit.
    The mean coded bits per token over the rows are <= `budget` (default floor(16 p / ratio))."""
    z = torch.as_tensor(z, dtype=torch.float32)
    if z.ndim != 2 or z.shape[0] < 16:
        raise ValueError(f"ECSQ needs held-out projections (N >= 16, k); got shape {tuple(z.shape)}")
    if sigma is None:
        sigma = np.sqrt(heldout_variances(z))
    budget = budget_bits(p, ratio) if budget is None else int(budget)
    stride = max(1, z.shape[0] // settings.fit_rows)
    rate = _RateModel(z[::stride][:settings.fit_rows].contiguous(), sigma, settings)
    lo, hi = _bracket(rate, sigma, budget, settings)  # rate(lo) > budget >= rate(hi)
    for _ in range(settings.iterations):
        if hi - lo < settings.tolerance:
            break
        mid = (lo + hi) / 2
        if rate.bits(math.exp(mid)) > budget:
            lo = mid
        else:
            hi = mid
    step = math.exp(hi)
    full = _RateModel(z, sigma, settings)  # the bisection's rows are a sample: meet the budget on all of them
    full.cache = rate.cache
    for _ in range(32):
        if full.bits(step) <= budget:
            break
        step *= 2.0 ** (1 / 64)
    rate = full
    kept, index, classes = rate.layout(step)
    models = tuple(rate.cache[c] for c in classes)
    offsets = _offsets(z[:, :kept], step, sigma[:kept] / step, settings)
    return EcsqFit(float(ratio), budget, step, sigma[:kept].astype(np.float32), index.astype(np.int32),
                   offsets.astype(np.float32), models, rate.bits(step), int(rate.z.shape[0]))


def reconstruct(fit: EcsqFit, z: torch.Tensor) -> torch.Tensor:
    """z (N, k >= kept) -> zhat (N, kept) as the runtime codec reconstructs it."""
    z = torch.as_tensor(z, dtype=torch.float32)[:, :fit.kept]
    return dequantize(quantize(z, fit.step), fit.step, torch.from_numpy(fit.offsets))


def squared_error(fit: EcsqFit, z: torch.Tensor) -> float:
    """Summed squared error in the basis of rows z (N, k), dropped components included."""
    z = torch.as_tensor(z, dtype=torch.float32)
    err = (z[:, :fit.kept] - reconstruct(fit, z)).double().square().sum()
    return float(err + z[:, fit.kept:].double().square().sum())


def fit_ratios(ratios, z: torch.Tensor, p: int, settings: EcsqSettings = EcsqSettings(),
               budgets=None) -> list[EcsqFit]:
    """One EcsqFit per ratio (input order), sharing the held-out scales; budgets: bits per token per ratio
    (None: each ratio's floor(16 p / CR))."""
    z = torch.as_tensor(z, dtype=torch.float32)
    sigma = np.sqrt(heldout_variances(z))
    return [fit_ecsq(r, z, p, settings, sigma, None if budgets is None else budgets[i]) for i, r in enumerate(ratios)]
