"""Hostile inputs, counted: bad command lines, tampered registries (local and S3 on a moto server on
loopback) and fuzzed codec blobs. Each case must end in a clear error or a correct result, with nothing
written outside a root; prints how each family ended, and the cost of the verified pull against
hashing the same files (the baseline, measured in the same run).

    .venv/bin/python bench/hostile.py [--blobs 20000]
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import hashlib
import io
import json
import os
import random
import socket
import struct
import sys
import tempfile
import time
import uuid
import warnings
import zlib
from pathlib import Path

import torch

from kvtc.artifacts import ArtifactNotFoundError, IntegrityError, Registry, publish, pull
from kvtc.artifacts.testing import forge_version, toy_content
from kvtc.kernels import BlobError, KVTCCodec, read_blob
from kvtc.kernels.blob import write_blob
from kvtc.kernels.synthetic import synthetic_cache, synthetic_spec
from kvtc.pipeline import cli


def cli_cases(reg: str, tmp: Path) -> collections.Counter:
    (tmp / "afile").write_text("x")
    afile = str(tmp / "afile")
    argvs = [
        ["show", "toy\n"], ["show", "../toy"], ["show", "toy@../../x"], ["alias", "toy", "prod\n"], ["alias", "toy", "a/b"],
        ["calibrate", "--name", "bad/name"], ["calibrate", "--name", "x\n"], ["calibrate", "--registry", ""],
        ["calibrate", "--workers", "0"], ["calibrate", "--threads-per-worker", "0"], ["calibrate", "--tokens", "0"],
        ["calibrate", "--ratios", "1e9"], ["calibrate", "--ratios", "16,16"], ["calibrate", "--ratios", "8,nan"],
        ["calibrate", "--ratios", "1"], ["calibrate", "--ratios", "x"], ["calibrate", "--sample", "0"],
        ["calibrate", "--holdout-fraction", "1"], ["calibrate", "--address", "127.0.0.1:1"],
        ["calibrate", "--address", "nohostport"], ["calibrate", "--seq-len", "0"], ["calibrate", "--sinks", "-1"],
        ["drift", "toy", "--tokens", "0"], ["drift", "toy", "--threshold", "nan"], ["drift", "toy", "--threshold", "-1"],
        ["recalibrate", "toy", "--if-drift", "inf"], ["recalibrate", "toy", "--alias", "a\n"],
        ["schedule", "--every", "inf", "--", "list"], ["schedule", "--every", "0", "--", "list"],
        ["pull", "toy", "--to", afile], ["report", "toy", "--out", afile], ["export", "toy", "--ratio", "4", "--to", afile],
        ["list", "--registry", "ftp://127.0.0.1:1"], ["show", "nope"], ["show", "toy@nope"],
        ["show", "toy@sha256:" + "0" * 64], ["verify", "toy", "--require-signature"], ["verify", "toy", "--key", afile],
        ["eval", "toy", "--ratios", "0.5"], ["eval", "toy", "--sequences", "0"],
    ]
    out = collections.Counter()
    for argv in argvs:
        if "--registry" not in argv:
            argv = [*argv, "--registry", reg]
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            rc = cli.main(argv)
        text = err.getvalue()
        clean = "Traceback" not in text and len(text.strip().splitlines()) == 1
        out[f"exit {rc}, one line" if clean else f"exit {rc}, NOT one line"] += 1
    return out


def tamper_cases(reg: Registry, tmp: Path) -> collections.Counter:
    def alias(target):
        return lambda r, v: r.fs.pipe_file(r.path("toy", "aliases", "latest"), json.dumps({"version": target}).encode())

    def edit(old: bytes, new: bytes):
        def run(r, v):
            path = f"{r.version_path('toy', v)}/manifest.json"
            r.fs.pipe_file(path, r.fs.cat_file(path).replace(old, new))
        return run

    def flip(rel: str):
        def run(r, v):
            path = f"{r.version_path('toy', v)}/{rel}"
            data = bytearray(r.fs.cat_file(path))
            data[len(data) // 2] ^= 1
            r.fs.pipe_file(path, bytes(data))
        return run

    cases = {
        "alias ../../../../evil": alias("../../../../evil"), "alias /etc": alias("/etc"), "alias v\\n": alias("v\n"),
        "alias ../versions/V": lambda r, v: alias(f"../versions/{v}")(r, v),
        "manifest window 128->64": edit(b'"window": 128', b'"window": 64'),
        "manifest schema_version string": edit(b'"schema_version": 1', b'"schema_version": "1"'),
        "manifest files as list": lambda r, v: r.fs.pipe_file(f"{r.version_path('toy', v)}/manifest.json", b'{"files": []}'),
        "forged manifest, name ../../escape": lambda r, v: forge_version(r, "toy", v, lambda m: m.update(name="../../escape")),
        "forged manifest, window 64 (latest pins digest)": lambda r, v: forge_version(r, "toy", v, lambda m: m["calibration"].update(window=64)),
        "forged listing ../../../outside": lambda r, v: forge_version(r, "toy", v, lambda m: None, {"../../../outside.txt": b"x"}),
        "forged kernels/codec.py with hash": lambda r, v: forge_version(r, "toy", v, lambda m: None, {"kernels/codec.py": b"import os\n"}),
        "replaced parquet + updated hash": lambda r, v: forge_version(r, "toy", v, lambda m: None, {"metrics.parquet": b"PAR1"}),
        "flipped basis byte": flip("bases/keys-g0.components.parquet"),
        "flipped kernel byte": flip("kernels/codec.py"),
        "flipped chart byte (optional file)": flip("charts/allocation.png"),
        "digest file removed": lambda r, v: r.fs.rm_file(f"{r.version_path('toy', v)}/manifest.sha256"),
    }
    out = collections.Counter()
    for label, attack in cases.items():
        name = f"c{uuid.uuid4().hex[:6]}"
        sub = Registry(f"{reg.uri}/{name}")
        if sub.local:
            os.makedirs(sub.root, exist_ok=True)
        ref = publish(toy_content(), sub)
        attack(sub, ref.version)
        before = {p for p in tmp.rglob("*")}
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                art = pull("toy", registry=sub, cache_dir=tmp / "cache")
                art.basis("keys", 0)
            ended = "correct result with a warning" if caught else "correct result"
        except (IntegrityError, ArtifactNotFoundError, ValueError) as exc:
            ended = f"refused ({type(exc).__name__})"
        outside = [p for p in {p for p in tmp.rglob("*")} - before
                   if not str(p).startswith(str(tmp / "cache")) and not str(p).startswith(str(tmp / "registry"))]
        out[ended + (", WROTE OUTSIDE" if outside else "")] += 1
        print(f"  {reg.uri.split(':')[0] if not reg.local else 'local'}: {label}: {ended}", file=sys.stderr)
    return out


def blob_cases(n: int) -> collections.Counter:
    spec = synthetic_spec(2, 1, 8, 4.0, sinks=2, window=3, kept=12, seed=8)
    codec = KVTCCodec(spec, backend="torch")
    keys, values = synthetic_cache(spec, 12, torch.float16, start=1, seed=9)
    blob = codec.encode(keys, values, start=1)
    header, sections = read_blob(blob)
    meta_len = struct.unpack_from("<I", blob, 8)[0]
    rng = random.Random(0)
    out = collections.Counter()
    for i in range(n):
        kind = i % 4
        if kind == 0:
            data = bytes(blob[: rng.randrange(len(blob))])
        elif kind == 1:
            b = bytearray(blob)
            for _ in range(rng.choice([1, 2, 8])):
                b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
            data = bytes(b)
        elif kind == 2:  # metadata bytes changed, CRC recomputed
            m = bytearray(blob[16:16 + meta_len])
            for _ in range(rng.choice([1, 2, 4])):
                m[rng.randrange(len(m))] = rng.randrange(256)
            data = struct.pack("<4sHHII", b"KVTC", 1, 0, len(m), zlib.crc32(m)) + bytes(m) + blob[16 + meta_len:]
        else:  # valid CRCs, hostile fields
            field = rng.choice(["tokens", "start", "head_raw", "tail_raw", "layers", "sinks", "window", "head_dim"])
            h = dataclasses.replace(header, **{field: rng.choice([0, 1, 13, 200_000, 2**31, 2**63 - 1])})
            try:
                data = write_blob(h, sections)
            except (struct.error, ValueError):
                out["unwritable header (skipped)"] += 1
                continue
        try:
            k, _ = codec.decode(data)
            out["decoded, right shape" if k.shape[:2] == keys.shape[:2] else "decoded, WRONG SHAPE"] += 1
        except BlobError:
            out["BlobError"] += 1
        except Exception as exc:  # would be a bug
            out[f"CRASH {type(exc).__name__}"] += 1
    return out


def verify_cost(tmp: Path) -> tuple[float, float]:
    """Seconds for a verified pull of a local version vs sha256 of its files alone (median of 5)."""
    reg = Registry(str(tmp / "cost"))
    ref = publish(toy_content(num_layers=8, num_kv_heads=4, head_dim=64), reg)
    folder = Path(ref.path)
    files = [p for p in folder.rglob("*") if p.is_file()]
    base, full = [], []
    for _ in range(5):
        t = time.perf_counter()
        for p in files:
            hashlib.sha256(p.read_bytes()).hexdigest()
        base.append(time.perf_counter() - t)
        t = time.perf_counter()
        pull("toy", registry=reg)
        full.append(time.perf_counter() - t)
    return sorted(full)[2], sorted(base)[2]


@contextlib.contextmanager
def moto_s3():
    from moto.server import ThreadedMotoServer

    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    os.environ["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{port}"
    try:
        yield
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blobs", type=int, default=20000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        tmp = Path(scratch)
        os.environ["KVTC_CACHE"] = str(tmp / "cache")
        reg = tmp / "registry"
        publish(toy_content(), reg)
        results = {"command lines": cli_cases(str(reg), tmp), "tampered local registry": tamper_cases(Registry(str(reg)), tmp)}
        with moto_s3():
            s3 = Registry(f"s3://kvtc-bench-{uuid.uuid4().hex[:8]}/reg")
            s3.fs.mkdir(s3.root.split("/")[0])
            results["tampered S3 registry (moto)"] = tamper_cases(s3, tmp)
        results["fuzzed blobs"] = blob_cases(args.blobs)
        full, base = verify_cost(tmp)
    print("| family | cases | how they ended |\n|---|---|---|")
    for family, counts in results.items():
        print(f"| {family} | {sum(counts.values())} | {', '.join(f'{v} {k}' for k, v in sorted(counts.items()))} |")
    print(f"\nverified pull (digest, binding, listing, bundle, every file's sha256): {1000 * full:.1f} ms; "
          f"sha256 of the same files alone (baseline): {1000 * base:.1f} ms; ratio {full / base:.2f}x")


if __name__ == "__main__":
    main()
