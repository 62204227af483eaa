"""Hostile resource arguments to `kvtc calibrate`: how fast each is refused, the process's peak memory, and
whether torch or Ray was loaded (goal: under 2 s, under 200 MB, no Ray started).

    python bench/resource_refusals.py

Each case runs in a fresh process (`kvtc.pipeline.cli.main`), timed from the process's start.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

CASES = [
    ["--workers", "1000000"],
    ["--threads-per-worker", "1000000"],
    ["--gpus-per-worker", "8"],
    ["--accumulators", "1000000"],
    ["--seqs-per-shard", "100000000"],
    ["--tokens", "1000000000000000"],
    ["--seq-len", "100000"],
    ["--workers", str((os.cpu_count() or 1) + 1)],
]
PROBE = """
import json, sys
from kvtc.pipeline import cli
rc = cli.main(["calibrate", *json.loads(sys.argv[1])])
print(json.dumps({"rc": rc, "loaded": sorted(m for m in ("torch", "ray", "transformers") if m in sys.modules)}))
"""


def run_case(argv: list[str], root: str) -> dict:
    args = [*argv, "--registry", os.path.join(root, "reg"), "--store", os.path.join(root, "store")]
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-P", "-c", PROBE, json.dumps(args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "KVTC_CACHE": os.path.join(root, "c")})
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - t0
    out, err = proc.stdout.read(), proc.stderr.read()
    got = json.loads(out.strip().splitlines()[-1])
    return {"argv": " ".join(argv), "rc": got["rc"], "seconds": seconds, "peak_mb": usage.ru_maxrss / 1024,
            "loaded": ",".join(got["loaded"]) or "-", "message": err.strip().splitlines()[-1][:110]}


def main() -> None:
    print(f"load average {os.getloadavg()[0]:.2f}, {os.cpu_count()} CPUs")
    print(f"{'argument':<36} {'exit':>4} {'seconds':>8} {'peak MB':>8} {'loaded':>7}  message")
    with tempfile.TemporaryDirectory() as root:
        rows = [run_case(argv, root) for argv in CASES]
    for r in rows:
        print(f"{r['argv']:<36} {r['rc']:>4} {r['seconds']:>8.2f} {r['peak_mb']:>8.0f} {r['loaded']:>7}  {r['message']}")
    worst_s, worst_mb = max(r["seconds"] for r in rows), max(r["peak_mb"] for r in rows)
    clean = all(r["rc"] == 2 and r["loaded"] == "-" for r in rows)
    print(f"worst {worst_s:.2f} s, {worst_mb:.0f} MB; all refused with exit 2, no torch or Ray: {clean}")


if __name__ == "__main__":
    main()
