"""Hostile inputs, counted: bad command lines, tampered registries (local and S3 on a moto server on
loopback), fuzzed codec blobs in both modes, and issue 21's families: ECSQ inflation bombs and cut
ANS streams, version-id pins, files swapped after verification, special files (FIFO, directory,
/dev/zero), oversized objects, stale `published/` markers, writes through planted symlinks and
crafted statistics objects; and issue 28's: special files (FIFO, directory, /dev/zero and outside
links, hardlinks) in the statistics store, held-out rows, store key, pull cache and every output folder,
nested per-layer containers, and short inputs declaring long caches (peak RSS over input bytes, time to
refusal). Each case must end in a clear error or a correct result, with nothing written outside a root;
prints how each family ended, and the cost of the verified pull against hashing the same files (the
baseline, measured in the same run).

    .venv/bin/python bench/hostile.py [--blobs 20000] [--race-seconds 10] [--round-three] [--round-four] [--round-five]
                                      [--geometry 30,3,64]

Issue 49's families (--round-five runs only them, `--side calibration|serving` one side's): forged joint budget
records and ECSQ budgets read by every reader, reduce checkpoints swapped or copied from another job, sensitivity
sums out of range, malformed GGUF files and a damaged conversion cache, environment variables Ray crashes on, and
command lines that loaded a model before refusing. A family registers with `@round_five(side)`.

Issue 35's families (run first; --round-four runs only them): Parquet bombs in every file of an artifact,
NaN and inf bit patterns in raw sections of every cache dtype, non-finite values given to encode, bases and
decoders out of range, degenerate whitenings, NaN drift figures, degenerate statistics objects.
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

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the fixtures: tests/helpers

from kvtc.artifacts import ArtifactNotFoundError, IntegrityError, Registry, publish, pull
from kvtc.artifacts.manifest import build_files
from kvtc.kernels import BlobError, KVTCCodec, read_blob
from kvtc.kernels.codec.blob import TAG_ECSQ, TAG_ESCAPES, Section, write_blob
from kvtc.kernels.codec.ecsq import decode_group, encode_symbols
from kvtc.kernels.codec.entropy import PLAIN, ZLIB
from kvtc.pipeline import cli

from helpers.ecsq_synthetic import synthetic_ecsq_spec  # noqa: E402
from helpers.parquet_bombs import zero_rows_bomb  # noqa: E402
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
        "forged kernels/kvtc_codec.py with hash": lambda r, v: forge_version(r, "toy", v, lambda m: None, {"kernels/kvtc_codec.py": b"import os\n"}),
        "replaced parquet + updated hash": lambda r, v: forge_version(r, "toy", v, lambda m: None, {"metrics.parquet": b"PAR1"}),
        "flipped basis byte": flip("bases/keys-g0.components.parquet"),
        "flipped kernel byte": flip("kernels/kvtc_codec.py"),
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
            data = blob[:8] + struct.pack("<II", len(m), zlib.crc32(m)) + bytes(m) + blob[16 + meta_len:]
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


# ---- issue 28: special files in every store and output folder, nested containers, amplification ----

@dataclasses.dataclass
class Ended:
    """How one hostile case ended: `clean` (a one-line error naming the object, or a correct result,
    nothing written through or lost), the input's bytes, the peak RSS it added and its seconds."""

    family: str
    label: str
    how: str
    clean: bool
    input_bytes: int = 0
    peak_bytes: int = 0
    seconds: float = 0.0


def _status(field: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) << 10
    return 0


def _reset_peak() -> bool:
    """Reset the kernel's peak RSS (VmHWM) to the current RSS; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


def measured(family: str, label: str, input_bytes: int, case, deadline: int = 10) -> Ended:
    """Run `case()` -> (how, clean) under a deadline (10 s), measuring its peak RSS above the RSS before it."""
    import gc

    gc.collect()
    _reset_peak()
    base = _status("VmRSS")
    t = time.perf_counter()
    try:
        with _deadline(deadline):
            how, clean = case()
    except TimeoutError:
        how, clean = f"HUNG ({deadline} s)", False
    except Exception as exc:  # would be a bug: the case itself decides what is expected
        how, clean = f"CRASH {type(exc).__name__}: {str(exc)[:80]}", False
    seconds = time.perf_counter() - t
    return Ended(family, label, how, clean, input_bytes, max(0, _status("VmHWM") - base), seconds)


def _plant(path: Path, kind: str, outside: Path) -> None:
    """Put a special file where kvtc reads or writes: fifo, dir, zero (symlink to /dev/zero), outside
    (symlink to a file outside the root), hardlink (to that file)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dir":
        path.mkdir()
    elif kind == "zero":
        os.symlink("/dev/zero", path)
    elif kind == "outside":
        os.symlink(outside, path)
    elif kind == "hardlink":
        os.link(outside, path)
    else:
        raise ValueError(kind)


def _toy_stats():
    from kvtc.workers.capture import CaptureSettings
    from kvtc.workers.stats import CalibrationStats

    s = CalibrationStats.new({"num_layers": 1, "num_kv_heads": 1, "head_dim": 4}, CaptureSettings(sinks=0, window=0),
                             shard_ids=("s0",))
    for stream in ("keys", "values"):
        s._get(stream, 0, torch.device("cpu")).n = 1
    return s


def store_special_files(tmp: Path) -> list[Ended]:
    """Statistics objects, held-out rows and the store key replaced by special or oversized files: each is
    named in one line; statistics and rows are moved aside (a rerun recomputes them), nothing read hangs."""
    import numpy as np

    from kvtc.pipeline.job.store import KEY_FILE, ShardStore
    from kvtc.workers.stats_file import CorruptStats

    outside = tmp / "outside.bin"
    outside.write_bytes(b"precious")
    out = []
    for kind in ("fifo", "dir", "zero", "outside"):
        for what in ("acc_shards", "get_acc"):
            store = ShardStore(str(tmp / f"st-{uuid.uuid4().hex[:8]}"), "m", "c")
            store.put_acc("a0", _toy_stats())
            path = next(Path(store.root).rglob("a0.stats"))
            _plant(path, kind, outside)

            def case(store=store, path=path, what=what):
                err = io.StringIO()
                try:
                    with contextlib.redirect_stderr(err):
                        got = store.acc_shards("a0") if what == "acc_shards" else store.get_acc("a0")
                except CorruptStats as exc:
                    text = str(exc)
                else:
                    text = err.getvalue()
                    if got is not None:
                        return "READ", False
                aside = os.path.lexists(f"{path}.corrupt") and not os.path.lexists(path)
                named = "a0.stats" in text and len(text.strip().splitlines()) == 1
                ok = aside and named and outside.read_bytes() == b"precious"
                return ("named, moved aside" if ok else f"NOT CLEAN (aside={aside}, named={named})"), ok
            out.append(measured("statistics store: special files", f".stats {kind} ({what})", 0, case))
    for kind in ("fifo", "dir", "zero", "outside", "2 GiB appended", "header declaring 2^40 bytes"):
        store = ShardStore(str(tmp / f"st-{uuid.uuid4().hex[:8]}"), "m", "c")
        store.put("sh", "rows", {"keys": np.zeros((4, 8), np.float32)}, {"shard_id": "sh", "seq_len": 4})
        path = next(Path(store.root).rglob("sh.rows.safetensors"))
        size = path.stat().st_size
        if kind == "2 GiB appended":
            os.truncate(path, size + (2 << 30))  # sparse: no disk, but 2 GiB for a reader that trusts it
            size += 2 << 30
        elif kind.startswith("header"):
            data = bytearray(path.read_bytes())
            header = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])
            header["keys"]["data_offsets"][1] = 1 << 40
            text = json.dumps(header).encode()
            path.write_bytes(len(text).to_bytes(8, "little") + text + bytes(data[8 + int.from_bytes(data[:8], "little"):]))
        else:
            _plant(path, kind, outside)

        def case(store=store, path=path):
            try:
                store.get("sh", "rows")
            except CorruptStats as exc:
                aside = os.path.lexists(f"{path}.corrupt") and not os.path.lexists(path)
                ok = aside and "sh.rows.safetensors" in str(exc) and outside.read_bytes() == b"precious"
                return ("named, moved aside" if ok else "NOT MOVED ASIDE OR NOT NAMED"), ok
            return "READ", False
        out.append(measured("held-out rows: special and oversized files", f"rows {kind}", size, case))
    for kind in ("fifo", "dir", "zero", "mode 0644", "33 bytes"):
        root = tmp / f"key-{uuid.uuid4().hex[:8]}"
        ShardStore(str(root), "m", "c").put_acc("a0", _toy_stats())
        key = root / KEY_FILE
        from kvtc.pipeline.job import store as store_module

        store_module._KEYS.clear()
        if kind == "mode 0644":
            os.chmod(key, 0o644)
        elif kind == "33 bytes":
            key.write_bytes(bytes(33))
        else:
            _plant(key, kind, outside)

        def case(root=root):
            try:
                ShardStore(str(root), "m", "c").acc_shards("a0")
            except ValueError as exc:
                ok = KEY_FILE in str(exc) and "\n" not in str(exc)
                return ("refused, named" if ok else "NOT NAMED"), ok
            return "ACCEPTED", False
        out.append(measured("store key: special files and modes", f".store-key {kind}", 0, case))
    return out


def output_special_files(tmp: Path) -> list[Ended]:
    """Every file the CLI writes (export dynamo and sglang, report, pull --to, keygen) with a hardlink,
    symlink or FIFO planted in its place: never written through, never hung, a multi-file output whole
    or absent; a hardlink is replaced (exit 0), a symlink or FIFO refused in one line."""
    from kvtc.pipeline.evaluation import report

    reg = tmp / f"reg-{uuid.uuid4().hex[:8]}"
    publish(toy_content(), reg)
    report.build_from_artifact = lambda art, quality: {"report.md": b"# report\n", "charts/a.txt": b"chart\n"}
    commands = {
        "export dynamo": (["export", "toy", "--ratio", "4", "--layout", "token-major", "--allow-rope-removed",
                           "--to"], ["dynamo_kvtc.json", "keys-g0.mean.f32"]),
        "export sglang": (["export", "toy", "--ratio", "4", "--format", "sglang", "--to"],
                          ["kvtc_sglang.json", "kvtc_sglang.pt"]),
        "report": (["report", "toy", "--out"], ["report.md"]),
        "pull --to": (["pull", "toy", "--to"], ["metrics.parquet", "manifest.json"]),
        "keygen": (["keygen", "--out"], ["signer.pem", "signer.pub.pem"]),
    }
    out = []
    for command, (argv, planted_names) in commands.items():
        for planted in planted_names:
            for kind in ("hardlink", "symlink", "fifo"):
                victim = tmp / f"victim-{uuid.uuid4().hex[:8]}"
                victim.write_bytes(b"precious")
                folder = tmp / f"out-{uuid.uuid4().hex[:8]}"
                _plant(folder / planted, "outside" if kind == "symlink" else kind, victim)
                target = str(folder / "signer") if command == "keygen" else str(folder)
                full = [*argv, target] + ([] if command == "keygen" else ["--registry", str(reg)])

                def case(full=full, folder=folder, victim=victim, kind=kind, planted=planted, names=planted_names):
                    rc, err = _cli(*full)
                    intact = victim.read_bytes() == b"precious"
                    one = len(err.strip().splitlines()) <= 1 and "Traceback" not in err
                    present = [n for n in names if n != planted and (folder / n).exists()]
                    if rc == 0:
                        ok = intact and kind == "hardlink" and not (folder / planted).samefile(victim)
                        return ("replaced, exit 0" if ok else f"exit 0, NOT CLEAN (victim intact={intact})"), ok
                    ok = intact and one and not present and rc in (2, 6)
                    return (f"refused, exit {rc}, one line, nothing written" if ok else
                            f"exit {rc}, NOT CLEAN (intact={intact}, one line={one}, written={present})"), ok
                out.append(measured("output folders: planted files", f"{command}: {planted} as {kind}", 0, case))
    return out


def cache_special_files(tmp: Path) -> list[Ended]:
    """Listed files of a pulled version replaced in the local pull cache: the cache entry is refused and
    fetched again (a correct result), never read through a FIFO or a link."""
    reg = Registry(str(tmp / f"reg-{uuid.uuid4().hex[:8]}"))
    publish(toy_content(), reg)
    outside = tmp / "outside-cache.bin"
    outside.write_bytes(b"precious")
    out = []
    for rel in ("metrics.parquet", "manifest.json"):
        for kind in ("fifo", "dir", "zero", "outside"):
            art = pull("toy", registry=reg)
            _plant(art.path / rel, kind, outside)

            def case():
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    again = pull("toy", registry=reg)
                ok = (again.path / rel).is_file() and not (again.path / rel).is_symlink() \
                    and outside.read_bytes() == b"precious"
                return ("refetched, correct" if ok else "NOT REFETCHED"), ok
            out.append(measured("pull cache: special files", f"{rel} as {kind}", 0, case))
    return out


def _layered(depth: int) -> tuple[KVTCCodec, bytes]:
    """A per-layer container nested `depth` deep in its first segment (CRCs recomputed at each level)."""
    spec = synthetic_spec(2, 1, 8, 4.0, groups=[(0, 1), (1, 2)], sinks=1, window=1, kept=6, seed=3)
    codec = KVTCCodec(spec, backend="torch", mode="fixed")
    keys = [torch.randn(1, 6, 8, dtype=torch.float16), torch.randn(1, 4, 8, dtype=torch.float16)]
    values = [torch.randn(1, 6, 8, dtype=torch.float16), torch.randn(1, 4, 8, dtype=torch.float16)]
    blob = codec.encode(keys, values, start=0)
    header, sections = read_blob(blob)
    for _ in range(depth):
        inner = blob
        blob = write_blob(header, [sections[0], Section(sections[1].key, PLAIN, len(inner), inner), *sections[2:]])
    return codec, blob


def nested_containers() -> list[Ended]:
    """A per-layer container inside a segment of another, 1 to 2,000 deep: a BlobError, no recursion."""
    out = []
    for depth in (1, 2, 10, 2000):
        codec, blob = _layered(depth)

        def case(codec=codec, blob=blob):
            try:
                codec.decode(blob)
            except BlobError as exc:
                return ("BlobError" if "nest" in str(exc) else f"BlobError ({str(exc)[:60]})"), True
            return "DECODED", False
        out.append(measured("nested containers", f"depth {depth}", len(blob), case))
    return out


def _no_words(section: bytes, symbols: int) -> bytes:
    """A rANS section with the lane table the symbol count needs and no words."""
    from kvtc.kernels.codec import rans

    lanes = -(-symbols // rans.MAX_LANE_SYMBOLS)
    return struct.pack("<I", lanes) + struct.pack(f"<{lanes}I", *([rans.STATE_LOW] * lanes)) + bytes(2 * lanes)


def amplification(geometry: tuple[int, int, int] = (8, 2, 64)) -> list[Ended]:
    """Short inputs declaring long caches: each must be refused before it costs memory (peak RSS over the
    input's bytes) -- rANS lane tables with no words, a constriction stream of one word, DEFLATE bombs in
    fixed mode, a stored chunk longer than its destination."""
    from kvtc.kernels.codec.chunk_serde import ChunkTransform
    from kvtc.kernels.codec.ecsq import _CODED, _EXPONENT, STREAM_FORMAT, TRUNCATED_FORMAT

    layers, heads, dim = geometry
    spec = synthetic_ecsq_spec(layers, heads, dim, 8.0, sinks=2, window=3)
    out = []
    for fmt in ("rans", "constriction"):
        codec = KVTCCodec(spec, backend="torch", mode="ecsq", ecsq_format=fmt, outlier_factor=None)  # no decode inside encode
        keys, values = synthetic_cache(spec, 16, torch.float16, seed=1)
        header, sections = read_blob(codec.encode(keys, values))
        for tokens, coded in ((8192, None), (131072, None), (131072, 1)):
            long = dataclasses.replace(header, tokens=tokens, truncated=coded is not None)
            _, mid, _ = codec.split(tokens, 0)
            kept = {s.key: g.kept for si, st in enumerate(("keys", "values"))
                    for gi, g in enumerate(spec.ecsq[st]) for s in sections if s.key == (TAG_ECSQ, si, gi, 0)}
            head = _EXPONENT.pack(STREAM_FORMAT << 16) if coded is None else \
                _EXPONENT.pack(TRUNCATED_FORMAT << 16) + _CODED.pack(coded)  # the first component alone
            forged = [Section(s.key, PLAIN, 0, b"") if s.key.tag == TAG_ESCAPES else
                      Section(s.key, PLAIN, *(lambda b: (len(b), b))(
                          head + (_no_words(b"", mid * (coded or kept[s.key])) if fmt == "rans"
                                  else struct.pack("<II", 0, 1))))
                      if s.key.tag == TAG_ECSQ else s for s in sections]
            blob = write_blob(long, forged)

            def case(codec=codec, blob=blob):
                try:
                    codec.decode(blob, max_tokens=131072)
                except BlobError as exc:
                    return ("BlobError before decoding" if "cannot hold" in str(exc) else "BlobError"), True
                return "DECODED", False
            what = "no words" if coded is None else f"{coded} component coded, no words"
            out.append(measured("amplification", f"{fmt}: {what}, {tokens} tokens declared, {layers}x{heads}x{dim}",
                                len(blob), case))
    plain = synthetic_spec(layers, heads, dim, 8.0, sinks=0, window=0, kept=64, rope_theta=None)
    fixed = KVTCCodec(plain, backend="torch", mode="fixed")
    keys, values = synthetic_cache(plain, 16, torch.float16, seed=1)
    header, sections = read_blob(fixed.encode(keys, values))
    for tokens, label, bomb in ((131072, "sizes declared, 1 byte stored", False),
                                (2048, "DEFLATE-packed zeros at the exact sizes (a valid cache)", True)):
        long = dataclasses.replace(header, tokens=tokens)
        bounds = {b.key: b.max_raw for b in fixed.section_bounds(long)}
        blob = write_blob(long, [Section(s.key, ZLIB, bounds[s.key], _bomb(bounds[s.key]) if bomb else b"x")
                                 if s.key.tag > 2 else s for s in sections])

        def case(blob=blob):
            try:
                fixed.decode(blob, max_tokens=131072)
            except BlobError:
                return "BlobError", True
            return "DECODED (a valid cache of that length)", True
        out.append(measured("amplification", f"fixed: {label}, {tokens} tokens", len(blob), case))
    serde = ChunkTransform(KVTCCodec(plain, backend="torch", mode="fixed"))
    width = heads * dim
    stored = serde.serialize(torch.randn(2, layers, 4096, width, dtype=torch.float16))
    dest = torch.zeros(2, layers, 256, width, dtype=torch.float16)

    def chunk_case():
        try:
            serde.deserialize(stored, dest)
        except BlobError as exc:
            return ("BlobError before decoding" if "limit" in str(exc) else "BlobError"), True
        return "DECODED", False
    out.append(measured("amplification", "chunk serde: 4096-token chunk into a 256-token destination", len(stored),
                        chunk_case))
    return out


# ---- issue 35: Parquet bombs, non-finite values, whitening and drift, degenerate statistics ----

def _refused(read, error: type, words: tuple[str, ...] = ()) -> tuple[str, bool]:
    """Run `read()`: (how, clean) where clean is a refusal of type `error` naming each of `words`, in one line."""
    try:
        read()
    except error as exc:
        text = str(exc)
        ok = all(w in text for w in words) and "\n" not in text
        return ("refused, named" if ok else f"refused, NOT NAMED ({text[:80]})"), ok
    return "READ", False


def parquet_bombs(tmp: Path) -> list[Ended]:
    """Every Parquet file of an artifact replaced (digests edited to agree) by 2M zstd zero rows: refused from
    its footer before a data page is read."""
    from kvtc.artifacts.errors import CorruptArtifactError
    from kvtc.pipeline.fit.metric import decode_root

    reg = Registry(str(tmp / f"reg-{uuid.uuid4().hex[:8]}"))
    decoder = "bases/keys-g0.decoder.parquet"
    reads = {"bases/keys-g0.components.parquet": ("component", lambda a: a.basis("keys", 0)),
             "bases/keys-g0.mean.parquet": ("mean", lambda a: a.basis("keys", 0)),
             decoder: ("decoder", lambda a: a.decoder("keys", 0)),
             "metrics.parquet": ("value", lambda a: a.metrics()),
             "allocations.parquet": ("ratio", lambda a: a.allocations()),
             "curves/error_by_position.parquet": ("position", lambda a: a.curve("error_by_position"))}
    out = []
    for rel, (column, read) in reads.items():
        bomb = zero_rows_bomb(column)
        version = publish(toy_content(), reg).version  # a fresh version: one forged file at a time

        def mutate(m, rel=rel):
            if rel == decoder:
                m["bases"]["entries"][0]["decoder"] = decoder
        forge_version(reg, "toy", version, mutate, {rel: bomb})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            art = pull("toy", version, registry=reg)
        out.append(measured("Parquet bombs", f"{rel}: 2M rows in {len(bomb)} bytes", len(bomb),
                            lambda art=art, read=read, rel=rel: _refused(lambda: read(art), CorruptArtifactError,
                                                                         (rel.split("/")[-1],))))
    path = tmp / "metric-bomb.parquet"
    path.write_bytes(zero_rows_bomb("root", 200_000, 64))
    out.append(measured("Parquet bombs", f"attention metric file: 200k blocks in {path.stat().st_size} bytes",
                        path.stat().st_size, lambda: _refused(lambda: decode_root(str(path), 32, 8),
                                                              CorruptArtifactError, ("metric-bomb.parquet",))))
    return out


_NON_FINITE = {"float16": (0x7E00, 0x7C00), "bfloat16": (0x7FC0, 0x7F80), "float32": (0x7FC00000, 0x7F800000),
               "float8_e4m3fn": (0x7F,)}


def non_finite_cases(tmp: Path) -> list[Ended]:
    """Raw sink and window sections holding NaN or inf bit patterns (CRCs recomputed), in every cache dtype;
    encode given NaN or inf in a sink, the window or the middle, and start=True; bases and decoders of
    NaN or float32 max: each refused naming what."""
    import numpy as np

    from kvtc.artifacts import tables
    from kvtc.artifacts.errors import CorruptArtifactError
    from kvtc.kernels.codec.blob import TAG_RAW_HEAD, TAG_RAW_TAIL
    from kvtc.kernels.codec.entropy import decode_sections

    spec = synthetic_spec(2, 2, 8, 4.0, sinks=2, window=3, kept=6, seed=3, rope_theta=None)
    codec = KVTCCodec(spec, backend="torch", mode="fixed")
    keys, values = synthetic_cache(spec, 12, torch.float32, seed=1)
    out = []
    for name, patterns in _NON_FINITE.items():
        dtype = getattr(torch, name)
        header, sections = read_blob(codec.encode(keys.to(dtype), values.to(dtype)))
        item = torch.empty(0, dtype=dtype).element_size()
        for tag, where in ((TAG_RAW_HEAD, "sink"), (TAG_RAW_TAIL, "window")):
            for pattern in patterns:
                forged = []
                for sec in sections:
                    if sec.key.tag == tag and sec.key.stream == 0:
                        raw = bytearray(decode_sections([sec], None)[sec.key] if sec.coding != PLAIN else sec.stored)
                        raw[:item] = pattern.to_bytes(item, "little")
                        sec = Section(sec.key, PLAIN, len(raw), bytes(raw))
                    forged.append(sec)
                blob = write_blob(header, forged)
                out.append(measured("non-finite values", f"decode: {name} {where} section, bits {pattern:#x}", len(blob),
                                    lambda blob=blob: _refused(lambda: codec.decode(blob), BlobError, ("non-finite",))))
    for where, index in (("sink", (0, 0, 0, 1)), ("window", (1, 1, 11, 2)), ("middle", (0, 1, 5, 3))):
        for bad in (float("nan"), float("inf")):
            k = keys.to(torch.float16).clone()
            k[index] = bad
            out.append(measured("non-finite values", f"encode: {bad} in the {where}", 0,
                                lambda k=k, index=index: _refused(lambda: codec.encode(k, values.to(torch.float16)),
                                                                  ValueError, (str(index),))))
    out.append(measured("non-finite values", "encode: start=True", 0,
                        lambda: _refused(lambda: codec.encode(keys, values, start=True), ValueError, ("start",))))
    p, k = 16, 4
    for label, matrix in (("decoder of float32 max", np.full((p, k), np.finfo(np.float32).max, np.float32)),
                          ("decoder of NaN", np.full((p, k), np.nan, np.float32))):
        data = tables.encode_decoder(matrix, "float32")
        out.append(measured("non-finite values", label, len(data),
                            lambda data=data: _refused(lambda: tables.decode_decoder(data, (p, k)), ValueError,
                                                       ("decoder",))))
    reg = Registry(str(tmp / f"reg-{uuid.uuid4().hex[:8]}"))
    content = toy_content()
    mean, eig, comp = content.bases[("keys", 0)]
    for label, files in (("components of float32 max", (np.full_like(comp, 3e38), mean)),
                         ("mean of inf", (comp, np.full_like(mean, np.inf)))):
        ref = publish(content, reg)
        kept = reg.read_manifest("toy", ref.version)["bases"]["entries"][0]["k"]  # as published: trimmed
        files = tables.encode_basis(files[1], eig[:kept], files[0][:, :kept], "float32")
        forged = dict(zip(("bases/keys-g0.components.parquet", "bases/keys-g0.mean.parquet"), files))
        version = ref.version
        forge_version(reg, "toy", version, lambda m: None, forged)
        art = pull("toy", version, registry=reg)
        out.append(measured("non-finite values", label, sum(map(len, files)),
                            lambda art=art: _refused(lambda: art.basis("keys", 0), CorruptArtifactError,
                                                     ("basis (keys, 0)",))))
    return out


def whitening_and_drift(tmp: Path) -> list[Ended]:
    """Metric files whose whitening is zero, singular, ill-conditioned or asymmetric: refused when read (a
    corrupt artifact, exit 6); NaN drift figures: drifted (exit 3), never "not drifted"; an attention
    manifest without its decoders, a deleted metric file."""
    import numpy as np

    from kvtc.artifacts.errors import CorruptArtifactError
    from kvtc.pipeline.fit.metric import decode_root, encode_root
    from kvtc.pipeline.operations.drift import compare

    out = []
    eye = np.eye(8)
    for label, root in (("all zero", np.zeros((4, 8, 8))), ("one zero block", np.stack([eye, eye, eye, 0 * eye])),
                        ("singular", np.stack([eye] * 3 + [np.diag([1.0] * 7 + [0.0])])),
                        ("condition 1e9", np.stack([eye] * 3 + [eye * 1e-9])),
                        ("negative definite", np.stack([eye] * 3 + [-eye])),
                        ("asymmetric", np.stack([eye] * 3 + [np.triu(np.ones((8, 8)))])),
                        ("NaN", np.full((4, 8, 8), np.nan))):
        path = tmp / f"metric-{uuid.uuid4().hex[:8]}.parquet"
        path.write_bytes(encode_root(root))
        out.append(measured("whitening and drift", f"metric file: {label}", path.stat().st_size,
                            lambda path=path: _refused(lambda: decode_root(str(path), 32, 8), CorruptArtifactError,
                                                       (path.name,))))
    for label, rec, mea in (("measured NaN", 0.1, float("nan")), ("recorded NaN", float("nan"), 0.1),
                            ("both NaN", float("nan"), float("nan"))):
        def case(rec=rec, mea=mea):
            c = compare({(4.0, "keys"): rec}, {(4.0, "keys"): mea}, 0.1)[0]
            return ("drifted (exit 3)" if c.drifted else "NOT DRIFTED"), c.drifted
        out.append(measured("whitening and drift", f"drift: {label}", 0, case))
    reg = Registry(str(tmp / f"reg-{uuid.uuid4().hex[:8]}"))
    version = publish(toy_content(), reg).version
    forge_version(reg, "toy", version, lambda m: m["calibration"].update(objective="attention"))
    out.append(measured("whitening and drift", "attention manifest without decoders", 0,
                        lambda: _refused(lambda: pull("toy", version, registry=reg), IntegrityError, ("no decoder",))))
    reg = Registry(str(tmp / f"reg-{uuid.uuid4().hex[:8]}"))
    version = publish(toy_content(), reg).version
    reg.fs.rm_file(f"{reg.version_path('toy', version)}/report.md")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        art = pull("toy", version, registry=reg)
    out.append(measured("whitening and drift", "deleted optional (metric) file", 0,
                        lambda: _refused(lambda: art.file("report.md"), IntegrityError, ("is missing",))))
    return out


def degenerate_statistics(tmp: Path) -> list[Ended]:
    """Statistics objects with a valid store key whose metric sums are zero or negative, or whose Gram holds
    a negative variance: named (object and tensor), moved aside, and absent to the next run (recomputed)."""
    import numpy as np

    from kvtc.pipeline.job.store import ShardStore
    from kvtc.workers.stats_file import DegenerateStats

    good = {"keys": np.ones((1, 1, 4)), "values": np.eye(4)[None, None], "concentration": np.ones((1, 1))}
    bad = {"metric/keys zero": ("keys", np.zeros((1, 1, 4))), "metric/keys negated": ("keys", -np.ones((1, 1, 4))),
           "metric/values zero": ("values", np.zeros((1, 1, 4, 4))),
           "metric/values negated": ("values", -np.eye(4)[None, None]),
           "metric/concentration zero": ("concentration", np.zeros((1, 1))),
           "keys/0/gram_triu negative variance": ("gram", None)}
    out = []
    for label, (key, value) in bad.items():
        store = ShardStore(str(tmp / f"st-{uuid.uuid4().hex[:8]}"), "m", "c")
        stats = _toy_stats()
        stats.metric = {k: torch.from_numpy(value if k == key else v) for k, v in good.items()}
        stats.metric_tokens = 3
        if key == "gram":
            stats._get("keys", 0, torch.device("cpu")).gram[0] = -1.0
        store.put_acc("a0", stats)

        def case(store=store, tensor=label.split()[0]):
            how, ok = _refused(lambda: store.get_acc("a0"), DegenerateStats, ("a0.stats", tensor))
            aside = os.path.exists(store._acc_path("a0") + ".corrupt") and store.acc_shards("a0") is None
            return (how + (", moved aside" if aside else ", NOT MOVED ASIDE")), ok and aside
        out.append(measured("degenerate statistics", label, 0, case))
    return out


def round_four_table(ended: list[Ended]) -> str:
    """Per family: cases refused cleanly / correct / defect, the largest peak RSS and time of a case under 1 MB."""
    lines = ["| family | cases | refused cleanly | correct | defect | largest peak RSS, < 1 MB | longest, < 1 MB |",
             "|---|---|---|---|---|---|---|"]
    for family in dict.fromkeys(e.family for e in ended):
        cases = [e for e in ended if e.family == family]
        correct = [e for e in cases if e.clean and e.how.startswith(("drifted", "refetched"))]
        refused = [e for e in cases if e.clean and e not in correct]
        small = [e for e in cases if e.input_bytes < 1 << 20]
        lines.append(f"| {family} | {len(cases)} | {len(refused)} | {len(correct)} | {len(cases) - len(refused) - len(correct)} | "
                     f"{max((e.peak_bytes for e in small), default=0) / 2**20:.1f} MB | "
                     f"{max((e.seconds for e in small), default=0.0):.2f} s |")
    lines += [f"DEFECT: {e.family}: {e.label}: {e.how}" for e in ended if not e.clean]
    return "\n".join(lines)


_ACCEPTED = ("DECODED", "replaced", "refetched")  # correct results, not refusals


def round_three_table(ended: list[Ended]) -> str:
    """Per family: cases, clean, peak RSS over input bytes (worst), the worst peak RSS of an input under
    1 MB, and the longest time to the end of a case."""
    lines = ["| family | cases | clean | worst peak RSS / input bytes | worst peak RSS, inputs < 1 MB | longest |",
             "|---|---|---|---|---|---|"]
    for family in dict.fromkeys(e.family for e in ended):
        cases = [e for e in ended if e.family == family]
        refused = [e for e in cases if not e.how.startswith(_ACCEPTED)]  # RSS before a refusal
        sized = [e for e in refused if e.input_bytes]
        ratio = max((e.peak_bytes / e.input_bytes for e in sized), default=None)
        small = max((e.peak_bytes for e in refused if e.input_bytes < 1 << 20), default=0)
        lines.append(f"| {family} | {len(cases)} | {sum(e.clean for e in cases)} | "
                     f"{'-' if ratio is None else f'{ratio:.1f}'} | {small / 2**20:.1f} MB | "
                     f"{max(e.seconds for e in cases):.2f} s |")
    lines += [f"valid input, decoded: {e.label}: {e.input_bytes / 1024:.0f} KB, peak RSS +{e.peak_bytes / 2**20:.0f} MB, "
              f"{e.seconds:.2f} s" for e in ended if e.how.startswith("DECODED")]
    lines += [f"NOT CLEAN: {e.family}: {e.label}: {e.how}" for e in ended if not e.clean]
    return "\n".join(lines)


# ---- issue 49 (round five): budgets, checkpoints, sums and inputs bound to what they claim ----
#
# One registry of families, each a function (tmp) -> [Ended] tagged with its side: the calibration and registry
# side's are below; the serving side's (chunks after a server restart, the vLLM tier's budget, extreme finite
# chunks, decode memory) join the same round with `@round_five("serving")` and appear in the same table.

ROUND_FIVE: list[tuple[str, object]] = []  # (side, family function), in the order they run
SIDES: dict[str, str] = {}  # family name (as its cases name it) -> side, filled as the round runs
CORRECT = ("correct", "recomputed", "rebuilt", "reused", "listed")  # a case that ends in a correct result


def round_five(side: str):
    """Register a family of the fifth round (`side`: "calibration" or "serving")."""
    def register(family):
        ROUND_FIVE.append((side, family))
        return family
    return register


class _WouldRun(Exception):
    """A command line that was not refused reached the job (stubbed: nothing runs)."""


@contextlib.contextmanager
def _job_stubbed():
    """The calibration job and Ray start replaced by a raise, so a command line that is not refused costs nothing."""
    from kvtc.pipeline.job import calibrate as job

    def would_run(*_, **__):
        raise _WouldRun("WOULD RUN THE JOB")

    saved = job.run
    job.run = would_run
    try:
        yield
    finally:
        job.run = saved


@contextlib.contextmanager
def _env(**values: str):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _refused_cli(argv: list[str], code: int, words: tuple[str, ...]) -> tuple[str, bool]:
    """A command line run in this process: (how, clean) where clean is exit `code` in one line naming `words`."""
    rc, err = _cli(*argv)
    one = len(err.strip().splitlines()) == 1 and "Traceback" not in err
    named = all(w in err for w in words)
    ok = rc == code and one and named
    return (f"exit {rc}" + (", one line" if one else ", NOT one line") + ("" if named else ", NOT NAMED")), ok


@round_five("calibration")
def joint_budget_records(tmp: Path) -> list[Ended]:
    """A re-digested (unsigned) artifact whose joint split record (calibration.bit_split) or ECSQ budgets were
    edited: huge, string, NaN, negative or zero shares, shares off the total, a ratio missing or foreign, a basis
    twice, a misrecorded own share, ECSQ budgets of 0 or against the record. Read by `show`, `verify`, `report`,
    `export` and the codec's load: each a clean integrity error (exit 6), never exit 1, never a fallback."""
    from helpers.joint_artifacts import RECORD_FORGERIES, TABLE_FORGERIES, forged_ecsq, joint_content
    from kvtc.artifacts.errors import IntegrityError as Integrity

    joint, even = joint_content(), joint_content(joint=False)
    out = []

    def readers(reg: Registry, version: str, tables_only: bool) -> dict:
        ref, folder = f"joint@{version}", str(tmp / f"out-{uuid.uuid4().hex[:8]}")
        cli_readers = {"verify": ["verify", ref]} if tables_only else {
            "show": ["show", ref], "verify": ["verify", ref], "report": ["report", ref, "--out", folder],
            "export": ["export", ref, "--ratio", "8", "--format", "sglang", "--to", folder]}
        found = {name: (lambda argv=argv: _refused_cli([*argv, "--registry", reg.uri], 6, ("joint@",)))
                 for name, argv in cli_readers.items()}
        found["codec load"] = lambda: _refused(lambda: KVTCCodec.from_registry(ref, 8.0, registry=reg), Integrity,
                                               ("joint@",))
        return found

    for label, edit in RECORD_FORGERIES.items():
        reg = Registry(str(tmp / f"jr-{uuid.uuid4().hex[:8]}"))
        version = publish(joint, reg).version
        size = len(forge_version(reg, "joint", version, edit))
        for reader, case in readers(reg, version, False).items():
            out.append(measured("joint budget record", f"{label}: {reader}", size, case))
    for label, (on_joint, edit) in TABLE_FORGERIES.items():
        content = joint if on_joint else even
        reg = Registry(str(tmp / f"jt-{uuid.uuid4().hex[:8]}"))
        version = publish(content, reg).version
        data = forged_ecsq(content, edit)
        forge_version(reg, "joint", version, lambda m: None, {"ecsq.parquet": data})
        for reader, case in readers(reg, version, True).items():
            out.append(measured("joint budget record", f"{label}: {reader}", len(data), case))
    reg = Registry(str(tmp / f"jok-{uuid.uuid4().hex[:8]}"))
    version = publish(joint, reg).version

    def untampered() -> tuple[str, bool]:
        codec = KVTCCodec.from_registry(f"joint@{version}", 8.0, registry=reg)
        shares = {s: codec.spec.ecsq[s][0].budget_bits for s in ("keys", "values")}
        rc, _ = _cli("verify", f"joint@{version}", "--registry", reg.uri)
        want = {s: int(joint.ecsq[(8.0, s, 0)]["budget_bits"]) for s in ("keys", "values")}
        ok = rc == 0 and shares == want
        return ("correct: verified, the codec runs each share" if ok else f"WRONG: exit {rc}, shares {shares}"), ok
    out.append(measured("joint budget record", "untampered joint artifact: verify and codec", 0, untampered))
    return out


@round_five("calibration")
def reduce_checkpoints(tmp: Path) -> list[Ended]:
    """A reduce stopped with its checkpoints in the store, then resumed after a writer of the store (no key)
    swapped the keys and values solve checkpoints, swapped the spectra, swapped the results, or copied another
    job's checkpoint (another task, another model) under this job's name: each object named once on stderr,
    recomputed, and the reduce's result is the untampered run's, bit for bit."""
    from helpers import reduce_checkpoints as rc
    from kvtc.pipeline.job.store import ShardStore

    with contextlib.redirect_stderr(io.StringIO()):  # the reduce's progress lines
        baseline = rc.reduce_once(rc.make_store(tmp / "ck-base"), rc.make_tasks())
        spectra = [e for e, _ in rc.reduce_once(rc.make_store(tmp / "ck-spectra"), rc.make_tasks(), solve_only=True)]
    tasks = rc.make_tasks()
    solo = [dataclasses.replace(t, solve_only=True) for t in tasks]

    def resumed(prepare, solve_only: bool = False, named: int = 2):
        def case() -> tuple[str, bool]:
            store = rc.make_store(tmp / f"ck-{uuid.uuid4().hex[:8]}")
            with contextlib.redirect_stderr(io.StringIO()):
                prepare(store)
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                got = rc.reduce_once(store, tasks, solve_only=solve_only)
            lines = [line for line in err.getvalue().splitlines() if line.startswith("kvtc:")]
            same = all(np.array_equal(a[0], b) for a, b in zip(got, spectra)) if solve_only else \
                rc.same_results(got, baseline)
            once = len(lines) == named and len(set(lines)) == named
            ok = same and once
            return ((f"recomputed, {len(lines)} object(s) named once, the untampered result" if ok else
                     f"{'SAME' if same else 'ANOTHER'} RESULT, {len(lines)} line(s) named") if same or once else
                    "ANOTHER RESULT USED"), ok
        return case

    def solved_then(edit):
        def prepare(store):
            rc.reduce_once(store, tasks, solve_only=True)
            edit(store)
        return prepare

    def results_then(edit):
        def prepare(store):
            rc.reduce_once(store, tasks)
            edit(store)
        return prepare

    def other_job(ratios, model_id="m"):
        def prepare(store):
            other = ShardStore(store.root, model_id, "c")
            if model_id != "m":
                rc.make_store(store.root)  # the key exists already; the other scope gets its own accumulator
            stats = store.get_acc("acc0")
            other.put_acc("accB", stats)
            theirs = rc.make_tasks(ratios, accumulator="accB")
            rc.reduce_once(other, theirs, solve_only=True, seed=1)
            rc.copy_from(other, rc.solved_name(theirs[0]), store, rc.solved_name(tasks[0]))
        return prepare

    def legacy(store):
        from kvtc.workers.stats_file import write_stats

        path = rc.object_path(store, rc.solved_name(tasks[0]))
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:  # authenticated, but naming no task: an earlier release's checkpoint
            write_stats(f, {"mean": np.zeros(rc.P), "eigenvalues": np.ones(rc.P), "components": np.eye(rc.P)},
                        {"solved": {"method": "exact", "k": rc.P, "device": "cpu", "sum_s": 0.0, "eig_s": 0.0},
                         "total_variance": float(rc.P), "n": 400, "by_tokens": None}, store.hmac_key)

    cases = {
        "solve checkpoints of keys and values swapped": (solved_then(lambda st: rc.swap(
            st, rc.solved_name(tasks[0]), rc.solved_name(tasks[1]))), False, 2),
        "spectra of keys and values swapped": (solved_then(lambda st: rc.swap(
            st, rc.spectrum_name(solo[0]), rc.spectrum_name(solo[1]))), True, 2),
        "results of keys and values swapped": (results_then(lambda st: rc.swap(
            st, rc.result_name(tasks[0]), rc.result_name(tasks[1]))), False, 2),
        "another job's solve checkpoint (other ratios) copied in": (other_job((8.0,)), False, 1),
        "another model's solve checkpoint copied in": (other_job((4.0,), "m2"), False, 1),
        "an earlier release's checkpoint (no binding)": (legacy, False, 1),
    }
    return [measured("reduce checkpoints", label, 0, resumed(prepare, solve_only, named), deadline=60)
            for label, (prepare, solve_only, named) in cases.items()]


def _sensitivity_stats(tensor: str | None = None, factor: float = 1.0):
    stats = _toy_stats()
    metric = {"keys": np.ones((1, 1, 4)), "values": np.eye(4)[None, None], "concentration": np.ones((1, 1)),
              "sensitivity_keys": np.full((1, 1, 4), 0.5), "sensitivity_values": np.eye(4)[None, None] * 0.5}
    if tensor is not None:
        metric[tensor] = metric[tensor] * factor
    stats.metric = {k: torch.from_numpy(v) for k, v in metric.items()}
    stats.metric_tokens = 3
    return stats


@round_five("calibration")
def sensitivity_sums(tmp: Path) -> list[Ended]:
    """KL sensitivity sums (`sensitivity_keys`, `sensitivity_values`) forged to x1e300 or x1e-300 and re-signed
    with the store's key: named (object and tensor), moved aside, absent to the next run; the same sums in range
    read back. End to end on a tiny model: the forged rerun refused naming them (exit 2 kind), the next rerun
    recomputes them and publishes the untampered run's bases."""
    from kvtc.pipeline.job.store import ShardStore
    from kvtc.workers.stats_file import DegenerateStats

    out = []
    for tensor in ("sensitivity_keys", "sensitivity_values"):
        for factor in (1e300, 1e-300):
            store = ShardStore(str(tmp / f"se-{uuid.uuid4().hex[:8]}"), "m", "c")
            store.put_acc("a0", _sensitivity_stats(tensor, factor))

            def case(store=store, tensor=tensor):
                how, ok = _refused(lambda: store.get_acc("a0", keys=[]), DegenerateStats,
                                   ("a0.stats", f"metric/{tensor}"))
                aside = os.path.exists(store._acc_path("a0") + ".corrupt") and store.acc_shards("a0") is None
                return (how + (", moved aside" if aside else ", NOT MOVED ASIDE")), ok and aside
            out.append(measured("sensitivity sums", f"{tensor} x{factor:g}", 0, case))
    store = ShardStore(str(tmp / f"se-{uuid.uuid4().hex[:8]}"), "m", "c")
    store.put_acc("a0", _sensitivity_stats())

    def sound() -> tuple[str, bool]:
        got = store.get_acc("a0", keys=[]).metric["sensitivity_values"]
        ok = bool(torch.equal(got, _sensitivity_stats().metric["sensitivity_values"]))
        return ("correct: read back" if ok else "WRONG"), ok
    out.append(measured("sensitivity sums", "sums in range", 0, sound))
    out.append(measured("sensitivity sums", "end to end: x1e300 forged between two calibrations of tiny:llama", 0,
                        lambda: _sensitivity_end_to_end(tmp), deadline=300))
    return out


def _sensitivity_end_to_end(tmp: Path) -> tuple[str, bool]:
    from kvtc.artifacts import pull as pull_version
    from kvtc.pipeline.job.calibrate import run
    from kvtc.pipeline.job.store import ShardStore
    from kvtc.pipeline.settings import JobSettings
    from kvtc.workers.stats_file import DegenerateStats

    root = tmp / f"e2e-{uuid.uuid4().hex[:8]}"

    def calibrate() -> dict:
        cfg = JobSettings.of(model="tiny:llama", corpus="pydoc", eval_corpus=None, seq_len=64, window=8, sinks=2,
                             tokens=1024, seqs_per_shard=4, heldout_rows=512, ratios=(4.0, 8.0),
                             tokens_curve_points=0, served_sequences=0, registry=str(root / "reg"),
                             store=str(root / "store"), name="sens")
        with contextlib.redirect_stderr(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return run(cfg, in_process=True)

    first = calibrate()
    accs = sorted(root.glob("store/*/*/acc/*.stats"))
    for path in accs:
        store = ShardStore(str(root / "store"), path.parent.parent.parent.name, path.parent.parent.name)
        stats = store.get_acc(path.stem)
        stats.metric["sensitivity_values"] = stats.metric["sensitivity_values"] * 1e300
        store.put_acc(path.stem, stats)
    try:
        calibrate()
        return "FORGED SUMS USED", False
    except DegenerateStats as exc:
        named = "sensitivity_values" in str(exc) and ".stats" in str(exc)
    aside = any(p.with_name(p.name + ".corrupt").exists() for p in accs)
    third = calibrate()
    reg = str(root / "reg")
    a, b = (pull_version(f"sens@{s['version']}", registry=reg) for s in (first, third))
    same = all(np.array_equal(a.basis(s, 0)[2], b.basis(s, 0)[2]) for s in ("keys", "values"))
    ok = named and aside and same
    return (("recomputed: refused naming the tensor, moved aside, rerun publishes the same bases" if ok else
             f"NOT CLEAN (named={named}, aside={aside}, same={same})"), ok)


_GGUF_CUTS = {"magic and version only": 8, "cut inside the tokenizer's arrays (1 MB)": 1 << 20,
              "cut inside the tensor infos": -5000, "cut inside the tensor data (50 MB)": 50_000_000}


def _gguf_inputs(tmp: Path) -> dict[str, Path]:
    """Malformed GGUF files: the embedded file cut at several points, and small forged headers."""
    from kvtc.workers.model_limits import embedded_gguf, read_gguf_header

    source = embedded_gguf()
    start = read_gguf_header(source).data_start
    out = {}
    with open(source, "rb") as f:
        for label, cut in _GGUF_CUTS.items():
            f.seek(0)
            path = tmp / f"cut-{uuid.uuid4().hex[:6]}.gguf"
            path.write_bytes(f.read(start + cut if cut < 0 else cut))
            out[label] = path
    head = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 3) + b"abc" + struct.pack("<I", 9)
    forged = {"a u8 array of 2^40 items past the end": head + struct.pack("<IQ", 0, 1 << 40),
              "a string array of 2^40 items past the end": head + struct.pack("<IQ", 8, 1 << 40),
              "version 7": b"GGUF" + struct.pack("<IQQ", 7, 0, 0),
              "not a GGUF file": b"PK\x03\x04" + bytes(60),
              "a tensor of unknown type 99": b"GGUF" + struct.pack("<IQQ", 3, 1, 0) + struct.pack("<Q", 1) + b"t"
              + struct.pack("<IQIQ", 1, 32, 99, 0)}
    for label, data in forged.items():
        path = tmp / f"forged-{uuid.uuid4().hex[:6]}.gguf"
        path.write_bytes(data)
        out[label] = path
    return out


@round_five("calibration")
def gguf_files(tmp: Path) -> list[Ended]:
    """Malformed GGUF files given to `kvtc calibrate --model` and to `load_spec`: a clean refusal (exit 2)
    naming the file, before transformers reads it, never exit 1."""
    from kvtc.workers.models import load_spec

    out = []
    with _job_stubbed():
        for label, path in _gguf_inputs(tmp).items():
            size = path.stat().st_size
            out.append(measured("GGUF files", f"{label}: kvtc calibrate", size, lambda path=path: _refused_cli(
                ["calibrate", "--model", str(path), "--registry", str(tmp / "reg")], 2, (path.name,))))
            out.append(measured("GGUF files", f"{label}: load_spec", size, lambda path=path: _refused(
                lambda: load_spec(str(path), cache_dir=tmp / "cache"), ValueError, (path.name,))))
    return out


@round_five("calibration")
def gguf_conversion_cache(tmp: Path) -> list[Ended]:
    """The conversion cache (gguf-<digest>/ with model.safetensors, its record beside) truncated, a weight
    changed, its record missing (an earlier release) or an unlisted file planted: named once, rebuilt. The
    dequantization itself is stubbed (a small safetensors file): the cache logic is what is tried."""
    import numpy as np
    from safetensors.numpy import save_file

    from kvtc.workers import models
    from kvtc.workers.model_limits import embedded_gguf

    source = embedded_gguf()
    digest = models.sha256_file(source)
    calls = []

    def fake_convert(path, folder, digest):
        calls.append(folder)
        save_file({"w": np.arange(4096, dtype=np.float32)}, str(folder / "model.safetensors"))
        (folder / "config.json").write_text('{"model_type": "llama"}')
        models.write_conversion_record(folder, digest)

    def weights(folder: Path) -> Path:
        return folder / "model.safetensors"

    def truncate(folder: Path) -> None:
        data = weights(folder).read_bytes()
        weights(folder).write_bytes(data[: len(data) // 2])

    def change_weight(folder: Path) -> None:
        data = bytearray(weights(folder).read_bytes())
        data[-4:] = struct.pack("<f", 1e30)
        weights(folder).write_bytes(bytes(data))

    cases = {"truncated model.safetensors": truncate, "a weight changed (same size)": change_weight,
             "no record (an earlier release's conversion)": lambda f: (f / models.CONVERSION_RECORD).unlink(),
             "an unlisted safetensors file planted": lambda f: (f / "extra.safetensors").write_bytes(b"x"),
             "the record says another GGUF": lambda f: (f / models.CONVERSION_RECORD).write_text(
                 json.dumps({"source_sha256": "0" * 64, "files": {}}))}
    real, out = models._convert, []
    models._convert = fake_convert
    try:
        def fresh() -> tuple[str, bool]:
            cache = tmp / f"cv-{uuid.uuid4().hex[:8]}"
            folder = models.convert_gguf(source, cache, digest)
            again = models.convert_gguf(source, cache, digest)
            ok = folder == again and len(calls) == 1 and models.conversion_problem(folder, digest) is None
            return ("reused: converted once, recorded, verified" if ok else f"NOT REUSED ({len(calls)} conversions)"), ok
        calls.clear()
        out.append(measured("GGUF conversion cache", "a sound cache", 0, fresh))
        for label, damage in cases.items():
            cache = tmp / f"cv-{uuid.uuid4().hex[:8]}"
            folder = models.convert_gguf(source, cache, digest)
            damage(folder)

            def case(cache=cache, folder=folder):
                calls.clear()
                err = io.StringIO()
                with contextlib.redirect_stderr(err):
                    got = models.convert_gguf(source, cache, digest)
                    models.convert_gguf(source, cache, digest)
                lines = [line for line in err.getvalue().splitlines() if line.strip()]
                ok = got == folder and len(calls) == 1 and len(lines) == 1 and folder.name in lines[0] \
                    and models.conversion_problem(folder, digest) is None
                return ("rebuilt, named once" if ok else f"NOT CLEAN ({len(calls)} conversions, {len(lines)} lines)"), ok
            out.append(measured("GGUF conversion cache", label, 0, case))
    finally:
        models._convert = real
    return out


_ENV_CASES = {  # variable, value, the command line that reads it
    "RAY_memory_usage_threshold=abc (Ray segfaulted)": ("RAY_memory_usage_threshold", "abc", "calibrate"),
    "RAY_memory_usage_threshold=nan": ("RAY_memory_usage_threshold", "nan", "calibrate"),
    "RAY_memory_usage_threshold=-1": ("RAY_memory_usage_threshold", "-1", "calibrate"),
    "RAY_memory_usage_threshold=0.0001": ("RAY_memory_usage_threshold", "0.0001", "calibrate"),
    "RAY_memory_usage_threshold=1.5": ("RAY_memory_usage_threshold", "1.5", "calibrate"),
    "RAY_task_oom_retries=many": ("RAY_task_oom_retries", "many", "calibrate"),
    "RAY_USAGE_STATS_ENABLED=maybe": ("RAY_USAGE_STATS_ENABLED", "maybe", "calibrate"),
    "RAY_ADDRESS=nohostport": ("RAY_ADDRESS", "nohostport", "calibrate"),
    "KVTC_TEST_KILL_ON_SHARD=x": ("KVTC_TEST_KILL_ON_SHARD", "x", "calibrate"),
    "KVTC_REQUIRE_SIGNATURE=yes": ("KVTC_REQUIRE_SIGNATURE", "yes", "list"),
    "KVTC_REQUIRE_KERNELS=true": ("KVTC_REQUIRE_KERNELS", "true", "list"),
    "KVTC_TEST_HOLD_ON_NODE=reduce": ("KVTC_TEST_HOLD_ON_NODE", "reduce", "calibrate"),
    "KVTC_PUBLIC_KEY=/nonexistent.pem": ("KVTC_PUBLIC_KEY", "/nonexistent.pem", "list"),
    "KVTC_CACHE=a file": ("KVTC_CACHE", "", "list"),
}


@round_five("calibration")
def environment_variables(tmp: Path) -> list[Ended]:
    """RAY_* and KVTC_* variables kvtc reads or hands to Ray, set to values nothing can use: refused before Ray
    starts (exit 2), the line naming the variable."""
    reg = tmp / "env-reg"
    reg.mkdir(exist_ok=True)
    afile = tmp / "env-file"
    afile.write_text("x")
    out = []
    with _job_stubbed():
        for label, (name, value, command) in _ENV_CASES.items():
            argv = ["calibrate", "--registry", str(reg)] if command == "calibrate" else ["list", "--registry", str(reg)]

            def case(name=name, value=value or str(afile), argv=argv):
                with _env(**{name: value}):
                    return _refused_cli(argv, 2, (name,))
            out.append(measured("environment variables", label, 0, case))
    return out


_SLOW_REFUSALS = [  # bad command lines the plan stage refused only after loading the model's config and tokenizer
    ["calibrate", "--tp", "7"], ["calibrate", "--model", "tiny:llama", "--tp", "3"],
    ["calibrate", "--sinks", "600", "--window", "600", "--seq-len", "1024"], ["calibrate", "--ratios", "20000"],
    ["calibrate", "--model", "nonexistent-spec"], ["calibrate", "--model", "org/notcached"],
    ["calibrate", "--model", "tiny:nope"], ["calibrate", "--model", "tiny:llama@0x0x0"],
    ["calibrate", "--model", "/nonexistent.gguf"], ["calibrate", "--model", "/tmp"],
    ["calibrate", "--corpus", "/nonexistent.txt"], ["calibrate", "--eval-corpus", "/nonexistent/*.jsonl"],
    ["calibrate", "--objective", "attention", "--sensitivity", "0"], ["calibrate", "--sensitivity", "0"],
    ["calibrate", "--basis-budget", "1e-9%"], ["calibrate", "--store", "{afile}"], ["calibrate", "--cache-dir", "{afile}"],
    ["eval", "toy"], ["eval", "toy", "--model", "nonexistent"], ["drift", "toy"], ["drift", "toy", "--model", "x/y/z"],
    ["recalibrate", "toy"], ["recalibrate", "toy", "--model", "tiny:nope"],
]

_CHILD = r"""
import builtins, contextlib, io, json, sys, time
t0 = time.perf_counter()
real = builtins.__import__
def guarded(name, *a, **k):  # the job and Ray replaced by a raise: a line that is not refused runs nothing
    mod = real(name, *a, **k)
    for target, attr in (("kvtc.pipeline.job.calibrate", "run"), ("ray", "init"), ("kvtc.workers.models", "load_model")):
        m = sys.modules.get(target)
        if m is not None and not getattr(m, "_kvtc_guarded", False) and hasattr(m, attr):
            setattr(m, attr, lambda *x, **y: (_ for _ in ()).throw(RuntimeError("WOULD RUN")))
            m._kvtc_guarded = True
    return mod
builtins.__import__ = guarded
from kvtc.pipeline import cli
err = io.StringIO()
with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
    rc = cli.main(json.loads(sys.argv[1]))
peak = next(int(l.split()[1]) << 10 for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(json.dumps({"rc": rc, "err": err.getvalue(), "seconds": time.perf_counter() - t0, "peak": peak}))
"""


def _cold_cli(argv: list[str]) -> dict:
    """A command line in a fresh interpreter (cold imports, as a user runs it): rc, stderr, seconds, peak RSS."""
    import subprocess

    done = subprocess.run([sys.executable, "-P", "-c", _CHILD, json.dumps(argv)], capture_output=True, text=True,
                          timeout=60, start_new_session=True)
    try:
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"rc": done.returncode, "err": done.stderr[-300:], "seconds": 60.0, "peak": 0}


@round_five("calibration")
def command_lines(tmp: Path) -> list[Ended]:
    """`kvtc list` of a registry path that does not exist (exit 2 naming it) and of an empty one (exit 0, nothing
    listed); the bad command lines that took 2.2-10.6 s to refuse, each in a fresh interpreter: exit 2, one line,
    under 2 s. Peak RSS: above a refusal that loads nothing (`kvtc show ../x`)."""
    reg = tmp / "cl-reg"
    publish(toy_content(), reg)
    empty = tmp / "cl-empty"
    empty.mkdir()
    afile = tmp / "cl-file"
    afile.write_text("x")
    out = [measured("command lines", "kvtc list --registry /nonexistent", 0, lambda: _refused_cli(
        ["list", "--registry", str(tmp / "nonexistent")], 2, ("nonexistent", "does not exist")))]

    def listed_empty() -> tuple[str, bool]:
        rc, err = _cli("list", "--registry", str(empty))
        return ("listed nothing, exit 0" if rc == 0 and not err.strip() else f"exit {rc}: {err[:60]}"), rc == 0
    out.append(measured("command lines", "kvtc list of an empty registry", 0, listed_empty))
    base = _cold_cli(["show", "../x", "--registry", str(reg)])["peak"]
    for argv in _SLOW_REFUSALS:
        argv = [a.replace("{afile}", str(afile)) for a in argv] + ["--registry", str(reg)]
        got = _cold_cli(argv)
        lines = got["err"].strip().splitlines()
        ok = got["rc"] == 2 and len(lines) == 1 and "Traceback" not in got["err"] and got["seconds"] < 2.0
        how = f"exit {got['rc']}, {'one line' if len(lines) == 1 else f'{len(lines)} lines'}, {got['seconds']:.2f} s cold"
        out.append(Ended("command lines", " ".join(argv[:-2]), how if ok else f"NOT CLEAN: {how}: {got['err'][:80]}",
                         ok, 0, max(0, got["peak"] - base), got["seconds"]))
    return out


# ---- issue 49, the serving side: extreme finite chunks, the runtime without constriction, decode memory,
# chunks after a restart (keyed frames), the vLLM tier's budget, a bad --l2-adapter ----

def _serving_spec():
    from helpers.ecsq_synthetic import synthetic_ecsq_spec

    return synthetic_ecsq_spec(2, 2, 8, 4.0, sinks=2, window=3)


@round_five("serving")
def extreme_finite_chunks(tmp: Path) -> list[Ended]:
    """Chunks holding a key and a value token at the dtype's maximum (fp32 3.4e38, bf16 3.39e38), 1e38, 1e10 and
    -1e35, first and later, through the chunk store's transform, the vLLM tier's chunk codec and KVTCCache's coder:
    each stored and loaded back finite (never "corrupt or forged"), or refused in one line."""
    from helpers.lmcache_artifacts import chunk
    from helpers.synthetic import synthetic_cache
    from kvtc.kernels.codec.chunk_serde import ChunkTransform, binding
    from kvtc.kernels.integrations.kvtc_cache import _CodedStore
    from kvtc.kernels.codec.coefficients import CoefficientCoder
    from kvtc.kernels.integrations.vllm_offload import ChunkCodec

    spec = _serving_spec()
    t = ChunkTransform(KVTCCodec(spec), positions=True)
    tier = ChunkCodec(KVTCCodec(spec), [0, 1])
    store = _CodedStore(CoefficientCoder(spec, "torch", "ecsq"))
    out = []
    for dtype, value in ((torch.float32, torch.finfo(torch.float32).max), (torch.bfloat16, 3.39e38),
                         (torch.float32, 1e38), (torch.float32, 1e10), (torch.bfloat16, -1e35)):
        for start in (0, 16):
            def case(dtype=dtype, value=value, start=start) -> tuple[str, bool]:
                kv = chunk(*synthetic_cache(spec, 16, torch.float32, start=start)).to(dtype)
                kv[0, 1, 5, :] = value
                kv[1, 0, 3, :] = value
                data = t.serialize(kv, start=start, key=binding(b"k", start))
                back = torch.empty_like(kv)
                t.deserialize(data, back, start=None, key=binding(b"k", start))
                k, v = kv[0].reshape(2, 16, 2, 8).permute(0, 2, 1, 3), kv[1].reshape(2, 16, 2, 8).permute(0, 2, 1, 3)
                tk, tv = tier.decode(tier.encode(k, v, start + 32), torch.device("cpu"), start + 32)
                coded = store.encode(k[:, None], v[:, None], start + 32)
                fine = all(bool(torch.isfinite(x.float()).all()) for x in (back, tk, tv))
                return (f"correct: stored and loaded finite ({coded.mode} in KVTCCache)" if fine else "NOT FINITE"), fine
            out.append(measured("extreme finite chunks", f"{str(dtype)[6:]} {value:.3g} at {start}", 16 * 64, case))
    return out


_NO_CONSTRICTION = """
import sys
sys.modules["constriction"] = None
sys.path.insert(0, sys.argv[1])
import torch
from helpers.ecsq_synthetic import synthetic_ecsq_spec
from helpers.synthetic import synthetic_cache
from kvtc.kernels import KVTCCodec
spec = synthetic_ecsq_spec(2, 2, 8, 4.0, sinks=2, window=3)
codec = KVTCCodec(spec)
keys, values = synthetic_cache(spec, 40, torch.float32, start=0)
k, v = codec.decode(codec.encode(keys, values, start=0))
print("decoded", float((k - keys).norm() / keys.norm()) < 0.3)
"""


@round_five("serving")
def runtime_without_constriction(tmp: Path) -> list[Ended]:
    """A default-mode (rans) blob encoded and decoded in a process where constriction cannot be imported."""
    import subprocess

    script = tmp / "no_constriction.py"
    script.write_text(_NO_CONSTRICTION)

    def case() -> tuple[str, bool]:
        run = subprocess.run([sys.executable, "-P", str(script), str(Path(__file__).resolve().parents[1] / "tests")],
                             capture_output=True, text=True, timeout=300)
        ok = run.returncode == 0 and "decoded True" in run.stdout
        return ("correct: decoded without constriction" if ok else f"FAILED: {run.stderr.strip()[-120:]}"), ok
    return [measured("runtime without constriction", "rans blob, constriction unimportable", 0, case, deadline=300)]


@round_five("serving")
def decode_memory(tmp: Path) -> list[Ended]:
    """ECSQ blobs of a small artifact (2 layers x 4 KV heads x 16 dims, float32) declaring 8K to 131K tokens,
    decoded here: correct when decode's peak RSS stays within 2.5 x its output (bench/decode_memory.py measures
    each in a fresh process, before and after)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import decode_memory as dm

    codec = dm._codec()
    codec.decode(dm._tiny_blob(codec))
    out = []
    for tokens in (8192, 32768, 131072):
        path = tmp / f"decode-{tokens}.blob"
        dm._blob(tokens, path)
        blob = path.read_bytes()

        def case(blob=blob) -> tuple[str, bool]:
            import gc

            gc.collect()
            _reset_peak()
            before = _status("VmRSS")
            keys, values = codec.decode(blob)
            grown = _status("VmHWM") - before
            size = keys.numel() * keys.element_size() + values.numel() * values.element_size()
            ok = grown <= 2.5 * size
            return f"{'correct' if ok else 'TOO LARGE'}: peak {grown / size:.2f} x the output of {size / 1e6:.0f} MB", ok
        out.append(measured("decode memory", f"{tokens} tokens, blob {len(blob) / 1e6:.1f} MB", len(blob), case,
                            deadline=120))
    return out


@round_five("serving")
def chunks_after_a_restart(tmp: Path) -> list[Ended]:
    """A RoPE-removed chunk stored under a deployment chunk key, loaded by a fresh transform (a restarted server:
    no position recorded) at its blob's position; then forged or altered by a writer of the store without the key
    (unkeyed frame, MAC of another blob, one bit flipped, another key, no key configured): each a miss naming why."""
    from helpers.lmcache_artifacts import chunk
    from helpers.synthetic import synthetic_cache
    from kvtc.kernels.codec.chunk_serde import FRAME_BYTES, ChunkTransform, binding
    from kvtc.kernels.integrations.lmcache_settings import load_chunk_key

    spec = _serving_spec()
    key = load_chunk_key(tmp / "chunk-key")
    kv = chunk(*synthetic_cache(spec, 16, torch.float32, start=32))
    k = binding(b"chunk", 32)
    stored = ChunkTransform(KVTCCodec(spec), positions=True, chunk_key=key).serialize(kv, start=32, key=k)
    other = ChunkTransform(KVTCCodec(spec), positions=True, chunk_key=key).serialize(kv * 2, start=48, key=k)
    flipped = bytearray(stored)
    flipped[FRAME_BYTES + 40] ^= 1
    unkeyed = ChunkTransform(KVTCCodec(spec), positions=True).serialize(kv * 3, start=32, key=k)
    cases = [("restarted server, same key", stored, key, k, None),
             ("unkeyed frame forged", unkeyed, key, k, "unkeyed frame"),
             ("another blob under the MAC", stored[:FRAME_BYTES] + other[FRAME_BYTES:], key, k, "does not verify"),
             ("one bit of the blob flipped", bytes(flipped), key, k, "does not verify"),
             ("read for another key", stored, key, binding(b"other", 32), "does not verify"),
             ("server without the key", stored, None, k, "is keyed")]
    out = []
    for label, data, chunk_key, asked, says in cases:
        def case(data=data, chunk_key=chunk_key, asked=asked, says=says) -> tuple[str, bool]:
            fresh = ChunkTransform(KVTCCodec(spec), positions=True, chunk_key=chunk_key)
            dst = torch.zeros_like(kv)
            try:
                fresh.deserialize(data, dst, start=None, key=asked)
            except BlobError as exc:
                one = "\n" not in str(exc)
                return f"refused: {str(exc)[:60]}", says is not None and says in str(exc) and one and not dst.any()
            ok = says is None and float((dst - kv).norm() / kv.norm()) < 0.3
            return ("correct: loaded at its blob's position" if ok else "LOADED A FORGED CHUNK"), ok
        out.append(measured("chunks after a restart", label, len(data), case))
    return out


@round_five("serving")
def vllm_tier_budget(tmp: Path) -> list[Ended]:
    """Many short distinct prompts (each one first chunk, its sinks raw) through the vLLM tier's manager and worker
    at 16- and 256-token chunks: correct when the blobs the worker holds stay within cpu_bytes_to_use."""
    try:
        import vllm.v1.kv_offload.base  # noqa: F401
    except ImportError:
        return [Ended("vLLM tier budget", "vLLM not installed", "skipped", True)]
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import vllm_budget as vb

    t = vb._tests()
    _, registry = t._artifact(tmp / "vllm")
    out = []
    for blocks, budget in ((4, 1 << 20), (64, 4 << 20)):
        def case(blocks=blocks, budget=budget) -> tuple[str, bool]:
            r = vb.measure(t, registry, blocks, budget)
            ok = r["worker_bytes"] <= budget
            return f"{'correct' if ok else 'OVER BUDGET'}: holds {r['worker_bytes'] / budget:.2f} x the budget", ok
        out.append(measured("vLLM tier budget", f"{blocks * t.N}-token chunks", 0, case, deadline=300))
    return out


@round_five("serving")
def bad_l2_adapters(tmp: Path) -> list[Ended]:
    """`kvtc lmcache-server` with a bad --l2-adapter (not JSON, not an object, an unknown type, a kvtc serde
    without its artifact, a chunk key that cannot be created): exit 2 in one line."""
    import subprocess

    try:
        import lmcache.v1.distributed.config  # noqa: F401
    except ImportError:
        return [Ended("bad --l2-adapter", "LMCache not installed", "skipped", True)]
    out = []
    for label, adapter in (("not JSON", "{bad"), ("a list", "[1]"), ("unknown type", '{"type": "nope"}'),
                           ("serde without artifact", '{"type": "fs", "base_path": "/tmp/x", "serde": {"type": "kvtc"}}'),
                           ("key file in a missing folder", json.dumps({"type": "fs", "base_path": str(tmp), "serde": {
                               "type": "kvtc", "artifact": "a", "ratio": 8, "key_file": "/nonexistent/k"}}))):
        def case(adapter=adapter) -> tuple[str, bool]:
            run = subprocess.run([sys.executable, "-P", "-m", "kvtc.kernels.integrations.lmcache_server", "--host",
                                  "127.0.0.1", "--port", "6999", "--l1-size-gb", "0.1", "--eviction-policy", "LRU",
                                  "--l2-adapter", adapter], capture_output=True, text=True, timeout=300)
            lines = (run.stdout + run.stderr).strip().splitlines()
            ok = run.returncode == 2 and len(lines) == 1 and lines[0].startswith("kvtc lmcache-server: error:")
            return f"exit {run.returncode}, {len(lines)} line(s)", ok
        out.append(measured("bad --l2-adapter", label, len(adapter), case, deadline=300))
    return out


def round_five_table(ended: list[Ended]) -> str:
    """Per family: cases, refused cleanly, correct results, defects; the longest refusal and the largest peak RSS
    a refusal added (inputs under 1 MB, and over); the longest correct result (a recomputation or rebuild)."""
    lines = ["| side | family | cases | refused cleanly | correct | defect | longest refusal | largest peak RSS of a "
             "refusal, < 1 MB | same, >= 1 MB | longest correct result |", "|---|---|---|---|---|---|---|---|---|---|"]
    for family in dict.fromkeys(e.family for e in ended):
        cases = [e for e in ended if e.family == family]
        correct = [e for e in cases if e.clean and e.how.startswith(CORRECT)]
        refused = [e for e in cases if e not in correct]  # clean refusals and defects
        small = [e.peak_bytes for e in refused if e.input_bytes < 1 << 20]
        big = [e.peak_bytes for e in refused if e.input_bytes >= 1 << 20]
        clean = sum(e.clean for e in refused)
        lines.append(f"| {SIDES.get(family, '')} | {family} | {len(cases)} | {clean} | {len(correct)} | "
                     f"{len(refused) - clean} | {max((e.seconds for e in refused), default=0.0):.2f} s | "
                     f"{max(small, default=0) / 2**20:.1f} MB | {'-' if not big else f'{max(big) / 2**20:.1f} MB'} | "
                     f"{'-' if not correct else f'{max(e.seconds for e in correct):.2f} s'} |")
    lines += [f"DEFECT: {e.family}: {e.label}: {e.how}" for e in ended if not e.clean]
    return "\n".join(lines)


def run_round_five(tmp: Path, sides: tuple[str, ...] = ("calibration", "serving")) -> list[Ended]:
    """Every registered family of the fifth round on `sides`, in registration order."""
    out: list[Ended] = []
    for side, family in ROUND_FIVE:
        if side in sides:
            ended = family(tmp)
            SIDES.update({e.family: side for e in ended})
            out += ended
    return out


def _in_scratch(run):
    """run(scratch folder) with a private kvtc cache there and warnings silenced -> (its cases, seconds)."""
    with tempfile.TemporaryDirectory() as scratch:
        tmp = Path(scratch)
        os.environ["KVTC_CACHE"] = str(tmp / "cache")
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cases = run(tmp)
        return cases, time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blobs", type=int, default=20000)
    parser.add_argument("--race-seconds", type=float, default=10.0)
    parser.add_argument("--round-three", action="store_true", help="only issue 28's families (special files in every "
                        "store and output folder, nested containers, amplification), with their cost table")
    parser.add_argument("--round-four", action="store_true", help="only issue 35's families (Parquet bombs, "
                        "non-finite values, whitening and drift, degenerate statistics), with their table")
    parser.add_argument("--round-five", action="store_true", help="only issue 49's families (joint budget records, "
                        "reduce checkpoints, sensitivity sums, GGUF files and their conversion cache, environment "
                        "variables, command lines; and the serving side's where registered), with their table")
    parser.add_argument("--side", choices=["calibration", "serving", "both"], default="both",
                        help="--round-five: the families of one side only")
    parser.add_argument("--geometry", default="30,3,64", help="layers,kv_heads,head_dim of the amplification cases "
                        "(default: the embedded SmolLM2's)")
    args = parser.parse_args()
    geometry = tuple(int(x) for x in args.geometry.split(","))
    if args.round_five:
        sides = ("calibration", "serving") if args.side == "both" else (args.side,)
        fifth, seconds = _in_scratch(lambda tmp: run_round_five(tmp, sides))
        print(round_five_table(fifth))
        print(f"\nissue 49's families: {len(fifth)} cases in {seconds:.1f} s")
        return
    fourth, seconds = _in_scratch(lambda tmp: [*parquet_bombs(tmp), *non_finite_cases(tmp), *whitening_and_drift(tmp),
                                               *degenerate_statistics(tmp)])
    print(round_four_table(fourth))
    print(f"\nissue 35's families: {len(fourth)} cases in {seconds:.1f} s\n")
    if args.round_four:
        return
    with tempfile.TemporaryDirectory() as scratch:
        tmp = Path(scratch)
        os.environ["KVTC_CACHE"] = str(tmp / "cache")
        t0 = time.perf_counter()
        third = [*store_special_files(tmp), *output_special_files(tmp), *cache_special_files(tmp),
                 *nested_containers(), *amplification(geometry)]
        print(round_three_table(third))
        print(f"\nissue 28's families: {len(third)} cases in {time.perf_counter() - t0:.1f} s")
    if args.round_three:
        return
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
