"""Issue 35: Parquet files bounded by the manifest before they are read, decode never
returns a non-finite value, drift fails closed, degenerate statistics named and moved aside."""
from __future__ import annotations

import io
import math
import os
import time

import numpy as np
import pytest
import torch

from kvtc.artifacts import IntegrityError, Registry, publish, pull
from kvtc.artifacts import tables
from kvtc.artifacts.errors import CorruptArtifactError
from kvtc.artifacts.manifest import build_files
from kvtc.artifacts.parquet_bounds import Declared, check_bounds
from kvtc.kernels import BlobError, KVTCCodec, read_blob
from kvtc.kernels.codec.blob import TAG_RAW_HEAD, TAG_RAW_TAIL, Section, write_blob
from kvtc.kernels.codec.entropy import PLAIN
from kvtc.pipeline.fit.metric import MAX_CONDITION, decode_root, encode_root
from kvtc.pipeline.operations.drift import compare, nan_notes
from kvtc.pipeline.job.store import ShardStore
from kvtc.workers.capture import CaptureSettings
from kvtc.workers.stats import CalibrationStats
from kvtc.workers.stats_file import CorruptStats, DegenerateStats

from helpers.parquet_bombs import zero_rows_bomb
from helpers.synthetic import synthetic_cache, synthetic_spec
from helpers.toy_artifacts import forge_version, toy_content


@pytest.fixture()
def toy(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTC_CACHE", str(tmp_path / "cache"))
    reg = Registry(str(tmp_path / "reg"))
    ref = publish(toy_content(), reg)
    return reg, ref.version


# ---- 1. Parquet files checked from their footer before any data is read ----


@pytest.mark.parametrize("rel, read", [
    ("bases/keys-g0.components.parquet", lambda art: art.basis("keys", 0)),
    ("bases/keys-g0.mean.parquet", lambda art: art.basis("keys", 0)),
    ("metrics.parquet", lambda art: art.metrics()),
    ("allocations.parquet", lambda art: art.allocations()),
])
def test_a_parquet_bomb_is_refused_from_its_footer_before_any_data_is_read(toy, rel, read):
    reg, version = toy
    bomb = zero_rows_bomb("component" if "components" in rel else "value")
    assert len(bomb) < 64 << 10
    forge_version(reg, "toy", version, lambda m: None, {rel: bomb})
    art = pull("toy", version, registry=reg)
    t = time.perf_counter()
    with pytest.raises(CorruptArtifactError, match=rel.split("/")[-1]) as caught:
        read(art)
    assert time.perf_counter() - t < 1.0
    assert "rows" in str(caught.value) or "columns" in str(caught.value)


def test_a_page_whose_header_declares_more_than_the_shape_is_refused():
    data = tables.encode_rows([{"value": float(i)} for i in range(100)])
    declared = Declared(max_bytes=64, max_values=10_000, max_rows=1000)
    with pytest.raises(ValueError, match="decode to more than"):
        check_bounds(io.BytesIO(data), len(data), declared)
    assert check_bounds(io.BytesIO(data), len(data), Declared(1 << 20, 10_000, max_rows=1000)).metadata.num_rows == 100


def test_a_legitimate_artifact_reads_back_through_the_bounds(toy):
    reg, version = toy
    art = pull("toy", version, registry=reg)
    content = toy_content()
    assert art.basis("keys", 0)[0].tobytes() == content.bases[("keys", 0)][0].tobytes()
    assert art.allocations() and art.metrics() is not None


def test_a_basis_beyond_any_fit_or_non_finite_is_refused_when_read(toy):
    reg, version = toy
    content = toy_content()
    mean, eig, comp = content.bases[("keys", 0)]
    forged_mean = tables.encode_basis(np.full_like(mean, np.nan), eig, comp, "float32")[1]
    forge_version(reg, "toy", version, lambda m: None, {"bases/keys-g0.mean.parquet": forged_mean})
    with pytest.raises(CorruptArtifactError, match=r"basis \(keys, 0\).*mean holds non-finite"):
        pull("toy", version, registry=reg).basis("keys", 0)
    huge = np.full_like(comp, np.finfo(np.float32).max)
    forge_version(reg, "toy", version, lambda m: None,
                  {"bases/keys-g0.components.parquet": tables.encode_basis(mean, eig, huge, "float32")[0],
                   "bases/keys-g0.mean.parquet": build_files(content)[0]["bases/keys-g0.mean.parquet"]})
    with pytest.raises(CorruptArtifactError, match="beyond"):
        pull("toy", version, registry=reg).basis("keys", 0)


def test_a_decoder_of_float32_max_is_refused_when_read():
    p, k = 8, 4
    data = tables.encode_decoder(np.full((p, k), np.finfo(np.float32).max, np.float32), "float32")
    with pytest.raises(ValueError, match="beyond"):
        tables.decode_decoder(data, (p, k))


def test_an_attention_manifest_needs_a_decoder_for_every_basis(toy):
    reg, version = toy
    forge_version(reg, "toy", version, lambda m: m["calibration"].update(objective="attention"))
    with pytest.raises(IntegrityError, match="no decoder.*attention"):
        pull("toy", version, registry=reg)


def test_a_manifest_entry_without_its_shape_is_refused(toy):
    reg, version = toy
    forge_version(reg, "toy", version, lambda m: m["bases"]["entries"][0].update(k="4"))
    with pytest.raises(IntegrityError, match="declares p"):
        pull("toy", version, registry=reg)


def test_a_deleted_optional_file_is_reported_missing_not_as_failing_its_sha256(toy):
    reg, version = toy
    reg.fs.rm_file(f"{reg.version_path('toy', version)}/report.md")
    with pytest.warns(UserWarning, match="report.md"):
        art = pull("toy", version, registry=reg)
    with pytest.raises(IntegrityError, match="report.md is missing") as caught:
        art.file("report.md")
    assert "sha256" not in str(caught.value)


# ---- 2. decode never returns a non-finite value; encode refuses one anywhere ----


def _codec() -> tuple[KVTCCodec, object]:
    spec = synthetic_spec(2, 2, 8, 4.0, sinks=2, window=3, kept=6, seed=3, rope_theta=None)
    return KVTCCodec(spec, backend="torch", mode="fixed"), spec


_PATTERNS = {torch.float16: (0x7E00, 0x7C00), torch.bfloat16: (0x7FC0, 0x7F80), torch.float32: (0x7FC00000, 0x7F800000),
             torch.float8_e4m3fn: (0x7F, 0x7F)}


@pytest.mark.parametrize("dtype", list(_PATTERNS))
@pytest.mark.parametrize("tag", [TAG_RAW_HEAD, TAG_RAW_TAIL])
def test_raw_sections_holding_nan_or_inf_bit_patterns_are_refused_on_decode(dtype, tag):
    codec, spec = _codec()
    keys, values = synthetic_cache(spec, 12, torch.float32, seed=1)
    keys, values = keys.to(dtype), values.to(dtype)
    header, sections = read_blob(codec.encode(keys, values))
    item = torch.empty(0, dtype=dtype).element_size()
    for pattern in _PATTERNS[dtype]:
        forged = []
        for s in sections:
            if s.key.tag == tag and s.key.stream == 1:
                raw = bytearray(codec_raw(s))
                raw[item:2 * item] = pattern.to_bytes(item, "little")
                s = Section(s.key, PLAIN, len(raw), bytes(raw))
            forged.append(s)
        with pytest.raises(BlobError, match="non-finite value"):
            codec.decode(write_blob(header, forged))


def codec_raw(section: Section) -> bytes:
    from kvtc.kernels.codec.entropy import decode_sections

    return decode_sections([section], None)[section.key] if section.coding != PLAIN else section.stored


def test_encode_refuses_non_finite_values_in_raw_positions_naming_them():
    codec, spec = _codec()
    keys, values = synthetic_cache(spec, 12, torch.float16, seed=1)
    values[1, 0, 0, 3] = float("nan")  # a sink
    with pytest.raises(ValueError, match=r"values hold a non-finite value at .* \(1, 0, 0, 3\)"):
        codec.encode(keys, values)
    values[1, 0, 0, 3] = 0
    keys[0, 1, 11, 2] = float("inf")  # the window
    with pytest.raises(ValueError, match=r"keys hold a non-finite value at .* \(0, 1, 11, 2\).*position 11"):
        codec.encode(keys, values)


@pytest.mark.parametrize("start", [True, False, 1.0, "1"])
def test_start_must_be_an_integer_not_a_bool(start):
    codec, spec = _codec()
    keys, values = synthetic_cache(spec, 12, torch.float16, seed=1)
    with pytest.raises(ValueError, match="start must be an integer"):
        codec.encode(keys, values, start=start)
    assert codec.encode(keys, values, start=np.int64(1))


def test_a_basis_the_held_dtype_cannot_hold_is_refused():
    codec, spec = _codec()
    keys, values = synthetic_cache(spec, 12, torch.float16, seed=1)
    spec.streams["keys"][0].components[0, 0] = 1e6  # beyond float16
    with pytest.raises(ValueError, match="beyond torch.float16's range"):
        KVTCCodec(spec, backend="torch", mode="fixed", basis_dtype=torch.float16).encode(keys, values)


# ---- 3. the whitening checked when read; drift fails closed ----


def _root_file(tmp_path, root: np.ndarray) -> str:
    path = tmp_path / "metric.parquet"
    path.write_bytes(encode_root(root))
    return str(path)


@pytest.mark.parametrize("root, message", [
    (np.zeros((2, 4, 4)), "zero"),
    (np.stack([np.eye(4), np.diag([1.0, 1.0, 1.0, 0.0])]), "singular"),
    (np.stack([np.eye(4), np.eye(4) * 1e-7]), "ill-conditioned"),
    (np.stack([np.eye(4), -np.eye(4)]), "singular"),
    (np.stack([np.eye(4), np.triu(np.ones((4, 4)))]), "not symmetric"),
])
def test_a_degenerate_whitening_is_refused_when_read(tmp_path, root, message):
    with pytest.raises(CorruptArtifactError, match=message):
        decode_root(_root_file(tmp_path, root), 8, 4)


def test_a_sound_whitening_reads_and_a_bomb_is_refused(tmp_path):
    w = decode_root(_root_file(tmp_path, np.stack([np.eye(4) * 2, np.eye(4)])), 8, 4)
    assert np.allclose(w.root[0], 2 * np.eye(4)) and MAX_CONDITION >= 1e6
    path = tmp_path / "bomb.parquet"
    path.write_bytes(zero_rows_bomb("root", 200_000, 16))
    t = time.perf_counter()
    with pytest.raises(CorruptArtifactError, match="rows|columns"):
        decode_root(str(path), 8, 4)
    assert time.perf_counter() - t < 1.0


def test_nan_drift_figures_count_as_drifted():
    recorded = {(4.0, "keys"): 0.1, (4.0, "values"): float("nan"), (8.0, "keys"): 0.2}
    measured = {(4.0, "keys"): float("nan"), (4.0, "values"): 0.1, (8.0, "keys"): 0.2}
    out = compare(recorded, measured, 0.1)
    assert [c.drifted for c in out] == [True, True, False]
    notes = nan_notes(out)
    assert len(notes) == 2 and "measured error is NaN" in notes[0] and "recorded error is NaN" in notes[1]
    assert math.isnan(out[0].change)


# ---- 4. degenerate statistics named, moved aside ----


def _metric_stats(keys: np.ndarray | None = None, values: np.ndarray | None = None,
                  concentration: np.ndarray | None = None) -> CalibrationStats:
    s = CalibrationStats.new({"num_layers": 1, "num_kv_heads": 1, "head_dim": 4}, CaptureSettings(sinks=0, window=0),
                             shard_ids=("s0",))
    for stream in ("keys", "values"):
        s._get(stream, 0, torch.device("cpu")).n = 1
    s.metric = {"keys": torch.from_numpy(np.ones((1, 1, 4)) if keys is None else keys),
                "values": torch.from_numpy(np.eye(4)[None, None] if values is None else values),
                "concentration": torch.from_numpy(np.ones((1, 1)) if concentration is None else concentration)}
    s.metric_tokens = 3
    return s


@pytest.mark.parametrize("tensor, stats, problem", [
    ("metric/keys", lambda: _metric_stats(keys=np.zeros((1, 1, 4))), "is zero"),
    ("metric/keys", lambda: _metric_stats(keys=-np.ones((1, 1, 4))), "holds a negative"),
    ("metric/values", lambda: _metric_stats(values=np.zeros((1, 1, 4, 4))), "is zero"),
    ("metric/values", lambda: _metric_stats(values=-np.eye(4)[None, None]), "holds a negative"),
    ("metric/concentration", lambda: _metric_stats(concentration=np.zeros((1, 1))), "is zero"),
])
def test_degenerate_statistics_are_named_and_moved_aside(tmp_path, tensor, stats, problem):
    store = ShardStore(str(tmp_path / "store"), "m", "c")
    store.put_acc("a0", stats())
    path = store._acc_path("a0")
    with pytest.raises(DegenerateStats, match=f"a0.stats is degenerate: tensor {tensor} {problem}") as caught:
        store.get_acc("a0", keys=[])
    assert isinstance(caught.value, CorruptStats) and caught.value.tensor == tensor
    assert os.path.exists(f"{path}.corrupt") and not os.path.exists(path)
    assert store.acc_shards("a0") is None  # the next run recomputes it
    store.put_acc("a0", _metric_stats())
    assert store.get_acc("a0", keys=[]).metric_tokens == 3


def test_a_negative_variance_in_a_gram_is_named(tmp_path):
    store = ShardStore(str(tmp_path / "store"), "m", "c")
    stats = _metric_stats()
    stats._get("keys", 0, torch.device("cpu")).gram[0] = -1.0
    store.put_acc("a0", stats)
    with pytest.raises(DegenerateStats, match="tensor keys/0/gram_triu holds a negative sum of squares at feature 0"):
        store.get_acc("a0")
