"""Baseline compressors: real byte accounting, raw sinks and window, and round-trip errors."""
import math
import zlib

import pytest
import torch

from kvtc.pipeline.evaluation import baselines as bl

L, H, D, SINKS, WINDOW = 2, 2, 16, 4, 8


def cache(tokens: int = 62, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(L, H, tokens, D, generator=g)
    keys[:, :, :, 3] += 20.0  # a per-channel outlier, as real keys have
    return keys, torch.randn(L, H, tokens, D, generator=g)


def assert_raw_ends(rec: bl.Reconstruction, keys: torch.Tensor, values: torch.Tensor) -> None:
    for x, xh in ((keys, rec.keys), (values, rec.values)):
        assert torch.equal(xh[:, :, :SINKS], x[:, :, :SINKS]) and torch.equal(xh[:, :, -WINDOW:], x[:, :, -WINDOW:])


def rel(x, xh) -> float:
    err, norm = bl.rel_error(x[:, :, SINKS:-WINDOW], xh[:, :, SINKS:-WINDOW])
    return math.sqrt(err / norm)


def test_split_matches_codec_convention():
    assert bl.split(62, 4, 8) == (4, 50, 8)
    assert bl.split(10, 4, 8) == (4, 0, 6)
    assert bl.split(3, 4, 8) == (3, 0, 0)


@pytest.mark.parametrize("bits,group", [(2, 32), (2, 128), (4, 32), (4, 128)])
def test_kivi_counts_codes_scales_and_zero_points(bits, group):
    keys, values = cache()
    rec = bl.kivi(keys, values, bits, group, SINKS, WINDOW)
    mid, p = 50, L * H * D
    key_groups = p * math.ceil(mid / group)           # per channel, groups of tokens
    value_groups = L * mid * math.ceil(H * D / group)  # per token and layer, groups of channels
    assert rec.mid == mid and rec.features == p
    assert rec.stored_bytes == 2 * math.ceil(p * mid * bits / 8) + 4 * (key_groups + value_groups)
    assert rec.cr == pytest.approx(4 * p * mid / rec.stored_bytes)
    assert_raw_ends(rec, keys, values)


def test_kivi_error_falls_with_bits_and_per_channel_keys_absorb_outliers():
    keys, values = cache()
    two, four = (bl.kivi(keys, values, b, 32, SINKS, WINDOW) for b in (2, 4))
    assert rel(keys, four.keys) < rel(keys, two.keys) and rel(values, four.values) < rel(values, two.values)
    # per-token quantization of the keys would spend its range on the +20 channel; per channel does not
    per_token, _ = bl._grouped(keys[:, :, SINKS:-WINDOW].permute(0, 2, 1, 3).reshape(-1, H * D), 32, "int4")
    per_token = per_token.view(L, 50, H, D).permute(0, 2, 1, 3)
    assert rel(keys, four.keys) < 0.5 * rel(keys, bl._splice(keys, per_token, SINKS, 50))


def test_fp8_cast_is_two_x_and_close():
    keys, values = cache()
    rec = bl.fp8_cast(keys, values, SINKS, WINDOW)
    assert rec.cr == pytest.approx(2.0) and rec.stored_bytes == 2 * L * H * D * 50
    assert 0 < rel(values, rec.values) < 0.05
    assert_raw_ends(rec, keys, values)


def test_deflate_is_lossless_at_fp16_and_counts_zlib_bytes():
    keys, values = cache()
    keys[:, :, SINKS:-WINDOW] = keys[:, :, SINKS:SINKS + 1]  # repeated tokens compress well
    rec = bl.deflate(keys, values, SINKS, WINDOW)
    expect = sum(len(zlib.compress(x[:, :, SINKS:-WINDOW].half().contiguous().view(torch.uint8).numpy().tobytes(), 6))
                 for x in (keys, values))
    assert rec.stored_bytes == expect and rec.cr > 1.5
    torch.testing.assert_close(rec.values[:, :, SINKS:-WINDOW], values[:, :, SINKS:-WINDOW].half().float(), rtol=0, atol=0)


@pytest.mark.parametrize("ratio", [2.0, 8.0, 16.0])
def test_evict_keeps_sinks_window_and_recent_tokens_within_budget(ratio):
    keys, values = cache()
    rec = bl.evict(keys, values, ratio, SINKS, WINDOW)
    p, mid = L * H * D, 50
    kept = int(rec.keep[SINKS:-WINDOW].sum())
    assert kept == (math.floor(4 * p * mid / ratio) - 8) // (4 * p)
    assert rec.stored_bytes <= 4 * p * mid / ratio and rec.cr >= ratio
    assert rec.keep[:SINKS].all() and rec.keep[-WINDOW:].all()
    assert rec.keep[SINKS:-WINDOW].tolist() == [False] * (mid - kept) + [True] * kept  # the most recent ones
    gone = keys[:, :, SINKS:SINKS + mid - kept].double().square().sum() / keys[:, :, SINKS:-WINDOW].double().square().sum()
    assert rel(keys, rec.keys) == pytest.approx(math.sqrt(float(gone)), rel=1e-3)


def test_uniform_blocks_spend_one_width_within_budget():
    lam = torch.linspace(10, 0.01, 256)
    for ratio in (4.0, 8.0, 16.0):
        blocks = bl.uniform_blocks(lam, 256, ratio)
        assert len({b[3] for b in blocks}) == 1
        assert sum(size * bits + 32 for _, size, _, bits in blocks) <= 16 * 256 // ratio
        assert [b[0] for b in blocks] == [64 * i for i in range(len(blocks))]
    with pytest.raises(ValueError, match="not one uniform block"):
        bl.uniform_blocks(lam, 256, 200.0)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="layers, kv_heads, tokens, head_dim"):
        bl.fp8_cast(torch.zeros(2, 3, 4), torch.zeros(2, 3, 4), 1, 1)
    with pytest.raises(ValueError, match="bits must be"):
        bl.kivi(*cache(), 0, 32, SINKS, WINDOW)
