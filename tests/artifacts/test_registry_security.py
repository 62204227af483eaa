"""A registry nobody can subvert, on a local disk and on S3 (moto on loopback): traversal from aliases
and manifests, manifest tampering, copied folders, unlisted files, the kernel bundle, digest pulls,
Ed25519 signatures, `latest` under concurrent publishers, file modes."""
from __future__ import annotations

import json
import os
import threading

import pytest

from kvtc.artifacts import ArtifactNotFoundError, IntegrityError, Registry, publish, pull
from kvtc.artifacts.manifest import encode_manifest, manifest_digest
from kvtc.artifacts.names import split_ref
from helpers.toy_artifacts import forge_version, toy_content


def _files_under(path) -> set[str]:
    return {os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs}


def test_names_and_refs_are_fully_anchored():
    for bad in ("toy\n", "toy@v1\n", "../toy", "toy@..", "toy@a/b", "to y", "toy@sha256:" + "0" * 63, "@v1", ""):
        with pytest.raises(ValueError, match="invalid|ref"):
            split_ref(bad)
    assert split_ref("toy@sha256:" + "a" * 64) == ("toy", "sha256:" + "a" * 64)


def test_alias_pointing_outside_is_refused_and_nothing_is_written_outside(registry, tmp_path):
    ref = publish(toy_content(), registry)
    prefix = registry.path("toy")
    for target in ("../../../../evil", "../versions/" + ref.version, "/etc", "v\n"):
        registry.fs.pipe_file(f"{prefix}/aliases/evil", json.dumps({"version": target}).encode())
        with pytest.raises(IntegrityError, match="invalid version"):
            pull("toy@evil", registry=registry, cache_dir=tmp_path / "cache")
    assert not (tmp_path / "evil").exists() and not (tmp_path / "cache").exists() or \
        all(".." not in f for f in _files_under(tmp_path / "cache"))
    with pytest.raises(IntegrityError, match="unsafe path segment"):
        registry.path("toy", "..", "x")


def test_manifest_naming_another_place_is_refused(registry, tmp_path):
    ref = publish(toy_content(), registry)
    forge_version(registry, "toy", ref.version, lambda m: m.update(name="../../escape"))
    with pytest.raises(IntegrityError, match="invalid name"):
        pull(f"toy@{ref.version}", registry=registry, cache_dir=tmp_path / "c")
    ref2 = publish(toy_content(seed=1), registry)
    forge_version(registry, "toy", ref2.version, lambda m: None, files={"../../../outside.txt": b"x"})
    before = _files_under(tmp_path)
    with pytest.raises(IntegrityError, match="unsafe file path"):
        pull(f"toy@{ref2.version}", registry=registry, cache_dir=tmp_path / "c")
    assert {f for f in _files_under(tmp_path) - before if not f.startswith("root")} == set()


def test_edited_manifest_and_copied_folder_are_refused(registry, tmp_path):
    ref = publish(toy_content(), registry)
    path = f"{registry.version_path('toy', ref.version)}/manifest.json"
    original = registry.fs.cat_file(path)
    registry.fs.pipe_file(path, original.replace(b'"window": 128', b'"window": 64'))
    with pytest.raises(IntegrityError, match="does not match its recorded digest"):
        pull(f"toy@{ref.version}", registry=registry, cache_dir=tmp_path / "c")
    registry.fs.pipe_file(path, original)
    # a consistent forgery passes the digest file but not the digest `latest` recorded, nor a digest pin
    forge_version(registry, "toy", ref.version, lambda m: m["calibration"].update(window=64))
    with pytest.raises(IntegrityError, match="expected sha256:"):
        pull("toy@latest", registry=registry, cache_dir=tmp_path / "c")
    with pytest.raises(ArtifactNotFoundError, match="no version with manifest digest"):
        pull(f"toy@{manifest_digest(original)}", registry=registry, cache_dir=tmp_path / "c")
    # a version folder copied under another id
    registry.fs.pipe_file(path, original)
    registry.fs.pipe_file(f"{registry.version_path('toy', ref.version)}/manifest.sha256",
                          (manifest_digest(original) + "\n").encode())
    other = registry.version_path("toy", "copied")
    for rel in registry.fs.find(registry.version_path("toy", ref.version)):
        target = other + rel[len(registry.version_path("toy", ref.version)):]
        registry.fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
        registry.fs.pipe_file(target, registry.fs.cat_file(rel))
    with pytest.raises(IntegrityError, match="manifest says version"):
        pull("toy@copied", registry=registry, cache_dir=tmp_path / "c")


def test_replaced_file_with_updated_hash_and_kernel_bundle_are_refused(registry, tmp_path):
    ref = publish(toy_content(), registry)
    data = forge_version(registry, "toy", ref.version, lambda m: None, files={"kernels/kvtc_codec.py": b"import os\n"})
    with pytest.raises(IntegrityError, match="kernel bundle hash"):
        pull(f"toy@{ref.version}", registry=registry, cache_dir=tmp_path / "c")
    with pytest.raises(IntegrityError, match="expected sha256:"):
        pull("toy", registry=registry, cache_dir=tmp_path / "c")
    assert manifest_digest(data) != manifest_digest(encode_manifest(ref.manifest))


def test_digest_refs_and_unlisted_files(registry, tmp_path):
    ref = publish(toy_content(), registry)
    digest = manifest_digest(encode_manifest(ref.manifest))
    assert pull(f"toy@{digest}", registry=registry, cache_dir=tmp_path / "c").version == ref.version
    with pytest.raises(ArtifactNotFoundError, match="no version with manifest digest"):
        pull("toy@sha256:" + "0" * 64, registry=registry, cache_dir=tmp_path / "c")
    registry.fs.pipe_file(f"{registry.version_path('toy', ref.version)}/kernels/backdoor.py", b"import os\n")
    art = pull(f"toy@{ref.version}", registry=registry, cache_dir=tmp_path / "c2")
    assert not (art.path / "kernels" / "backdoor.py").exists() or registry.local
    assert registry.unlisted("toy", ref.version, art.manifest) == ["kernels/backdoor.py"]


def test_signatures(registry, tmp_path):
    pytest.importorskip("cryptography")
    from kvtc.artifacts.signing import generate_keypair

    private, public = generate_keypair(tmp_path / "signer")
    _, other_public = generate_keypair(tmp_path / "other")
    assert oct(private.stat().st_mode & 0o777) == "0o600"
    signed = publish(toy_content(), registry, signing_key=private)
    assert pull("toy", registry=registry, public_key=public, require_signature=True, cache_dir=tmp_path / "c")
    with pytest.raises(IntegrityError, match="signed by another key"):
        pull("toy", registry=registry, public_key=other_public, cache_dir=tmp_path / "c")
    unsigned = publish(toy_content(seed=1), registry)
    with pytest.raises(IntegrityError, match="not signed"):
        pull(f"toy@{unsigned.version}", registry=registry, public_key=public, require_signature=True)
    with pytest.raises(ValueError, match="public key"):
        pull(f"toy@{unsigned.version}", registry=registry, require_signature=True)
    registry.sign("toy", unsigned.version, private)
    pull(f"toy@{unsigned.version}", registry=registry, public_key=public, require_signature=True, cache_dir=tmp_path / "c")
    forge_version(registry, "toy", signed.version, lambda m: m["calibration"].update(window=64))
    with pytest.raises(IntegrityError, match="tampered"):
        pull(f"toy@{signed.version}", registry=registry, public_key=public, cache_dir=tmp_path / "c3")


def test_latest_follows_the_newest_version_not_the_last_writer(registry):
    old = publish(toy_content(seed=1), registry, version="old", alias_latest=False)
    new = publish(toy_content(seed=2), registry, version="new")
    registry.move_latest("toy", old.version)  # a slow publisher of the older version writes last
    assert registry.resolve("toy", "latest") == new.version
    if registry.local:
        threads = [threading.Thread(target=publish, args=(toy_content(seed=s), registry)) for s in range(3, 7)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        newest = max(registry.versions("toy"), key=lambda v: registry.read_manifest("toy", v)["created"])
        assert registry.resolve("toy", "latest") == newest


def test_files_follow_the_process_umask(tmp_path):
    old = os.umask(0o022)
    try:
        reg = Registry(str(tmp_path / "reg"))
        publish(toy_content(), reg)
        reg.set_alias("toy", "production", "latest")
        for rel in ("toy/aliases/latest", "toy/aliases/production"):
            assert oct((tmp_path / "reg" / rel).stat().st_mode & 0o777) == "0o644"
    finally:
        os.umask(old)


def test_a_damaged_chart_does_not_stop_the_codec(tmp_path):
    from kvtc.kernels import KVTCCodec

    reg = Registry(str(tmp_path / "reg"))
    content = toy_content()
    content.model["rope"] = {"rope_type": "default", "theta": 10000.0, "head_dim": 8, "rotary_dim": 8,
                             "inv_freq": [10000.0 ** (-2 * i / 8) for i in range(4)], "attention_scaling": 1.0,
                             "layout": "half"}
    ref = publish(content, reg)
    chart = tmp_path / "reg" / "toy" / "versions" / ref.version / "charts" / "allocation.png"
    data = bytearray(chart.read_bytes())
    data[10] ^= 0xFF
    chart.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="charts/allocation.png"):
        codec = KVTCCodec.from_registry("toy", 4.0, registry=reg)
    assert codec.spec.version == ref.version
    with pytest.raises(IntegrityError):
        pull("toy", registry=reg).file("charts/allocation.png")
