"""Hostile inputs, counted: bad command lines, tampered registries (local and S3 on a moto server on
loopback), fuzzed codec blobs in both modes, and issue 21's families: ECSQ inflation bombs and cut
ANS streams, version-id pins, files swapped after verification, special files (FIFO, directory,
/dev/zero), oversized objects, stale `published/` markers, writes through planted symlinks and
crafted statistics objects. Each case must end in a clear error or a correct result, with nothing
written outside a root; prints how each family ended, and the cost of the verified pull against
hashing the same files (the baseline, measured in the same run).

    .venv/bin/python bench/hostile.py [--blobs 20000] [--race-seconds 10]
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import functools
import hashlib
import io
import json
import os
import random
import shutil
import signal
import socket
import struct
import sys
import tempfile
import threading
import time
import uuid
import warnings
import zlib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the fixtures: tests/helpers

from kvtc.artifacts import ArtifactNotFoundError, IntegrityError, Registry, publish, pull
from kvtc.artifacts.manifest import build_files
from kvtc.kernels import BlobError, KVTCCodec, read_blob
from kvtc.kernels.blob import TAG_ECSQ, TAG_ESCAPES, Section, write_blob
from kvtc.kernels.ecsq import decode_group, encode_symbols
from kvtc.kernels.entropy import PLAIN, ZLIB
from kvtc.pipeline import cli

from helpers.ecsq_synthetic import synthetic_ecsq_spec  # noqa: E402
from helpers.synthetic import synthetic_cache, synthetic_spec  # noqa: E402
from helpers.toy_artifacts import forge_version, toy_content  # noqa: E402


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


def blob_cases(n: int, mode: str = "fixed") -> collections.Counter:
    spec = synthetic_ecsq_spec(2, 1, 8, 4.0) if mode == "ecsq" else \
        synthetic_spec(2, 1, 8, 4.0, sinks=2, window=3, kept=12, seed=8)
    codec = KVTCCodec(spec, backend="torch", mode=mode)
    keys, values = synthetic_cache(spec, 12, torch.float16, start=1, seed=9)
    blob = codec.encode(keys, values, start=1)
    header, sections = read_blob(blob)
    coded = [s for s in sections if s.key.tag in (TAG_ECSQ, TAG_ESCAPES) and s.stored] or \
        [s for s in sections if s.key.tag > 2]
    meta_len = struct.unpack_from("<I", blob, 8)[0]
    flags = struct.unpack_from("<H", blob, 6)[0]
    rng = random.Random(0 if mode == "fixed" else 21)
    out = collections.Counter()
    kinds = 4 if mode == "fixed" else 7
    for i in range(n):
        kind = i % kinds
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
            data = struct.pack("<4sHHII", b"KVTC", 1, flags, len(m), zlib.crc32(m)) + bytes(m) + blob[16 + meta_len:]
        elif kind == 3:  # valid CRCs, hostile fields
            field = rng.choice(["tokens", "start", "head_raw", "tail_raw", "layers", "sinks", "window", "head_dim"])
            h = dataclasses.replace(header, **{field: rng.choice([0, 1, 13, 200_000, 2**31, 2**63 - 1])})
            try:
                data = write_blob(h, sections)
            except (struct.error, ValueError):
                out["unwritable header (skipped)"] += 1
                continue
        else:  # ECSQ only: the coded sections themselves, checksums recomputed
            s = rng.choice(coded)
            body = bytearray(s.stored)
            if kind == 4 and body:  # flipped bits in the stream
                for _ in range(rng.choice([1, 2, 8])):
                    body[rng.randrange(len(body))] ^= 1 << rng.randrange(8)
                new = Section(s.key, s.coding, s.raw_len, bytes(body))
            elif kind == 5:  # the stream cut or extended by whole words (its length says where it ends)
                cut = rng.choice([-8, -4, 4, 8, 12])
                body = body[:cut] if cut < 0 else body[:4] + body[4 + cut:] if rng.random() < 0.5 else body + bytes(cut)
                new = Section(s.key, PLAIN, len(body), bytes(body))
            else:  # a hostile declared raw length, or a DEFLATE bomb for the section
                if rng.random() < 0.5:
                    size = rng.choice([1 << 20, 1 << 26])
                    new = Section(s.key, ZLIB, size, _bomb(size))
                else:
                    new = Section(s.key, s.coding, rng.choice([0, max(0, s.raw_len - 4), s.raw_len + 4, 1 << 40]), s.stored)
            data = write_blob(header, [new if x is s else x for x in sections])
        try:
            k, v = codec.decode(data)
        except BlobError:
            out["BlobError"] += 1
            continue
        except Exception as exc:  # would be a bug
            out[f"CRASH {type(exc).__name__}"] += 1
            continue
        if k.shape[:2] != keys.shape[:2]:
            out["decoded, WRONG SHAPE"] += 1
        elif mode == "ecsq" and not _self_consistent(codec, data):
            out["decoded, NOT self-consistent"] += 1
        else:
            out["self-consistent decode"] += 1
    return out


@functools.lru_cache(maxsize=None)
def _bomb(size: int) -> bytes:
    return zlib.compress(bytes(size), 9)


def _self_consistent(codec: KVTCCodec, data: bytes) -> bool:
    """Every ECSQ stream of a decoded blob is exactly the encoding of the symbols it decodes to."""
    header, sections = read_blob(data)
    table = {s.key: bytes(s.stored) for s in sections}
    _, mid, _ = codec.split(header.tokens, header.start)
    for si, stream in enumerate(("keys", "values")):
        for gi, g in enumerate(codec.spec.ecsq[stream] if mid else ()):
            words, escapes = table[(TAG_ECSQ, si, gi, 0)], table[(TAG_ESCAPES, si, gi, 0)]
            q, _ = decode_group(words, escapes, mid, g)
            if encode_symbols(q, g) != (words[4:], escapes):
                return False
    return True


@contextlib.contextmanager
def _deadline(seconds: int = 20):
    def expired(*_):
        raise TimeoutError("HUNG")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _cli(*argv: str) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()), _deadline():
        try:
            rc = cli.main(list(argv))
        except TimeoutError:
            return -1, "HUNG"
    return rc, err.getvalue()


def _ended(rc: int, err: str) -> str:
    lines = err.strip().splitlines()
    return f"exit {rc}" + (", one line" if len(lines) <= 1 and "Traceback" not in err else ", NOT one line")


def registry_round_two(tmp: Path) -> dict[str, collections.Counter]:
    """Issue 21's registry families on a local disk; each case in a fresh registry."""
    from kvtc.artifacts.signing import generate_keypair

    private, public = generate_keypair(tmp / "signer")
    out: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)

    def fresh() -> tuple[Registry, object]:
        reg = Registry(str(tmp / f"r{uuid.uuid4().hex[:8]}"))
        return reg, publish(toy_content(), reg, signing_key=private)

    # version ids are pins
    reg, old = fresh()
    new = publish(toy_content(seed=2), reg, signing_key=private)
    rc, err = _cli("alias", f"toy@{old.version}", new.version, "--registry", reg.uri)
    out["version-id pins"][f"alias named as a version id: {_ended(rc, err)}"] += 1
    reg.fs.pipe_file(reg.path("toy", "aliases", new.version), json.dumps({"version": old.version}).encode())
    got = pull(f"toy@{new.version}", registry=reg, public_key=public, require_signature=True).version
    out["version-id pins"]["planted alias file, --require-signature pull: "
                           + ("the pinned version" if got == new.version else "ROLLED BACK")] += 1
    try:
        publish(toy_content(seed=3), reg, version="latest")
        out["version-id pins"]["version id 'latest': ACCEPTED"] += 1
    except ValueError:
        out["version-id pins"]["version id 'latest': refused"] += 1

    # special files: FIFO, directory, symlink to /dev/zero, symlink outside
    for where, make in (("alias", "fifo"), ("manifest.json", "fifo"), ("manifest.sig", "fifo"),
                        ("manifest.sha256", "fifo"), ("manifest.sig", "dir"), ("alias", "zero"),
                        ("manifest.json", "zero"), ("manifest.sha256", "zero"), ("alias", "outside")):
        reg, ref = fresh()
        folder = os.path.join(reg.root, "toy", "versions", ref.version)
        path = os.path.join(reg.root, "toy", "aliases", "x") if where == "alias" else os.path.join(folder, where)
        if os.path.lexists(path):
            os.unlink(path)
        if make == "fifo":
            os.mkfifo(path)
        elif make == "dir":
            os.mkdir(path)
        else:
            target = "/dev/zero" if make == "zero" else str(tmp / "outside.json")
            (tmp / "outside.json").write_text(json.dumps({"version": ref.version}))
            os.symlink(target, path)
        rc_list, err_list = _cli("list", "--registry", reg.uri)
        rc, err = _cli("verify", "toy@" + ("x" if where == "alias" else ref.version), "--key", str(public),
                       "--registry", reg.uri)
        out["special files in a registry"][f"list {_ended(rc_list, err_list)}; verify {_ended(rc, err)}"] += 1

    # oversized objects
    for rel, size in (("report.md", 8 << 20), ("metrics.parquet", 8 << 20)):
        reg, ref = fresh()
        with open(os.path.join(ref.path, rel), "wb") as handle:
            handle.write(bytes(size))
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                art = pull("toy", registry=reg, cache_dir=tmp / f"c{uuid.uuid4().hex[:6]}")
            ended = "optional file left out with a warning" if rel in art.damaged and caught else "LOADED"
        except IntegrityError:
            ended = "refused (IntegrityError)"
        out["oversized objects (8 MiB where the listing says less)"][f"{rel}: {ended}"] += 1

    # stale published markers
    reg, ref = fresh()
    reg.fs.pipe_file(reg.path("toy", "published", "99991231T000000.ghost"), b"")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        later = publish(toy_content(seed=5), reg)
    moved = reg.resolve("toy", "latest") == later.version
    out["stale published/ marker"]["publish ok, latest moved, warned" if moved and caught else "FAILED"] += 1

    # planted symlinks in output folders
    from kvtc.pipeline.evaluation import report

    build = report.build_from_artifact
    report.build_from_artifact = lambda art, quality: {"report.md": b"# report\n"}
    try:
        for command, flag, planted in (("export", "--to", "keys-g0.mean.f32"), ("pull", "--to", "metrics.parquet"),
                                       ("report", "--out", "report.md")):
            reg, ref = fresh()
            folder = tmp / f"o{uuid.uuid4().hex[:6]}"
            folder.mkdir()
            victim = tmp / f"victim-{command}"
            victim.write_bytes(b"precious")
            os.symlink(victim, folder / planted)
            extra = ["--ratio", "4", "--layout", "token-major", "--allow-rope-removed"] if command == "export" else []
            rc, err = _cli(command, "toy", flag, str(folder), *extra, "--registry", reg.uri)
            harm = ", VICTIM OVERWRITTEN" if victim.read_bytes() != b"precious" else ""
            out["writes through planted symlinks"][f"{_ended(rc, err)}{harm}"] += 1
    finally:
        report.build_from_artifact = build
    return out


def swap_race(tmp: Path, seconds: float) -> collections.Counter:
    """A thread swaps a verified basis file with a forged one as fast as it can while signed loads run."""
    from kvtc.artifacts.signing import generate_keypair

    private, public = generate_keypair(tmp / "racer")
    reg = Registry(str(tmp / "race"))
    ref = publish(toy_content(), reg, signing_key=private)
    rel = "bases/keys-g0.components.parquet"
    path = os.path.join(ref.path, rel)
    genuine, forged = build_files(toy_content())[0][rel], build_files(toy_content(seed=5))[0][rel]
    stop = threading.Event()

    def swap() -> None:
        while not stop.is_set():
            for data in (forged, genuine):
                tmp_path = f"{path}.swap"
                with open(tmp_path, "wb") as handle:
                    handle.write(data)
                os.replace(tmp_path, path)

    want = toy_content().bases[("keys", 0)][2]
    out = collections.Counter()
    thread = threading.Thread(target=swap, daemon=True)
    thread.start()
    end = time.time() + seconds
    try:
        while time.time() < end:
            cache = tmp / f"rc{uuid.uuid4().hex[:8]}"
            try:
                art = pull("toy", registry=reg, cache_dir=cache, public_key=public, require_signature=True)
                got = art.basis("keys", 0)[2]
                ok = got.shape[1] <= want.shape[1] and abs(got - want[:, :got.shape[1]]).max() < 1e-6
                out["genuine basis loaded" if ok else "TAMPERED BASIS LOADED"] += 1
            except IntegrityError:
                out["refused (IntegrityError: swapped mid-read)"] += 1
            shutil.rmtree(cache, ignore_errors=True)
    finally:
        stop.set()
        thread.join()
    return out


def stats_cases(tmp: Path) -> collections.Counter:
    """Crafted statistics objects in a shard store: each must be named and moved aside."""
    from kvtc.pipeline.job.store import ShardStore
    from kvtc.workers.capture import CaptureSettings
    from kvtc.workers.stats import CalibrationStats
    from kvtc.workers.stats_file import MAGIC, CorruptStats

    def stats() -> CalibrationStats:
        s = CalibrationStats.new({"num_layers": 1, "num_kv_heads": 1, "head_dim": 4},
                                 CaptureSettings(sinks=0, window=0), shard_ids=("s0",))
        for stream in ("keys", "values"):
            m = s._get(stream, 0, torch.device("cpu"))
            m.n = 1
        return s

    def reforge(data: bytes, edit) -> bytes:
        (length,) = struct.unpack("<Q", data[-48:-40])
        footer = json.loads(data[-48 - length:-48])
        edit(footer)
        new = json.dumps(footer, sort_keys=True).encode()
        return data[:-48 - length] + new + struct.pack("<Q", len(new)) + hashlib.sha256(new).digest() + MAGIC

    cases = {
        "forged footer (shard list)": lambda d: reforge(d, lambda f: f["metadata"].update(shard_ids=["s0", "s9"])),
        "dtype |O": lambda d: reforge(d, lambda f: f["tensors"]["keys/0/sum"].update(dtype="|O")),
        "2^40-element shape": lambda d: reforge(d, lambda f: f["tensors"]["keys/0/gram_triu"].update(shape=[1 << 40])),
        "bad JSON": lambda d: d[:-60] + b"{" * 12 + d[-48:],
        "unkeyed (older release)": lambda d: stats().to_bytes(),
    }
    parse_attacks = ("dtype |O", "2^40-element shape", "bad JSON")  # a stand-alone file has no key: only these apply
    out = collections.Counter()
    for label, attack in cases.items():
        for keyed in (True, False) if label in parse_attacks else (True,):
            store = ShardStore(str(tmp / f"s{uuid.uuid4().hex[:8]}"), "m", "c")
            store.put_acc("a0", stats())
            path = next(Path(store.root).rglob("a0.stats"))
            path.write_bytes(attack(path.read_bytes() if keyed else stats().to_bytes()))
            try:
                if keyed:
                    store.get_acc("a0")
                else:
                    CalibrationStats.load(path)
                ended = "READ"
            except CorruptStats as exc:
                named = path.name in str(exc)
                aside = not keyed or path.with_name("a0.stats.corrupt").exists()
                ended = "CorruptStats naming it" + (", moved aside" if keyed and aside else "") + \
                    ("" if named and aside else " (NOT NAMED OR NOT MOVED)")
            except Exception as exc:  # would be a bug
                ended = f"CRASH {type(exc).__name__}"
            out[f"{'store (keyed)' if keyed else 'stand-alone file (sha256)'}: {ended}"] += 1
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
    parser.add_argument("--race-seconds", type=float, default=10.0)
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
        results["fuzzed blobs (fixed mode)"] = blob_cases(args.blobs)
        t0 = time.perf_counter()
        results["fuzzed blobs (ECSQ mode)"] = blob_cases(args.blobs, "ecsq")
        ecsq_s = time.perf_counter() - t0
        results.update(registry_round_two(tmp))
        results[f"verify-then-swap race ({args.race_seconds:g} s, signed pulls)"] = swap_race(tmp, args.race_seconds)
        results["crafted statistics objects"] = stats_cases(tmp)
        full, base = verify_cost(tmp)
    print("| family | cases | how they ended |\n|---|---|---|")
    for family, counts in results.items():
        print(f"| {family} | {sum(counts.values())} | {', '.join(f'{v} {k}' for k, v in sorted(counts.items()))} |")
    print(f"\nECSQ fuzz: {args.blobs} blobs in {ecsq_s:.1f} s")
    print(f"\nverified pull (digest, binding, listing, bundle, every file's sha256): {1000 * full:.1f} ms; "
          f"sha256 of the same files alone (baseline): {1000 * base:.1f} ms; ratio {full / base:.2f}x")


if __name__ == "__main__":
    main()
