"""Decode's peak memory over its output size (issue 49): an ECSQ blob of a small synthetic artifact
(2 layers x 4 KV heads x 16 dims, keys RoPE-removed; float32 output, 1 KiB per token) decoded on the CPU
at 1K to 131K tokens, each in a fresh process: the growth of its peak RSS (VmHWM, reset just before) during decode, over
the bytes of the keys and values decode returns. Also checks the decoded tensors against a digest of
the first run's (--digests FILE: written if absent, compared if present), so a change to decode can be
shown bit-identical.

    .venv/bin/python -P bench/decode_memory.py [--tokens 1024,8192,32768,131072] [--digests FILE] [--json]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the fixtures: tests/helpers

SHAPE = (2, 4, 16)  # layers, kv heads, head dim


def _codec():
    from kvtc.kernels import KVTCCodec
    from helpers.ecsq_synthetic import synthetic_ecsq_spec

    return KVTCCodec(synthetic_ecsq_spec(*SHAPE, 8.0, sinks=4, window=0), backend="torch", max_tokens=1 << 20)


def _blob(tokens: int, path: Path) -> None:
    import torch
    from helpers.synthetic import synthetic_cache

    codec = _codec()
    keys, values = synthetic_cache(codec.spec, tokens, torch.float32, start=0)
    path.write_bytes(codec.encode(keys, values, start=0))


def _status_kib(field: str) -> int:
    """VmRSS (resident now) or VmHWM (its peak since the last reset) of this process, KiB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _reset_peak() -> None:
    """Reset VmHWM to the resident size now (Linux >= 4.0: clear_refs 5), so the peak is decode's alone."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def child(path: str) -> None:
    import torch

    codec = _codec()
    blob = Path(path).read_bytes()
    small = _tiny_blob(codec)
    codec.decode(small)  # imports and first-use costs outside the measure
    _reset_peak()
    before = _status_kib("VmRSS")
    keys, values = codec.decode(blob)
    peak = _status_kib("VmHWM")
    out = keys.numel() * keys.element_size() + values.numel() * values.element_size()
    digest = hashlib.sha256(keys.numpy().tobytes() + values.numpy().tobytes()).hexdigest()[:16]
    print(json.dumps({"grown": (peak - before) * 1024, "output": out, "digest": digest,
                      "blob": len(blob), "tokens": int(keys.shape[2])}))
    del torch


def _tiny_blob(codec) -> bytes:
    import torch
    from helpers.synthetic import synthetic_cache

    keys, values = synthetic_cache(codec.spec, 64, torch.float32, start=0)
    return codec.encode(keys, values, start=0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1024,8192,32768,131072")
    ap.add_argument("--digests", type=Path, default=None)
    ap.add_argument("--json", action="store_true", help="print the rows as one JSON list instead of a table")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child)
    known = json.loads(args.digests.read_text()) if args.digests and args.digests.exists() else {}
    rows, seen = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in (int(x) for x in args.tokens.split(",")):
            path = Path(tmp) / f"{n}.blob"
            _blob(n, path)
            run = subprocess.run([sys.executable, "-P", __file__, "--child", str(path)], capture_output=True,
                                 text=True, env={**os.environ}, check=True)
            r = json.loads(run.stdout.strip().splitlines()[-1])
            seen[str(n)] = r["digest"]
            same = "" if str(n) not in known else ("identical" if known[str(n)] == r["digest"] else "DIFFERS")
            rows.append((n, r["blob"], r["output"], r["grown"], same))
    if args.json:
        print(json.dumps([dict(zip(("tokens", "blob", "output", "grown", "digests"), row)) for row in rows]))
        return
    if args.digests and not known:
        args.digests.write_text(json.dumps(seen))
    print(f"{'tokens':>8} {'blob MB':>8} {'output MB':>10} {'peak grown MB':>14} {'peak/output':>12} {'vs digests':>10}")
    for n, blob, out, grown, same in rows:
        print(f"{n:>8} {blob / 1e6:>8.2f} {out / 1e6:>10.1f} {grown / 1e6:>14.1f} {grown / out:>12.2f} {same:>10}")


if __name__ == "__main__":
    main()
