"""Triton kernels (interpreter) against their plain-torch references on odd shapes.

Tolerances: integer codes and fp16 params identical; fp32 outputs within 1e-5 relative (exact on
the CPU interpreter); fp16/bf16 outputs within one unit in the last place of the stored dtype.
"""
import pytest
import torch

from kvtc.kernels.codec.bitpack import pack_codes, packed_nbytes, unpack_codes
from kvtc.kernels.codec.dequantize import unpack_dequantize, unpack_dequantize_reference
from kvtc.kernels.codec.quantize import quantize_pack, quantize_pack_blocks, quantize_pack_reference
from kvtc.artifacts.blocks import QTYPES
from kvtc.kernels.codec.reference import quantize_block
from kvtc.kernels.codec.rope_center import rope_center, rope_center_reference, rope_restore, rope_restore_reference
from kvtc.kernels.codec.spec import CodedBlock
from helpers.synthetic import random_blocks
from kvtc.kernels.codec.rope import RopeSpec

ULP = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7, torch.float32: 1e-6}


def _rope(head_dim: int, rotary_dim: int, layout: str, scaling: float = 1.0) -> RopeSpec:
    inv = tuple(10000.0 ** (-2 * i / rotary_dim) for i in range(rotary_dim // 2))
    return RopeSpec("default", 10000.0, head_dim, rotary_dim, inv, scaling, layout)


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rotary", [12, 8, 0])
def test_rope_center_and_restore_match_reference(layout, dtype, rotary):
    torch.manual_seed(0)
    L, H, T, D = 3, 2, 19, 12
    cache = (torch.randn(L, H, T, D) * 3).to(dtype)
    mean = torch.randn(L * H * D)
    cos = sin = None
    if rotary:
        cos, sin = _rope(D, rotary, layout, 1.25).cos_sin(torch.arange(7, 7 + T))
    feat = rope_center(cache, cos, sin, mean, layout)
    ref = rope_center_reference(cache, cos, sin, mean, layout)
    assert feat.shape == (T, L * H * D) and feat.dtype == torch.float32
    torch.testing.assert_close(feat, ref, rtol=1e-5, atol=1e-5)
    out = torch.empty(L, H, T, D, dtype=dtype)
    rope_restore(feat, cos, sin, mean, out, layout)
    back = rope_restore_reference(feat, cos, sin, mean, (L, H, T, D), dtype, layout)
    torch.testing.assert_close(out.float(), back.float(), rtol=ULP[dtype], atol=ULP[dtype])
    torch.testing.assert_close(back.float(), cache.float(), rtol=2 * ULP[dtype], atol=1e-4)


def test_rope_center_reference_inverts_ropespec():
    torch.manual_seed(1)
    rope = _rope(16, 16, "half", 1.1)
    pos = torch.arange(100, 111)
    x = torch.randn(2, 3, 11, 16)
    cos, sin = rope.cos_sin(pos)
    feat = rope_center_reference(rope.apply(x, pos), cos, sin, torch.zeros(96))
    torch.testing.assert_close(feat, x.permute(2, 0, 1, 3).reshape(11, 96), rtol=1e-5, atol=1e-5)


def test_rope_restore_writes_into_strided_slice():
    torch.manual_seed(2)
    L, H, T, D = 2, 3, 9, 8
    cos, sin = _rope(D, D, "half").cos_sin(torch.arange(4, 4 + T))
    feat, mean = torch.randn(T, L * H * D), torch.randn(L * H * D)
    big = torch.zeros(L, H, T + 5, D, dtype=torch.float16)
    rope_restore(feat, cos, sin, mean, big[:, :, 2:2 + T])
    ref = rope_restore_reference(feat, cos, sin, mean, (L, H, T, D), torch.float16)
    assert torch.equal(big[:, :, 2:2 + T], ref)
    assert not big[:, :, :2].any() and not big[:, :, 2 + T:].any()


def _hard_rows(n: int, k: int) -> torch.Tensor:
    torch.manual_seed(3)
    z = torch.randn(n, k) * 3
    z[1] = 0.0
    z[2] = 1.5
    z[3] = torch.randn(k) * 1e-6
    z[4] = torch.randn(k) * 1e5
    z[5, ::2] = -z[5, ::2]
    return z


@pytest.mark.parametrize("qtype", [q for q in QTYPES if q != "none"])
@pytest.mark.parametrize("size", [1, 5, 16, 37])
def test_quantize_pack_and_dequantize_match_reference(qtype, size):
    z = _hard_rows(13, 50)
    packed, params = quantize_pack(z, 7, size, qtype)
    ref_packed, ref_params = quantize_pack_reference(z, 7, size, qtype)
    assert packed.shape == ref_packed.shape and torch.equal(packed, ref_packed)
    assert torch.equal(params.view(torch.int16), ref_params.view(torch.int16))
    out = torch.full((13, 60), 7.0)
    ref = torch.full((13, 60), 7.0)
    unpack_dequantize(packed, params, qtype, out, 3, size)
    unpack_dequantize_reference(ref_packed, ref_params, qtype, ref, 3, size)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=0)
    assert (out[:, :3] == 7).all() and (out[:, 3 + size:] == 7).all()


def test_fp8_codes_hit_every_grid_point_tie_and_subnormal():
    grid = torch.arange(256, dtype=torch.uint8)
    grid = grid[(grid & 0x7F) != 0x7F].view(torch.float8_e4m3fn).float()
    mids = (grid[:-1] + grid[1:]) / 2
    row = torch.cat([torch.tensor([448.0]), grid, mids, torch.tensor([-0.0, 1e-9, -1e-9, 2.0 ** -10, 3 * 2.0 ** -11])])
    z = row[None, :].repeat(3, 1)
    packed, params = quantize_pack(z, 0, z.shape[1], "fp8")
    ref_packed, ref_params = quantize_pack_reference(z, 0, z.shape[1], "fp8")
    assert float(params[0, 1]) == 1.0
    assert torch.equal(packed, ref_packed) and torch.equal(params, ref_params)


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("size", [1, 3, 17])
def test_bitpack_roundtrip(bits, size):
    codes = torch.randint(0, 1 << bits, (5, size), dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.shape == (5, packed_nbytes(size, bits))
    assert torch.equal(unpack_codes(packed, size, bits), codes)


def test_pack_layout_is_lsb_first():
    codes = torch.tensor([[1, 2, 3]], dtype=torch.uint8)
    assert pack_codes(codes, 2).tolist() == [[1 | 2 << 2 | 3 << 4]]
    assert pack_codes(torch.tensor([[5, 6]], dtype=torch.uint8), 3).tolist() == [[5 | (6 & 7) << 3]]


def test_quantize_pack_codes_equal_reference_codes():
    z = _hard_rows(9, 21)
    codes, _ = quantize_block(z[:, 2:21], "int3")
    packed, _ = quantize_pack(z, 2, 19, "int3")
    assert torch.equal(unpack_codes(packed, 19, 3), codes)


def test_batched_reference_blocks_equal_block_by_block():
    z = _hard_rows(11, 90)
    runs = tuple(CodedBlock(s, 16, "int2", 2) for s in range(0, 80, 16))
    for blocks in (random_blocks(90, 5), runs):
        batched = quantize_pack_blocks(z, blocks, reference=True)
        single = quantize_pack_blocks(z, blocks, reference=False)
        for b, x, y in zip(blocks, batched, single):
            assert (x is None) == (b.bits == 0) == (y is None)
            if x is not None:
                assert torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])
