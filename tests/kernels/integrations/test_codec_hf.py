"""transformers DynamicCache integration: a restored cache continues generation like the original."""
import copy
import inspect

import pytest
import torch

from kvtc.artifacts.groups import FeatureGroup
from kvtc.kernels import CodecSpec, CodedBlock, GroupCode, KVTCCodec
from kvtc.kernels.integrations.kvtc_cache import cache_tensors, compress_cache, restore_cache
from kvtc.workers.rope import rope_from_config

transformers = pytest.importorskip("transformers")


def near_lossless_spec(model, sinks: int = 3, window: int = 5) -> CodecSpec:
    """Full orthonormal basis and int8 blocks: decode error ~1e-3, enough to test the plumbing."""
    cfg = model.config
    L, H = cfg.num_hidden_layers, cfg.num_key_value_heads
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    p = L * H * D
    g = torch.Generator().manual_seed(0)
    streams = {}
    for stream in ("keys", "values"):
        q, _ = torch.linalg.qr(torch.randn(p, p, generator=g))
        blocks = tuple(CodedBlock(s, min(16, p - s), "int8", 8) for s in range(0, p, 16))
        streams[stream] = (GroupCode(FeatureGroup.span(0, L), torch.zeros(p), q.contiguous(), blocks),)
    return CodecSpec("tiny", "v0", 2.0, "tiny", L, H, D, sinks, window,
                     rope_from_config(cfg).to_dict(), streams)


def forward(model, ids: torch.Tensor, cache=None):
    """(logits, cache) across transformers versions (5.x renamed past_key_values to cache)."""
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.no_grad():
        out = model(ids, use_cache=True, **({name: cache} if cache is not None else {}))
    return out.logits, out["cache"] if "cache" in out else out["past_key_values"]


def greedy(model, cache, first: torch.Tensor, steps: int) -> list[int]:
    tokens, nxt = [], first
    for _ in range(steps):
        logits, cache = forward(model, nxt, cache)
        nxt = logits[:, -1:].argmax(-1)
        tokens.append(int(nxt))
    return tokens


@pytest.mark.parametrize("arch", ["llama", "qwen2", "phi"])
def test_restored_cache_continues_like_original_tiny(arch):
    from kvtc.workers.tiny import build_tiny

    model = build_tiny(arch)
    ids = torch.randint(3, 2000, (1, 37), generator=torch.Generator().manual_seed(1))
    _, cache = forward(model, ids[:, :-1])
    codec = KVTCCodec(near_lossless_spec(model))
    restored = restore_cache(codec, compress_cache(codec, cache), config=model.config)
    assert restored.get_seq_length() == cache.get_seq_length() == 36
    k0, v0 = cache_tensors(cache)
    k1, v1 = cache_tensors(restored)
    assert (k1 - k0).norm() / k0.norm() < 5e-3 and (v1 - v0).norm() / v0.norm() < 5e-3
    a, _ = forward(model, ids[:, -1:], copy.deepcopy(cache))
    b, _ = forward(model, ids[:, -1:], copy.deepcopy(restored))
    torch.testing.assert_close(b, a, rtol=0, atol=2e-2 * float(a.abs().max()))
    assert greedy(model, restored, ids[:, -1:], 4) == greedy(model, cache, ids[:, -1:], 4)


def test_compress_cache_refuses_batches():
    from transformers import DynamicCache

    cache = DynamicCache()
    cache.update(torch.zeros(2, 1, 3, 4), torch.zeros(2, 1, 3, 4), 0)
    with pytest.raises(ValueError, match="batch size 2"):
        cache_tensors(cache)


def _calibrated_smollm2_codec(lm, ratio: float, sinks: int, window: int) -> KVTCCodec:
    """Per-layer PCA and analytic DP allocation from two sequences of Python's own docs."""
    pca = pytest.importorskip("kvtc.pipeline.fit.pca")
    allocator = pytest.importorskip("kvtc.pipeline.fit.allocator")
    from pydoc_data.topics import topics

    from kvtc.workers.capture import CaptureSettings, capture_kv
    from kvtc.workers.stats import CalibrationStats

    text = "\n\n".join(topics[k] for k in sorted(topics))[:30000]
    ids = lm.tokenizer(text, return_tensors="pt").input_ids[0, : 2 * 256].reshape(2, 256)
    settings = CaptureSettings(sinks=sinks, window=window, groups="layer", objective="mse")
    stats = CalibrationStats.new(lm.fingerprint, settings)
    stats.update(capture_kv(lm, ids, settings))
    analytic = allocator.AllocatorSettings(error_model="analytic")
    streams = {}
    for stream in ("keys", "values"):
        codes = []
        for gi, group in enumerate(stats.groups):
            basis = pca.pca_from_moments(*stats.stream(stream, gi))
            (alloc,) = allocator.allocate([ratio], basis, None, analytic)
            blocks = tuple(CodedBlock(x.start, x.size, x.qtype, x.bits) for x in alloc.blocks)
            codes.append(GroupCode(group, torch.as_tensor(basis.mean, dtype=torch.float32),
                                   torch.as_tensor(basis.components[:, :alloc.kept], dtype=torch.float32), blocks))
        streams[stream] = tuple(codes)
    spec = CodecSpec("smollm2-test", "v0", ratio, "smollm2", lm.num_layers, lm.num_kv_heads, lm.head_dim,
                     sinks, window, lm.rope.to_dict(), streams)
    return KVTCCodec(spec)


@pytest.mark.embedded
def test_smollm2_cr8_restored_cache_gives_same_next_tokens():
    from kvtc.workers.models import load_model

    lm = load_model(device="cpu", dtype=torch.float32)
    codec = _calibrated_smollm2_codec(lm, 8.0, sinks=4, window=16)
    prompt = "The Python tutorial explains how to define functions, use lists and dictionaries, and handle errors"
    ids = lm.tokenizer(prompt * 3, return_tensors="pt").input_ids
    _, cache = forward(lm.model, ids[:, :-1])
    head, mid, tail = codec.split(ids.shape[1] - 1, 0)
    assert mid > 20
    restored = restore_cache(codec, compress_cache(codec, cache), config=lm.config)
    steps = 8
    want = greedy(lm.model, copy.deepcopy(cache), ids[:, -1:], steps)
    got = greedy(lm.model, restored, ids[:, -1:], steps)
    differing = sum(a != b for a, b in zip(want, got))
    print(f"SmolLM2 CR8: {differing}/{steps} continued tokens differ ({mid} of {ids.shape[1] - 1} tokens coded)")
    assert got[0] == want[0] and differing <= 2


@pytest.mark.embedded
def test_smollm2_kvtc_cache_generates_like_dynamic_cache():
    from transformers import DynamicCache

    from kvtc.kernels import KVTCCache
    from kvtc.workers.models import load_model

    lm = load_model(device="cpu", dtype=torch.float32)
    codec = _calibrated_smollm2_codec(lm, 8.0, sinks=4, window=16)
    prompt = "The Python tutorial explains how to define functions, use lists and dictionaries, and handle errors"
    ids = lm.tokenizer(prompt * 3, return_tensors="pt").input_ids
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
              pad_token_id=lm.tokenizer.eos_token_id)
    want = lm.model.generate(ids, cache=DynamicCache(config=lm.config), **kw)[0, ids.shape[1]:].tolist()
    cache = KVTCCache(codec, config=lm.config, chunk=8)
    got = lm.model.generate(ids, cache=cache, **kw)[0, ids.shape[1]:].tolist()
    differing = sum(a != b for a, b in zip(want, got))
    print(f"SmolLM2 KVTCCache CR8: {differing}/8 tokens differ, {cache.coded_tokens} coded, "
          f"{cache.resident_bytes()} resident bytes")
    assert cache.coded_tokens > 20 and got[0] == want[0] and differing <= 2
