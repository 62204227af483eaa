"""Worker processes a local Ray starts for the calibration pool, and the pool's start-up time.

Two ways to hand the KVTC_* settings to the worker actors, each in a fresh local Ray:
  actor-env   (baseline, the former way) a runtime environment on the actors: Ray cannot use the
              workers it started with the driver, starts new ones and shuts the unused ones down
              as idle (the shutdown that at times crashed and printed a stack dump);
  inherited   (current) the local Ray inherits the driver's environment, the actors need none.
Prints, per mode, the mean pool start-up (actors created and ready), worker processes started
and workers shut down as idle, and the ratio of start-ups against the baseline.

    python bench/ray_startup.py [--repeats 3] [--workers 2]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Idle:
    def ready(self) -> bool:
        return True

    def process(self, payload: dict) -> dict:
        return {"tokens_run": 0}


def one_run(mode: str, workers: int) -> dict:
    import ray

    from kvtc.pipeline.job import ray_pool

    os.environ["KVTC_BENCH_SETTING"] = "1"
    started = ray_pool.start_ray(None, num_cpus=workers)
    try:
        session = Path(ray._private.worker.global_worker.node.get_session_dir_path())
        # env_inherited=False: run_pool gives the actors a runtime environment carrying KVTC_BENCH_SETTING
        settings = ray_pool.PoolSettings(workers=workers, env_inherited=started and mode == "inherited")
        t0 = time.perf_counter()
        pool = ray_pool.run_pool(Idle, {}, [{"n": i} for i in range(2 * workers)], settings)
        total = time.perf_counter() - t0
        time.sleep(3)  # let the raylet shut idle workers down
        logs = list((session / "logs").glob("python-core-worker-*.log"))
        idle = sum("idle for a long time" in p.read_text(errors="replace") for p in logs)
        return {"startup_s": pool.startup_s, "total_s": total, "workers_started": len(logs), "idle_shutdowns": idle}
    finally:
        if started:
            ray.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--one", choices=("actor-env", "inherited"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one_run(args.one, args.workers)))
        return 0
    results: dict[str, list[dict]] = {}
    for _ in range(args.repeats):
        for mode in ("actor-env", "inherited"):
            out = subprocess.run([sys.executable, __file__, "--one", mode, "--workers", str(args.workers)],
                                 capture_output=True, text=True, check=True)
            results.setdefault(mode, []).append(json.loads(out.stdout.strip().splitlines()[-1]))
    base = sum(r["startup_s"] for r in results["actor-env"]) / args.repeats
    print("| mode | pool start-up (s) | vs actor-env | worker processes | idle shutdowns |\n|---|---|---|---|---|")
    for mode, rows in results.items():
        mean = sum(r["startup_s"] for r in rows) / len(rows)
        print(f"| {mode} | {mean:.2f} | {mean / base:.2f}x | {sum(r['workers_started'] for r in rows) / len(rows):.1f} "
              f"| {sum(r['idle_shutdowns'] for r in rows) / len(rows):.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
