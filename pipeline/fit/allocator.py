"""Bit allocation by dynamic programming (KVTC section 3), one run per compression ratio.

Components, in PCA order, are cut into contiguous blocks; a block has one size from
`block_sizes` and one type from `types` (kernels/codec/reference.py defines the quantizers and
`block_cost_bits`). A block of size s starts at a multiple of s (aligned starts: the tables
then hold K/s entries per size instead of K, which is what makes measured errors affordable).
The DP runs over (component index, cost units) and minimises the summed squared error subject
to cost <= B = floor(16 p / CR); components after the last block that got bits are dropped
(error: their variance), and only those: a component is never dropped while a later (weaker)
one gets bits, so noisy held-out errors cannot make the DP skip components. Cost unit g: the gcd of all block costs (exact DP); when
(K+1) * (B/g + 1) would exceed `max_dp_states`, g is the smallest multiple of that gcd that
fits, and each block's cost is rounded UP to a multiple of g, so B is never exceeded (the
only loss is slack on blocks whose cost is not a multiple of g, in practice size-1 blocks).
Error tables are built once per basis (`error_tables`) and shared by every ratio.
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch

from kvtc.artifacts.blocks import Block, block_cost_bits, budget_bits, check_payable, check_ratios, qtype_bits
from kvtc.pipeline.fit.allocator_settings import AllocatorSettings
from kvtc.pipeline.fit.block_errors import ErrorTables, analytic_tables, measured_tables
from kvtc.pipeline.fit.heldout import heldout_variances
from kvtc.pipeline.fit.pca import Basis



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
        """(kept,) float64: each component's bits as stored, its block's padding and scale cost amortised in."""
        out = np.zeros(self.kept)
        for b in self.blocks:
            out[b.start:b.end] = b.cost_bits / b.size if b.bits else 0.0
        return out

    def to_dict(self) -> dict:
        return {"ratio": self.ratio, "budget_bits": self.budget_bits, "cost_bits": self.cost_bits,
                "kept": self.kept, "expected_error": self.expected_error, "total_variance": self.total_variance,
                "error_model": self.error_model, "cost_unit": self.cost_unit, "heldout_rows": self.heldout_rows,
                "warnings": list(self.warnings), "blocks": [b.to_dict() for b in self.blocks]}


def validate_ratios(ratios, p: int, settings: AllocatorSettings = AllocatorSettings()) -> tuple[float, ...]:
    """Check every ratio before any model work; returns them as floats, in the given order."""
    out = check_ratios(ratios)
    check_payable(out, p, settings.types, settings.block_sizes)
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
    mids: list[str] = []  # no "none" block before a coded one: never drop a component and code a weaker one
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
        blocks.append(Block(j - s, s, t, qtype_bits(t)))
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
        variances = None
        if projections is not None:  # held-out variances (isotonic) generalize better than the eigenvalues
            variances = heldout_variances(torch.as_tensor(projections, dtype=torch.float32))
        return analytic_tables(basis, k, settings.block_sizes, settings.quantized_types, variances), ()
    if projections is None:
        if heldout is None:
            raise ValueError("error_model='measured' needs held-out rows; pass heldout=(N, p) rows or use 'analytic'")
        projections = basis.project(heldout, k)
    z = torch.as_tensor(projections, dtype=torch.float32)
    if z.ndim != 2:
        raise ValueError(f"held-out projections must be (N, k), got shape {tuple(z.shape)}")
    beyond = None
    if z.ndim == 2 and z.shape[1] == basis.dim > k:  # the dropped tail's variance as held-out rows show it
        beyond = float(z[:, k:].double().square().sum() / max(z.shape[0], 1))
    z = z[:, :k]
    n, notes = int(z.shape[0]), ()
    if n < settings.min_rows:
        raise ValueError(f"only {n} held-out rows; the error tables need at least {settings.min_rows} "
                         "(hold out more sequences or use error_model='analytic')")
    if n < settings.recommended_rows:
        notes = (f"only {n} held-out rows (recommended >= {settings.recommended_rows}); measured errors are noisy",)
        warnings.warn(notes[0], stacklevel=2)
    tables = measured_tables(basis, z, settings.block_sizes, settings.quantized_types)
    if beyond is not None:
        tables = dataclasses.replace(tables, beyond=beyond)
    return tables, notes


def allocate(ratios, basis: Basis, heldout: np.ndarray | torch.Tensor | None = None,
             settings: AllocatorSettings = AllocatorSettings(), *, tables: ErrorTables | None = None,
             projections: torch.Tensor | None = None) -> list[Allocation]:
    """One Allocation per ratio (input order). Error tables are computed once for all ratios,
    over as many components as the least aggressive ratio could pay for (budget / cheapest
    bits per component; a quantized block past that would need a "none" gap before it, which
    sorted variances never favour), and at most settings.max_components (the basis budget)."""
    ratios = validate_ratios(ratios, basis.dim, settings)
    notes: tuple[str, ...] = ()
    if tables is None:
        k = min(basis.k, settings.kept_bound(basis.dim, ratios))
        tables, notes = error_tables(basis, heldout, settings, k, projections)
    return [allocate_from_tables(r, tables, settings, notes) for r in ratios]
