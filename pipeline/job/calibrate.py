"""`kvtc calibrate`: the main job. Corpus shards stream through Ray worker actors that capture the
model's KV cache and store per-shard statistics; the driver folds them in shard order, computes
PCA bases and one DP bit allocation per ratio, measures held-out errors and publishes a versioned
artifact to the registry.

The `kvtc calibrate` command is kvtc.pipeline.commands.calibrate; `python -m kvtc.pipeline.calibrate_job ...`
runs it for `ray job submit`.
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator

import psutil
import torch

from kvtc import artifacts
from kvtc.artifacts.fingerprint import model_id as fingerprint_id
from kvtc.artifacts.groups import stream_dims
from kvtc.artifacts.tensor_parallel import TensorParallelLayout
from kvtc.kernels.codec.layers import layers_of
from kvtc.pipeline.evaluation.diagnostics import curve_components
from kvtc.pipeline.fit.allocator import validate_ratios
from kvtc.pipeline.fit.basis_budget import BasisBudget, model_parameters
from kvtc.pipeline.job import fold_plan as fold_planning
from kvtc.pipeline.job.accumulators import AccumulatorPlan, FoldPlanner
from kvtc.pipeline.job.basis_solver import max_components
from kvtc.pipeline.job.corpus import iter_documents
from kvtc.pipeline.job.memory_plan import check_fits, estimate, plan_gpus
from kvtc.pipeline.job.progress import ShardProgress
from kvtc.pipeline.job.pool_run import PoolRun
from kvtc.pipeline.job.reduce import Published, ReduceInput, Reduced, publish, reduce
from kvtc.pipeline.job.reduce_plan import node_budget
from kvtc.pipeline.job.reduce_tasks import Placement, clear
from kvtc.pipeline.job.served_check import job_prep
from kvtc.pipeline.job.served_prep import ServedPrep
from kvtc.pipeline.job.shard_worker import ShardWorker
from kvtc.pipeline.job.shard_records import ShardEntry, ShardResult
from kvtc.pipeline.job.shards import plan_shards, shard_plan
from kvtc.pipeline.job.store import ShardStore, capture_key, default_store_uri
from kvtc.pipeline.job.store_reach import alive_nodes, check_store_reach

from kvtc.pipeline.checks.machine import Machine, check_cluster, check_job
from kvtc.pipeline.settings import DEFAULT_CPU_TOKENS, DEFAULT_GPU_TOKENS, JobSettings
from kvtc.workers.attention_metric import choose_objective
from kvtc.workers.capture import CaptureSettings, check_seq_len, resolve_groups
from kvtc.workers.model_size import model_size
from kvtc.workers.models import ModelSpec, load_spec, prepare_weights, resolve_dtype


def run(cfg: JobSettings, alias_latest: bool = True, in_process: bool = False) -> dict:
    """Run the whole job; returns the summary that `--json` prints. alias_latest=False publishes
    the version without moving `latest` (recalibration decides after validating it); in_process=True
    runs the shards in this process, one after another, without Ray (tests, benches)."""
    return _execute(cfg, alias_latest, in_process)[0]


def calibrate_local(cfg: JobSettings) -> tuple[dict, dict]:
    """`run(cfg, in_process=True)` -> (summary, context); context holds the shard "store", the
    "shards" ({id, index, role, tokens, cached}) and the model "fingerprint", for diagnostics."""
    return _execute(cfg, True, in_process=True)


def _memory_estimate(cfg: JobSettings, num_layers, kv_heads: int, head_dim: int, groups: str, workers: int):
    """num_layers: a layer count or the model's layer schema (kvtc.kernels.codec.layers)."""
    settings = CaptureSettings(groups=groups, tp=cfg.capture.tp)
    dims = [g.dim(kv_heads, head_dim) for g in settings.group_layers(num_layers, kv_heads)]
    return estimate(dims, accumulators=cfg.reduce.accumulators, workers=workers, rows_per_batch=cfg.plan.seq_len,
                    heldout_rows=cfg.reduce.heldout_rows, curve_points=cfg.reduce.tokens_curve_points,
                    curve_k=curve_components(sum(dims), cfg.reduce.curve_ratio),
                    kept_max=max(max_components(p, cfg.reduce.ratios, cfg.allocator) for p in dims))


@dataclass(frozen=True)
class Planned:
    """The plan stage's hand-off: the settings as they will run (tokens resolved), where the version
    goes, the shard store root, the model's tokenizer and fingerprint (config only, no weights)."""

    settings: JobSettings
    registry: str
    store_root: str
    tokenizer: Any
    fingerprint: dict
    seconds: float
    model_config: Any = None  # the model's transformers config (the GPU plan sizes its weights)
    objective_reason: str = ""  # why the objective that runs was chosen (the manifest records it)
    fold: Any = None  # the CPU shard workers' memory sizer (fold_plan.FoldSizer); None: GPU workers or a cluster


@dataclass
class Folded:
    """The fold stage's hand-off: the shard store scope, every planned shard, the accumulators (name,
    shard ids) in order, the workers' results, and timings."""

    store: ShardStore
    shards: list[ShardEntry]
    accumulators: list[tuple[str, list[str]]]
    results: list[ShardResult]
    workers: int
    model_dtype: str
    on_cluster_gpu: bool
    duplicates: list[str]
    startup_s: float
    fold_s: float
    workers_lost: int = 0  # workers whose node was lost mid-fold
    shards_rerun: int = 0  # their shards, run again on the workers left
    fold_plan: dict | None = None  # fold_plan.FoldPlan.to_dict() of a Ray fold whose workers memory admitted


def plan_job(cfg: JobSettings, in_process: bool) -> Planned:
    """Plan: check every input before any model work (registry writable, corpus specs, model spec, then the
    settings resolved against the model and checked: `resolve_settings`, `check_settings`) and resolve the
    token count."""
    t0 = time.perf_counter()
    machine = Machine.of(cfg.runtime)
    check_job(cfg, machine if not in_process else replace(machine, cluster=False))  # resource arguments, instantly
    rt = cfg.runtime
    registry = artifacts.Registry(rt.registry).uri
    artifacts.check_writable(registry)
    for spec in filter(None, (cfg.plan.corpus, cfg.plan.eval_corpus)):
        iter_documents(spec, cfg.plan.text_column)  # a bad spec fails here, before any model work
    info = load_spec(cfg.model.model, cache_dir=rt.cache_dir)  # config and tokenizer only: the driver never loads weights
    given = cfg.plan
    windowed = any(layer.kind in ("sliding", "chunked") for layer in info.layers)
    cfg = replace(cfg, plan=given.resolved(info.max_positions, windowed))  # recorded as run: a recalibration repeats it
    check_job(cfg, machine if not in_process else replace(machine, cluster=False), info.max_positions)
    cfg, objective_reason = resolve_settings(cfg, info)
    fold = check_settings(cfg, info, in_process)
    if cfg.plan.tokens is None:
        on_gpu = torch.cuda.is_available()
        cfg = replace(cfg, plan=replace(cfg.plan, tokens=DEFAULT_GPU_TOKENS if on_gpu else DEFAULT_CPU_TOKENS))
    if None in (given.tokens, given.seq_len, given.seqs_per_shard):
        plan = cfg.plan
        print(f"kvtc calibrate: running {plan.tokens} tokens in sequences of {plan.seq_len}, {plan.seqs_per_shard} "
              f"per shard ({'GPU' if torch.cuda.is_available() else 'CPU'} defaults where not given)", file=sys.stderr)
    return Planned(cfg, registry, rt.store or default_store_uri(), info.tokenizer, info.fingerprint,
                   time.perf_counter() - t0, info.config, objective_reason, fold)


def resolve_settings(cfg: JobSettings, info: ModelSpec) -> tuple[JobSettings, str]:
    """The settings as they will run on the model `info` (its config and layer schema, no weights), recorded as
    run so that a recalibration repeats them: --groups auto on one layer kind is "model"; the objective is
    resolved (`ObjectiveChoice.resolve` on a meta-device model: auto picks, attention for a model whose metric
    cannot be built is refused); a basis budget becomes components per group, the groups cut by the
    tensor-parallel layout (refused where the model's heads do not split over --tp). -> (settings, why the
    objective runs)."""
    capture = replace(cfg.capture, groups=resolve_groups(cfg.capture.groups, info.layers))  # "auto" on one kind: "model"
    objective, objective_reason = choose_objective(capture.objective, info.config, info.layers)
    capture = replace(capture, objective=objective)
    text_config = getattr(info.config, "text_config", None) or info.config
    TensorParallelLayout(capture.tp, info.num_kv_heads, int(getattr(text_config, "num_attention_heads", 0) or 0))
    alloc = cfg.allocator
    if alloc.basis_budget:  # a share of the model's parameters: resolved to components per group, recorded as such
        features = sum(g.dim(info.num_kv_heads, info.head_dim)
                       for g in capture.group_layers(info.layers, info.num_kv_heads))
        cap = BasisBudget(alloc.basis_budget, alloc.max_components or None).cap(model_parameters(info.config), features)
        alloc = replace(alloc, max_components=cap)
    return replace(cfg, capture=capture, allocator=alloc), objective_reason


def check_settings(cfg: JobSettings, info: ModelSpec, in_process: bool) -> fold_planning.FoldSizer | None:
    """ValueError naming the first resolved setting (`resolve_settings`) the model or this machine refuses: the
    sequence length, the objective's options (`ObjectiveChoice.check_options`), the ratios against every group,
    the memory a local run needs; -> the fold's memory sizer of CPU shard workers (None: GPU workers)."""
    capture, rt = cfg.capture, cfg.runtime
    check_seq_len(info, cfg.plan.seq_len, capture)
    capture.objective.check_options(cfg.reduce.attention_balance, capture.sensitivity)
    for group in capture.group_layers(info.layers, info.num_kv_heads):
        for heads, dim in set(stream_dims(info.fingerprint).values()):  # an MLA model's RoPE key is narrower
            validate_ratios(cfg.reduce.ratios, group.dim(heads, dim), cfg.allocator)
    if not in_process and rt.cluster_address:
        return fold_planning.job_sizer(cfg, info)  # a cluster: its CPU workers are admitted per node once joined
    if rt.gpus_per_worker and not in_process and not torch.cuda.is_available():  # local: this machine holds everything
        raise ValueError(f"--gpus-per-worker {rt.gpus_per_worker}: this machine has no GPU torch can see and no "
                         "cluster was given; omit it to run on CPUs, or join a cluster with GPUs (--address)")
    local_workers = 1 if in_process else rt.workers or max(1, (os.cpu_count() or 1) // rt.threads_per_worker)
    kv, hd = info.num_kv_heads, info.head_dim
    est = _memory_estimate(cfg, info.layers, kv, hd, capture.groups, local_workers)
    vm = psutil.virtual_memory()  # the line Ray's memory monitor kills at, less what the node already uses
    check_fits(est, node_budget(int(vm.total), int(vm.total - vm.available)), info.num_layers, kv * hd, capture.groups,
               lambda k: _memory_estimate(cfg, info.layers, kv, hd, f"layers:{k}", local_workers))
    if torch.cuda.is_available():
        return None
    fold = fold_planning.job_sizer(cfg, info)  # CPU workers: the fold's plan (fold_plan), refused here if one cannot fit
    fold.plan(local_workers, *fold_planning.node_now(0 if in_process else fold_planning.RAY_PROCESSES))  # Ray admits them
    return fold


def fold_shards(planned: Planned, in_process: bool, gpus: float, ray_started: bool = False, gpu_plan=None,
                worker_cuda: bool | None = None, served: ServedPrep | None = None) -> Folded:
    """Fold: run the planned shards through the model (a Ray actor pool, Ray already started, by this
    job when `ray_started`; or this process) into the stored accumulators and held-out rows; cached
    shards are not run again. `served`: the served check's raw half, handed the held-out shards as they are planned
    and started in this process once a worker on this node is left idle by the fold's last shards."""
    cfg, fingerprint = planned.settings, planned.fingerprint
    capture, rt = cfg.capture, cfg.runtime
    shards_seen: list[ShardEntry] = []
    duplicates: list[str] = []
    plan = shard_plan(cfg, cfg.plan.tokens)
    expected = [plan.most_shards]  # the bar's total: shards planned, less those found cached

    def payloads(store: ShardStore, planner: FoldPlanner):
        for role, shard in plan_shards(plan, planned.tokenizer, fingerprint["max_positions"], duplicates):
            entry = ShardEntry(shard.id, shard.index, role, int(shard.input_ids.size))
            shards_seen.append(entry)
            if role == "train":
                tasks = planner.add(shard.index, shard.id, {"shard": shard.to_payload()})
                entry.cached = not tasks
                expected[0] += len(tasks) - 1
                yield from tasks
                continue
            if role == "eval":
                finished = planner.finish()  # the training stream has ended
                expected[0] += len(finished)
                yield from finished
            if served is not None and role == "heldout":
                served.add_heldout(shard.id, shard.input_ids)
            entry.cached = store.has(shard.id, "rows")
            if not entry.cached:
                yield {"shard": shard.to_payload(), "role": role}
            else:
                expected[0] -= 1
        finished = planner.finish()
        expected[0] += len(finished)
        yield from finished

    # the workers' dtype scopes the statistics: bfloat16 on GPU workers, float32 on CPU ones (unless --dtype)
    # worker_cuda: whether torch sees the GPUs Ray gives the workers (ray_pool.GpuInventory.cuda)
    worker_gpu = torch.cuda.is_available() if in_process else (gpus >= 1 if worker_cuda is None else worker_cuda)
    model_dtype = str(resolve_dtype(cfg.model.dtype, torch.device("cuda" if worker_gpu else "cpu"))).removeprefix("torch.")
    store = ShardStore(planned.store_root, fingerprint_id(fingerprint), capture_key(capture.to_dict(), model_dtype))
    planner = FoldPlanner(AccumulatorPlan(cfg.reduce.accumulators), store)
    actor_kwargs = dict(
        model=cfg.model.model, capture=capture.to_dict(), store_root=planned.store_root, dtype=cfg.model.dtype,
        cache_dir=rt.cache_dir, threads=rt.threads_per_worker, rows_per_heldout_shard=max(1, cfg.reduce.heldout_rows // 2),
        fingerprint=fingerprint, model_dtype=model_dtype,
    )
    total = lambda: max(1, expected[0])  # noqa: E731
    fold_plan = None
    if in_process:
        workers, pool = 1, _run_in_process(ShardWorker, actor_kwargs, payloads(store, planner), total)
    else:
        ready = lambda: prepare_weights(cfg.model.model, rt.cache_dir)  # noqa: E731
        # the raw half beside the fold's last shards: a CPU pool on this node only (its idle cores are the driver's)
        early = None if served is None or gpu_plan is not None or rt.cluster_address else \
            (lambda idle: served.start(idle * rt.threads_per_worker, early=True))
        workers, pool, fold_plan = _run_on_ray(cfg, gpu_plan, ray_started, ShardWorker, actor_kwargs,
                                               _after_first(payloads(store, planner), ready), total, planned.fold,
                                               early)
    results = [ShardResult.from_dict(r) for r in pool.results]
    return Folded(store, shards_seen, planner.accumulators(), results, workers, model_dtype, gpus >= 1, duplicates,
                  pool.startup_s, pool.run_s, pool.workers_lost, pool.rerun,
                  fold_plan.to_dict() if fold_plan is not None else None)


def _execute(cfg: JobSettings, alias_latest: bool, in_process: bool) -> tuple[dict, dict]:
    """plan -> fold -> reduce (solve -> fit -> measure per stream and group) -> publish."""
    t_start = time.perf_counter()
    planned = plan_job(cfg, in_process)
    cfg, rt = planned.settings, planned.settings.runtime
    started, gpus = False, 0.0
    if not in_process:
        import ray  # noqa: PLC0415 - Ray loads only for a Ray run (in_process runs without it)

        from kvtc.pipeline.job import ray_pool  # noqa: PLC0415 - it imports Ray

        started = ray_pool.start_ray(rt.cluster_address, num_cpus=None, verbose=rt.verbose)
        if not rt.verbose and ray_pool.worker_log_dir():
            print(f"kvtc calibrate: worker output goes to {ray_pool.worker_log_dir()} (--verbose shows it here)",
                  file=sys.stderr)
    try:
        gpu_plan, worker_cuda = None, None
        if not in_process:
            check_store_reach(planned.store_root, rt.store_shared, alive_nodes())  # before any model work
            if rt.cluster_address:  # a joined cluster: its nodes
                check_cluster(rt, ray.nodes())
            gpus = ray_pool.cluster_gpus()
            if rt.gpus_per_worker and gpus < 1:
                raise ValueError(f"--gpus-per-worker {rt.gpus_per_worker}: Ray reports no GPU in the cluster; "
                                 "omit it to run on CPUs, or join a cluster with GPUs (--address)")
            if gpus >= 1:  # before any model work: refuse a model the workers' GPUs cannot hold
                inventory = ray_pool.gpu_inventory()
                gpu_plan = _gpu_plan(planned, gpus, inventory.gpu_bytes, inventory.gpus_per_node, inventory.cuda)
                worker_cuda = inventory.cuda
        served = job_prep(cfg, planned.model_config)
        folded = fold_shards(planned, in_process, gpus, started, gpu_plan, worker_cuda, served)
        inp = ReduceInput(cfg, planned.fingerprint, folded.store, folded.shards, folded.accumulators, folded.model_dtype,
                          planned.model_config, planned.objective_reason, served)
        # the reduce runs on the fold's workers (their actors are gone: the model's memory is free), one group per worker
        placement = Placement(0 if in_process else folded.workers, rt.threads_per_worker, folded.on_cluster_gpu,
                              gpu_plan.gpu_bytes if gpu_plan is not None else 0,
                              cluster=not in_process and rt.cluster_address is not None)
        if not in_process:  # a node that joined during the fold would not see the store either
            check_store_reach(planned.store_root, rt.store_shared, alive_nodes(), "before the reduce")
        reduced = reduce(inp, placement)
        published = publish(inp, reduced, planned.registry, alias_latest)
        clear(reduced.tasks, folded.store)  # published: the groups' checkpoints and results go
    finally:
        if started:
            ray.shutdown()
    summary = published.summary
    if folded.duplicates:
        summary["warnings"].append(f"{len(folded.duplicates)} shards repeated an earlier shard's tokens and were folded once")
    summary["run"] = run_figures(planned, folded, reduced, published, time.perf_counter() - t_start)
    return summary, {"store": folded.store, "shards": folded.shards, "fingerprint": planned.fingerprint}


def run_figures(planned: Planned, folded: Folded, reduced: Reduced, published: Published, wall_s: float) -> dict:
    """The summary's "run" section: pool figures, store bytes, and the seconds of every stage
    (solve, fit and measure summed over groups, on whichever worker ran them; reduce: that stage's wall)."""
    results, rt = folded.results, planned.settings.runtime
    run_tokens = sum(r.tokens_run for r in results)
    trained = [r for r in results if r.role == "train" and not r.skipped]
    pool_s = folded.fold_s
    out = {
        "workers": folded.workers,
        "placement": placement_figures(results),
        "threads_per_worker": rt.threads_per_worker,
        "accumulators": planned.settings.reduce.accumulators,
        "shards_run": sum(not r.skipped for r in results),
        "shards_cached": sum(s.cached for s in folded.shards),
        "workers_lost": folded.workers_lost,
        "shards_rerun": folded.shards_rerun,
        "fold_plan": folded.fold_plan,
        "tokens_run": run_tokens,
        "startup_seconds": round(folded.startup_s, 2),
        "pool_seconds": round(pool_s, 2),
        "pool_tokens_per_s": round(run_tokens / pool_s, 1) if pool_s > 0 and run_tokens else None,
        "checkpoint_bytes_per_shard": int(sum(r.bytes for r in trained) / max(1, len(trained))),
        "capture_seconds": round(sum(r.capture_s for r in trained), 2),  # summed over workers
        "fold_seconds": round(sum(r.fold_s for r in trained), 2),
        "checkpoint_seconds": round(sum(r.checkpoint_s for r in trained), 2),
        "stats_bytes": folded.store.stats_bytes(),
        "reduce_seconds": round(reduced.seconds + published.seconds, 2),
        "solve_seconds": round(reduced.solve_s, 2),
        "eig_seconds": round(reduced.eig_s, 2),
        "groups": [{"stream": r.stream, "group": r.group, "p": int(r.basis[0].shape[0]), "kept": int(r.basis[2].shape[1]),
                    "solves": [dict(method=s.method, k=s.k, device=s.device, sum_s=round(s.sum_s, 2),
                                    eig_s=round(s.eig_s, 2)) for s in r.solves],
                    "fit_s": round(r.fit_s, 2), "measure_s": round(r.measure.seconds, 2)} for r in reduced.results],
        "wall_seconds": round(wall_s, 2),
        "reduce_plan": reduced.plan,
        # plan -> fold (model work, after the actors loaded the model) -> reduce (its wall; solve, fit, measure
        # summed over groups) -> publish
        "stages": {"plan": round(planned.seconds, 2), "startup": round(folded.startup_s, 2), "fold": round(pool_s, 2),
                   "reduce": round(reduced.seconds, 2), "solve": round(reduced.solve_s, 2),
                   "fit": round(reduced.fit_s, 2), "measure": round(reduced.measure_s, 2),
                   "publish": round(published.seconds, 2)},
    }
    out["wall_over_model_work"] = round(wall_s / pool_s, 2) if pool_s else None
    return out


def placement_figures(results: list[ShardResult]) -> list[dict]:
    """Where the shards ran: one row per (node, GPU ids, torch device) with its shard count, in first-seen order."""
    rows: dict[tuple[str, str, str], int] = {}
    for r in results:
        if not r.skipped:
            key = (r.node, r.gpus, r.device)
            rows[key] = rows.get(key, 0) + 1
    return [{"node": node, "gpus": gpus, "device": device, "shards": n} for (node, gpus, device), n in rows.items()]


def _run_in_process(worker_cls: type, worker_kwargs: dict, payloads, total=None) -> PoolRun:
    """The shards one after another in this process; the model loads only when a shard must run.
    total: the shards expected (a callable, read as they run), the bar's total."""
    t0 = time.perf_counter()
    it = iter(payloads)
    first = next(it, None)
    if first is None:
        return PoolRun([], 0.0, 0.0)
    worker = worker_cls(**worker_kwargs)
    startup_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    results = []
    with ShardProgress(total) as bar:
        for p in [first, *it]:
            results.append(worker.process(p))
            bar.advance(results[-1])
    return PoolRun(results, startup_s, time.perf_counter() - t0)


def _gpu_plan(planned: Planned, cluster_gpus: float, gpu_bytes: int, gpus_per_node: int, cuda: bool = True):
    """GPUs per worker (memory_plan.plan_gpus) for the model's weights in the workers' dtype (the CPU's where
    the GPUs are Ray's logical ones and torch sees none: `cuda` False)."""
    cfg, fp = planned.settings, planned.fingerprint
    rt, kv, hd = cfg.runtime, int(fp["num_kv_heads"]), int(fp["head_dim"])
    device = torch.device("cuda" if cuda else "cpu")
    size = model_size(planned.model_config, resolve_dtype(cfg.model.dtype, device), cfg.plan.seq_len)
    return plan_gpus(size, gpu_bytes, int(cluster_gpus), gpus_per_node,
                     lambda workers: _memory_estimate(cfg, layers_of(fp), kv, hd, cfg.capture.groups,
                                                      rt.workers or workers).worker, rt.gpus_per_worker)


def _after_first(payloads: Iterator[dict], before: Callable[[], None]) -> Iterator[dict]:
    """`payloads`, with `before()` run once there is a first one (the workers start only then; a job whose
    shards are all cached runs neither)."""
    first = next(payloads, None)
    if first is None:
        return
    before()
    yield first
    yield from payloads


def _run_on_ray(cfg: JobSettings, gpu_plan, started: bool, worker_cls: type, worker_kwargs: dict,
                payloads, total=None, fold=None, on_idle=None) -> tuple[int, PoolRun, Any]:
    """(workers, results, fold plan) of the shards on a Ray actor pool (Ray already started, by this job when
    `started`); fold tasks are pinned to the actor that owns their accumulator. With GPUs, each worker
    takes `gpu_plan.gpus` of them and spreads the model over them when more than one. `fold` (a
    fold_plan.FoldSizer, CPU workers on this node): as many workers as the node's memory holds now."""
    import ray  # noqa: PLC0415 - Ray loads only for a Ray run (in_process runs without it)

    from kvtc.pipeline.job import ray_pool  # noqa: PLC0415 - it imports Ray

    cpus = int(ray.cluster_resources().get("CPU", os.cpu_count() or 1))
    rt = cfg.runtime
    workers = rt.workers or (gpu_plan.workers if gpu_plan else max(1, cpus // rt.threads_per_worker))
    fold_plan, memory = None, 0
    if fold is not None and gpu_plan is None:  # Ray's own processes now count as used
        if rt.cluster_address:  # a joined cluster: per node, each actor asking for its peak
            fold_plan = fold_planning.admit_on_nodes(fold, workers, rt.threads_per_worker, ray.nodes())
            memory = fold_plan.worker_bytes
        else:
            fold_plan = fold.plan(workers, *fold_planning.node_now())
        print(fold_plan.line(), file=sys.stderr)
        workers = fold_plan.workers
    if gpu_plan is not None and gpu_plan.gpus > 1:
        worker_kwargs = {**worker_kwargs, "gpu_budgets": gpu_plan.max_memory()}
    pool = ray_pool.PoolSettings(workers=workers, threads_per_worker=rt.threads_per_worker,
                                 gpus_per_worker=float(gpu_plan.gpus) if gpu_plan else 0.0, env_inherited=started,
                                 memory=memory)
    return workers, ray_pool.run_pool(worker_cls, worker_kwargs, payloads, pool,
                                      route=lambda payload: payload.get("acc_index"), total=total,
                                      on_idle=on_idle), fold_plan


if __name__ == "__main__":  # the former `ray job submit` entry: say where the command went instead of doing nothing
    sys.exit("kvtc: this module has no command line; run `python -m kvtc.pipeline.calibrate_job ARGS` "
             "(the same as `kvtc calibrate ARGS`)")
