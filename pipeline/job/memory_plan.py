"""Memory a calibration needs, estimated from the model's geometry before any model work.

Two phases peak apart: the shard pool (each worker holds the running totals of the accumulators
routed to it: count, sum and packed Gram per stream and group, plus a shard's captured rows) and
the reduce (the driver's held-out rows, and the largest group's task running alone with the solver
of the smallest peak: `reduce_plan.least_bytes`; the reduce itself runs as many at once as fit), or
the publish after it (`publish_bytes`: the driver holding every basis and their files; the served check
measures only when its own copies fit, `served_check.served_bytes`). Host memory does not count model weights (they
live on the GPUs on a cluster, and are small for the tiny geometry presets).

On GPU workers `plan_gpus` sizes the worker: the weights spread layer by layer over its GPUs, a
forward's working set on each, and on the first GPU the statistics totals and captured rows (the
worker estimate above), each GPU counted at GPU_USABLE of its memory.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from kvtc.pipeline.job.reduce_plan import least_bytes
from kvtc.workers.model_size import ModelSize
from kvtc.workers.placement import pack

GIB = 1 << 30


def packed_bytes(p: int) -> int:
    """float64 packed upper triangle plus the float64 sum of one stream and group."""
    return 8 * (p * (p + 1) // 2 + p)


def statistics_bytes(group_dims, accumulators: int, workers: int) -> int:
    """The statistics one of `workers` shard workers holds: its share of the `accumulators`' packed Grams and sums,
    both streams, and a row tile of x^T x (its selection and float64 copy). The one formula of it: the plan's
    estimate and the fold's sizer (fold_plan.FoldSizer) both call it."""
    busy = max(1, min(workers, accumulators))
    pmax = max(group_dims)
    tile = 4 * 3 * min(1024, pmax) * pmax
    return math.ceil(accumulators / busy) * 2 * sum(packed_bytes(p) for p in group_dims) + tile


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
             heldout_rows: int, kept_max: int, curve_points: int = 0, curve_k: int = 0) -> MemoryEstimate:
    """group_dims: p of each group; rows_per_batch: captured rows folded at once (a shard's sequences
    x seq_len); heldout_rows: cap per split; kept_max: components the reducer computes at most;
    curve_points, curve_k: the error-by-tokens chart's prefixes and components per prefix basis (each task holds
    the running sums of all but the last prefix)."""
    p_total = sum(group_dims)
    busy = max(1, min(workers, accumulators))
    worker = statistics_bytes(group_dims, accumulators, workers) + rows_per_batch * p_total * 4 * 2
    p = max(group_dims)
    held = 2 * heldout_rows * p_total * 4 * 2  # the driver: held-out and second-domain rows, both streams, float32
    prefixes = max(0, min(curve_points, accumulators) - 1)
    curve_k = min(p, curve_k) if curve_points > 0 else 0
    reduce = held + least_bytes(p, min(p, kept_max), 2 * heldout_rows, prefixes, curve_k)  # the largest task, alone
    return MemoryEstimate(worker, busy, max(reduce, publish_bytes(group_dims, kept_max)), p)


def publish_bytes(group_dims: list[int], kept_max: int) -> int:
    """The driver's peak while it publishes (the group tasks have ended): every basis of both streams as
    float32, the artifact's encoded files, and one basis's transient encoding copies (its rows, Arrow's
    buffer, the bytes)."""
    bases = [2 * 4 * p * min(p, kept_max) for p in group_dims]
    return 2 * sum(bases) + 3 * max(bases, default=0) // 2  # the served check skips itself when it cannot fit


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


GPU_USABLE = 0.90  # of a GPU's memory; the rest: CUDA context, cuBLAS workspaces, allocator fragmentation


@dataclass(frozen=True)
class GpuPlan:
    """One worker's GPUs: `gpus` of `gpu_bytes` each hold the weights (`weights` bytes, placement units
    packed in forward order), a forward's working set on every GPU (`activations`), and on the first
    GPU the worker's statistics totals and captured rows (`first_gpu`); `workers` such workers fit
    the cluster."""

    gpus: int
    gpu_bytes: int
    weights: int
    activations: int
    first_gpu: int
    workers: int

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.workers < 1 or min(self.gpu_bytes, self.weights, self.activations, self.first_gpu) < 0:
            raise ValueError("GPU plan: gpus and workers must be >= 1, byte counts >= 0")

    @property
    def usable(self) -> int:
        """Bytes per GPU left for weights (and, on the first GPU, statistics)."""
        return int(GPU_USABLE * self.gpu_bytes) - self.activations

    def max_memory(self) -> dict[int, int]:
        """Weight budget per local GPU index (the worker's device map packs within it)."""
        return {i: max(0, self.usable - (self.first_gpu if i == 0 else 0)) for i in range(self.gpus)}


def plan_gpus(size: ModelSize, gpu_bytes: int, cluster_gpus: int, gpus_per_node: int,
              first_gpu: Callable[[int], int], requested: int | None = None) -> GpuPlan:
    """GPUs per worker for a model: the fewest n whose GPUs hold its placement units packed in order,
    each GPU counted at GPU_USABLE of its memory minus one forward's working set, the first also
    holding `first_gpu(workers)` (statistics and rows; workers = cluster_gpus // n). `requested`
    (--gpus-per-worker) is checked against that number and the largest node (`gpus_per_node`).
    Raises ValueError naming the number that fits."""
    def plan(n: int) -> GpuPlan:
        return GpuPlan(n, gpu_bytes, size.weight_bytes, size.activation_bytes, first_gpu(max(1, cluster_gpus // n)),
                       max(1, cluster_gpus // n))

    def fits(p: GpuPlan) -> bool:
        return p.first_gpu <= p.usable and pack(size.units, p.max_memory()) is not None

    need = next((n for n in range(1, 1025) if fits(plan(n))), None)
    sizes = (f"{size.weight_bytes / GIB:.1f} GiB of weights, {size.activation_bytes / GIB:.1f} GiB of activations per "
             f"GPU and {plan(need or 1).first_gpu / GIB:.1f} GiB of statistics on the first, on GPUs of "
             f"{gpu_bytes / GIB:.0f} GiB ({GPU_USABLE:.0%} usable)")
    if need is None:
        raise ValueError(f"the model cannot fit any number of GPUs per worker: {sizes}; the statistics must fit one "
                         "GPU: split the features with --groups layers:K, or lower --accumulators")
    if requested is not None and requested < need:
        raise ValueError(f"--gpus-per-worker {requested} is too few: the model needs {need} GPUs per worker ({sizes}); "
                         f"pass --gpus-per-worker {need} or omit it")
    n = requested or need
    if n > gpus_per_node:
        raise ValueError(f"the model needs {n} GPUs per worker on one node ({sizes}), and the largest node has "
                         f"{gpus_per_node}; add a node type with {n} or more GPUs (see ray_cluster.yaml)")
    return plan(n)
