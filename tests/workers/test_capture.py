"""KV capture: RoPE removal is exact against the attention module's own pre-RoPE keys, layout, positions."""
import pytest
import torch

from kvtc.artifacts.groups import FeatureGroup
from kvtc.workers.capture import CaptureSettings, capture_kv, check_seq_len, raw_cache
from kvtc.workers.models import load_model
from kvtc.workers.tiny import UNIFORM_ARCHS

SETTINGS = CaptureSettings(sinks=4, window=8, objective="mse")


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2-135m", device="cpu")


def _ids(b: int, t: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 49152, (b, t), generator=torch.Generator().manual_seed(seed))


def _pre_rope_keys(lm, ids: torch.Tensor) -> torch.Tensor:
    """Keys as the attention module sees them before RoPE (k_proj, or k_norm when present): (B, T, L, H, D)."""
    grabbed = {}
    hooks = []
    for i, layer in enumerate(lm.base.layers):
        module = getattr(layer.self_attn, "k_norm", None) or layer.self_attn.k_proj
        hooks.append(module.register_forward_hook(lambda m, a, out, i=i: grabbed.__setitem__(i, out.detach())))
    try:
        with torch.inference_mode():
            lm.base(input_ids=ids)
    finally:
        for h in hooks:
            h.remove()
    b, t = ids.shape
    return torch.stack([grabbed[i].reshape(b, t, lm.num_kv_heads, lm.head_dim) for i in range(lm.num_layers)], 2)


def _check_exact(lm, b: int, t: int) -> None:
    ids = _ids(b, t)
    cap = capture_kv(lm, ids, SETTINGS)
    k = t - SETTINGS.sinks - SETTINGS.window
    p = lm.num_layers * lm.num_kv_heads * lm.head_dim
    assert cap.keys.shape == cap.values.shape == (b * k, p)
    assert cap.keys.dtype == cap.values.dtype == torch.float32
    ref = _pre_rope_keys(lm, ids)[:, SETTINGS.sinks : t - SETTINGS.window].reshape(b * k, p)
    rel = (cap.keys - ref).abs().max() / ref.abs().max()
    assert rel <= 1e-4, f"RoPE-removed keys differ from pre-RoPE keys by {rel:.2e}"
    # without removal the keys would be far off: the test has teeth
    raw_k, _ = raw_cache(lm, ids[:1])
    rotated = raw_k[:, :, SETTINGS.sinks : t - SETTINGS.window].permute(2, 0, 1, 3).reshape(k, p)
    assert (rotated - ref[:k]).abs().max() / ref.abs().max() > 1e-2


@pytest.mark.parametrize("arch", UNIFORM_ARCHS)
def test_rope_removal_exact_tiny(arch):
    _check_exact(load_model(f"tiny:{arch}", device="cpu"), b=2, t=48)


def test_rope_removal_exact_smollm2(smollm2):
    assert (smollm2.num_layers, smollm2.num_kv_heads, smollm2.head_dim) == (30, 3, 64)
    _check_exact(smollm2, b=1, t=160)


def test_layout_positions_and_raw_cache():
    lm = load_model("tiny:mistral", device="cpu")
    ids = _ids(3, 40, seed=1)
    cap = capture_kv(lm, ids, CaptureSettings(sinks=2, window=5, objective="mse"))
    k = 40 - 2 - 5
    assert torch.equal(cap.positions, torch.arange(2, 35).repeat(3))
    assert torch.equal(cap.sequence, torch.arange(3).repeat_interleave(k))
    keys, values = raw_cache(lm, ids[1:2])
    assert keys.shape == values.shape == (lm.num_layers, 1, 40, lm.head_dim)
    # row = (sequence 1, position 10): layer-major, then head, then head_dim
    row = k + 8
    torch.testing.assert_close(cap.values[row], values[:, :, 10, :].reshape(-1))
    rerotated = lm.rope.apply(cap.keys[row].reshape(lm.num_layers, 1, 1, lm.head_dim), torch.tensor([10]))
    torch.testing.assert_close(rerotated.reshape(-1), keys[:, :, 10, :].reshape(-1), rtol=1e-5, atol=1e-6)


def test_sampling_is_deterministic_and_content_seeded():
    lm = load_model("tiny:qwen3", device="cpu")
    ids = _ids(2, 64, seed=2)
    settings = CaptureSettings(sinks=4, window=8, sample=0.25, seed=7, objective="mse")
    a, b = capture_kv(lm, ids, settings), capture_kv(lm, ids, settings)
    assert torch.equal(a.positions, b.positions) and torch.equal(a.keys, b.keys)
    per_seq = a.positions.reshape(2, -1)
    assert per_seq.shape[1] == round(0.25 * 52)
    assert not torch.equal(per_seq[0], per_seq[1])
    assert per_seq.min() >= 4 and per_seq.max() < 56 and (per_seq.diff(dim=1) > 0).all()
    other = capture_kv(lm, ids, CaptureSettings(sinks=4, window=8, sample=0.25, seed=8, objective="mse"))
    assert not torch.equal(other.positions, a.positions)


def test_group_layers_and_settings_validation():
    span = FeatureGroup.span
    assert CaptureSettings().group_layers(30) == [span(0, 30)]
    assert CaptureSettings(groups="layer").group_layers(3) == [span(0, 1), span(1, 2), span(2, 3)]
    assert CaptureSettings(groups="layers:4").group_layers(30)[-2:] == [span(24, 28), span(28, 30)]
    assert CaptureSettings.from_dict(CaptureSettings(groups="layers:2").to_dict()) == CaptureSettings(groups="layers:2")
    for bad in ({"groups": "heads"}, {"groups": "layers:0"}, {"sinks": -1}, {"sample": 0.0}, {"sample": 1.5}):
        with pytest.raises(ValueError):
            CaptureSettings(**bad)


def test_bad_sequence_lengths(smollm2):
    settings = CaptureSettings(objective="mse")
    check_seq_len(smollm2, 1024, settings)
    with pytest.raises(ValueError, match="exceeds the model's limit"):
        check_seq_len(smollm2, smollm2.max_positions + 1, settings)
    with pytest.raises(ValueError, match="no position after"):
        check_seq_len(smollm2, 132, settings)
    with pytest.raises(ValueError, match="no position after"):
        capture_kv(load_model("tiny:llama", device="cpu"), _ids(1, 100), settings)
    with pytest.raises(ValueError, match=r"\(B, T\)"):
        capture_kv(load_model("tiny:llama", device="cpu"), torch.zeros(200, dtype=torch.int64), settings)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU torch can see")
def test_capture_on_gpu_matches_cpu():
    ids = _ids(2, 48, seed=3)
    cpu = capture_kv(load_model("tiny:qwen3", device="cpu"), ids, SETTINGS)
    gpu_lm = load_model("tiny:qwen3", device="cuda", dtype="float32")
    _check_exact(gpu_lm, b=2, t=48)
    gpu = capture_kv(gpu_lm, ids, SETTINGS)
    assert gpu.keys.is_cuda and gpu.source_dtype == "float32"
    torch.testing.assert_close(gpu.keys.cpu(), cpu.keys, rtol=1e-3, atol=1e-4)
    bf16 = capture_kv(load_model("tiny:qwen3", device="cuda"), ids, SETTINGS)
    assert bf16.source_dtype == "bfloat16" and bf16.keys.dtype == torch.float32
    assert (bf16.keys.cpu() - cpu.keys).abs().max() / cpu.keys.abs().max() < 5e-2


def test_rope_kept_keys_and_zero_sinks_window_are_the_cached_rows():
    lm = load_model("tiny:llama", device="cpu")
    ids = _ids(1, 24, seed=3)
    settings = CaptureSettings(sinks=0, window=0, keys="rope-kept", objective="mse")
    cap = capture_kv(lm, ids, settings)
    raw_k, raw_v = raw_cache(lm, ids)
    p = lm.num_layers * lm.num_kv_heads * lm.head_dim
    assert cap.positions.tolist() == list(range(24))
    torch.testing.assert_close(cap.keys, raw_k.permute(2, 0, 1, 3).reshape(24, p).float())
    torch.testing.assert_close(cap.values, raw_v.permute(2, 0, 1, 3).reshape(24, p).float())
    assert "keys" not in CaptureSettings().to_dict() and settings.to_dict()["keys"] == "rope-kept"
    with pytest.raises(ValueError, match="keys must be one of"):
        CaptureSettings(keys="rope")
