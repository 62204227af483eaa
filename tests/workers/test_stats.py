"""CalibrationStats: equal to a direct float64 numpy computation, additive, saved without pickle.

Tolerance: Gram products are float32 per batch folded into float64, so entries match the float64
reference to rtol 1e-5 of the largest |entry| (float32 round-off over a few hundred rows).
"""
import json

import numpy as np
import pytest
import torch

from kvtc.workers.capture import CaptureSettings, capture_kv
from kvtc.workers.models import load_model
from kvtc.workers.stats import CalibrationStats

GRAM_RTOL = 1e-5


@pytest.fixture(scope="module")
def lm():
    return load_model("tiny:llama", device="cpu")


def _ids(b: int, t: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 49152, (b, t), generator=torch.Generator().manual_seed(seed))


def _assert_moments(stats: CalibrationStats, stream: str, group: int, rows: np.ndarray) -> None:
    n, s, g = stats.stream(stream, group)
    ref = rows.astype(np.float64)
    assert n == ref.shape[0]
    np.testing.assert_allclose(s, ref.sum(0), rtol=1e-9, atol=1e-9 * np.abs(ref).sum(0).max())
    gram = ref.T @ ref
    np.testing.assert_allclose(g, gram, rtol=0, atol=GRAM_RTOL * np.abs(gram).max())
    np.testing.assert_array_equal(g, g.T)


@pytest.mark.parametrize("groups", ["model", "layer", "layers:2"])
def test_stats_equal_direct_numpy(lm, groups):
    settings = CaptureSettings(sinks=4, window=8, groups=groups, objective="mse")
    cap = capture_kv(lm, _ids(2, 300, seed=0), settings)
    stats = CalibrationStats.new(lm.fingerprint, settings, shard_ids=("s0",))
    stats.update(cap)
    for g, group in enumerate(settings.group_layers(lm.num_layers)):
        for stream in ("keys", "values"):
            rows = getattr(cap, stream)[:, group.columns(lm.num_kv_heads, lm.head_dim)].numpy()
            _assert_moments(stats, stream, g, rows)
    assert len(stats.dims) == len(settings.group_layers(lm.num_layers)) and sum(stats.dims) == cap.keys.shape[1]


def test_merge_equals_union_and_roundtrips(lm, tmp_path):
    settings = CaptureSettings(sinks=4, window=8, groups="layer", objective="mse")
    caps = [capture_kv(lm, _ids(2, 64, seed=s), settings) for s in (1, 2, 3)]
    a = CalibrationStats.new(lm.fingerprint, settings, shard_ids=("a",))
    a.update(caps[0])
    a.update(caps[1])
    b = CalibrationStats.new(lm.fingerprint, settings, shard_ids=("b",))
    b.update(caps[2])
    size = a.save(tmp_path / "a.safetensors")
    b.save("memory://kvtc-test/b.safetensors")
    a2 = CalibrationStats.load(tmp_path / "a.safetensors")
    b2 = CalibrationStats.load("memory://kvtc-test/b.safetensors")
    # packed upper triangle: about half the bytes of full float64 Gram matrices
    assert size < 0.6 * 2 * 8 * sum(d * d for d in a.dims) + 6000  # plus a JSON footer of a few KB
    assert a2.shard_ids == ("a",) and a2.fingerprint == lm.fingerprint and a2.settings == settings.to_dict()
    merged = a2.merge(b2)
    assert merged.shard_ids == ("a", "b")
    width = lm.num_kv_heads * lm.head_dim
    for g in range(lm.num_layers):
        for stream in ("keys", "values"):
            rows = np.concatenate([getattr(c, stream)[:, g * width : (g + 1) * width].numpy() for c in caps])
            _assert_moments(merged, stream, g, rows)
            direct = a.merge(b).stream(stream, g)
            np.testing.assert_array_equal(direct[2], merged.stream(stream, g)[2])


def test_merge_refuses_mismatches(lm):
    settings = CaptureSettings(sinks=4, window=8, objective="mse")
    base = CalibrationStats.new(lm.fingerprint, settings, shard_ids=("x",))
    other_model = CalibrationStats.new(load_model("tiny:qwen2", device="cpu").fingerprint, settings, shard_ids=("y",))
    with pytest.raises(ValueError, match="different models"):
        base.merge(other_model)
    with pytest.raises(ValueError, match="capture settings"):
        base.merge(CalibrationStats.new(lm.fingerprint, CaptureSettings(sinks=2, window=8, objective="mse"), shard_ids=("y",)))
    with pytest.raises(ValueError, match="counted twice"):
        base.merge(CalibrationStats.new(lm.fingerprint, settings, shard_ids=("x",)))
    with pytest.raises(ValueError, match=r"\(N, 96\)"):
        base.update(capture_kv(load_model("tiny:mistral", device="cpu"), _ids(1, 40, 0), settings))


def test_load_rejects_foreign_files(tmp_path):
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, tmp_path / "x.safetensors", metadata={"other": json.dumps({})})
    with pytest.raises(ValueError, match=r"x\.safetensors is corrupt .*not a statistics object"):
        CalibrationStats.load(tmp_path / "x.safetensors")


def test_flipped_byte_is_an_error_naming_the_object(lm, tmp_path):
    settings = CaptureSettings(sinks=4, window=8, objective="mse")
    stats = CalibrationStats.new(lm.fingerprint, settings, shard_ids=("a",))
    stats.update(capture_kv(lm, _ids(1, 64, seed=5), settings))
    data = bytearray(stats.to_bytes())
    for where in (100, len(data) - 80):  # a Gram entry, then the footer
        bad = bytearray(data)
        bad[where] ^= 0x10
        (tmp_path / "bad.stats").write_bytes(bytes(bad))
        with pytest.raises(ValueError, match=r"bad\.stats is corrupt .*checksum mismatch.*rerun"):
            CalibrationStats.load(tmp_path / "bad.stats")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU torch can see")
def test_gpu_bf16_stats_match_float64_reference():
    settings = CaptureSettings(sinks=4, window=8, objective="mse")
    gpu_lm = load_model("tiny:llama", device="cuda", dtype="bfloat16")
    cap = capture_kv(gpu_lm, _ids(2, 300, seed=4), settings)
    stats = CalibrationStats.new(gpu_lm.fingerprint, settings, shard_ids=("g",))
    stats.update(cap)  # TF32 Gram on bf16-sourced rows
    for stream in ("keys", "values"):
        rows = getattr(cap, stream).cpu().numpy().astype(np.float64)
        n, s, g = stats.stream(stream, 0)
        gram = rows.T @ rows
        assert n == rows.shape[0]
        np.testing.assert_allclose(g, gram, rtol=0, atol=1e-3 * np.abs(gram).max())
    assert CalibrationStats.from_bytes(stats.to_bytes()).stream("keys", 0)[0] == cap.keys.shape[0]
