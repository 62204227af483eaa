"""Memory a calibration needs, estimated from the model's geometry before any model work.

Two phases peak apart: the shard pool (each worker holds the running totals of the accumulators
routed to it: count, sum and packed Gram per stream and group, plus a shard's captured rows) and
the reduce (one stream and group at a time: about 3 packed Grams of the largest group plus its
leading eigenvectors, and the held-out rows). Model weights are not counted (they live on the
GPU on a cluster, and are small for the tiny geometry presets).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

GIB = 1 << 30


def packed_bytes(p: int) -> int:
    """float64 packed upper triangle plus the float64 sum of one stream and group."""
    return 8 * (p * (p + 1) // 2 + p)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes: `worker` per worker actor, `workers` actors, `reduce` for the reducer."""

    worker: int
    workers: int
    reduce: int
    largest_group: int

    def __post_init__(self) -> None:
        if min(self.worker, self.reduce) < 0 or self.workers < 1:
            raise ValueError("memory estimate: byte counts must be >= 0 and workers >= 1")

    @property
    def peak(self) -> int:
        return max(self.worker * self.workers, self.reduce)


def estimate(group_dims: list[int], *, accumulators: int, workers: int, rows_per_batch: int,
             heldout_rows: int, kept_max: int) -> MemoryEstimate:
    """group_dims: p of each group; rows_per_batch: captured rows folded at once (a shard's sequences
    x seq_len); heldout_rows: cap per split; kept_max: components the reducer computes at most."""
    p_total = sum(group_dims)
    busy = max(1, min(workers, accumulators))
    per_worker_accs = math.ceil(accumulators / busy)
    tile = 4 * 3 * min(1024, max(group_dims)) * max(group_dims)  # a row tile of x^T x, its selection, float64 copy
    worker = per_worker_accs * 2 * sum(packed_bytes(p) for p in group_dims) + rows_per_batch * p_total * 4 * 2 + tile
    p = max(group_dims)
    held = 2 * heldout_rows * p_total * 4 * 2  # held-out and second-domain rows, both streams, float32
    reduce = 3 * packed_bytes(p) + 8 * p * min(p, kept_max) + held
    return MemoryEstimate(worker, busy, reduce, p)


def check_fits(est: MemoryEstimate, available: int, num_layers: int, width: int, groups: str,
               fits_with: callable) -> None:
    """Raise ValueError when the estimate exceeds `available` bytes, saying how much it needs and
    suggesting `--groups layers:K` (the largest K that fits, from `fits_with(K) -> MemoryEstimate`)."""
    if est.peak <= available:
        return
    hint = ""
    for k in range(num_layers, 0, -1):
        if fits_with(k).peak <= available:
            hint = f"; split the features into layer groups with --groups layers:{k} (needs about {fits_with(k).peak / GIB:.1f} GiB)"
            break
    phase = "the shard workers" if est.worker * est.workers >= est.reduce else "the reduce"
    raise ValueError(
        f"this geometry needs about {est.peak / GIB:.1f} GiB for {phase} (largest group p={est.largest_group}, "
        f"groups {groups!r}: {est.workers} worker(s) x {est.worker / GIB:.1f} GiB, reduce {est.reduce / GIB:.1f} GiB), "
        f"more than the {available / GIB:.1f} GiB available{hint or ''}; fewer --accumulators or --workers, or a "
        f"smaller --heldout-rows also lower it" + ("" if hint else f" (p per layer is {width})"))
