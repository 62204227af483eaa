"""Reduce: from the stored accumulators, compute PCA bases and one DP bit allocation per ratio for
every stream and group, measure them on held-out rows (and the second domain), and publish.

Stages, typed: `reduce(ReduceInput, Placement) -> Reduced` runs every stream and group's
solve -> fit -> measure (`group_task.run_group`: a `GroupResult` carrying each stage's seconds, and
its share of the error-by-tokens curve) in this process or as Ray tasks on the job's workers
(`reduce_tasks`); then `publish(ReduceInput, Reduced) -> Published` assembles the manifest fields, the
stream-level metrics (`evaluation.measure.stream_rows`), report and charts, and publishes.

Accumulators are summed in accumulator order, each folded in shard order, and group results are
taken in (stream, group) order, so the artifact is bit-identical for any number of workers.
Held-out rows come from whole held-out shards (never in the statistics) captured at every
position; the DP error tables and the in-domain metrics use their positions [s, T - w), the
error-by-position curve uses all of them.
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field, replace
from typing import Any

import psutil
import torch

from kvtc import artifacts
from kvtc.artifacts.blocks import budget_bits, cheapest_block_bits
from kvtc.artifacts.calibration import CalibrationRecord
from kvtc.artifacts.groups import FeatureGroup, group_columns, stream_dims
from kvtc.artifacts.tensor_parallel import TensorParallelLayout
from kvtc.kernels.codec.layers import layers_of, layers_to_json
from kvtc.pipeline.evaluation import report
from kvtc.pipeline.evaluation.diagnostics import curve_components, prefix_points, stream_prefix_rows
from kvtc.pipeline.evaluation.measure import CURVES, stream_rows
from kvtc.pipeline.fit.joint_budget import BasisSpectrum, attention_weights, split_budget, split_unit
from kvtc.pipeline.fit.allocator_settings import BitSplit
from kvtc.pipeline.fit.heldout_rows import HeldOut
from kvtc.pipeline.fit.metric import AttentionMetric, encode_root, metric_file
from kvtc.pipeline.fit.pca import cores
from kvtc.pipeline.fit.sensitivity_reach import reach_factors
from kvtc.pipeline.job.basis_solver import max_components, metric_sums
from kvtc.pipeline.job.corpus import describe
from kvtc.pipeline.job.fold_plan import SENSITIVITY_TOKENS
from kvtc.pipeline.job.group_task import GroupResult, GroupTask, TokensCurve
from kvtc.pipeline.job.heldout_store import load_rows
from kvtc.pipeline.job.reduce_plan import GpuSolve, Planned, choose, node_budget, refuse_unless_fits, task_bytes
from kvtc.pipeline.job.progress import ReduceProgress
from kvtc.pipeline.job.reduce_tasks import Placement, rows_name, run_groups
from kvtc.pipeline.job.served_check import metric_rows, needle_metrics, served_continuation, served_quality
from kvtc.pipeline.job.shard_records import ShardEntry
from kvtc.pipeline.job.store import ShardStore
from kvtc.pipeline.settings import JobSettings
from kvtc.workers.stats import STREAMS

MIN_HELDOUT_ROWS = 16


@dataclass(frozen=True)
class ReduceInput:
    """What the fold hands the reduce: the settings as run, the model fingerprint, the shard store,
    every planned shard (`shard_records.ShardEntry`), the accumulators (name, shard ids) in
    order, the workers' model dtype, the model's transformers config (no weights) and why the objective ran."""

    settings: JobSettings
    fingerprint: dict
    store: ShardStore
    shards: list[ShardEntry]
    accumulators: list[tuple[str, list[str]]]
    model_dtype: str = "float32"
    model_config: Any = None
    objective_reason: str = ""
    served: Any = None  # the served check's raw half (served_prep.ServedPrep), maybe started beside the fold


@dataclass
class Reduced:
    """Every group's result in (stream, group) order, the error-by-tokens rows, the groups, row counts,
    warnings, and seconds: `seconds` the stage's wall; solve/fit/measure summed over groups (on
    whichever worker ran them)."""

    groups: list[FeatureGroup]
    results: list[GroupResult]
    by_tokens: list[dict]
    tokens_in: int
    heldout_rows: int
    eval_rows: int
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    tasks: list[GroupTask] = field(default_factory=list)  # their results stay in the store until `clear`
    plan: dict = field(default_factory=dict)  # the memory plan as run: budget, largest peak, most at once, kills
    split: dict | None = None  # the joint bit split (weights, each basis's bits per ratio); None: every basis its own

    @property
    def solve_s(self) -> float:
        return sum(r.solve_s for r in self.results)

    @property
    def eig_s(self) -> float:
        return sum(s.eig_s for r in self.results for s in r.solves)

    @property
    def fit_s(self) -> float:
        return sum(r.fit_s for r in self.results)

    @property
    def measure_s(self) -> float:
        return sum(r.measure.seconds for r in self.results)


@dataclass
class Published:
    """The job summary (name, version, per-ratio errors, warnings) and the stage's seconds."""

    summary: dict
    seconds: float


def reduce(inp: ReduceInput, placement: Placement) -> Reduced:
    """Solve, fit and measure every stream and group (and the error-by-tokens curve): the tasks planned at
    an even split (`plan_tasks`), with a joint split their shares set from a first pass of solves
    (`joint_split_pass`), then every group solved (or resumed), fitted and measured (`group_pass`)."""
    t0 = time.perf_counter()
    cap = inp.settings.capture
    notes: list[str] = []
    names, tokens_in = trained_on(inp, notes)
    held, evals = heldout_of(inp)
    heldout_rows = int(held.middle(cap.sinks, cap.window).sum())
    eval_rows = 0 if evals is None else int(evals.middle(cap.sinks, cap.window).sum())
    groups = cap.group_layers(layers_of(inp.fingerprint), int(inp.fingerprint["num_kv_heads"]))
    budget = reduce_budget(placement)
    tasks, peaks = plan_tasks(inp, placement, groups, names, budget, len(held.positions) + eval_rows)
    reserved = inp.served.reserved_bytes() if inp.served is not None else 0
    if reserved and max(peaks, default=0) > budget - reserved:
        inp.served.defer()  # the served check's raw half gives its memory back to the reduce, and runs after it
    else:
        budget -= reserved  # it is still running beside the reduce: its tasks admitted beside what it may take
    put_task_rows(inp, tasks, groups, held, evals)
    del held, evals  # the driver keeps no rows: each task reads its own from the store
    tasks, split = joint_split_pass(inp, tasks, groups, names, placement, peaks, budget, notes)
    results, progress = group_pass(tasks, inp.store, placement, peaks, budget)
    for r in results:
        notes.extend(w for w in r.notes if w not in notes)
    plan = {"budget_bytes": budget, "peak_bytes": max(peaks, default=0), "at_once": progress.most_at_once,
            "killed": progress.kills, "solvers": sorted({f"{s.method}/{s.driver}/{s.device}" for s in
                                                         (t.solver for t in tasks)})}
    return Reduced(groups, results, stream_prefix_rows([(r.stream, r.by_tokens) for r in results]), tokens_in,
                   heldout_rows, eval_rows, notes, time.perf_counter() - t0, tasks, plan, split)


def trained_on(inp: ReduceInput, notes: list[str]) -> tuple[list[str], int]:
    """The accumulators' names and the tokens of the training and held-out shards; a warning (and a note) when
    the corpus ran out before the tokens requested. ValueError without a training shard."""
    tokens_requested = int(inp.settings.plan.tokens or 0)
    tokens_in = sum(s.tokens for s in inp.shards if s.role in ("train", "heldout"))
    if tokens_in < tokens_requested:
        msg = f"the corpus ran out after {tokens_in} tokens of the {tokens_requested} requested; calibrated on what exists"
        warnings.warn(msg, stacklevel=3)
        notes.append(msg)
    names = [name for name, _ in inp.accumulators]
    if not names:
        raise ValueError("no training shard: the corpus is too small for --tokens/--seqs-per-shard/--holdout-fraction")
    return names, tokens_in


def heldout_of(inp: ReduceInput) -> tuple[HeldOut, HeldOut | None]:
    """The held-out rows and the second domain's (None without eval shards), in shard order; ValueError when no
    held-out shard or fewer than MIN_HELDOUT_ROWS middle rows."""
    cap, most = inp.settings.capture, inp.settings.reduce.heldout_rows
    by_index = sorted(inp.shards, key=lambda s: s.index)
    held = load_rows(inp.store, [s.id for s in by_index if s.role == "heldout"], most)
    if held is None:
        raise ValueError("no held-out shard; raise --holdout-fraction or --tokens")
    rows = int(held.middle(cap.sinks, cap.window).sum())
    if rows < MIN_HELDOUT_ROWS:
        raise ValueError(f"only {rows} held-out rows; at least {MIN_HELDOUT_ROWS} are needed")
    eval_ids = [s.id for s in by_index if s.role == "eval"]
    return held, load_rows(inp.store, eval_ids, most) if eval_ids else None


def plan_tasks(inp: ReduceInput, placement: Placement, groups: list[FeatureGroup], names: list[str], budget: int,
               n_rows: int) -> tuple[list[GroupTask], list[int]]:
    """Every stream and group's task at an even split (each basis its own floor(16 p / CR)), its solver chosen
    within `budget` for `n_rows` held-out and eval rows, and its planned peak bytes; ValueError, before anything is
    written, when a group cannot run even alone."""
    cfg = inp.settings
    alloc, cap, red = cfg.allocator, cfg.capture, cfg.reduce
    kv_heads, head_dim = int(inp.fingerprint["num_kv_heads"]), int(inp.fingerprint["head_dim"])
    dims = stream_dims(inp.fingerprint)  # MLA: the streams (latent, RoPE key) differ in width
    p_total = sum(g.dim(kv_heads, head_dim) for g in groups)
    curve = None
    if red.tokens_curve_points > 0:  # error against calibration tokens (chart 1): prefixes of the accumulators
        curve = TokensCurve(tuple(prefix_points(len(names), red.tokens_curve_points)), red.curve_ratio,
                            curve_components(p_total, red.curve_ratio))
    metric = metric_json(cfg, inp.fingerprint)  # as the manifest records it
    task_metric = None if metric is None else AttentionMetric(**metric)
    threads = placement.threads if placement.workers else cores()
    tasks, peaks = [], []
    gpu = gpu_solve(placement)
    for stream in STREAMS:
        for g, group in enumerate(groups):
            p = group.dim(*dims[stream])
            bound = max_components(p, red.ratios, alloc)
            solver = choose(p, bound, budget, n_rows, gpu)
            task = GroupTask(index=len(tasks), stream=stream, group=g, p=p, accumulators=tuple(names),
                             ratios=tuple(red.ratios), allocator=alloc, sinks=cap.sinks, window=cap.window,
                             threads=threads, device=solver.device, budget=budget,
                             metric=task_metric, solver=solver, curve=curve)
            tasks.append(task)
            peaks.append(task_bytes(p, bound, n_rows, solver, task.prefixes_held, task.curve_k))
    plans = [Planned(t.index, f"{t.stream} group {t.group}", t.p, t.solver, b) for t, b in zip(tasks, peaks)]
    refuse_unless_fits(plans, budget, *_node_memory_now())
    return tasks, peaks


def put_task_rows(inp: ReduceInput, tasks: list[GroupTask], groups: list[FeatureGroup], held: HeldOut,
                  evals: HeldOut | None) -> None:
    """Each task's rows (its stream and group's columns of the held-out rows, and of the eval rows' middle ones)
    written to the store for it (`rows_name`)."""
    cap, dims = inp.settings.capture, stream_dims(inp.fingerprint)  # MLA: the streams differ in width
    columns_of = {stream: group_columns(groups, *dims[stream]) for stream in STREAMS}
    for task in tasks:
        rows = held.group(task.stream, columns_of[task.stream][task.group], evals, cap.sinks, cap.window)
        inp.store.put_basis(rows_name(task), rows.arrays(), {"seq_len": rows.seq_len})
        del rows


def joint_split_pass(inp: ReduceInput, tasks: list[GroupTask], groups: list[FeatureGroup], names: list[str],
                     placement: Placement, peaks: list[int], budget: int,
                     notes: list[str]) -> tuple[list[GroupTask], dict | None]:
    """The joint bit split's first pass: every basis solved (and checkpointed for the next pass, its rows kept),
    each task given its share of each ratio's total from the spectra (`joint_tasks`). -> the tasks with their
    budgets and the split; the tasks as they are and None where the split is even (or no pool holds two bases).
    A note joins `notes` where the statistics cannot weigh keys against values."""
    alloc = inp.settings.allocator
    weighed = inp.settings.capture.objective.weighs_bases and alloc.bit_split.shares_total
    weights = split_weights(inp, groups, names) if weighed else None
    if weighed and weights is None:
        notes.append("the statistics hold no keys' reach (captured by an earlier release): keys and values keep "
                     "their own totals, shared between groups only; recalibrate with a fresh --store to share them")
    pools = split_pools(tasks, groups, alloc.bit_split, across_streams=bool(weights))
    if not pools:
        return tasks, None
    spectra = run_groups([replace(t, solve_only=True) for t in tasks], inp.store, placement, peaks, budget,
                         ReduceProgress([f"{t.stream} group {t.group} (solve)" for t in tasks], [t.p for t in tasks]),
                         keep_rows=True)
    return joint_tasks(tasks, spectra, pools, weights or {}, alloc, inp.settings.reduce.attention_metric)


def group_pass(tasks: list[GroupTask], store: ShardStore, placement: Placement, peaks: list[int],
               budget: int) -> tuple[list[GroupResult], ReduceProgress]:
    """Every group solved (or resumed from its checkpoint), fitted and measured at its budgets; its rows dropped
    after. -> the results in task order, and the progress (its kills and most tasks at once)."""
    progress = ReduceProgress([f"{t.stream} group {t.group}" for t in tasks], [t.p for t in tasks])
    return run_groups(tasks, store, placement, peaks, budget, progress), progress


def split_pools(tasks: list[GroupTask], groups: list[FeatureGroup], bit_split: BitSplit, across_streams: bool) -> dict:
    """{task index: pool} of the bases whose bits one total covers, or {} when no pool holds two: a rank's
    (KV head range's) bases where weights put the streams' errors in one unit (`across_streams`, the
    attention objective's); else, the streams' errors having no common unit, a stream's within it."""
    if not bit_split.shares_total:
        return {}
    pools = {t.index: (groups[t.group].heads,) + (() if across_streams else (t.stream,)) for t in tasks}
    sizes: dict = {}
    for pool in pools.values():
        sizes[pool] = sizes.get(pool, 0) + 1
    return pools if max(sizes.values(), default=0) > 1 else {}


def split_weights(inp: ReduceInput, groups: list[FeatureGroup], names: list[str]) -> dict | None:
    """The attention objective's weight of each basis (`joint_budget.attention_weights`), from the metric sums."""
    sums, tokens, _ = metric_sums(inp.store, names)
    kv_heads = int(inp.fingerprint["num_kv_heads"])
    text = getattr(inp.model_config, "text_config", None) or inp.model_config
    query_heads = max(1, int(getattr(text, "num_attention_heads", 0) or kv_heads) // kv_heads)
    return attention_weights(inp.settings.reduce.attention_metric, sums, tokens, groups, kv_heads, query_heads)


def joint_tasks(tasks: list[GroupTask], spectra: list, pools: dict, weights: dict, alloc,
                metric) -> tuple[list[GroupTask], dict]:
    """The tasks with their shares of each ratio's total (`joint_budget.split_budget`), and the split as the
    manifest records it."""
    bases = [BasisSpectrum(t.stream, t.group, t.p, eig, min(len(eig), alloc.max_components or t.p),
                           weights.get((t.stream, t.group), 1.0), pools[t.index],
                           cheapest_block_bits(alloc.types, alloc.block_sizes, t.p))
             for t, (eig, _) in zip(tasks, spectra)]
    ratios = tasks[0].ratios
    shares = [split_budget(bases, r) for r in ratios]
    out = [replace(t, budgets=tuple(int(shares[j][i]) for j in range(len(ratios)))) for i, t in enumerate(tasks)]
    split = {"split": "joint", "unit": split_unit(metric, bool(weights)), "weights": [[t.stream, t.group, float(b.weight)] for t, b in zip(tasks, bases)],
             "bits": [{"ratio": float(r), "stream": t.stream, "group": t.group, "bits": int(shares[j][i]),
                       "own": budget_bits(t.p, r)} for j, r in enumerate(ratios) for i, t in enumerate(tasks)]}
    return out, split


def _node_memory_now() -> tuple[int, int]:
    """(total, used) bytes of this node now."""
    vm = psutil.virtual_memory()
    return int(vm.total), int(vm.total - vm.available)


def reduce_budget(placement: Placement) -> int:
    """Bytes the group tasks may hold together: this node's (in process, or a Ray started here) below the
    kill line; on a joined cluster, the largest node's Ray `memory` resource."""
    if placement.workers and placement.cluster:
        import ray  # noqa: PLC0415 - Ray loads only on a Ray run (an in-process job runs without it)

        return int(max((n["Resources"].get("memory", 0) for n in ray.nodes() if n.get("Alive")), default=0))
    return node_budget(*_node_memory_now())


def gpu_solve(placement: Placement) -> GpuSolve | None:
    """What the tasks' GPU can solve (None without one)."""
    if not placement.gpu:
        return None
    major = int(str(torch.version.cuda or "12").split(".")[0])
    return GpuSolve(placement.gpu_bytes or (1 << 62), major)


def publish(inp: ReduceInput, reduced: Reduced, registry: str, alias_latest: bool = True) -> Published:
    """Assemble the artifact from the group results, store report and charts, publish; the summary."""
    t0 = time.perf_counter()
    cfg, fingerprint = inp.settings, inp.fingerprint
    by_index = sorted(inp.shards, key=lambda s: s.index)
    kv_heads = int(fingerprint["num_kv_heads"])
    train_rows = reduced.results[-1].train_rows if reduced.results else 0
    p_total = sum(g.dim(kv_heads, int(fingerprint["head_dim"])) for g in reduced.groups)
    calibration = calibration_record(
        cfg, reduced.groups, inp.model_dtype, reduced.tokens_in, int(train_rows), reduced.heldout_rows,
        reduced.eval_rows, reduced.notes,
        {"ratio": cfg.reduce.curve_ratio, "components": curve_components(p_total, cfg.reduce.curve_ratio),
         "method": "top-k randomized PCA, analytic DP, in the objective's space",
         "prefixes": "whole accumulators, in order"},
        kv_heads, inp.objective_reason, reduced.split, fingerprint).to_manifest()
    # the per-layer attention schema, on every artifact (the fingerprint carries it only for mixed models,
    # so uniform models keep their model ids): kind, window/chunk, RoPE or none, KV heads, head dim
    calibration["layers"] = layers_to_json(layers_of(fingerprint))
    corpus = {
        "spec": cfg.plan.corpus, "eval_spec": cfg.plan.eval_corpus, "seq_len": cfg.plan.seq_len, "seed": cfg.capture.seed,
        "train_shards": [s.id for s in by_index if s.role == "train"],
        "heldout_shards": [s.id for s in by_index if s.role == "heldout"],
        "eval_shards": [s.id for s in by_index if s.role == "eval"],
        "accumulators": [name for name, _ in inp.accumulators], "tokens": {s.id: s.tokens for s in inp.shards},
    }
    corpus["mixture"] = describe(str(corpus.get("spec", cfg.plan.corpus)))  # sources, pkgdocs distributions
    results = reduced.results
    metrics = [m for r in results for m in r.measure.metrics] + stream_rows([r.measure for r in results])
    curves: dict[str, list[dict]] = {name: [] for name in CURVES}
    curves["error_by_tokens"] = reduced.by_tokens
    for r in results:
        for name, rows in r.measure.curves.items():
            curves[name] += rows
    allocations = {key: value for r in results for key, value in r.allocations.items()}
    metric_files = {metric_file(r.stream, r.group): encode_root(r.metric_root) for r in results
                    if r.metric_root is not None}
    content = artifacts.ArtifactContent(
        name=cfg.artifact_name, model=fingerprint, calibration=calibration, corpus=corpus,
        bases={(r.stream, r.group): r.basis for r in results}, allocations=allocations, metrics=metrics,
        curves=curves, extra_files=dict(metric_files), parent=cfg.runtime.parent,
        ecsq={key: table for r in results for key, table in r.ecsq.items()},
        decoders={(r.stream, r.group): r.decoder for r in results if r.decoder is not None},
    )
    quality, notes, served_s = None, list(reduced.notes), 0.0
    if cfg.reduce.served_sequences:  # what serving will cost: held-out text through the chunk path, before publishing
        t_served = time.perf_counter()
        quality, skipped = served_quality(content, cfg.model.model, cfg.model.dtype, cfg.reduce.served_sequences,
                                          served_continuation(cfg.plan.seq_len), inp.model_config,
                                          cfg.runtime.cache_dir, inp.served)
        served_s = time.perf_counter() - t_served
        if skipped:
            notes.append(skipped)
        else:
            metrics = metrics + metric_rows(quality["rows"])
            if quality.get("long"):  # one held-out window at the longest context: its rows and error by position
                metrics = metrics + metric_rows(quality["long"]["rows"], "-long", quality["long"]["prefix"])
                metrics = metrics + needle_metrics(quality["long"].get("needles") or [])
                curves = {**curves, "error_by_position_long": quality["long"]["positions"]}
                content = replace(content, curves=curves)
    extra = report.build(metrics, curves, allocations, calibration, fingerprint, f"KVTC report: {cfg.artifact_name}",
                         quality)
    content = replace(content, metrics=metrics, extra_files={**extra, **metric_files})
    ref = artifacts.publish(content, registry=registry, alias_latest=alias_latest)
    summary = summarize(ref, metrics, notes)
    summary["served_seconds"] = round(served_s, 2)
    if quality:
        summary["served_stages"] = quality["seconds"]  # staging the content, loading the model (overlapped), scoring
    return Published(summary, time.perf_counter() - t0)


def metric_json(cfg: JobSettings, fingerprint: dict | None) -> dict | None:
    """The objective's metric as tasks and the manifest carry it (None: the cache's own squared error), with each
    layer's reach factor where the sensitivity balance measured fewer tokens than the sequences hold and the
    model's layers differ in reach (kvtc.pipeline.fit.sensitivity_reach)."""
    metric = cfg.capture.objective.task_metric(cfg.reduce.attention_metric)
    if metric is None or not fingerprint or not cfg.reduce.attention_metric.balance.scaled_by_sensitivity:
        return metric
    reach = reach_factors(layers_of(fingerprint), cfg.plan.seq_len, SENSITIVITY_TOKENS)
    return metric if reach is None else {**metric, "reach": list(reach)}


def calibration_record(cfg: JobSettings, groups: list[FeatureGroup], model_dtype: str, tokens: int,
                       train_rows: int, heldout_rows: int, eval_rows: int, notes: list[str], tokens_curve: dict,
                       kv_heads: int = 0, objective_reason: str = "", split: dict | None = None,
                       fingerprint: dict | None = None):
    """The manifest's CalibrationRecord: the settings verbatim, their flat fields for readers, the results
    (and with --tp, the layout of the model's `kv_heads` over the ranks), and why the objective ran."""
    cap, plan = cfg.capture, cfg.plan
    return CalibrationRecord(
        sinks=cap.sinks, window=cap.window, seq_len=plan.seq_len, seed=cap.seed, ratios=cfg.reduce.ratios,
        groups=tuple(groups), allocator=cfg.allocator.to_dict(), group_spec=cap.groups, sample=cap.sample,
        tokens_requested=plan.tokens, eval_tokens=plan.eval_tokens, seqs_per_shard=plan.seqs_per_shard,
        holdout_fraction=plan.holdout_fraction, heldout_rows_cap=cfg.reduce.heldout_rows, text_column=plan.text_column,
        dtype=cfg.model.dtype, model_dtype=model_dtype, keys=cap.keys, tokens=tokens, train_rows=train_rows,
        heldout_rows=heldout_rows, eval_rows=eval_rows, notes=tuple(notes), tokens_curve=tokens_curve,
        settings=cfg.computational(), objective=cap.objective.name, objective_reason=objective_reason or None, bit_split=split,
        attention_metric=metric_json(cfg, fingerprint),
        tensor_parallel=None if cap.tp == 1 else TensorParallelLayout(cap.tp, kv_heads).to_dict(groups),
    )


def summarize(ref, metrics: list[dict], notes: list[str]) -> dict:
    """The `--json` summary: per ratio, the codec's default mode ("ecsq" where the artifact has its
    tables, else "fixed") and per stream that mode's held-out and second-domain errors and kept
    components first, then each mode's figures under "ecsq" and "fixed" and the Gaussian bound."""
    modes: dict = {}
    for m in metrics:
        if m["split"] not in ("heldout", "eval") or (m["group"] is not None and m["metric"] not in ("kept", "ecsq_kept")):
            continue
        mode, metric = ("ecsq", m["metric"][5:]) if m["metric"].startswith("ecsq_") else ("fixed", m["metric"])
        if metric == "heldout_bound_rel_error":
            mode, metric = "bound", "rel_error"
        entry = modes.setdefault(m["ratio"], {}).setdefault(m["stream"], {}).setdefault(mode, {})
        name = metric if m["split"] == "heldout" else f"eval_{metric}"
        if metric == "kept":
            if m["split"] == "heldout" and m["group"] is not None:  # summed over groups
                entry["kept"] = entry.get("kept", 0) + int(m["value"])
        elif m["group"] is None:
            entry[name] = m["value"]
    served: dict = {}
    for m in metrics:
        if m["split"] in ("served-chunk", "served-offline", "served-chunk-long", "served-offline-long"):
            served.setdefault(m["ratio"], {}).setdefault(m["split"][7:], {})[m["metric"]] = m["value"]
    rows = []
    for ratio, streams in sorted(modes.items()):
        default = "ecsq" if all("rel_error" in s.get("ecsq", {}) for s in streams.values()) else "fixed"
        row: dict = {"ratio": ratio, "mode": default}
        if ratio in served:  # the model's perplexity ratio and KL on held-out text: offline codec, chunk path
            row["served"] = served[ratio]
        for stream, by_mode in streams.items():
            first = by_mode.get(default, {})
            row[stream] = {**{k: first[k] for k in ("rel_error", "eval_rel_error", "kept") if k in first},
                           "ecsq": by_mode.get("ecsq", {}), "fixed": by_mode.get("fixed", {}),
                           "bound_rel_error": by_mode.get("bound", {}).get("rel_error")}
        rows.append(row)
    return {"name": ref.name, "version": ref.version, "registry": ref.registry, "ratios": rows, "warnings": notes}
