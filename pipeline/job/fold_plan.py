"""The fold's memory plan: what one shard worker holds at its peak, by model size, --seq-len, objective, dtype and
batch, and how many workers run at once on a node so that their sum stays under its kill line (as the reduce's
plan does for group tasks: reduce_plan.py, whose `node_budget` gives the line).

A worker's peak (`FoldSizer.worker_bytes`) is its process (`WORKER_BASE`: Python, torch, transformers, a Ray
worker), the model's weights in the workers' dtype, the statistics totals of the accumulators routed to it
(`memory_plan.packed_bytes` per stream and group, and a row tile of the Gram update), and the largest working set of
what it does to one batch (`capture_bytes`), T = --seq-len, B = batch, s = the dtype's bytes:

- forward (every training shard): the model's cache of every coded layer (B T layers x kv_features x s) with, first,
  one layer's activations (2 B T (hidden + intermediate) s), then the captured rows (float32, both streams, the
  positions past sinks and window); the attention metric adds one layer's repeated keys and values, its scored
  query rows and their scores;
- sensitivity (--objective attention, --sensitivity >= 1; one sequence, kvtc.workers.sensitivity): the cache entries
  as grad leaves, each checkpointed layer's input (T x hidden), the final hidden states, their copy and gradient,
  and the larger of one logits block (about 4 float32 copies of LOGIT_BLOCK_BYTES) and one layer's recomputed
  activations with their gradients (about 5 T (hidden + intermediate) s); layers without a KV cache are not
  checkpointed and keep theirs;
- held-out shards: whole sequences, every position, up to the worker's row cap (a whole batch past it), as rows,
  their concatenation and the serialized entry's two copies (4 copies in all).

Calibrated on SmolLM2-135M (float32 on a 2-core CPU, one thread, glibc's mmap threshold fixed as the worker fixes
it: kvtc.workers.malloc) with bench/fold_memory.py, one fresh process per point, working set = peak RSS less the
resident process, weights and totals. Measured (modelled) GiB at T = 1024 / 4096 / 8192: training capture 0.39
(0.37) / 0.70 (0.72) / 1.26 (1.25); held-out shard 0.78 (0.70) / 0.76 (0.70) / 1.46 (1.41). WORKER_BASE is a Ray
actor's RSS after loading the model and one short capture, less its weights (0.665 GiB measured); ALLOC_SLACK
covers what the allocator keeps beyond the live tensors. The goal run (`--seq-len 8192`, bench/README.md, "The fold's memory") checks
the sum against the workers' RSS polled through the job.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import psutil
import torch

from kvtc.kernels.codec.layers import cached_layers
from kvtc.pipeline.job.memory_plan import GIB, statistics_bytes
from kvtc.pipeline.job.reduce_plan import MARGIN, kill_threshold, node_budget
from kvtc.pipeline.settings import ReduceSettings
from kvtc.workers.capture_settings import CaptureSettings
from kvtc.workers.model_size import model_size
from kvtc.workers.models import load_spec, resolve_dtype
from kvtc.workers.objective import ATTENTION, Objective

WORKER_BASE = 720 << 20  # a Ray shard worker with torch and transformers imported, its model's weights excluded
ALLOC_SLACK = 1.10  # measured peak over modelled working set: what the allocator holds beyond live tensors
LOGIT_BLOCK_BYTES = 64 << 20  # kvtc.workers.sensitivity.LOGIT_BLOCK_BYTES (kept here: the plan imports no torch)
SENSITIVITY_TOKENS = 1024  # kvtc.workers.sensitivity.SENSITIVITY_TOKENS: the tokens of a sequence the pass measures
LOGIT_COPIES = 4  # logits, softmax, log-softmax kept for the backward, gradient
METRIC_QUERY_ROWS = 256  # kvtc.workers.attention_metric.QUERY_ROWS
HELDOUT_COPIES = 4  # rows, their concatenation, the serialized entry's two copies (ShardWorker._store_rows)


@dataclass(frozen=True)
class FoldShape:
    """What sizes one shard worker, from the model's config and the capture settings (no weights loaded).

    weights: bytes of the weights in the workers' dtype; itemsize: that dtype's bytes; layers: decoder layers;
    coded: layers with a KV cache, each holding kv_heads x (head_dim + value_dim) values per position (value_dim:
    the values slot's width, head_dim but for MLA); hidden, intermediate, vocab, heads: the text model's sizes;
    seq_len, batch: one batch's shape; captured: positions captured per sequence (past sinks and window, sampled);
    attention: the objective captures the attention metric; sensitivity: sequences per shard with the KL pass;
    probe: tokens of the copy probe's KL pass (the first shard's; 0: none);
    heldout_rows: the row cap of one held-out shard (ShardWorker rows_per_heldout_shard)."""

    weights: int
    itemsize: int
    layers: int
    coded: int
    kv_heads: int
    head_dim: int
    value_dim: int
    hidden: int
    intermediate: int
    vocab: int
    heads: int
    seq_len: int
    batch: int = 1
    captured: int = 0
    attention: bool = True
    sensitivity: int = 1
    heldout_rows: int = 4096
    probe: int = 0

    def __post_init__(self) -> None:
        sizes = (self.itemsize, self.layers, self.coded, self.kv_heads, self.head_dim, self.value_dim, self.hidden,
                 self.vocab, self.heads, self.seq_len, self.batch)
        if min(sizes) < 1 or min(self.weights, self.intermediate, self.captured, self.sensitivity,
                                 self.heldout_rows, self.probe) < 0:
            raise ValueError(f"fold shape: sizes must be >= 1 and byte counts >= 0, got {self}")
        if self.coded > self.layers or self.captured > self.seq_len:
            raise ValueError(f"fold shape: {self.coded} coded of {self.layers} layers, {self.captured} captured of "
                             f"{self.seq_len} positions")

    @property
    def features(self) -> int:
        """p of both streams together."""
        return self.coded * self.kv_heads * (self.head_dim + self.value_dim)

    def at(self, seq_len: int, captured: int) -> "FoldShape":
        return replace(self, seq_len=seq_len, captured=captured)


def forward_bytes(s: FoldShape) -> int:
    """A training batch's forward: the cache, one layer's activations then the captured rows, the metric's part."""
    tokens = s.batch * s.seq_len
    cache = tokens * s.features * s.itemsize
    layer = 2 * tokens * (s.hidden + s.intermediate) * s.itemsize
    rows = s.batch * s.captured * s.features * 4
    metric = 0
    if s.attention:  # one layer's keys and values repeated to every query head, scores; every layer's query rows
        scored = min(s.seq_len, METRIC_QUERY_ROWS)
        metric = 2 * tokens * s.heads * s.head_dim * 4 + 3 * s.batch * s.heads * scored * s.seq_len * 4 \
            + s.coded * s.batch * scored * s.heads * s.head_dim * 4
    return cache + max(layer, rows) + metric


def sensitivity_bytes(s: FoldShape) -> int:
    """One sequence's KL-sensitivity pass (0 without it): leaves, checkpointed inputs, hidden states, the larger
    of a logits block and one layer's backward."""
    if not s.attention or s.sensitivity < 1:
        return 0
    t = max(min(s.seq_len, SENSITIVITY_TOKENS), min(s.seq_len, s.probe))  # the copy probe's pass where it is longer
    leaves = t * s.features * s.itemsize
    inputs = t * s.coded * s.hidden * s.itemsize
    layer = 5 * t * (s.hidden + s.intermediate) * s.itemsize
    kept = (s.layers - s.coded) * layer  # layers without a KV cache are not checkpointed
    block = max(16, LOGIT_BLOCK_BYTES // (4 * s.vocab))
    logits = LOGIT_COPIES * min(t, block) * s.vocab * 4
    return leaves + inputs + kept + 3 * t * s.hidden * 4 + max(logits, layer)


def heldout_bytes(s: FoldShape) -> int:
    """A held-out shard: whole batches of every position up to the row cap, HELDOUT_COPIES of them."""
    per_batch = s.batch * s.seq_len
    rows = max(1, math.ceil(s.heldout_rows / per_batch)) * per_batch
    return HELDOUT_COPIES * rows * s.features * 4


def capture_bytes(s: FoldShape) -> int:
    """The largest working set of one batch, whatever the shard."""
    return max(forward_bytes(s), sensitivity_bytes(s), heldout_bytes(s))


@dataclass(frozen=True)
class FoldPlan:
    """The fold as planned: `workers` at once, each peaking near `worker_bytes`, under `budget` bytes of the node
    (`wanted`: the count asked for or the CPUs' default, before memory was counted)."""

    workers: int
    wanted: int
    worker_bytes: int
    budget: int
    seq_len: int
    objective: Objective

    def __post_init__(self) -> None:
        if not 1 <= self.workers <= max(1, self.wanted) or self.worker_bytes < 0:
            raise ValueError(f"fold plan: workers must be in [1, {self.wanted}] and bytes >= 0, got {self.workers}")

    def line(self) -> str:
        """The plan, for the console: workers, each one's peak, the node's budget."""
        lowered = (f"; lowered from {self.wanted} workers, which would need more than the budget"
                   if self.workers < self.wanted else "")
        return (f"kvtc calibrate: fold plan: {self.workers} worker{'s' if self.workers != 1 else ''} x "
                f"{self.worker_bytes / GIB:.2f} GiB per worker (seq-len {self.seq_len}, objective {self.objective.name}), "
                f"node budget {self.budget / GIB:.1f} GiB{lowered}")

    def to_dict(self) -> dict[str, Any]:
        return {"workers": self.workers, "wanted": self.wanted, "worker_gib": round(self.worker_bytes / GIB, 3),
                "budget_gib": round(self.budget / GIB, 2), "seq_len": self.seq_len,
                "objective": self.objective.name}


@dataclass(frozen=True)
class FoldSizer:
    """One worker's peak for a given worker count (its share of the accumulators) and --seq-len.

    shape: the worker's FoldShape; group_dims: p of each group (keys stream; both streams counted); accumulators:
    --accumulators; sinks, window, sample: the capture's excluded positions and sampled share; objective: the one
    that runs, and `sensitivity` how to drop the KL pass, for messages."""

    shape: FoldShape
    group_dims: tuple[int, ...]
    accumulators: int
    sinks: int = 4
    window: int = 128
    sample: float = 1.0
    objective: Objective = ATTENTION
    sensitivity: str = field(default="", compare=False)  # how the KL pass is switched off, for messages

    def __post_init__(self) -> None:
        if not self.group_dims or min(self.group_dims) < 1 or self.accumulators < 1:
            raise ValueError("fold sizer: needs groups of p >= 1 and accumulators >= 1")

    def totals_bytes(self, workers: int) -> int:
        """The statistics a worker holds (memory_plan.statistics_bytes)."""
        return statistics_bytes(self.group_dims, self.accumulators, workers)

    def captured(self, seq_len: int) -> int:
        eligible = max(0, seq_len - self.sinks - self.window)
        return eligible if self.sample >= 1.0 else max(1, round(self.sample * eligible))

    def capture_bytes(self, seq_len: int | None = None) -> int:
        """One batch's largest working set at `seq_len` (default: the shape's), the allocator's slack included."""
        t = seq_len or self.shape.seq_len
        return int(ALLOC_SLACK * capture_bytes(self.shape.at(t, min(t, self.captured(t)))))

    def worker_bytes(self, workers: int, seq_len: int | None = None) -> int:
        """Peak bytes of one of `workers` shard workers at `seq_len` (default: the shape's)."""
        return WORKER_BASE + self.shape.weights + self.totals_bytes(workers) + self.capture_bytes(seq_len)

    def longest_fitting(self, budget: int) -> int | None:
        """The longest --seq-len (up to the shape's) at which one worker fits `budget`, or None. A scan: a held-out
        shard's whole batches past its row cap make the peak not monotone in the length."""
        lowest = self.sinks + self.window + 1
        return next((t for t in range(self.shape.seq_len, lowest - 1, -1) if self.worker_bytes(1, t) <= budget), None)

    def plan(self, wanted: int, budget: int, total: int, used: int) -> FoldPlan:
        """The most workers, up to `wanted`, whose peaks together fit `budget` (fewer rather than killed); ValueError
        before any model work when even one does not fit, naming the longest --seq-len that would."""
        wanted = max(1, wanted)
        n = next((k for k in range(wanted, 0, -1) if k * self.worker_bytes(k) <= budget), 0)
        if n:
            return FoldPlan(n, wanted, self.worker_bytes(n), budget, self.shape.seq_len, self.objective)
        one, t = self.worker_bytes(1), self.shape.seq_len
        fits = self.longest_fitting(budget)
        where = (f"{kill_threshold():.0%} of {total / GIB:.1f} GiB less {used / GIB:.1f} GiB in use and a "
                 f"{MARGIN:.0%} margin")
        shortest = self.sinks + self.window + 1
        hint = (f"the longest --seq-len that fits one worker here is {fits}" if fits else
                f"no --seq-len fits one worker here (at {shortest} one still needs about "
                f"{self.worker_bytes(1, shortest) / GIB:.1f} GiB: fewer --accumulators or a smaller --heldout-rows "
                "lower it)")
        raise ValueError(
            f"--seq-len {t}: one shard worker needs about {one / GIB:.1f} GiB (process {WORKER_BASE / GIB:.1f} GiB, "
            f"model weights {self.shape.weights / GIB:.1f} GiB, statistics {self.totals_bytes(1) / GIB:.1f} GiB, capture "
            f"{self.capture_bytes() / GIB:.1f} GiB with objective {self.objective.name}), more than the "
            f"{max(budget, 0) / GIB:.1f} GiB a worker may hold on this node ({where}); {hint}"
            f"{self.sensitivity}; or run on a node with more memory")


def fold_sizer(config: Any, layers: Sequence[Any], dtype: Any, seq_len: int, group_dims: Sequence[int], *,
               accumulators: int, objective: Objective, sensitivity: int, sinks: int, window: int, sample: float,
               heldout_rows: int, batch: int = 1, probe: int = 0) -> FoldSizer:
    """The sizer of a model (its transformers `config` and layer schema, `dtype` a torch dtype), no weights loaded."""
    text = getattr(config, "text_config", None) or config
    size = model_size(config, dtype, seq_len)
    coded = [layers[i] for i in cached_layers(tuple(layers))]
    spec = coded[0]
    hidden = int(getattr(text, "hidden_size", 0) or 1)
    shape = FoldShape(
        weights=size.weight_bytes, itemsize=size.itemsize, layers=len(layers), coded=len(coded),
        kv_heads=spec.kv_heads, head_dim=spec.head_dim, value_dim=spec.value_dim or spec.head_dim, hidden=hidden,
        intermediate=int(getattr(text, "intermediate_size", 0) or 4 * hidden),
        vocab=int(getattr(text, "vocab_size", 0) or 1), heads=int(getattr(text, "num_attention_heads", 0) or 1),
        seq_len=seq_len, batch=batch, captured=0, attention=objective.captures_metric, sensitivity=sensitivity,
        heldout_rows=heldout_rows, probe=probe if sensitivity > 0 else 0)
    off = "" if not shape.attention or sensitivity < 1 else \
        "; --sensitivity 0 (with --attention-balance layer) drops the KL-sensitivity pass"
    return FoldSizer(shape, tuple(group_dims), accumulators, sinks, window, sample, objective, off)


def smollm2_worker_bytes(seq_len: int, accumulators: int = 4, workers: int = 2) -> int:
    """The planned peak of one of `workers` shard workers of the embedded SmolLM2 (float32, the default capture:
    attention objective, one KL-sensitivity pass per shard) at `seq_len`: what bench/fold_memory.py prints."""
    info, capture = load_spec(), CaptureSettings(groups="model")
    dims = [g.dim(info.num_kv_heads, info.head_dim) for g in capture.group_layers(info.layers, info.num_kv_heads)]
    sizer = fold_sizer(info.config, info.layers, torch.float32, seq_len, dims, accumulators=accumulators,
                       objective=ATTENTION, sensitivity=capture.sensitivity, sinks=capture.sinks,
                       window=capture.window, sample=capture.sample, heldout_rows=ReduceSettings().heldout_rows // 2,
                       probe=capture.copy_probe)
    return sizer.worker_bytes(workers)


RAY_PROCESSES = 640 << 20  # a local Ray's own processes (GCS, raylet, agents), not yet started when the job plans


def admit_on_nodes(sizer: FoldSizer, wanted: int, threads: int, nodes: Sequence[dict]) -> FoldPlan:
    """A joined cluster's fold: the most workers, up to `wanted`, that its alive `nodes` (ray.nodes()) can place
    with each worker's peak inside a node's Ray `memory` resource and its `threads` inside the node's CPUs (each
    actor then asks Ray for that memory, so Ray packs no more on a node); ValueError before any model work when no
    node holds one, naming the longest --seq-len the largest node would."""
    alive = [n.get("Resources") or {} for n in nodes if n.get("Alive")]
    largest = max((int(r.get("memory", 0)) for r in alive), default=0)
    for n in range(max(1, wanted), 0, -1):
        peak = sizer.worker_bytes(n)
        room = sum(min(int(r.get("CPU", 0)) // threads, int(r.get("memory", 0)) // max(1, peak)) for r in alive)
        if room >= n:
            return FoldPlan(n, max(1, wanted), peak, largest, sizer.shape.seq_len, sizer.objective)
    fits = sizer.longest_fitting(largest)
    hint = f"the longest --seq-len one worker fits there is {fits}" if fits else "no --seq-len fits one worker there"
    raise ValueError(f"--seq-len {sizer.shape.seq_len}: one shard worker needs about {sizer.worker_bytes(1) / GIB:.1f} "
                     f"GiB, more than the largest node's Ray memory ({largest / GIB:.1f} GiB of {len(alive)} alive "
                     f"node(s)); {hint}; or add nodes with more memory")


def node_now(reserve: int = 0) -> tuple[int, int, int]:
    """(budget, total, used) bytes of this node now: what workers may hold together under Ray's kill line
    (reduce_plan.node_budget), `reserve` bytes more counted as used (processes about to start)."""
    vm = psutil.virtual_memory()
    used = int(vm.total - vm.available) + reserve
    return node_budget(int(vm.total), used), int(vm.total), used


def job_sizer(cfg: Any, info: Any, device: str = "cpu") -> FoldSizer:
    """The sizer of a calibration's shard workers: `cfg` its JobSettings (capture resolved: groups, objective),
    `info` its model's ModelSpec (kvtc.workers.models.load_spec), `device` the workers' ("cpu" or "cuda")."""
    capture = cfg.capture
    dims = [g.dim(info.num_kv_heads, info.head_dim) for g in capture.group_layers(info.layers, info.num_kv_heads)]
    return fold_sizer(info.config, info.layers, resolve_dtype(cfg.model.dtype, torch.device(device)), cfg.plan.seq_len,
                      dims, accumulators=cfg.reduce.accumulators, objective=capture.objective.resolved(),
                      sensitivity=capture.sensitivity, sinks=capture.sinks, window=capture.window,
                      sample=capture.sample, heldout_rows=max(1, cfg.reduce.heldout_rows // 2),
                      probe=capture.copy_probe)
