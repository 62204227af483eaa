"""Bit allocation by dynamic programming (KVTC section 3), one run per compression ratio.

Components, in PCA order, are cut into contiguous blocks; a block has one size from
`block_sizes` and one type from `types` (kernels/reference.py defines the quantizers and
`block_cost_bits`). A block of size s starts at a multiple of s (aligned starts: the tables
then hold K/s entries per size instead of K, which is what makes measured errors affordable).
The DP runs over (component index, cost units) and minimises the summed squared error subject
to cost <= B = floor(16 p / CR); components after the last block that got bits are dropped
(error: their variance). Cost unit g: the gcd of all block costs (exact DP); when
(K+1) * (B/g + 1) would exceed `max_dp_states`, g is the smallest multiple of that gcd that
fits, and each block's cost is rounded UP to a multiple of g, so B is never exceeded (the
only loss is slack on blocks whose cost is not a multiple of g, in practice size-1 blocks).
Error tables are built once per basis (`error_tables`) and shared by every ratio.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch

from kernels.reference import block_cost_bits, qtype_bits, quantize_dequantize, scale_bits
from pipeline.pca import Basis

FP16_REL_MSE = 2.0 ** -21 * 0.54 / 12
FP8_REL_MSE = 2.0 ** -6 * 0.54 / 12


@dataclass(frozen=True)
class AllocatorSettings:
    """block_sizes: allowed block lengths; types: allowed block types ("none" or any reference
    qtype; the dropped tail is always "none"); error_model: "measured" (reference quantizer on
    held-out projections) or "analytic"; min_rows / recommended_rows: held-out rows below which
    allocation fails / warns; max_dp_states: cap on DP table cells; cost_unit: 0 = automatic."""

    block_sizes: tuple[int, ...] = (1, 16, 64, 256, 1024)
    types: tuple[str, ...] = ("none", "int2", "int4", "fp8")
    error_model: str = "measured"
    min_rows: int = 16
    recommended_rows: int = 1024
    max_dp_states: int = 150_000_000
    cost_unit: int = 0

    def __post_init__(self) -> None:
        sizes, types = tuple(self.block_sizes), tuple(self.types)
        if not sizes or any(not isinstance(s, int) or s < 1 for s in sizes) or len(set(sizes)) != len(sizes):
            raise ValueError(f"block_sizes={sizes}: give distinct positive integers, e.g. (1, 16, 64, 256, 1024)")
        for t in types:
            qtype_bits(t)
        if len(set(types)) != len(types) or not any(t != "none" for t in types):
            raise ValueError(f"types={types}: give distinct types with at least one quantized type, e.g. int4")
        if self.error_model not in ("measured", "analytic"):
            raise ValueError(f"error_model={self.error_model!r}: use 'measured' or 'analytic'")
        if not 1 <= self.min_rows <= self.recommended_rows:
            raise ValueError("min_rows must be >= 1 and <= recommended_rows")
        if self.max_dp_states < 1000 or self.cost_unit < 0:
            raise ValueError("max_dp_states must be >= 1000 and cost_unit >= 0 (0 = automatic)")
        object.__setattr__(self, "block_sizes", tuple(sorted(sizes)))
        object.__setattr__(self, "types", types)

    @property
    def quantized_types(self) -> tuple[str, ...]:
        return tuple(t for t in self.types if t != "none")

    def to_dict(self) -> dict:
        return {"block_sizes": list(self.block_sizes), "types": list(self.types), "error_model": self.error_model,
                "min_rows": self.min_rows, "recommended_rows": self.recommended_rows,
                "max_dp_states": self.max_dp_states, "cost_unit": self.cost_unit, "aligned_starts": True}

    @classmethod
    def from_dict(cls, d: dict) -> "AllocatorSettings":
        """Inverse of to_dict (unknown keys are an error; "aligned_starts" is informational)."""
        d = {k: v for k, v in d.items() if k != "aligned_starts"}
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown allocator settings {sorted(unknown)}")
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})


@dataclass(frozen=True)
class Block:
    """Components [start, start + size) stored as `qtype` (bits per component, per-token scale bits)."""

    start: int
    size: int
    qtype: str
    bits: int
    scale_bits: int

    @property
    def end(self) -> int:
        return self.start + self.size

    @property
    def cost_bits(self) -> int:
        return self.size * self.bits + self.scale_bits

    def to_dict(self) -> dict:
        return {"start": self.start, "size": self.size, "type": self.qtype, "bits": self.bits,
                "scale_bits": self.scale_bits}


@dataclass(frozen=True)
class Allocation:
    """One ratio's allocation. blocks tile [0, kept) (a block may be "none"); components >= kept
    are dropped. cost_bits: per token; expected_error: per-token squared error predicted by the
    error model (dropped tail included); total_variance: trace of the calibration covariance."""

    ratio: float
    budget_bits: int
    blocks: tuple[Block, ...]
    cost_bits: int
    kept: int
    expected_error: float
    total_variance: float
    error_model: str
    cost_unit: int
    heldout_rows: int
    warnings: tuple[str, ...] = field(default=())

    def bits_per_component(self) -> np.ndarray:
        """(kept,) float64: each component's bits with its block's scale cost amortised in."""
        out = np.zeros(self.kept)
        for b in self.blocks:
            out[b.start:b.end] = b.bits + b.scale_bits / b.size if b.bits else 0.0
        return out

    def to_dict(self) -> dict:
        return {"ratio": self.ratio, "budget_bits": self.budget_bits, "cost_bits": self.cost_bits,
                "kept": self.kept, "expected_error": self.expected_error, "total_variance": self.total_variance,
                "error_model": self.error_model, "cost_unit": self.cost_unit, "heldout_rows": self.heldout_rows,
                "warnings": list(self.warnings), "blocks": [b.to_dict() for b in self.blocks]}


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


def _tables(basis: Basis, variance: np.ndarray, errors: dict, model: str, rows: int) -> ErrorTables:
    k = variance.shape[0]
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


def analytic_tables(basis: Basis, k: int, sizes, qtypes) -> ErrorTables:
    """Gaussian model on the calibrated spectrum. intB, block of s: range r = 2 m (m from
    `_expected_max`), step r / (2^B - 1), uniform error step^2 / 12 on the s - 2 components that
    are not the block's min or max (those two are stored exactly in fp16). fp8 e4m3: relative
    error of a 3-bit mantissa, 2^-6 E[1/m^2] / 12 with Benford mantissas (E = 0.54), on all
    components but the absmax one. Every entry adds fp16 rounding (2^-21 * 0.54 / 12 relative, as measured)."""
    lam_all = np.asarray(basis.eigenvalues[:k], dtype=np.float64)
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
    return _tables(basis, lam_all.copy(), errors, "analytic", 0)


def budget_bits(p: int, ratio: float) -> int:
    """Bits per token per stream: floor(16 p / CR)."""
    return int(math.floor(16 * p / ratio + 1e-9))


def validate_ratios(ratios, p: int, settings: AllocatorSettings = AllocatorSettings()) -> tuple[float, ...]:
    """Check every ratio before any model work; returns them as floats, in the given order."""
    out = tuple(float(r) for r in ratios)
    if not out:
        raise ValueError("no compression ratios given; pass e.g. 8 16 32")
    if len(set(out)) != len(out):
        raise ValueError(f"compression ratios {out} contain duplicates")
    cheapest = min(block_cost_bits(t, s) for t in settings.quantized_types for s in settings.block_sizes if s <= p)
    for r in out:
        if not math.isfinite(r) or r <= 1:
            raise ValueError(f"compression ratio {r:g} must be a finite number > 1")
        if budget_bits(p, r) < cheapest:
            raise ValueError(f"compression ratio {r:g} leaves {budget_bits(p, r)} bits per token for p={p}, less than "
                             f"the cheapest quantized block ({cheapest} bits); use a ratio <= {16 * p / cheapest:g}")
    return out


def _cost_unit(settings: AllocatorSettings, k: int, budget: int) -> int:
    if settings.cost_unit:
        return settings.cost_unit
    if 2 * (k + 1) > settings.max_dp_states:
        raise ValueError(f"{k} components need max_dp_states >= {2 * (k + 1)}; raise it or set cost_unit")
    costs = [block_cost_bits(t, s) for t in settings.quantized_types for s in settings.block_sizes if s <= k]
    g = math.gcd(*costs)
    m = max(1, math.ceil((k + 1) * (budget // g + 1) / settings.max_dp_states))
    while (k + 1) * (budget // (g * m) + 1) > settings.max_dp_states:
        m += 1
    return g * m


def solve_budget(tables: ErrorTables, settings: AllocatorSettings, budget: int):
    """Exact DP in cost units; returns (blocks, error within the tables' K columns, unit)."""
    k, unit = tables.k, _cost_unit(settings, tables.k, budget)
    units = budget // unit
    width = units + 1
    mids = ["none"] if "none" in settings.types else []
    choices = [(s, t) for s in settings.block_sizes if s <= k for t in mids + list(settings.quantized_types)]
    ucost = [-(-block_cost_bits(t, s) // unit) for s, t in choices]
    cum = np.concatenate([[0.0], np.cumsum(tables.variance)])
    ring = max(settings.block_sizes) + 1
    rows = np.zeros((ring, width))
    index_type = np.int8 if len(choices) < 128 else np.int16
    choice = np.zeros((k + 1, width), dtype=index_type)
    final = np.full(k + 1, np.inf)
    final[0] = cum[k]
    cand = np.empty((len(choices), width))
    for j in range(1, k + 1):
        live = []
        for ci, (s, t) in enumerate(choices):
            i = j - s
            if i < 0 or i % s or ucost[ci] > units:
                continue
            c, e = ucost[ci], (cum[j] - cum[i] if t == "none" else tables.errors[(s, t)][i // s])
            r = len(live)
            cand[r, :c] = np.inf
            np.add(rows[i % ring, :width - c], e, out=cand[r, c:])
            live.append(ci)
        if not live:
            rows[j % ring] = np.inf
            continue
        sub = cand[:len(live)]
        arg = sub.argmin(axis=0)
        rows[j % ring] = np.take_along_axis(sub, arg[None], axis=0)[0]
        choice[j] = np.asarray(live, dtype=index_type)[arg]
        final[j] = rows[j % ring, units] + cum[k] - cum[j]
    j = int(np.argmin(final))
    best, u, blocks = float(final[j]), units, []
    while j > 0:
        ci = int(choice[j, u])
        s, t = choices[ci]
        blocks.append(Block(j - s, s, t, qtype_bits(t), scale_bits(t)))
        j, u = j - s, u - ucost[ci]
    blocks.reverse()
    while blocks and blocks[-1].qtype == "none":
        blocks.pop()
    return tuple(blocks), best, unit


def allocate_from_tables(ratio: float, tables: ErrorTables, settings: AllocatorSettings,
                         notes: tuple[str, ...] = ()) -> Allocation:
    """One ratio's DP on prepared error tables."""
    budget = budget_bits(tables.p, ratio)
    blocks, err, unit = solve_budget(tables, settings, budget)
    cost = sum(b.cost_bits for b in blocks)
    if cost > budget:
        raise RuntimeError(f"allocator bug: ratio {ratio:g} costs {cost} bits > budget {budget}")
    kept = blocks[-1].end if blocks else 0
    return Allocation(float(ratio), budget, blocks, cost, kept, err + tables.beyond, tables.total_variance,
                      tables.model, unit, tables.rows, notes)


def error_tables(basis: Basis, heldout: np.ndarray | torch.Tensor | None = None,
                 settings: AllocatorSettings = AllocatorSettings(), k: int | None = None,
                 projections: torch.Tensor | None = None) -> tuple[ErrorTables, tuple[str, ...]]:
    """Tables for the first k components (default: all of the basis). Measured: from raw held-out
    rows (N, p) or from centered projections (N, >= k). Returns (tables, warnings)."""
    k = basis.k if k is None else min(int(k), basis.k)
    if settings.error_model == "analytic":
        return analytic_tables(basis, k, settings.block_sizes, settings.quantized_types), ()
    if projections is None:
        if heldout is None:
            raise ValueError("error_model='measured' needs held-out rows; pass heldout=(N, p) rows or use 'analytic'")
        projections = basis.project(heldout, k)
    z = torch.as_tensor(projections, dtype=torch.float32)
    if z.ndim != 2:
        raise ValueError(f"held-out projections must be (N, k), got shape {tuple(z.shape)}")
    z = z[:, :k]
    n, notes = int(z.shape[0]), ()
    if n < settings.min_rows:
        raise ValueError(f"only {n} held-out rows; the error tables need at least {settings.min_rows} "
                         "(hold out more sequences or use error_model='analytic')")
    if n < settings.recommended_rows:
        notes = (f"only {n} held-out rows (recommended >= {settings.recommended_rows}); measured errors are noisy",)
        warnings.warn(notes[0], stacklevel=2)
    return measured_tables(basis, z, settings.block_sizes, settings.quantized_types), notes


def allocate(ratios, basis: Basis, heldout: np.ndarray | torch.Tensor | None = None,
             settings: AllocatorSettings = AllocatorSettings(), *, tables: ErrorTables | None = None,
             projections: torch.Tensor | None = None) -> list[Allocation]:
    """One Allocation per ratio (input order). Error tables are computed once for all ratios,
    over as many components as the least aggressive ratio could pay for (budget / cheapest
    bits per component; a quantized block past that would need a "none" gap before it, which
    sorted variances never favour)."""
    ratios = validate_ratios(ratios, basis.dim, settings)
    notes: tuple[str, ...] = ()
    if tables is None:
        cheapest = min(block_cost_bits(t, s) / s for t in settings.quantized_types for s in settings.block_sizes)
        k = min(basis.k, math.ceil(budget_bits(basis.dim, min(ratios)) / cheapest))
        tables, notes = error_tables(basis, heldout, settings, k, projections)
    return [allocate_from_tables(r, tables, settings, notes) for r in ratios]
