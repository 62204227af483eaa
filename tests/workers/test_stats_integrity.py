"""Crafted statistics objects (issue 21): forged footers, object dtypes, huge shapes, bad JSON, forged
held-out rows. Each ends in a CorruptStats naming the object, which the store moves aside; never a
crash, a huge allocation or a silently different basis."""
from __future__ import annotations

import hashlib
import json
import os
import stat
import struct

import numpy as np
import pytest
import torch

from kvtc.pipeline.job.store import KEY_FILE, ShardStore
from kvtc.workers.capture import CaptureSettings
from kvtc.workers.stats import CalibrationStats
from kvtc.workers.stats_file import MAGIC, CorruptStats

FP = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 4}


def _stats(ids=("s0",), seed=1.0) -> CalibrationStats:
    s = CalibrationStats.new(FP, CaptureSettings(sinks=0, window=0), shard_ids=tuple(ids))
    for stream in ("keys", "values"):
        m = s._get(stream, 0, torch.device("cpu"))
        m.n = 1
        m.sum += seed
    return s


def _reforge(data: bytes, edit) -> bytes:
    """Rewrite an object's footer as an attacker without the store key can: edit it, recompute sha256."""
    (length,) = struct.unpack("<Q", data[-48:-40])
    footer = json.loads(data[-48 - length:-48])
    edit(footer)
    new = json.dumps(footer, sort_keys=True).encode()
    return data[:-48 - length] + new + struct.pack("<Q", len(new)) + hashlib.sha256(new).digest() + MAGIC


def _store(tmp_path) -> ShardStore:
    return ShardStore(str(tmp_path / "store"), "m", "c")


def test_the_store_key_is_private_and_a_forged_footer_does_not_verify(tmp_path):
    store = _store(tmp_path)
    store.put_acc("a0", _stats())
    key = tmp_path / "store" / KEY_FILE
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and len(key.read_bytes()) == 32
    path = next((tmp_path / "store").rglob("a0.stats"))
    forged = _reforge(path.read_bytes(), lambda f: f["metadata"].update(shard_ids=["s0", "s1", "s2"]))
    path.write_bytes(forged)
    assert store.acc_shards("a0") is None  # refused, moved aside, recomputed by the run
    assert not path.exists() and path.with_name("a0.stats.corrupt").exists()
    path.write_bytes(forged)
    with pytest.raises(CorruptStats, match=r"a0\.stats is corrupt .*not authenticated"):
        store.get_acc("a0")
    assert not path.exists()


def test_an_object_under_another_store_key_is_refused(tmp_path):
    other = ShardStore(str(tmp_path / "other"), "m", "c")
    other.put_acc("a0", _stats())
    store = _store(tmp_path)
    store.put_acc("a1", _stats())
    target = next((tmp_path / "store").rglob("a1.stats")).with_name("a0.stats")
    target.write_bytes(next((tmp_path / "other").rglob("a0.stats")).read_bytes())
    with pytest.raises(CorruptStats, match="authentication failed"):
        store.get_acc("a0")


@pytest.mark.parametrize("edit, problem", [
    (lambda f: f["tensors"]["keys/0/sum"].update(dtype="|O"), "no valid dtype"),
    (lambda f: f["tensors"]["keys/0/gram_triu"].update(shape=[1 << 40]), "is not its"),
    (lambda f: f["tensors"]["keys/0/sum"].update(offset=1 << 50), "past the end"),
    (lambda f: f["tensors"]["keys/0/sum"].update(shape=[-4]), "negative"),
    (lambda f: f["metadata"].pop("dims"), "malformed metadata"),
    (lambda f: f["metadata"].update(dims=[2]), "not float64 arrays for p=2"),
])
def test_crafted_dtypes_shapes_and_metadata_are_refused_before_allocating(tmp_path, edit, problem):
    path = tmp_path / "crafted.stats"
    path.write_bytes(_reforge(_stats().to_bytes(), edit))  # stand-alone file: plain sha256 footer, forgeable
    with pytest.raises(CorruptStats, match=f"crafted.stats is corrupt .*{problem}"):
        CalibrationStats.load(path)


def test_bad_json_names_the_object(tmp_path):
    data = _stats().to_bytes()
    (length,) = struct.unpack("<Q", data[-48:-40])
    junk = b"{not json" + b" " * (length - 9)
    path = tmp_path / "junk.stats"
    path.write_bytes(data[:-48 - length] + junk + data[-48:-40] + hashlib.sha256(junk).digest() + MAGIC)
    with pytest.raises(CorruptStats, match=r"junk\.stats is corrupt \(footer is not JSON"):
        CalibrationStats.load(path)


def test_forged_or_legacy_objects_in_the_store_are_moved_aside(tmp_path):
    store = _store(tmp_path)
    store.put_acc("a0", _stats())
    path = next((tmp_path / "store").rglob("a0.stats"))
    path.write_bytes(_stats().to_bytes())  # unkeyed (an older release's form, or a forgery)
    with pytest.raises(CorruptStats, match="older release"):
        store.get_acc("a0")
    assert path.with_name("a0.stats.corrupt").exists()
    store.put_basis("b0", {"components": np.eye(3, dtype=np.float32)}, {"k": 3})
    basis = next((tmp_path / "store").rglob("b0.basis"))
    basis.write_bytes(_reforge(basis.read_bytes()[:-8] + MAGIC, lambda f: None))
    with pytest.raises(CorruptStats, match="b0.basis"):
        store.get_basis("b0")
    assert basis.with_name("b0.basis.corrupt").exists()


def test_forged_held_out_rows_are_refused_and_moved_aside(tmp_path):
    from safetensors.numpy import load as st_load
    from safetensors.numpy import save as st_save

    store = _store(tmp_path)
    rows = {"keys": np.ones((3, 4), np.float32), "positions": np.arange(3)}
    store.put("sh", "rows", rows, {"n": 3})
    arrays, meta = store.get("sh", "rows")
    assert meta == {"n": 3} and np.array_equal(arrays["keys"], rows["keys"])
    path = next((tmp_path / "store").rglob("sh.rows.safetensors"))
    data = path.read_bytes()
    header = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])["__metadata__"]
    forged = dict(st_load(data), keys=np.full((3, 4), 9, np.float32))
    path.write_bytes(st_save(forged, metadata=header))  # the old MAC kept: it no longer matches
    with pytest.raises(CorruptStats, match=r"sh\.rows\.safetensors is corrupt .*not authenticated"):
        store.get("sh", "rows")
    assert not path.exists() and os.path.exists(f"{path}.corrupt")
    path.write_bytes(b"\xff" * 64)
    with pytest.raises(CorruptStats, match="moved aside"):
        store.get("sh", "rows")
