"""Scale benchmark: the whole calibration job at production KV geometry on this machine.

Each run is the full job (Ray pool, accumulators, reducer, publish) on a random model with a real
model's KV geometry and a tiny hidden size (`tiny:llama@LAYERSxKV_HEADSxHEAD_DIM`), in a fresh
shard store and registry under --root. Printed per run: statistics bytes in the store (and the
bound: accumulators x streams x packed float64 Gram of each group), peak RSS of the whole job
(this process plus every descendant, e.g. Ray's processes and workers with --ray, sampled every
0.2 s), and wall
time split into capture, fold (Gram accumulation), checkpoints and reduce (of which the
eigensolver). The baseline of a figure is named next to it (e.g. 4 vs 8 shards in one run).

    python bench/scale.py --runs 16x8x128:16384:8 16x8x128:16384:4 --ratios 16
    python bench/scale.py --runs 32x8x128:32768:8:layers:8 --ratios 8,16,32
    python bench/scale.py --runs 80x8x128:8192:4:layers:4 --ratios 16

A run is GEOMETRY:TOKENS:SEQS_PER_SHARD[:GROUPS] (GROUPS default model).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time

import psutil

GIB = 1 << 30


class TreeRSS:
    """Peak summed RSS of this process and all its descendants, sampled in a thread."""

    def __init__(self, interval: float = 0.2) -> None:
        self.interval, self.peak, self._stop = interval, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> int:
        me = psutil.Process()
        total = 0
        for proc in [me, *me.children(recursive=True)]:
            try:
                total += proc.memory_info().rss
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._sample())
            self._stop.wait(self.interval)

    def __enter__(self) -> "TreeRSS":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def one_run(spec: str, args: argparse.Namespace) -> dict:
    from kvtc.pipeline.job.calibrate import run
    from kvtc.pipeline.settings import JobSettings
    from kvtc.pipeline.job.memory_plan import packed_bytes
    from kvtc.workers.capture import CaptureSettings
    from kvtc.workers.tiny import Geometry

    parts = spec.split(":")
    geometry, tokens, seqs = Geometry.parse(parts[0]), int(parts[1]), int(parts[2])
    groups = ":".join(parts[3:]) or "model"
    if args.resume:  # one directory per run under --root, reused: a stopped run resumes (fold, then solved bases)
        root = os.path.join(args.root, spec.replace(":", "_"))
        os.makedirs(root, exist_ok=True)
    else:
        root = tempfile.mkdtemp(prefix="kvtc-scale-", dir=args.root)
    cfg = JobSettings.of(
        model=f"tiny:llama@{parts[0]}", corpus=args.corpus, eval_corpus=None, tokens=tokens, seq_len=args.seq_len,
        seqs_per_shard=seqs, window=args.window, ratios=tuple(float(r) for r in args.ratios.split(",")), groups=groups,
        accumulators=args.accumulators, workers=args.workers,
        threads_per_worker=args.threads_per_worker or (1 if args.ray else os.cpu_count() or 1),
        heldout_rows=args.heldout_rows, tokens_curve_points=args.tokens_curve_points,
        registry=os.path.join(root, "registry"), store=os.path.join(root, "store"), name="scale",
    )
    t0 = time.perf_counter()
    with TreeRSS() as rss:
        summary = run(cfg, in_process=not args.ray)
    wall = time.perf_counter() - t0
    width = geometry.kv_heads * geometry.head_dim
    dims = [len(g.layers) * width for g in CaptureSettings(groups=groups).group_layers(geometry.layers)]
    r = summary["run"]
    out = {
        "run": spec, "p": geometry.features, "groups": groups, "tokens": tokens, "train_shards": r["shards_run"],
        "stats_bytes": r["stats_bytes"], "bound_bytes": args.accumulators * 2 * sum(packed_bytes(p) for p in dims),
        "gram_bytes": 8 * max(dims) * (max(dims) + 1) // 2, "peak_rss": rss.peak, "wall_s": wall,
        "capture_s": r["capture_seconds"], "fold_s": r["fold_seconds"], "checkpoint_s": r["checkpoint_seconds"],
        "pool_s": r["pool_seconds"], "reduce_s": r["reduce_seconds"], "eig_s": r["eig_seconds"],
        "stages": r.get("stages", {}),
        "errors": {row["ratio"]: (row["keys"]["rel_error"], row["values"]["rel_error"]) for row in summary["ratios"]},
    }
    if not (args.keep or args.resume):
        shutil.rmtree(root, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", nargs="+", required=True, help="GEOMETRY:TOKENS:SEQS_PER_SHARD[:GROUPS] ...")
    ap.add_argument("--ratios", default="16")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--corpus", default="pydoc")
    ap.add_argument("--accumulators", type=int, default=2)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--heldout-rows", type=int, default=1024)
    ap.add_argument("--tokens-curve-points", type=int, default=0, help="error-by-tokens chart points (0: off; each refolds the accumulators)")
    ap.add_argument("--root", default=None, help="where the per-run stores and registries go (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the stores and registries")
    ap.add_argument("--resume", action="store_true", help="reuse ROOT/RUN (needs --root): a stopped run resumes where it stopped")
    ap.add_argument("--threads-per-worker", type=int, default=0, help="CPU threads per worker (default: 1 with --ray, "
                    "else every core)")
    ap.add_argument("--ray", action="store_true", help="run the shards on a local Ray pool (default: in this process, "
                    "the job's in-process mode: one worker, the same accumulators and reducer)")
    args = ap.parse_args(argv)
    if args.resume and not args.root:
        ap.error("--resume needs --root")
    rows = []
    for spec in args.runs:
        print(f"=== {spec}", file=sys.stderr, flush=True)
        rows.append(one_run(spec, args))
        r = rows[-1]
        print(f"{r['run']}: p={r['p']} groups={r['groups']} shards run={r['train_shards']} store={r['stats_bytes'] / 1e9:.3f} GB "
              f"(bound {r['bound_bytes'] / 1e9:.3f} GB, one packed Gram {r['gram_bytes'] / 1e9:.3f} GB) "
              f"peak RSS {r['peak_rss'] / GIB:.2f} GiB wall {r['wall_s']:.0f} s: capture {r['capture_s']:.0f} s, "
              f"fold {r['fold_s']:.0f} s, checkpoints {r['checkpoint_s']:.0f} s (worker sums; pool wall {r['pool_s']:.0f} s), "
              f"reduce {r['reduce_s']:.0f} s of which eigensolver {r['eig_s']:.0f} s; stages (s) {r['stages']}; "
              f"errors {r['errors']}", flush=True)
    print("\n| run | p | groups | store GB | bound GB | peak RSS GiB | wall s | capture s | fold s | checkpoint s | reduce s | eig s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['run']} | {r['p']} | {r['groups']} | {r['stats_bytes'] / 1e9:.3f} | {r['bound_bytes'] / 1e9:.3f} | "
              f"{r['peak_rss'] / GIB:.2f} | {r['wall_s']:.0f} | {r['capture_s']:.0f} | {r['fold_s']:.0f} | "
              f"{r['checkpoint_s']:.0f} | {r['reduce_s']:.0f} | {r['eig_s']:.0f} |")
    if len(rows) >= 2 and rows[0]["p"] == rows[1]["p"]:
        print(f"\nstore bytes {rows[1]['run']} / {rows[0]['run']}: {rows[1]['stats_bytes'] / rows[0]['stats_bytes']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
