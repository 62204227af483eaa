"""The main job through Ray with 1 and 2 workers, side by side: stage seconds, wall over model work,
and whether the two artifacts are bit-identical (bases, allocations, ECSQ tables).

    python bench/reduce_workers.py                      # the default job (80K tokens of the embedded model)
    python bench/reduce_workers.py --args "--tokens 16384 --ratios 8,16"

Each run is `kvtc calibrate --json` in a fresh shard store and registry (so the second run folds its
own shards), in a subprocess, as a user runs it.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BIN = Path(sys.executable).parent


def one(workers: int, extra: list[str], root: Path) -> dict:
    cmd = [str(BIN / "kvtc"), "calibrate", "--workers", str(workers), "--registry", str(root / "reg"),
           "--store", str(root / "store"), "--name", "bench", "--json", *extra]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"kvtc calibrate --workers {workers} failed:\n{out.stderr[-3000:]}")
    summary = json.loads(out.stdout)
    summary["outer_wall_s"] = time.perf_counter() - t0
    return summary


def artifact_digest(summary: dict) -> str:
    """sha256 over the version's Parquet files (bases, allocations, ECSQ tables, metrics, curves), in name order."""
    from kvtc import artifacts

    folder = Path(artifacts.pull(summary["name"], summary["version"], registry=summary["registry"]).path)
    h = hashlib.sha256()
    for path in sorted(folder.rglob("*.parquet")):
        h.update(str(path.relative_to(folder)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--args", default="", help="extra `kvtc calibrate` options")
    ap.add_argument("--workers", default="1,2")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvtc-reduce-workers-") as tmp:
        for w in (int(x) for x in args.workers.split(",")):
            root = Path(tmp) / f"w{w}"
            s = one(w, shlex.split(args.args), root)
            run = s["run"]
            rows.append((w, run, artifact_digest(s)))
            print(f"workers {w}: wall {run['wall_seconds']} s, model work {run['pool_seconds']} s, "
                  f"wall/model {run['wall_over_model_work']}, stages {run['stages']}", flush=True)
    print("\n| workers | wall s | model work s | wall / model work | reduce s (wall) | solve s | fit s | measure s | publish s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for w, r, _ in rows:
        st = r["stages"]
        print(f"| {w} | {r['wall_seconds']:.0f} | {r['pool_seconds']:.0f} | {r['wall_over_model_work']} | {st['reduce']:.0f} | "
              f"{st['solve']:.0f} | {st['fit']:.0f} | {st['measure']:.0f} | {st['publish']:.0f} |")
    if len(rows) >= 2:
        r1, r2 = rows[0][1]["stages"]["reduce"], rows[1][1]["stages"]["reduce"]
        print(f"\nreduce wall, {rows[0][0]} vs {rows[1][0]} workers: {r1:.0f} / {r2:.0f} s = {r1 / max(r2, 1e-9):.2f}x")
        print(f"artifacts bit-identical (every Parquet file: bases, allocations, ECSQ tables, metrics, curves): {rows[0][2] == rows[1][2]}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    sys.exit(main())
