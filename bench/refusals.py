"""Every input the sixth hostile round found refused late, run as a user runs it: each case a fresh `kvtc` process,
timed from the interpreter's start, with its peak memory over the bare interpreter's and the heavy modules loaded
when it refused (none of torch, transformers, Ray may be).

    .venv/bin/python bench/refusals.py [--json]

Prints one row per case: exit code, seconds, MB over the interpreter, heavy modules loaded, the one line it printed.
A registry with one artifact (`--registry`, default: a synthetic one made here) serves the `kvtc eval` cases.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HEAVY = ("torch", "transformers", "ray", "lmcache")
PROBE = r"""
import contextlib, io, json, sys, time
def hwm():  # this process's peak resident KB (ru_maxrss would carry a forking parent's peak across exec)
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:"))
t0 = time.perf_counter()
base = hwm()
from kvtc.pipeline.cli import main
err = io.StringIO()
with contextlib.redirect_stderr(err):
    try:
        rc = main(json.loads(sys.argv[1]))
    except SystemExit as exc:
        rc = exc.code
peak = hwm()
print(json.dumps({"rc": rc, "seconds": time.perf_counter() - t0, "mb": (peak - base) / 1024,
                  "heavy": [m for m in %r if m in sys.modules], "stderr": err.getvalue()}))
""" % (HEAVY,)


def probe(argv: list[str], env: dict[str, str] | None = None, timeout: float = 60.0) -> dict:
    """Run `kvtc ARGV` in a fresh interpreter; -> rc, seconds, mb (peak over the interpreter's), heavy, stderr."""
    full = {**os.environ, **(env or {})}
    done = subprocess.run([sys.executable, "-P", "-c", PROBE, json.dumps(argv)], capture_output=True, text=True,
                          env=full, timeout=timeout)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return {"rc": done.returncode, "seconds": float("nan"), "mb": float("nan"), "heavy": [], "stderr": done.stderr}
    return json.loads(lines[-1])


def cases(tmp: Path, registry: str) -> list[tuple[str, list[str], dict[str, str]]]:
    fifo = tmp / "key.fifo"
    os.mkfifo(fifo)
    record_dir = tmp / "record"
    record_dir.mkdir()
    empty = tmp / "empty.key"
    empty.write_bytes(b"")
    os.chmod(empty, 0o600)
    os.utime(empty, (0, 0))
    adapter = lambda key: ["lmcache-server", "--l2-adapter", json.dumps(  # noqa: E731
        {"type": "fs", "base_path": str(tmp / "chunks"), "serde": {"type": "kvtc", "artifact": "toy", "ratio": 8,
                                                                    "key_file": key}})]
    return [
        ("1 FIFO chunk key (key_file)", adapter(str(fifo)), {}),
        ("1 FIFO chunk key ($KVTC_CHUNK_KEY_FILE)", adapter(str(fifo))[:2] + [json.dumps(
            {"type": "fs", "base_path": str(tmp / "chunks"), "serde": {"type": "kvtc", "artifact": "toy", "ratio": 8}})],
         {"KVTC_CHUNK_KEY_FILE": str(fifo)}),
        ("2 RAY_task_oom_retries=1_0", ["calibrate", "--model", "tiny:llama"], {"RAY_task_oom_retries": "1_0"}),
        ("2 RAY_task_oom_retries=<arabic 5>", ["calibrate", "--model", "tiny:llama"],
         {"RAY_task_oom_retries": "\u0665"}),
        ("2 RAY_memory_usage_threshold='0.95 '", ["calibrate", "--model", "tiny:llama"],
         {"RAY_memory_usage_threshold": "0.95 "}),
        ("4 eval --prefix 10", ["eval", "toy", "--registry", registry, "--model", "smollm2-135m", "--prefix", "10"], {}),
        ("6 --store memory://x", ["calibrate", "--store", "memory://x"], {}),
        ("6 --store nosuchproto://x", ["calibrate", "--store", "nosuchproto://x"], {}),
        ("7 --store s3:// unreachable", ["calibrate", "--store", "s3://bucket/x"],
         {"AWS_ENDPOINT_URL": "http://127.0.0.1:9"}),
        ("8 eval --prefix 10^12", ["eval", "toy", "--registry", registry, "--model", "smollm2-135m", "--prefix",
                                   str(10**12)], {}),
        ("minor: empty chunk key", adapter(str(empty)), {}),
        ("minor: KVTC_REQUIRE_SIGNATURE=' 0'", ["list", "--registry", registry], {"KVTC_REQUIRE_SIGNATURE": " 0"}),
        ("minor: KVTC_REQUIRE_KERNELS=' 0'", ["list", "--registry", registry], {"KVTC_REQUIRE_KERNELS": " 0"}),
        ("minor: --workers of 5000 digits", ["calibrate", "--workers", "9" * 5000], {}),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--registry", default=None, help="a registry holding an artifact named toy (default: made here)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        registry = args.registry
        if registry is None:
            sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
            from helpers.toy_artifacts import toy_content  # noqa: PLC0415 - the tests' synthetic artifact

            from kvtc.artifacts import publish  # noqa: PLC0415

            registry = str(Path(tmp) / "registry")
            publish(toy_content(), registry)
        for name, argv, env in cases(Path(tmp), registry):
            got = probe(argv, {"KVTC_CACHE": str(Path(tmp) / "cache"), **env})
            rows.append({"case": name, **got, "stderr": " ".join(got["stderr"].split())})
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print("| case | exit | seconds | MB over the interpreter | heavy modules loaded | what it printed |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        said = r["stderr"] if len(r["stderr"]) <= 160 else r["stderr"][:157] + "..."
        print(f"| {r['case']} | {r['rc']} | {r['seconds']:.2f} | {r['mb']:.0f} | {', '.join(r['heavy']) or 'none'} | "
              f"{said} |")
    bad = [r["case"] for r in rows if r["rc"] != 2 or r["heavy"] or not r["seconds"] < 2 or not r["mb"] < 64]
    print(f"\n{len(rows) - len(bad)} of {len(rows)} cases refused with exit 2 in under 2 s and 64 MB, before any heavy "
          f"module loaded{'; not: ' + ', '.join(bad) if bad else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
