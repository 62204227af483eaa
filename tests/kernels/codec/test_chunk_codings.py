"""What a chunk costs to code: a first chunk (its sinks raw inside a later chunk's budget) is coded at most twice,
ECSQ then, where ECSQ cannot code it within the bound, fixed-rate; a later chunk likewise; each coding decodes its
middle once per stream to select outlier vectors, and the re-coding after them starts the step search where the
first coding's ended (bench/chunk_encode_time.py measures the time on the real artifact). The geometry is the
embedded model's (3 KV heads, head_dim 64, 4 sinks, 256-token bf16 chunks) with fewer layers; the chunks are the
vLLM budget test's: in-domain, scaled x1e6 and x1e9, a few huge spikes."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from helpers.synthetic import synthetic_ecsq, synthetic_spec
from kvtc.kernels.codec import ecsq
from kvtc.kernels.codec.blob import read_blob
from kvtc.kernels.codec.chunk_serde import ChunkTransform, unframe
from kvtc.kernels.codec.ecsq_mode import EcsqBlob
from kvtc.kernels.codec.fixed_mode import FixedBlob
from kvtc.kernels.codec.kvtc_codec import KVTCCodec

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integrations"))
from test_vllm_budget import chunk_of  # noqa: E402 - the budget test's hostile chunks

TOKENS = 256


@pytest.fixture
def counted(monkeypatch):
    """Calls of KVTCCodec.encode (codings), the modes' encode (one per stream and coding, re-codings included) and
    decoder (a coded middle decoded to select outlier vectors) -> the running counts."""
    n = {"codings": 0, "mode encodes": 0, "middle decodes": 0}
    for cls, name, what in ((KVTCCodec, "encode", "codings"), (EcsqBlob, "encode", "mode encodes"),
                            (FixedBlob, "encode", "mode encodes"), (EcsqBlob, "decoder", "middle decodes"),
                            (FixedBlob, "decoder", "middle decodes")):
        def wrapper(*a, _fn=getattr(cls, name), _what=what, **k):
            n[_what] += 1
            return _fn(*a, **k)
        monkeypatch.setattr(cls, name, wrapper)
    return n


@pytest.mark.parametrize("ratio", (8.0, 16.0, 32.0))
def test_a_first_chunk_costs_at_most_two_codings_and_one_middle_decode_per_stream(counted, ratio):
    spec = synthetic_ecsq(synthetic_spec(num_layers=4, kv_heads=3, head_dim=64, ratio=ratio, sinks=4, window=128))
    t = ChunkTransform(KVTCCodec(spec), positions=True)  # LMCache's: shared sinks, int8, padded
    shape = (2, spec.num_layers, TOKENS, 3 * 64)
    assert t._shares(TOKENS, torch.bfloat16)  # a first chunk pays its sinks from its own budget
    for kind in ("x1", "x1e6", "x1e9", "spikes"):
        for start in (0, TOKENS):
            keys, values = chunk_of(kind, spec, TOKENS, start)
            kv = torch.stack((keys, values)).transpose(2, 3).reshape(shape)
            counted.update(dict.fromkeys(counted, 0))
            data = t.serialize(kv, start=start)
            header = read_blob(unframe(data)[1])[0]
            where = f"CR {ratio:g}, {kind} at {start}: {counted}, coded {header.mode}"
            assert len(data) == t.serialized_size(shape, torch.bfloat16), where
            assert counted["codings"] <= 2 and counted["middle decodes"] <= 2, where  # outliers: one per stream
            assert counted["mode encodes"] <= 2 * 2 + 2, where  # ECSQ and its re-coding per stream, fixed-rate
            if kind == "x1":  # in-domain: one ECSQ coding, its sinks raw in a first chunk
                assert counted["codings"] == 1 and header.mode == "ecsq", where
                assert header.head_raw == (4 if start == 0 else 0), where
            out = torch.empty_like(kv)
            t.deserialize(data, out, start=start)
            assert torch.isfinite(out.float()).all(), where


def test_the_step_search_from_a_fitted_step_finds_the_step_a_full_search_finds_in_fewer_attempts(monkeypatch):
    """The codec's re-coding after outlier vectors: the same coefficients at a smaller budget, searched from the
    step the larger budget fitted (its predecessor overshot that budget, so this one too)."""
    spec = synthetic_ecsq(synthetic_spec(num_layers=4, kv_heads=3, head_dim=64, ratio=16.0, sinks=4, window=128))
    g = spec.ecsq["values"][0]
    keys, values = chunk_of("x1", spec, TOKENS, TOKENS)
    x = values.float().permute(2, 0, 1, 3).reshape(TOKENS, -1)
    z = (x - g.mean) @ g.components
    attempts = []
    real = ecsq._attempt
    monkeypatch.setattr(ecsq, "_attempt", lambda *a, **k: attempts.append(a[2]) or real(*a, **k))
    budget = g.budget_bytes(spec.ratio, TOKENS)
    for larger, smaller in ((budget * 9 // 10, budget * 17 // 20), (budget * 4 // 5, budget * 3 // 4), (budget, budget)):
        words, _ = ecsq.encode_group(z, g, larger, "rans")
        first = ecsq.step_exponent(words)
        attempts.clear()
        cold = ecsq.encode_group(z, g, smaller, "rans")
        full = len(attempts)
        attempts.clear()
        warm = ecsq.encode_group(z, g, smaller, "rans", first=first)
        assert warm == cold and len(attempts) <= full and min(attempts) >= first
        assert sum(map(len, warm)) <= smaller
