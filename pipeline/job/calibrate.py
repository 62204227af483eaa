"""`kvtc calibrate`: the main job. Corpus shards stream through Ray worker actors that capture the
model's KV cache and store per-shard statistics; the driver folds them in shard order, computes
PCA bases and one DP bit allocation per ratio, measures held-out errors and publishes a versioned
artifact to the registry.

Also runnable as `python -m kvtc.pipeline.job.calibrate ...` (for `ray job submit`).
"""
from __future__ import annotations

import argparse
import math
import json
import os
import sys
import time
import warnings
from dataclasses import dataclass, field, fields

from kvtc.pipeline.job.corpus import iter_documents
from kvtc.pipeline.job.shards import ShardPlan, plan_shards

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_CORPUS = "pydoc+pkgdocs"  # prose mixture; stdlib code stays the evaluation domain
DEFAULT_EVAL_CORPUS = "stdlib"
# Sized for about 10 minutes end to end on a 2-core CPU with the embedded model: 40K tokens took
# 347 s wall (2.3 min of model work at 338 tok/s, the rest start-up and reduce), so 80K take ~8 min.
DEFAULT_CPU_TOKENS = 80 * 1024
DEFAULT_GPU_TOKENS = 2_000_000


@dataclass(frozen=True)
class CalibrateConfig:
    model: str = DEFAULT_MODEL
    corpus: str = DEFAULT_CORPUS
    eval_corpus: str | None = DEFAULT_EVAL_CORPUS
    ratios: tuple[float, ...] = (8.0, 16.0, 32.0)
    tokens: int | None = None
    eval_tokens: int | None = None
    seq_len: int = 1024
    seqs_per_shard: int = 8
    registry: str | None = None
    name: str | None = None
    address: str | None = None
    workers: int | None = None
    threads_per_worker: int = 1
    gpus_per_worker: int | None = None
    tp: int = 1
    sinks: int = 4
    window: int = 128
    groups: str = "model"
    sample: float = 1.0
    seed: int = 0
    keys: str = "rope-removed"
    holdout_fraction: float = 0.2
    heldout_rows: int = 8192
    tokens_curve_points: int = 3
    accumulators: int = 4
    store: str | None = None
    dtype: str | None = None
    cache_dir: str | None = None
    text_column: str | None = None
    block_sizes: tuple[int, ...] = (1, 16, 64, 256, 1024)
    types: tuple[str, ...] = ("none", "int2", "int4", "fp8")
    error_model: str = "measured"
    parent: str | None = None
    extra_manifest: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        bad = [r for r in self.ratios if not r > 1]
        if not self.ratios or bad:
            raise ValueError(f"compression ratios must be > 1 (got {list(self.ratios)}); pass e.g. --ratios 8,16,32")
        if self.tokens is not None and self.tokens < self.seq_len:
            raise ValueError(f"--tokens {self.tokens} is below one sequence of --seq-len {self.seq_len}")
        if self.seqs_per_shard < 1:
            raise ValueError(f"--seqs-per-shard must be >= 1, got {self.seqs_per_shard}")
        if not 0 < self.holdout_fraction < 1:
            raise ValueError(f"holdout fraction must be in (0, 1), got {self.holdout_fraction}")
        if self.accumulators < 1:
            raise ValueError(f"--accumulators must be >= 1, got {self.accumulators}")
        from kvtc.artifacts.schema import check_name

        if self.name is not None:
            check_name("artifact name (--name)", self.name)  # before the run, not at publish time
        if self.registry is not None and not str(self.registry).strip():
            raise ValueError("--registry is empty; pass a path or URI, or omit it for $KVTC_REGISTRY or ./registry")
        for flag, value in (("--workers", self.workers), ("--threads-per-worker", self.threads_per_worker),
                            ("--gpus-per-worker", self.gpus_per_worker), ("--tp", self.tp),
                            ("--tokens", self.tokens), ("--eval-tokens", self.eval_tokens), ("--seq-len", self.seq_len)):
            if value is not None and value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        if len(set(self.ratios)) != len(self.ratios) or not all(math.isfinite(r) for r in self.ratios):
            raise ValueError(f"compression ratios must be finite and distinct, got {list(self.ratios)}")

    @property
    def artifact_name(self) -> str:
        if self.name:
            return self.name
        base = self.model.rstrip("/").split("/")[-1].replace(":", "-").removesuffix(".gguf")
        return base.lower()


def _capture_dict(cfg: CalibrateConfig) -> dict:
    return {"sinks": cfg.sinks, "window": cfg.window, "groups": cfg.groups, "sample": cfg.sample, "seed": cfg.seed,
            "keys": cfg.keys, "tp": cfg.tp}


def shard_plan(cfg: CalibrateConfig, tokens: int) -> ShardPlan:
    """The job's ShardPlan for `tokens` training-corpus tokens."""
    return ShardPlan(corpus=cfg.corpus, tokens=tokens, eval_corpus=cfg.eval_corpus, eval_tokens=cfg.eval_tokens,
                     seq_len=cfg.seq_len, seqs_per_shard=cfg.seqs_per_shard, seed=cfg.seed,
                     holdout_fraction=cfg.holdout_fraction, text_column=cfg.text_column)


def run(cfg: CalibrateConfig, alias_latest: bool = True, in_process: bool = False) -> dict:
    """Run the whole job; returns the summary that `--json` prints. alias_latest=False publishes
    the version without moving `latest` (recalibration decides after validating it); in_process=True
    runs the shards in this process, one after another, without Ray (tests, benches)."""
    return _execute(cfg, alias_latest, in_process)[0]


def calibrate_local(cfg: CalibrateConfig) -> tuple[dict, dict]:
    """`run(cfg, in_process=True)` -> (summary, context); context holds the shard "store", the
    "shards" ({id, index, role, tokens, cached}) and the model "fingerprint", for diagnostics."""
    return _execute(cfg, True, in_process=True)


def _memory_estimate(cfg: CalibrateConfig, info, groups: str, workers: int, alloc):
    from kvtc.pipeline.job.basis_solver import max_components
    from kvtc.pipeline.job.memory_plan import estimate
    from kvtc.workers.capture import CaptureSettings

    dims = [g.dim(info.num_kv_heads, info.head_dim)
            for g in CaptureSettings(groups=groups, tp=cfg.tp).group_layers(info.num_layers, info.num_kv_heads)]
    return estimate(dims, accumulators=cfg.accumulators, workers=workers, rows_per_batch=cfg.seq_len,
                    heldout_rows=cfg.heldout_rows, kept_max=max(max_components(p, cfg.ratios, alloc) for p in dims))


def _execute(cfg: CalibrateConfig, alias_latest: bool, in_process: bool) -> tuple[dict, dict]:
    import psutil
    import torch

    from kvtc import artifacts
    from kvtc.artifacts.tensor_parallel import TensorParallelLayout
    from kvtc.pipeline.fit.allocator import AllocatorSettings, validate_ratios
    from kvtc.pipeline.job.accumulators import AccumulatorPlan, FoldPlanner
    from kvtc.pipeline.job.memory_plan import check_fits
    from kvtc.pipeline.job.reduce import reduce_and_publish
    from kvtc.pipeline.job.shard_worker import ShardWorker
    from kvtc.pipeline.job.store import ShardStore, capture_key, default_store_uri
    from kvtc.workers.capture import CaptureSettings, check_seq_len
    from kvtc.workers.models import fingerprint_id, load_spec, resolve_dtype

    t_start = time.perf_counter()
    alloc = AllocatorSettings(block_sizes=tuple(cfg.block_sizes), types=tuple(cfg.types), error_model=cfg.error_model)
    plan = AccumulatorPlan(cfg.accumulators)
    registry = artifacts.Registry(cfg.registry).uri
    artifacts.check_writable(registry)
    capture = CaptureSettings(**_capture_dict(cfg))
    for spec in filter(None, (cfg.corpus, cfg.eval_corpus)):
        iter_documents(spec, cfg.text_column)  # a bad spec fails here, before any model work

    info = load_spec(cfg.model, cache_dir=cfg.cache_dir)  # config and tokenizer only: the driver never loads weights
    check_seq_len(info, cfg.seq_len, capture)
    width = info.num_kv_heads * info.head_dim
    text_config = getattr(info.config, "text_config", None) or info.config
    TensorParallelLayout(cfg.tp, info.num_kv_heads, int(getattr(text_config, "num_attention_heads", 0) or 0))
    for group in capture.group_layers(info.num_layers, info.num_kv_heads):
        validate_ratios(cfg.ratios, group.dim(info.num_kv_heads, info.head_dim), alloc)
    if in_process or not (cfg.address or os.environ.get("RAY_ADDRESS")):  # local: this machine holds everything
        if cfg.gpus_per_worker and not in_process and not torch.cuda.is_available():
            raise ValueError(f"--gpus-per-worker {cfg.gpus_per_worker}: this machine has no GPU torch can see and no "
                             "cluster was given; omit it to run on CPUs, or join a cluster with GPUs (--address)")
        local_workers = 1 if in_process else cfg.workers or max(1, (os.cpu_count() or 1) // cfg.threads_per_worker)
        est = _memory_estimate(cfg, info, cfg.groups, local_workers, alloc)
        check_fits(est, int(psutil.virtual_memory().available), info.num_layers, width, cfg.groups,
                   lambda k: _memory_estimate(cfg, info, f"layers:{k}", local_workers, alloc))
    tokenizer, fingerprint = info.tokenizer, info.fingerprint

    on_gpu = torch.cuda.is_available()
    tokens = cfg.tokens or (DEFAULT_GPU_TOKENS if on_gpu else DEFAULT_CPU_TOKENS)
    if cfg.tokens is None:
        print(f"kvtc calibrate: --tokens not given; running {tokens} tokens ({'GPU' if on_gpu else 'CPU'} default)", file=sys.stderr)
    store_root = cfg.store or default_store_uri()

    shards_seen: list[dict] = []
    duplicates: list[str] = []
    rows_per_heldout_shard = max(1, cfg.heldout_rows // 2)

    def payloads(store: ShardStore, planner: FoldPlanner):
        for role, shard in plan_shards(shard_plan(cfg, tokens), tokenizer, fingerprint["max_positions"], duplicates):
            entry = {"id": shard.id, "index": shard.index, "role": role, "tokens": int(shard.input_ids.size), "cached": False}
            shards_seen.append(entry)
            if role == "train":
                tasks = planner.add(shard.index, shard.id, {"shard": shard.to_payload()})
                entry["cached"] = not tasks
                yield from tasks
                continue
            if role == "eval":
                yield from planner.finish()  # the training stream has ended
            entry["cached"] = store.has(shard.id, "rows")
            if not entry["cached"]:
                yield {"shard": shard.to_payload(), "role": role}
        yield from planner.finish()

    started, gpus = False, 0.0
    if not in_process:
        import ray

        from kvtc.pipeline.job import ray_pool

        started = ray_pool.start_ray(cfg.address, num_cpus=None)
    try:
        gpu_plan = None
        if not in_process:
            gpus = ray_pool.cluster_gpus()
            if cfg.gpus_per_worker and gpus < 1:
                raise ValueError(f"--gpus-per-worker {cfg.gpus_per_worker}: Ray reports no GPU in the cluster; "
                                 "omit it to run on CPUs, or join a cluster with GPUs (--address)")
            if gpus >= 1:  # before any model work: refuse a model the workers' GPUs cannot hold
                gpu_plan = _gpu_plan(cfg, info, alloc, gpus, *ray_pool.gpu_inventory())
        # the workers' dtype scopes the statistics: bfloat16 on GPU workers, float32 on CPU ones (unless --dtype)
        worker_gpu = on_gpu if in_process else gpus >= 1
        model_dtype = str(resolve_dtype(cfg.dtype, torch.device("cuda" if worker_gpu else "cpu"))).removeprefix("torch.")
        store = ShardStore(store_root, fingerprint_id(fingerprint), capture_key(capture.to_dict(), model_dtype))
        planner = FoldPlanner(plan, store)
        actor_kwargs = dict(
            model=cfg.model, capture=capture.to_dict(), store_root=store_root, dtype=cfg.dtype, cache_dir=cfg.cache_dir,
            threads=cfg.threads_per_worker, rows_per_heldout_shard=rows_per_heldout_shard, fingerprint=fingerprint,
            model_dtype=model_dtype,
        )
        timing: dict = {}
        if in_process:
            workers, results = 1, _run_in_process(ShardWorker, actor_kwargs, payloads(store, planner), timing)
        else:
            workers, results = _run_on_ray(cfg, gpu_plan, started, ShardWorker, actor_kwargs, payloads(store, planner),
                                           timing)
        pool_seconds = timing["run_s"]
        if gpus < 1 and started:  # the reduce runs here: free Ray's processes (and their CPU) first
            ray.shutdown()
            started = False
        reduce_timing: dict = {}
        summary = reduce_and_publish(
            cfg=cfg, fingerprint=fingerprint, alloc=alloc, store=store, shards=shards_seen,
            accumulators=planner.accumulators(), registry=registry, tokens_requested=tokens, alias_latest=alias_latest,
            model_dtype=model_dtype, on_cluster_gpu=gpus >= 1, timing=reduce_timing,
        )
    finally:
        if started:
            ray.shutdown()

    run_tokens = sum(r["tokens_run"] for r in results)
    if duplicates:
        summary["warnings"].append(f"{len(duplicates)} shards repeated an earlier shard's tokens and were folded once")
    folded = [r for r in results if r["role"] == "train" and not r.get("skipped")]
    summary["run"] = {
        "workers": workers,
        "threads_per_worker": cfg.threads_per_worker,
        "accumulators": cfg.accumulators,
        "shards_run": sum(not r.get("skipped") for r in results),
        "shards_cached": sum(s["cached"] for s in shards_seen),
        "tokens_run": run_tokens,
        "startup_seconds": round(timing["startup_s"], 2),
        "pool_seconds": round(pool_seconds, 2),
        "pool_tokens_per_s": round(run_tokens / pool_seconds, 1) if pool_seconds > 0 and run_tokens else None,
        "checkpoint_bytes_per_shard": int(sum(r["bytes"] for r in folded) / max(1, len(folded))),
        "capture_seconds": round(sum(r.get("capture_s", 0.0) for r in folded), 2),  # summed over workers
        "fold_seconds": round(sum(r.get("fold_s", 0.0) for r in folded), 2),
        "checkpoint_seconds": round(sum(r.get("checkpoint_s", 0.0) for r in folded), 2),
        "stats_bytes": store.stats_bytes(),
        "reduce_seconds": round(reduce_timing.get("reduce_s", 0.0), 2),
        "solve_seconds": round(reduce_timing.get("solve_s", 0.0), 2),
        "eig_seconds": round(reduce_timing.get("eig_s", 0.0), 2),
        "curve_seconds": round(reduce_timing.get("curve_s", 0.0), 2),
        "wall_seconds": round(time.perf_counter() - t_start, 2),
    }
    return summary, {"store": store, "shards": shards_seen, "fingerprint": fingerprint}


def _run_in_process(worker_cls: type, worker_kwargs: dict, payloads, timing: dict) -> list[dict]:
    """The shards one after another in this process; the model loads only when a shard must run."""
    from tqdm import tqdm

    t0 = time.perf_counter()
    it = iter(payloads)
    first = next(it, None)
    if first is None:
        timing.update(startup_s=0.0, run_s=0.0)
        return []
    worker = worker_cls(**worker_kwargs)
    timing["startup_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    results = [worker.process(p) for p in tqdm([first, *it], unit="shard", desc="calibrate", dynamic_ncols=True,
                                                disable=None)]
    timing["run_s"] = time.perf_counter() - t0
    return results


def _gpu_plan(cfg: CalibrateConfig, info, alloc, cluster_gpus: float, gpu_bytes: int, gpus_per_node: int):
    """GPUs per worker (memory_plan.plan_gpus) for the model's weights in the workers' dtype."""
    import torch

    from kvtc.pipeline.job.memory_plan import plan_gpus
    from kvtc.workers.model_size import model_size
    from kvtc.workers.models import resolve_dtype

    size = model_size(info.config, resolve_dtype(cfg.dtype, torch.device("cuda")), cfg.seq_len)
    return plan_gpus(size, gpu_bytes, int(cluster_gpus), gpus_per_node,
                     lambda workers: _memory_estimate(cfg, info, cfg.groups, cfg.workers or workers, alloc).worker,
                     cfg.gpus_per_worker)


def _run_on_ray(cfg: CalibrateConfig, gpu_plan, started: bool, worker_cls: type, worker_kwargs: dict, payloads,
                timing: dict) -> tuple[int, list[dict]]:
    """(workers, results) of the shards on a Ray actor pool (Ray already started, by this job when
    `started`); fold tasks are pinned to the actor that owns their accumulator. With GPUs, each worker
    takes `gpu_plan.gpus` of them and spreads the model over them when more than one."""
    import ray

    from kvtc.pipeline.job import ray_pool

    cpus = int(ray.cluster_resources().get("CPU", os.cpu_count() or 1))
    workers = cfg.workers or (gpu_plan.workers if gpu_plan else max(1, cpus // cfg.threads_per_worker))
    if gpu_plan is not None and gpu_plan.gpus > 1:
        worker_kwargs = {**worker_kwargs, "gpu_budgets": gpu_plan.max_memory()}
    pool = ray_pool.PoolSettings(workers=workers, threads_per_worker=cfg.threads_per_worker,
                                 gpus_per_worker=float(gpu_plan.gpus) if gpu_plan else 0.0, env_inherited=started)
    return workers, ray_pool.run_pool(worker_cls, worker_kwargs, payloads, pool, timing=timing,
                                      route=lambda payload: payload.get("acc_index"))


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = CalibrateConfig()
    p.add_argument("--model", default=d.model, help="smollm2-135m (default), a hub id, a model dir, a .gguf path, or tiny:ARCH")
    p.add_argument("--corpus", default=d.corpus, help="pydoc+pkgdocs (default: a mixture, + interleaves), pydoc, pkgdocs, stdlib, hf:ORG/NAME, or local .txt/.jsonl/.parquet files, dirs, globs")
    p.add_argument("--eval-corpus", default=d.eval_corpus, help="second domain for cross-domain errors (default stdlib; 'none' to skip)")
    p.add_argument("--ratios", default="8,16,32", help="compression ratios, comma separated (default 8,16,32)")
    p.add_argument("--tokens", type=int, default=None, help="tokens to run through the model (default: sized for ~10 min on a 2-core CPU)")
    p.add_argument("--eval-tokens", type=int, default=None, help="tokens of --eval-corpus to run (default: 4 sequences)")
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="sequence length (default 1024)")
    p.add_argument("--seqs-per-shard", type=int, default=d.seqs_per_shard)
    p.add_argument("--registry", default=None, help="registry root: a path or fsspec URI (default $KVTC_REGISTRY or ./registry)")
    p.add_argument("--name", default=None, help="artifact name (default: derived from the model spec)")
    p.add_argument("--address", default=None, help="Ray cluster address to join (default: a local Ray started for the job)")
    p.add_argument("--workers", type=int, default=None, help="worker actors (default: one per GPU, else one per CPU)")
    p.add_argument("--threads-per-worker", type=int, default=d.threads_per_worker)
    p.add_argument("--gpus-per-worker", type=int, default=None,
                   help="GPUs each worker spreads the model over (default: the fewest that hold its weights, statistics "
                        "and activations, from its config, dtype and the GPU memory; refused when too few)")
    p.add_argument("--sinks", type=int, default=d.sinks, help="leading positions kept raw (default 4)")
    p.add_argument("--window", type=int, default=d.window, help="trailing positions kept raw (default 128)")
    p.add_argument("--groups", default=d.groups, help="model (default), layer, or layers:K")
    p.add_argument("--tp", type=int, default=d.tp,
                   help="tensor-parallel ranks the model is served at (default 1): one basis per rank's KV heads "
                        "(and per layer group), as vLLM and SGLang shard them; ranks holding the same heads share one")
    p.add_argument("--sample", type=float, default=d.sample, help="fraction of positions sampled (default 1.0)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--keys", choices=("rope-removed", "rope-kept"), default=d.keys,
                   help="rope-removed (default): keys calibrated and coded without RoPE; rope-kept: as servers store "
                        "them, for consumers that cannot remove RoPE (Dynamo, chunk stores without positions)")
    p.add_argument("--holdout-fraction", type=float, default=d.holdout_fraction)
    p.add_argument("--heldout-rows", type=int, default=d.heldout_rows, help="cap on held-out rows per stream")
    p.add_argument("--tokens-curve-points", type=int, default=d.tokens_curve_points,
                   help="prefixes of the shard stream measured for the error-vs-calibration-tokens chart (0: off)")
    p.add_argument("--accumulators", type=int, default=d.accumulators,
                   help="running statistics totals kept in the store (default 4): the store holds this many Grams per "
                        "stream and group whatever --tokens is; results are bit-identical for any --workers, not across values")
    p.add_argument("--store", default=None, help="shard statistics cache: a path or fsspec URI (default $KVTC_CACHE/shards)")
    p.add_argument("--dtype", default=None, help="float32 (CPU default), bfloat16 or float16")
    p.add_argument("--cache-dir", default=None, help="model cache dir (default $KVTC_CACHE)")
    p.add_argument("--text-column", default=None)
    p.add_argument("--block-sizes", default="1,16,64,256,1024")
    p.add_argument("--types", default="none,int2,int4,fp8")
    p.add_argument("--error-model", choices=("measured", "analytic"), default=d.error_model)
    p.add_argument("--json", action="store_true", help="print a machine-readable summary")


def config_values(options: dict) -> dict:
    """`kvtc calibrate` option values (argparse dests, as given on the command line) -> CalibrateConfig
    field values, for the options present (others, like `json` or the sub-command, are ignored)."""
    def numbers(name: str, kind: type) -> tuple:
        try:
            return tuple(kind(x) for x in str(options[name]).split(",") if x.strip())
        except ValueError:
            raise ValueError(f"--{name.replace('_', '-')} must be comma-separated numbers, got {options[name]!r}") from None

    settings = {f.name for f in fields(CalibrateConfig)}
    out = {k: v for k, v in options.items() if k in settings}
    if "eval_corpus" in out:
        out["eval_corpus"] = None if (out["eval_corpus"] or "").lower() in ("", "none") else out["eval_corpus"]
    if "ratios" in out:
        out["ratios"] = numbers("ratios", float)
    if "block_sizes" in out:
        out["block_sizes"] = numbers("block_sizes", int)
    if "types" in out:
        out["types"] = tuple(t.strip() for t in str(out["types"]).split(",") if t.strip())
    return out


def config_from_args(args: argparse.Namespace, **overrides) -> CalibrateConfig:
    return CalibrateConfig(**{**config_values(vars(args)), **overrides})


def config_from_manifest(manifest: dict, **overrides) -> CalibrateConfig:
    """The settings that repeat the calibration of `manifest` (a published version), then `overrides`
    (CalibrateConfig fields); settings the manifest did not record keep CalibrateConfig's defaults."""
    from kvtc.artifacts.calibration import CalibrationRecord

    rec = CalibrationRecord.from_manifest(manifest)
    corpus = manifest["corpus"]
    recorded = dict(
        model=manifest["model"]["spec"], corpus=corpus["spec"], eval_corpus=corpus.get("eval_spec") or None,
        ratios=rec.ratios, tokens=rec.tokens_requested, eval_tokens=rec.eval_tokens, seq_len=rec.seq_len,
        seqs_per_shard=rec.seqs_per_shard, sinks=rec.sinks, window=rec.window, groups=rec.group_spec,
        sample=rec.sample, seed=rec.seed, tp=rec.tp, holdout_fraction=rec.holdout_fraction, heldout_rows=rec.heldout_rows_cap,
        text_column=rec.text_column, dtype=rec.dtype, keys=rec.keys, block_sizes=tuple(rec.allocator["block_sizes"]),
        types=tuple(rec.allocator["types"]), error_model=rec.allocator["error_model"],
    )
    unrecorded = {"holdout_fraction", "heldout_rows", "seqs_per_shard"}  # None: keep the default
    recorded = {k: v for k, v in recorded.items() if v is not None or k not in unrecorded}
    return CalibrateConfig(**{**recorded, **overrides})


def print_summary(summary: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(summary, indent=2, sort_keys=True))
        return
    print(f"published {summary['name']}@{summary['version']} to {summary['registry']}")
    for row in summary["ratios"]:
        print(
            f"  CR {row['ratio']:>5g}: keys {100 * row['keys']['rel_error']:.2f}%  values {100 * row['values']['rel_error']:.2f}%"
            f"  (held-out relative error; kept {row['keys']['kept']}/{row['values']['kept']} components)"
        )
    run = summary.get("run", {})
    if run:
        print(f"  tokens run {run['tokens_run']} in {run['pool_seconds']} s ({run['pool_tokens_per_s']} tok/s), wall {run['wall_seconds']} s")


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    return f"kvtc calibrate: warning: {message}\n"


def _handler(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    warnings.formatwarning = _one_line_warning  # the message, not the source line that raised it
    print_summary(run(cfg), args.json)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("calibrate", help="calibrate a model and publish an artifact", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=_handler)


def main(argv: list[str] | None = None) -> int:
    from kvtc.pipeline.cli import main as cli_main

    return cli_main(["calibrate", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
