"""Registry behaviour on a local disk and on an S3-compatible server (moto, loopback) through fsspec:
round trip, tamper detection, immutability, aliases, concurrent and killed publishers."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from kvtc.artifacts import (ArtifactNotFoundError, IntegrityError, Registry, RegistryNotWritableError,
                       VersionExistsError, check_writable, kernel_bundle_hash, publish, pull)
from helpers.toy_artifacts import toy_content

REPO = Path(__file__).resolve().parents[2]


# `registry`: tests/conftest.py's (a local registry, then a fresh bucket on this module's moto server)


def _registry_file(reg: Registry, name: str, version: str, rel: str) -> str:
    return f"{reg.version_path(name, version)}/{rel}"


def test_round_trip_is_bit_exact(registry, tmp_path):
    content = toy_content(groups=[[0, 1], [1, 2]])
    ref = publish(content, registry)
    art = pull("toy", registry=registry, cache_dir=tmp_path / "c1")
    assert art.version == ref.version == registry.resolve("toy", "latest")
    assert ref.path.endswith(f"/toy/versions/{ref.version}") and ref.path.startswith("/" if registry.local else "s3://")
    for (stream, group), (mean, eig, comp) in content.bases.items():
        got_mean, got_eig, got_comp = art.basis(stream, group)
        k = got_comp.shape[1]
        assert k == max(b[0] + b[1] for a in content.allocations.values() for b in a["blocks"] if b[2] != "none")
        assert got_mean.tobytes() == mean.tobytes()
        assert got_eig.tobytes() == eig[:k].tobytes()
        assert got_comp.tobytes() == np.ascontiguousarray(comp[:, :k]).tobytes()
    for (ratio, stream, group), alloc in content.allocations.items():
        info = art.allocation_info(ratio, stream, group)
        assert info["blocks"] == [tuple(b) for b in alloc["blocks"]]
        assert (info["budget_bits"], info["cost_bits"], info["kept"]) == (alloc["budget_bits"], alloc["cost_bits"], alloc["kept"])
        assert art.allocation(ratio, stream, group) == [tuple(b[:4]) for b in alloc["blocks"]]
    assert art.metrics() == content.metrics
    assert {n: art.curve(n) for n in art.curves()} == content.curves
    for rel, data in content.extra_files.items():
        assert art.file(rel).read_bytes() == data
    manifest = art.manifest
    assert manifest["model"] == content.model and manifest["corpus"] == content.corpus
    assert manifest["calibration"]["groups"] == [[0, 1], [1, 2]]
    assert manifest["kernel_bundle_hash"] == kernel_bundle_hash() and art.kernels_match()
    assert art.file("kernels/reference.py").read_bytes() == (REPO / "kernels" / "codec" / "reference.py").read_bytes()
    codec_files = sorted(p.relative_to(REPO / "kernels" / "codec").as_posix() for p in (REPO / "kernels" / "codec").rglob("*.py"))
    assert sorted(rel for rel in manifest["files"] if rel.startswith("kernels/")) == [f"kernels/{rel}" for rel in codec_files]
    assert kernel_bundle_hash(art.file("kernels/__init__.py").parent) == manifest["kernel_bundle_hash"]  # the shipped folder
    again = pull(f"toy@{ref.version}", registry=registry, cache_dir=tmp_path / "c1")
    assert again.path == art.path


def test_tampered_or_truncated_file_is_refused(registry, tmp_path):
    ref = publish(toy_content(), registry)
    rel = "bases/keys-g0.components.parquet"
    path = _registry_file(registry, "toy", ref.version, rel)
    data = bytearray(registry.fs.cat_file(path))
    data[len(data) // 2] ^= 0x01
    registry.fs.pipe_file(path, bytes(data))
    with pytest.raises(IntegrityError, match=rel):
        pull("toy", registry=registry, cache_dir=tmp_path / "c1")
    registry.fs.pipe_file(path, bytes(data[:-10]))
    with pytest.raises(IntegrityError, match=f"{rel} has {len(data) - 10} bytes"):
        pull("toy", registry=registry, cache_dir=tmp_path / "c2")


def test_cached_copy_that_no_longer_verifies_is_fetched_again(registry, tmp_path):
    publish(toy_content(), registry)
    art = pull("toy", registry=registry, cache_dir=tmp_path / "c")
    target = art.path / "metrics.parquet"
    target.write_bytes(target.read_bytes()[:-1])
    assert pull("toy", registry=registry, cache_dir=tmp_path / "c").metrics() == toy_content().metrics


def test_versions_are_immutable_and_aliases_move(registry, tmp_path):
    first = publish(toy_content(seed=1), registry, version="v1")
    with pytest.raises(VersionExistsError):
        publish(toy_content(seed=2), registry, version="v1")
    assert pull("toy@v1", registry=registry, cache_dir=tmp_path / "c").metrics() == toy_content(seed=1).metrics
    second = publish(toy_content(seed=2, parent="v1"), registry)
    assert second.manifest["parent"] == "v1"
    assert registry.versions("toy") == sorted([first.version, second.version])
    assert registry.resolve("toy") == second.version
    registry.set_alias("toy", "production", "v1")
    assert registry.aliases("toy") == {"latest": second.version, "production": "v1"}
    assert pull("toy@production", registry=registry, cache_dir=tmp_path / "c").version == "v1"
    with pytest.raises(ArtifactNotFoundError, match="staging"):
        pull("toy@staging", registry=registry)
    with pytest.raises(ValueError, match="parent"):
        publish(toy_content(parent="nope"), registry)


def test_check_writable(registry, tmp_path):
    check_writable(registry)
    if registry.local:
        (tmp_path / "file").write_text("x")
        bad = str(tmp_path / "file" / "registry")
    else:
        bad = f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/reg"
    with pytest.raises(RegistryNotWritableError, match="not writable"):
        check_writable(bad)


PUBLISHER = textwrap.dedent("""
    import sys, time
    from kvtc.artifacts import VersionExistsError, publish
    from helpers.toy_artifacts import toy_content
    root, seed, start = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    content = toy_content(seed=seed)
    time.sleep(max(0.0, start - time.time()))
    print("version", publish(content, root).version, flush=True)
    time.sleep(max(0.0, start + 1.5 - time.time()))
    try:
        print("same", publish(content, root, version="same", alias_latest=False).version, flush=True)
    except VersionExistsError:
        print("same", "exists", flush=True)
""")


def _spawn(args: list[str], env: dict | None = None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")]), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.Popen([sys.executable, "-c", PUBLISHER if args[0] == "pub" else args[0], *args[1:]],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_concurrent_publishers_leave_both_versions_whole(registry, tmp_path):
    start = time.time() + 4.0
    procs = [_spawn(["pub", registry.uri, str(seed), str(start)]) for seed in (1, 2)]
    outputs = []
    for proc in procs:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        outputs.append(dict(line.split(" ", 1) for line in out.strip().splitlines()))
    versions = [o["version"] for o in outputs]
    assert len(set(versions)) == 2
    assert sorted(o["same"] for o in outputs) == ["exists", "same"]
    assert set(registry.versions("toy")) == {*versions, "same"}
    for version in (*versions, "same"):
        pull(f"toy@{version}", registry=registry, cache_dir=tmp_path / "c").verify()
    assert registry.resolve("toy", "latest") in versions


KILLED = "import sys; from kvtc.artifacts import publish; from helpers.toy_artifacts import toy_content; publish(toy_content(), sys.argv[1])"


def test_killed_publish_leaves_no_version_and_next_publish_succeeds(registry, tmp_path):
    proc = _spawn([KILLED, registry.uri], env={"KVTC_TEST_PAUSE_AT": "before_commit"})
    line = proc.stdout.readline()
    assert line.startswith("KVTC_PAUSED"), proc.stderr.read()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    assert registry.names() == [] and registry.versions("toy") == []
    with pytest.raises(ArtifactNotFoundError):
        pull("toy", registry=registry)
    ref = publish(toy_content(), registry)
    assert registry.versions("toy") == [ref.version]
    pull("toy", registry=registry, cache_dir=tmp_path / "c").verify()


def test_a_staged_folder_appears_whole_or_not_at_all(tmp_path):
    import errno
    import hashlib
    import io

    from kvtc.artifacts.local_files import sha256_handle, stage_folder

    final = tmp_path / "out" / "v1"

    def fill(folder):
        (folder / "a.bin").write_bytes(b"a")
        return "filled"

    assert stage_folder(final, fill) == "filled" and (final / "a.bin").read_bytes() == b"a"
    assert [p.name for p in final.parent.iterdir()] == ["v1"]  # the staging folder is gone

    def broken(folder):
        (folder / "half").write_bytes(b"x")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        stage_folder(tmp_path / "out" / "v2", broken)
    assert [p.name for p in final.parent.iterdir()] == ["v1"]  # nothing half-written is left

    final.joinpath("b.bin").write_bytes(b"b")  # a concurrent writer won: its folder stands, or the caller says no
    assert stage_folder(final, fill, taken=lambda exc: final.exists()) == "filled"
    assert (final / "b.bin").exists()

    def refuse(exc):
        if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
            raise FileExistsError("taken")
        return False

    with pytest.raises(FileExistsError, match="taken"):
        stage_folder(final, fill, tmp_path / "out" / ".staging" / "x", refuse)
    assert not (tmp_path / "out" / ".staging" / "x").exists()
    assert sha256_handle(io.BytesIO(b"abc" * 1000), chunk=7) == hashlib.sha256(b"abc" * 1000).hexdigest()
