"""The fit stage of one stream and group: DP allocations and ECSQ tables at every ratio, fitted on the
held-out middle rows' projections onto its basis."""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from kvtc.pipeline.fit import ecsq as ecsq_fit
from kvtc.pipeline.fit.allocator import Allocation, AllocatorSettings, allocate
from kvtc.pipeline.fit.heldout_rows import GroupRows
from kvtc.pipeline.fit.pca import Basis, cpu_threads


@dataclass
class GroupFit:
    """The fit stage's result for one stream and group: its basis, its held-out rows (`rows`, every
    position, and their projections `z_all` (N, k); the middle ones `x_mid` (M, p) and `z_mid` (M, k)),
    the DP allocations and the ECSQ fits at every ratio, and the seconds the fit took."""

    stream: str
    group: int
    basis: Basis
    rows: GroupRows
    x_mid: np.ndarray
    z_mid: torch.Tensor
    allocs: list[Allocation]
    fits: list[ecsq_fit.EcsqFit]
    seconds: float = 0.0
    max_components: int = 0  # the basis budget the fits were capped at (0: none)
    z_all: torch.Tensor | None = None

    @property
    def kept(self) -> int:
        return max([a.kept for a in self.allocs] + [f.kept for f in self.fits])


def fit_group(stream: str, group: int, basis: Basis, ratios, alloc: AllocatorSettings, rows: GroupRows,
              sinks: int, window: int, budgets=None) -> GroupFit:
    """DP allocations and ECSQ tables at `ratios` on the held-out middle rows' projections; the ECSQ tables
    within `budgets` (bits per token per ratio: a joint split's shares; None: each ratio's floor(16 p / CR))."""
    t0 = time.perf_counter()
    mid = rows.middle(sinks, window)
    x_mid = rows.rows[mid]
    z_all = basis.project(rows.rows)  # one GEMM serves the error tables, the ECSQ fit and every metric
    z_mid = z_all[torch.from_numpy(mid)]
    # the joint split is the ECSQ mode's (the default codec); the fixed mode keeps each basis's own share: its
    # blobs store an fp8 block's side information in 32 bits where the DP counts 16, so a larger share in fp8
    # blocks would outgrow the ratio's bound
    allocs = allocate(ratios, basis, settings=alloc, projections=z_mid)
    with cpu_threads(1):  # the step search's many small tensor ops: a second thread only waits (the same tables)
        fits = ecsq_fit.fit_ratios(ratios, z_mid, basis.dim,  # ECSQ mode, within the basis budget
                                   ecsq_fit.EcsqSettings(max_components=alloc.max_components), budgets)
    return GroupFit(stream, group, basis, rows, x_mid, z_mid, allocs, fits, time.perf_counter() - t0,
                    alloc.max_components, z_all)
