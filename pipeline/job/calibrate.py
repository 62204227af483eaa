"""`kvtc calibrate`: the main job. Corpus shards stream through Ray worker actors that capture the
model's KV cache and store per-shard statistics; the driver folds them in shard order, computes
PCA bases and one DP bit allocation per ratio, measures held-out errors and publishes a versioned
artifact to the registry.

Also runnable as `python -m kvtc.pipeline.job.calibrate ...` (for `ray job submit`).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_CORPUS = "pydoc"
DEFAULT_EVAL_CORPUS = "stdlib"
# Sized for about 10 minutes end to end on a 2-core CPU with the embedded model: 40K tokens took
# 347 s wall (2.3 min of model work at 338 tok/s, the rest start-up and reduce), so 80K take ~8 min.
DEFAULT_CPU_TOKENS = 80 * 1024
DEFAULT_GPU_TOKENS = 2_000_000
DEFAULT_EVAL_SEQS = 4


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
    sinks: int = 4
    window: int = 128
    groups: str = "model"
    sample: float = 1.0
    seed: int = 0
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

    @property
    def artifact_name(self) -> str:
        if self.name:
            return self.name
        base = self.model.rstrip("/").split("/")[-1].replace(":", "-").removesuffix(".gguf")
        return base.lower()


def _capture_dict(cfg: CalibrateConfig) -> dict:
    return {"sinks": cfg.sinks, "window": cfg.window, "groups": cfg.groups, "sample": cfg.sample, "seed": cfg.seed}


def _memory_estimate(cfg: CalibrateConfig, num_layers: int, width: int, groups: str, workers: int, alloc):
    from kvtc.pipeline.job.basis_solver import max_components
    from kvtc.pipeline.job.memory_plan import estimate
    from kvtc.workers.capture import CaptureSettings

    dims = [(b - a) * width for a, b in CaptureSettings(groups=groups).group_layers(num_layers)]
    return estimate(dims, accumulators=cfg.accumulators, workers=workers, rows_per_batch=cfg.seq_len,
                    heldout_rows=cfg.heldout_rows, kept_max=max(max_components(p, cfg.ratios, alloc) for p in dims))


def run(cfg: CalibrateConfig, alias_latest: bool = True) -> dict:
    """Run the whole job; returns the summary that `--json` prints. alias_latest=False publishes
    the version without moving `latest` (recalibration decides after validating it)."""
    import psutil
    import ray
    import torch

    from kvtc import artifacts
    from kvtc.pipeline.job import ray_pool
    from kvtc.pipeline.fit.allocator import AllocatorSettings, validate_ratios
    from kvtc.pipeline.job.accumulators import AccumulatorPlan, FoldPlanner
    from kvtc.pipeline.job.corpus import iter_documents
    from kvtc.pipeline.job.memory_plan import check_fits
    from kvtc.pipeline.job.reduce import reduce_and_publish
    from kvtc.pipeline.job.shards import make_shards
    from kvtc.pipeline.job.store import ShardStore, capture_key, default_store_uri
    from kvtc.workers.capture import CaptureSettings, check_seq_len
    from kvtc.workers.models import fingerprint_id, load_spec, resolve_dtype
    from kvtc.pipeline.job.shard_worker import ShardWorker

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
    groups = capture.group_layers(info.num_layers)
    width = info.num_kv_heads * info.head_dim
    for a, b in groups:
        validate_ratios(cfg.ratios, (b - a) * width, alloc)
    if not cfg.address and not os.environ.get("RAY_ADDRESS"):  # a local run: this machine holds everything
        local_workers = cfg.workers or max(1, (os.cpu_count() or 1) // cfg.threads_per_worker)
        est = _memory_estimate(cfg, info.num_layers, width, cfg.groups, local_workers, alloc)
        check_fits(est, int(psutil.virtual_memory().available), info.num_layers, width, cfg.groups,
                   lambda k: _memory_estimate(cfg, info.num_layers, width, f"layers:{k}", local_workers, alloc))
    tokenizer, fingerprint = info.tokenizer, info.fingerprint

    on_gpu = torch.cuda.is_available()
    tokens = cfg.tokens or (DEFAULT_GPU_TOKENS if on_gpu else DEFAULT_CPU_TOKENS)
    if cfg.tokens is None:
        print(f"kvtc calibrate: --tokens not given; running {tokens} tokens ({'GPU' if on_gpu else 'CPU'} default)", file=sys.stderr)
    store_root = cfg.store or default_store_uri()

    shards_seen: list[dict] = []
    seen_ids: set[str] = set()
    duplicates: list[str] = []
    rows_planned = {"heldout": 0, "eval": 0}
    rows_per_heldout_shard = max(1, cfg.heldout_rows // 2)

    def payloads(spec: str, budget: int, eval_domain: bool):
        for shard in make_shards(
            spec, tokenizer, seq_len=cfg.seq_len, seqs_per_shard=cfg.seqs_per_shard, max_tokens=budget,
            seed=cfg.seed, text_column=cfg.text_column,
            holdout_fraction=0.0 if eval_domain else cfg.holdout_fraction, min_holdout_shards=0 if eval_domain else 1,
            max_seq_len=fingerprint["max_positions"],
        ):
            if shard.id in seen_ids:
                duplicates.append(shard.id)  # identical tokens, identical statistics: fold once
                continue
            seen_ids.add(shard.id)
            role = "eval" if eval_domain else ("heldout" if shard.holdout else "train")
            entry = {"id": shard.id, "index": shard.index, "role": role, "tokens": int(shard.input_ids.size), "cached": False}
            shards_seen.append(entry)
            if role == "train":
                tasks = planner.add(shard.index, shard.id, {"shard": shard.to_payload()})
                entry["cached"] = not tasks
                yield from tasks
                continue
            if rows_planned[role] >= cfg.heldout_rows:
                entry["role"] = "spare" if role == "heldout" else "eval_spare"  # held out, but its rows are not needed
                continue
            rows_planned[role] += min(rows_per_heldout_shard, int(shard.input_ids.size))
            entry["cached"] = store.has(shard.id, "rows")
            if not entry["cached"]:
                yield {"shard": shard.to_payload(), "role": role}
        if not eval_domain:
            yield from planner.finish()

    def all_payloads():
        yield from payloads(cfg.corpus, tokens, eval_domain=False)
        if cfg.eval_corpus:
            yield from payloads(cfg.eval_corpus, cfg.eval_tokens or DEFAULT_EVAL_SEQS * cfg.seq_len, eval_domain=True)

    started = ray_pool.start_ray(cfg.address, num_cpus=None)
    try:
        gpus = ray_pool.cluster_gpus()
        # the workers' dtype scopes the statistics: bfloat16 on GPU workers, float32 on CPU ones (unless --dtype)
        model_dtype = str(resolve_dtype(cfg.dtype, torch.device("cuda" if gpus >= 1 else "cpu"))).removeprefix("torch.")
        store = ShardStore(store_root, fingerprint_id(fingerprint), capture_key(capture.to_dict(), model_dtype))
        planner = FoldPlanner(plan, store)
        cpus = int(ray.cluster_resources().get("CPU", os.cpu_count() or 1))
        workers = cfg.workers or (int(gpus) if gpus >= 1 else max(1, cpus // cfg.threads_per_worker))
        pool = ray_pool.PoolSettings(workers=workers, threads_per_worker=cfg.threads_per_worker, gpus_per_worker=1.0 if gpus >= 1 else 0.0)
        actor_kwargs = dict(
            model=cfg.model, capture=capture.to_dict(), store_root=store_root, dtype=cfg.dtype, cache_dir=cfg.cache_dir,
            threads=cfg.threads_per_worker, rows_per_heldout_shard=rows_per_heldout_shard, fingerprint=fingerprint,
            model_dtype=model_dtype,
        )
        timing: dict = {}
        results = ray_pool.run_pool(ShardWorker, actor_kwargs, all_payloads(), pool, timing=timing,
                                    route=lambda payload: payload.get("acc_index"))
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
    return summary


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = CalibrateConfig()
    p.add_argument("--model", default=d.model, help="smollm2-135m (default), a hub id, a model dir, a .gguf path, or tiny:ARCH")
    p.add_argument("--corpus", default=d.corpus, help="pydoc (default), stdlib, hf:ORG/NAME, or local .txt/.jsonl/.parquet files, dirs, globs")
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
    p.add_argument("--sinks", type=int, default=d.sinks, help="leading positions kept raw (default 4)")
    p.add_argument("--window", type=int, default=d.window, help="trailing positions kept raw (default 128)")
    p.add_argument("--groups", default=d.groups, help="model (default), layer, or layers:K")
    p.add_argument("--sample", type=float, default=d.sample, help="fraction of positions sampled (default 1.0)")
    p.add_argument("--seed", type=int, default=d.seed)
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


def config_from_args(args: argparse.Namespace, **overrides) -> CalibrateConfig:
    def floats(s: str) -> tuple[float, ...]:
        try:
            return tuple(float(x) for x in s.split(",") if x.strip())
        except ValueError:
            raise ValueError(f"--ratios must be comma-separated numbers, got {s!r}") from None

    eval_corpus = None if (args.eval_corpus or "").lower() in ("", "none") else args.eval_corpus
    kw = dict(
        model=args.model, corpus=args.corpus, eval_corpus=eval_corpus, ratios=floats(args.ratios), tokens=args.tokens,
        eval_tokens=args.eval_tokens, seq_len=args.seq_len, seqs_per_shard=args.seqs_per_shard, registry=args.registry,
        name=args.name, address=args.address, workers=args.workers, threads_per_worker=args.threads_per_worker,
        sinks=args.sinks, window=args.window, groups=args.groups, sample=args.sample, seed=args.seed,
        holdout_fraction=args.holdout_fraction, heldout_rows=args.heldout_rows,
        tokens_curve_points=args.tokens_curve_points, accumulators=args.accumulators, store=args.store, dtype=args.dtype,
        cache_dir=args.cache_dir, text_column=args.text_column,
        block_sizes=tuple(int(x) for x in args.block_sizes.split(",")), types=tuple(args.types.split(",")),
        error_model=args.error_model,
    )
    kw.update(overrides)
    return CalibrateConfig(**kw)


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


def _handler(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
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
