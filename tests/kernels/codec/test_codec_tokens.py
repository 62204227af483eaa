"""Property: every token count from 0 to sinks + window + 70 round-trips, for every dtype and RoPE layout.

Quantization is per token, so a middle token decodes to the same value whatever the length of the
cache it was coded in: each short cache must agree with the longest one on its own positions.
"""
import dataclasses

import pytest
import torch

from kvtc.kernels import KVTCCodec
from helpers.synthetic import synthetic_cache, synthetic_spec

SINKS, WINDOW = 4, 128
LONGEST = SINKS + WINDOW + 70


def _spec(layout: str):
    spec = synthetic_spec(2, 1, 8, 4.0, kept=12, seed=3, sinks=SINKS, window=WINDOW)
    return dataclasses.replace(spec, rope={**spec.rope, "layout": layout})


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_every_token_count_round_trips(dtype, layout):
    spec = _spec(layout)
    codec = KVTCCodec(spec, backend="torch")
    keys, values = synthetic_cache(spec, LONGEST, dtype, seed=1)
    full_k, full_v = codec.decode(codec.encode(keys, values))
    tol = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    for tokens in range(LONGEST + 1):
        k, v = keys[:, :, :tokens], values[:, :, :tokens]
        got_k, got_v = codec.decode(codec.encode(k, v))
        assert got_k.shape == k.shape and got_k.dtype == dtype and got_v.dtype == dtype
        head, mid, tail = codec.split(tokens, 0)
        for got, raw, full in ((got_k, k, full_k), (got_v, v, full_v)):
            assert torch.equal(got[:, :, :head], raw[:, :, :head])
            assert torch.equal(got[:, :, tokens - tail:], raw[:, :, tokens - tail:])
            # the full cache codes positions [SINKS, LONGEST - WINDOW); compare the overlap
            lo, hi = head, min(head + mid, LONGEST - WINDOW)
            torch.testing.assert_close(got[:, :, lo:hi].float(), full[:, :, lo:hi].float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("start", [0, 3, 4, 9])
def test_one_coded_token_with_the_triton_backend(dtype, start):
    spec = _spec("half")
    codec = KVTCCodec(spec, backend="triton")
    tokens = max(0, SINKS - start) + WINDOW + 1
    keys, values = synthetic_cache(spec, tokens, dtype, start=start, seed=2)
    assert codec.split(tokens, start)[1] == 1
    got_k, got_v = codec.decode(codec.encode(keys, values, start=start))
    ref_k, ref_v = KVTCCodec(spec, backend="torch").decode(codec.encode(keys, values, start=start))
    torch.testing.assert_close(got_k.float(), ref_k.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got_v.float(), ref_v.float(), atol=2e-2, rtol=2e-2)
