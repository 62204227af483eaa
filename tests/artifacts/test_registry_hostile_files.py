"""Issue 21's registry attacks, each ending in a clean refusal or a correct result: version ids shadowed
by aliases, files swapped after verification, special files (FIFO, directory, /dev/zero), oversized
objects, stale `published/` markers, writes through planted symlinks, and the CLI's messages."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal

import numpy as np
import pytest

from kvtc.artifacts import IntegrityError, Registry, publish, pull
from helpers.toy_artifacts import toy_content
from kvtc.pipeline import cli


@pytest.fixture
def local(tmp_path, monkeypatch) -> Registry:
    monkeypatch.setenv("KVTC_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("KVTC_PUBLIC_KEY", raising=False)
    monkeypatch.delenv("KVTC_REQUIRE_SIGNATURE", raising=False)
    return Registry(str(tmp_path / "registry"))


@contextlib.contextmanager
def _deadline(seconds: int = 20):
    """Fail instead of hanging (a FIFO read blocks forever)."""
    def expired(*_):
        raise TimeoutError(f"no answer within {seconds} s: the read hangs")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    with _deadline():
        rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _keys(tmp_path):
    pytest.importorskip("cryptography")
    from kvtc.artifacts.signing import generate_keypair

    return generate_keypair(tmp_path / "signer")


# ---- 3. a version id is a pin ----

def test_a_version_id_always_means_that_version(registry, tmp_path):
    old = publish(toy_content(seed=1), registry)
    new = publish(toy_content(seed=2), registry)
    with pytest.raises(ValueError, match="reads as a version id"):
        registry.set_alias("toy", new.version, old.version)
    # an alias file planted under a version's id does not shadow the version
    registry.fs.pipe_file(registry.path("toy", "aliases", new.version), json.dumps({"version": old.version}).encode())
    assert pull(f"toy@{new.version}", registry=registry, cache_dir=tmp_path / "c").version == new.version
    publish(toy_content(seed=3), registry, version="v3")
    with pytest.raises(ValueError, match="is the id of a version"):
        registry.set_alias("toy", "v3", old.version)
    registry.set_alias("toy", "production", old.version)
    for taken in ("latest", "production"):
        with pytest.raises(ValueError, match="is an alias"):
            publish(toy_content(seed=4), registry, version=taken)


def test_require_signature_pull_of_a_version_id_is_not_rolled_back(local, tmp_path, capsys):
    private, public = _keys(tmp_path)
    old = publish(toy_content(seed=1), local, signing_key=private)
    new = publish(toy_content(seed=2), local, signing_key=private)
    rc, _, err = _cli(capsys, "alias", f"toy@{old.version}", new.version, "--registry", local.uri)
    assert rc == 2 and "reads as a version id" in err and len(err.strip().splitlines()) == 1
    rc, out, _ = _cli(capsys, "pull", f"toy@{new.version}", "--key", str(public), "--require-signature",
                      "--registry", local.uri, "--json")
    assert rc == 0 and json.loads(out)["version"] == new.version


# ---- 4. read once, verified, never re-read ----

def test_a_file_swapped_after_verification_is_never_used(local, tmp_path, monkeypatch):
    import importlib

    from kvtc.kernels import KVTCCodec

    pull_module = importlib.import_module("kvtc.artifacts.pull")

    private, public = _keys(tmp_path)
    content = toy_content()
    content.model["rope"] = {"rope_type": "default", "theta": 10000.0, "head_dim": 8, "rotary_dim": 8,
                             "inv_freq": [10000.0 ** (-2 * i / 8) for i in range(4)], "attention_scaling": 1.0,
                             "layout": "half"}
    ref = publish(content, local, signing_key=private)
    rel = "bases/keys-g0.components.parquet"
    target = os.path.join(ref.path, rel)
    forged = toy_content(seed=5)
    from kvtc.artifacts.manifest import build_files

    swapped = build_files(forged)[0][rel]
    real_verify = pull_module.verify_folder

    def verify_then_swap(*args, **kwargs):  # the attacker wins every race: the swap lands right after the check
        damaged = real_verify(*args, **kwargs)
        with open(target, "wb") as handle:
            handle.write(swapped)
        return damaged

    monkeypatch.setattr(pull_module, "verify_folder", verify_then_swap)
    codec = KVTCCodec.from_registry(f"toy@{ref.version}", 4.0, registry=local, public_key=public,
                                    require_signature=True)
    expected = content.bases[("keys", 0)][2][:, :codec.spec.streams["keys"][0].kept]
    assert np.allclose(codec.spec.streams["keys"][0].components.numpy(), expected, atol=1e-6)
    assert not str(pull("toy", registry=local, verify=False).path).startswith(str(local.root))


# ---- 7. special files, oversized objects ----

@pytest.mark.parametrize("where", ["alias", "manifest.json", "manifest.sig", "manifest.sha256",
                                   "bases/keys-g0.mean.parquet"])
def test_fifos_in_a_registry_are_refused_not_waited_on(local, tmp_path, capsys, where):
    _, public = _keys(tmp_path)
    ref = publish(toy_content(), local)
    folder = os.path.join(local.root, "toy", "versions", ref.version)
    path = os.path.join(local.root, "toy", "aliases", "fifo") if where == "alias" else os.path.join(folder, where)
    if os.path.exists(path):
        os.unlink(path)
    os.mkfifo(path)
    rc, out, err = _cli(capsys, "list", "--registry", local.uri)
    assert rc == 0 and "toy" in out
    rc, _, err = _cli(capsys, "verify", "toy@" + (ref.version if where != "alias" else "fifo"), "--key", str(public),
                      "--registry", local.uri)
    lines = err.strip().splitlines()  # the error, after the unsigned version's warning where it got that far
    assert rc == 6 and "FIFO, not a regular file" in lines[-1] and all(l.startswith("kvtc verify: ") for l in lines)


@pytest.mark.parametrize("where", ["alias", "manifest.json", "manifest.sha256"])
def test_symlinks_to_dev_zero_or_outside_are_refused(local, tmp_path, capsys, where):
    ref = publish(toy_content(), local)
    folder = os.path.join(local.root, "toy", "versions", ref.version)
    path = os.path.join(local.root, "toy", "aliases", "zero") if where == "alias" else os.path.join(folder, where)
    if os.path.exists(path):
        os.unlink(path)
    os.symlink("/dev/zero", path)
    with _deadline(), pytest.raises(IntegrityError, match="symlink|outside"):
        pull("toy@" + ("zero" if where == "alias" else ref.version), registry=local)
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps({"version": ref.version}))
    os.symlink(secret, os.path.join(local.root, "toy", "aliases", "outside"))
    rc, out, err = _cli(capsys, "list", "--registry", local.uri, "--json")
    assert rc == 0 and "outside" in json.loads(out)["toy"].get("error", "")


def test_a_directory_signature_is_tampering(local, tmp_path, capsys):
    _, public = _keys(tmp_path)
    ref = publish(toy_content(), local)
    os.mkdir(os.path.join(ref.path, "manifest.sig"))
    rc, _, err = _cli(capsys, "verify", "toy", "--key", str(public), "--registry", local.uri)
    assert rc == 6 and "manifest.sig" in err and "directory" in err


def test_oversized_objects_are_cut_off_at_their_listed_size(registry, tmp_path, monkeypatch):
    ref = publish(toy_content(), registry)
    prefix = registry.version_path("toy", ref.version)
    registry.fs.pipe_file(f"{prefix}/report.md", b"#" * (8 << 20))  # listed as 13 bytes
    read = []
    real_open = registry.fs.open

    def counting_open(path, mode="rb", **kwargs):  # object stores: what the download loop takes
        handle = real_open(path, mode, **kwargs)
        if path.endswith("report.md"):
            real_read = handle.read
            handle.read = lambda n=-1: read.append(len(data := real_read(n))) or data
        return handle

    monkeypatch.setattr(registry.fs, "open", counting_open)
    with pytest.warns(UserWarning, match="report.md"):
        art = pull("toy", registry=registry, cache_dir=tmp_path / "c")
    assert "report.md" in art.damaged and not (art.path / "report.md").exists()
    assert sum(read) <= 14  # streamed: the listed size + 1, never the whole object
    registry.fs.pipe_file(f"{prefix}/metrics.parquet", b"\0" * (4 << 20))
    with pytest.raises(IntegrityError, match="more than the .* bytes allowed"):
        pull("toy", registry=registry, cache_dir=tmp_path / "c2")


# ---- 8. stale `published/` markers ----

def test_a_stale_published_marker_is_skipped_with_a_warning(registry):
    publish(toy_content(seed=1), registry, version="a")
    publish(toy_content(seed=2), registry, version="b")
    registry.fs.rm(registry.version_path("toy", "b"), recursive=True)  # deleted by hand, marker left behind
    c = publish(toy_content(seed=3), registry, version="c")
    assert registry.resolve("toy", "latest") == c.version
    # a marker newer than anything published (a deleted version, or a clock ahead) made every publish fail
    registry.fs.pipe_file(registry.path("toy", "published", "99991231T000000.ghost"), b"")
    with pytest.warns(UserWarning, match="ghost, which no longer exists"):
        d = publish(toy_content(seed=4), registry, version="d")
    assert registry.resolve("toy", "latest") == d.version and set(registry.versions("toy")) == {"a", "c", "d"}


# ---- 6. writes never follow a planted symlink ----

def test_export_pull_and_report_refuse_to_write_through_symlinks(local, tmp_path, capsys, monkeypatch):
    from kvtc.pipeline.evaluation import report

    monkeypatch.setattr(report, "build_from_artifact", lambda art, quality: {"report.md": b"# report\n"})
    publish(toy_content(), local)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    cases = {
        "export": (["export", "toy", "--ratio", "4", "--to", str(tmp_path / "exp"), "--layout", "token-major",
                    "--allow-rope-removed"], "keys-g0.mean.f32"),
        "pull": (["pull", "toy", "--to", str(tmp_path / "pulled")], "metrics.parquet"),
        "report": (["report", "toy", "--out", str(tmp_path / "rep")], "report.md"),
    }
    for command, (argv, planted) in cases.items():
        folder = tmp_path / argv[argv.index("--to" if "--to" in argv else "--out") + 1].rsplit("/", 1)[-1]
        folder.mkdir()
        os.symlink(victim, folder / planted)
        rc, _, err = _cli(capsys, *argv, "--registry", local.uri)
        assert rc == 6 and "symlink" in err, (command, err)
        assert victim.read_bytes() == b"precious", command


# ---- 9. messages ----

def test_verify_says_what_checked_the_signature_and_warnings_are_one_line(local, tmp_path, capsys, monkeypatch):
    private, public = _keys(tmp_path)
    publish(toy_content(), local, signing_key=private)
    monkeypatch.setenv("KVTC_PUBLIC_KEY", str(public))
    rc, out, _ = _cli(capsys, "verify", "toy", "--registry", local.uri)
    assert rc == 0 and "signature checked (key " in out and "not checked" not in out
    unsigned = publish(toy_content(seed=1), local)
    rc, _, err = _cli(capsys, "pull", f"toy@{unsigned.version}", "--registry", local.uri)
    assert rc == 0 and err.strip().splitlines() == [
        f"kvtc pull: warning: {local.uri}: toy@{unsigned.version} is not signed; loading it unverified "
        "(require signatures with --require-signature)"]
    shutil.rmtree(tmp_path / "cache", ignore_errors=True)
