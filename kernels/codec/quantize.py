"""Quantize + pack one block of PCA coefficients per token (the encode side of kernels/codec/reference.py).

z (N, k) float32 holds all coefficients of a group; a block is columns [start, start + size).
Output: packed (N, ceil(size * bits / 8)) uint8 in kernels/codec/bitpack.py layout, params (N, 2) fp16
(shift, scale) for intB or (0, scale) for fp8, bit-identical to reference.quantize_block.
"""
from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from kvtc.kernels.codec.bitpack import pack_codes, packed_nbytes
from kvtc.artifacts.blocks import qtype_bits
from kvtc.kernels.codec.reference import FP8_MAX, FP16_MAX, quantize_block
from kvtc.kernels.codec.spec import CodedBlock

_RNE_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2^23: (x + M) - M rounds |x| < 2^22 to nearest even


@triton.jit
def _e4m3_encode(v):
    """float32 within [-448, 448] -> e4m3fn bits (int32), round to nearest even, like torch."""
    bits = v.to(tl.uint32, bitcast=True)
    sign = ((bits >> 31) & 1).to(tl.int32) << 7
    mag = bits & 0x7FFFFFFF
    a = mag.to(tl.float32, bitcast=True)
    rounded = (mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20
    normal = rounded.to(tl.int32) - (120 << 3)
    sub = ((a * 512.0 + _RNE_MAGIC) - _RNE_MAGIC).to(tl.int32)
    return sign | tl.where(a >= 0.015625, normal, sub)


@triton.jit
def _quantize_code(z, shift, scale, FP8: tl.constexpr, LEVELS: tl.constexpr):
    if FP8:
        code = _e4m3_encode(tl.clamp(tl.math.div_rn(z, scale), -448.0, 448.0))
    else:
        v = tl.clamp(tl.math.div_rn(z - shift, scale), -1.0, LEVELS + 1.0)
        code = tl.clamp((v + _RNE_MAGIC) - _RNE_MAGIC, 0.0, LEVELS * 1.0).to(tl.int32)
    return code


@triton.jit
def _quantize_pack_kernel(z_ptr, packed_ptr, params_ptr, N, start, size, szr, szc, spr,
                          BITS: tl.constexpr, FP8: tl.constexpr, S_P2: tl.constexpr, NB_P2: tl.constexpr,
                          BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]
    rmask = rows < N
    cols = tl.arange(0, S_P2)[None, :]
    mask = rmask & (cols < size)
    zrow = z_ptr + rows * szr + start * szc
    z = tl.load(zrow + cols * szc, mask=mask, other=0.0)
    LEVELS: tl.constexpr = (1 << BITS) - 1
    if FP8:
        absmax = tl.minimum(tl.max(tl.abs(z), axis=1), 65504.0 * 448.0)
        scale = tl.math.div_rn(absmax, 448.0).to(tl.float16)
        shift = tl.zeros_like(scale)
    else:
        lo = tl.min(tl.where(mask, z, float("inf")), axis=1)
        hi = tl.max(tl.where(mask, z, float("-inf")), axis=1)
        shift = tl.clamp(lo, -65504.0, 65504.0).to(tl.float16)
        scale = tl.minimum(tl.math.div_rn(hi - shift.to(tl.float32), LEVELS * 1.0), 65504.0).to(tl.float16)
    scale = tl.where(scale > 0, scale, 1.0)
    prow = params_ptr + tl.program_id(0) * BLOCK_N * 2 + tl.arange(0, BLOCK_N) * 2
    pmask = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)) < N
    tl.store(prow, shift, mask=pmask)
    tl.store(prow + 1, scale, mask=pmask)
    shift_f = shift.to(tl.float32)[:, None]
    scale_f = scale.to(tl.float32)[:, None]
    if BITS == 8:
        code = _quantize_code(z, shift_f, scale_f, FP8, LEVELS)
        tl.store(packed_ptr + rows * spr + cols, code.to(tl.uint8), mask=mask)
    else:
        j = tl.arange(0, NB_P2)[None, :]
        nbytes = (size * BITS + 7) // 8
        byte = tl.zeros((BLOCK_N, NB_P2), dtype=tl.int32)
        for k in tl.static_range(8):
            g = j * 8 + k
            i = g // BITS
            ok = rmask & (i < size)
            zi = tl.load(zrow + i * szc, mask=ok, other=0.0)
            code = _quantize_code(zi, shift_f, scale_f, FP8, LEVELS)
            byte = byte | tl.where(ok, ((code >> (g % BITS)) & 1) << k, 0)
        tl.store(packed_ptr + rows * spr + j, byte.to(tl.uint8), mask=rmask & (j < nbytes))


def quantize_pack(z: torch.Tensor, start: int, size: int, qtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton: block [start, start+size) of z (N, k) float32 -> packed (N, nbytes) uint8, params (N, 2) fp16."""
    bits = qtype_bits(qtype)
    if bits == 0:
        raise ValueError("a 'none' block has no codes to pack")
    z = z.to(torch.float32)
    n = z.shape[0]
    nbytes = packed_nbytes(size, bits)
    packed = torch.empty(n, nbytes, dtype=torch.uint8, device=z.device)
    params = torch.empty(n, 2, dtype=torch.float16, device=z.device)
    if n:
        s_p2 = triton.next_power_of_2(size)
        block_n = max(1, min(64, 4096 // s_p2))
        _quantize_pack_kernel[(triton.cdiv(n, block_n),)](
            z, packed, params, n, start, size, z.stride(0), z.stride(1), packed.stride(0),
            BITS=bits, FP8=qtype == "fp8", S_P2=s_p2, NB_P2=triton.next_power_of_2(nbytes), BLOCK_N=block_n)
    return packed, params


def quantize_pack_reference(z: torch.Tensor, start: int, size: int, qtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch: same contract as quantize_pack, built from reference.quantize_block and pack_codes."""
    codes, params = quantize_block(z[:, start:start + size], qtype)
    return pack_codes(codes, qtype_bits(qtype)), params


def quantize_pack_blocks(z: torch.Tensor, blocks: Sequence[CodedBlock], reference: bool = False
                         ) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """Every block of z (N, k) -> (packed, params), None for "none" blocks.

    reference=True runs plain torch with each run of adjacent same-type, same-size blocks batched
    into one call (rows are independent, so the result is bit-identical to block by block)."""
    out: list[tuple[torch.Tensor, torch.Tensor] | None] = []
    n, i = z.shape[0], 0
    while i < len(blocks):
        b, m = blocks[i], 1
        while (i + m < len(blocks) and blocks[i + m][1:] == b[1:]
               and blocks[i + m].start == b.start + m * b.size):
            m += 1
        if not b.bits:
            out += [None] * m
        elif not reference:
            out += [quantize_pack(z, x.start, x.size, x.qtype) for x in blocks[i:i + m]]
        else:
            run = z[:, b.start:b.start + m * b.size].reshape(n * m, b.size)
            codes, params = quantize_block(run, b.qtype)
            packed = pack_codes(codes, b.bits).reshape(n, m, -1)
            params = params.reshape(n, m, 2)
            out += [(packed[:, r], params[:, r]) for r in range(m)]
        i += m
    return out


assert FP8_MAX == 448.0 and FP16_MAX == 65504.0, "kernel constants must follow kernels/codec/reference.py"
