"""Unpack + dequantize one block (the decode side of kernels/codec/reference.py).

packed (N, nbytes) uint8 in kernels/codec/bitpack.py layout and params (N, 2) fp16 -> z_hat written into
columns [start, start + size) of out (N, k) float32, equal to reference.dequantize_block.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvtc.kernels.codec.bitpack import unpack_codes
from kvtc.artifacts.blocks import qtype_bits
from kvtc.kernels.codec.reference import dequantize_block


@triton.jit
def _e4m3_decode(code):
    """e4m3fn bits (int32, never NaN) -> float32."""
    e = (code >> 3) & 15
    m = code & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    mag = tl.where(e > 0, normal, m.to(tl.float32) * 0.001953125)
    return tl.where((code & 128) != 0, -mag, mag)


@triton.jit
def _unpack_dequantize_kernel(packed_ptr, params_ptr, out_ptr, N, start, size, spr, sor, soc,
                              BITS: tl.constexpr, FP8: tl.constexpr, S_P2: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]
    cols = tl.arange(0, S_P2)[None, :]
    mask = (rows < N) & (cols < size)
    prow = packed_ptr + rows * spr
    if BITS == 8:
        code = tl.load(prow + cols, mask=mask, other=0).to(tl.int32)
    else:
        code = tl.zeros((BLOCK_N, S_P2), dtype=tl.int32)
        for b in tl.static_range(BITS):
            g = cols * BITS + b
            byte = tl.load(prow + (g >> 3), mask=mask, other=0).to(tl.int32)
            code = code | (((byte >> (g & 7)) & 1) << b)
    scale = tl.load(params_ptr + rows * 2 + 1, mask=rows < N, other=1.0).to(tl.float32)
    if FP8:
        z = _e4m3_decode(code) * scale
    else:
        shift = tl.load(params_ptr + rows * 2, mask=rows < N, other=0.0).to(tl.float32)
        z = shift + code.to(tl.float32) * scale
    tl.store(out_ptr + rows * sor + (start + cols) * soc, z, mask=mask)


def unpack_dequantize(packed: torch.Tensor, params: torch.Tensor, qtype: str, out: torch.Tensor,
                      start: int, size: int) -> torch.Tensor:
    """Triton: packed (N, nbytes) uint8, params (N, 2) fp16 -> out[:, start:start+size] (float32), returns out."""
    bits = qtype_bits(qtype)
    n = packed.shape[0]
    if bits == 0:
        out[:, start:start + size] = 0
        return out
    if out.dtype != torch.float32:
        raise ValueError(f"out must be float32, got {out.dtype}")
    if n:
        params, packed = params.contiguous(), packed if packed.stride(1) == 1 else packed.contiguous()
        s_p2 = triton.next_power_of_2(size)
        block_n = max(1, min(64, 4096 // s_p2))
        _unpack_dequantize_kernel[(triton.cdiv(n, block_n),)](
            packed, params, out, n, start, size, packed.stride(0), out.stride(0), out.stride(1),
            BITS=bits, FP8=qtype == "fp8", S_P2=s_p2, BLOCK_N=block_n)
    return out


def unpack_dequantize_reference(packed: torch.Tensor, params: torch.Tensor, qtype: str, out: torch.Tensor,
                                start: int, size: int) -> torch.Tensor:
    """Plain torch: same contract as unpack_dequantize."""
    bits = qtype_bits(qtype)
    codes = unpack_codes(packed, size, bits) if bits else torch.zeros(packed.shape[0], size, dtype=torch.uint8)
    out[:, start:start + size] = dequantize_block(codes, params, qtype)
    return out
