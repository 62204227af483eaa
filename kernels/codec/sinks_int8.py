"""Raw sinks as int8: a blob's TAG_RAW_HEAD section at about half the bytes of bfloat16.

The attention sinks are kept out of the transform (its error on them is above 100%), and every later query
attends to them. In a stored chunk they are paid from the chunk's own budget, so their bytes cost the coded
tokens precision: stored as int8 codes with one float32 scale per token vector (absmax / 127), a sink costs
W + 4 bytes per (layer, head) instead of 2W, at a relative error near 1% (the coded tokens': 10-25%).

Section layout: codes (L, H, n, W) int8, C order, then scales (L, H, n) float32 little endian.
"""
from __future__ import annotations

import torch

from kvtc.kernels.codec.blob import BlobError

_LEVELS = 127.0


def int8_bytes(layers: int, heads: int, tokens: int, width: int) -> int:
    """Bytes of the int8 section of (layers, heads, tokens, width) raw tokens."""
    return layers * heads * tokens * (width + 4)


def sinks_to_int8(x: torch.Tensor) -> bytes:
    """x (L, H, n, W), finite -> the section's bytes (codes, then scales)."""
    x = x.detach().to(device="cpu", dtype=torch.float64)  # float64: a float32 max / 127 x 127 stays finite
    scale = (x.abs().amax(dim=-1) / _LEVELS).to(torch.float32)
    wide = scale.to(torch.float64)[..., None]
    codes = torch.where(wide > 0, x / wide.clamp_min(torch.finfo(torch.float64).tiny), torch.zeros_like(x))
    codes = codes.round().clamp_(-_LEVELS, _LEVELS).to(torch.int8)
    return codes.contiguous().numpy().tobytes() + scale.contiguous().numpy().astype("<f4").tobytes()


def sinks_from_int8(data: bytes, shape: tuple[int, int, int, int], dtype: torch.dtype) -> torch.Tensor:
    """The section's bytes (length checked by the caller) -> (L, H, n, W) in `dtype`; BlobError for a scale
    that is negative or not finite, or a code of -128 (encode never writes one)."""
    L, H, n, W = shape
    data, cut = bytes(data), L * H * n * W
    codes = torch.frombuffer(bytearray(data[:cut]), dtype=torch.int8).reshape(L, H, n, W)
    scale = torch.frombuffer(bytearray(data[cut:]), dtype=torch.float32).reshape(L, H, n)
    if not bool(torch.isfinite(scale).all()) or bool((scale < 0).any()) or bool((codes == -128).any()):
        raise BlobError("the int8 sink section holds a scale that is negative or not finite, or a code of -128: "
                        "encode never stores one, the blob is corrupt or forged")
    out = codes.to(torch.float64) * scale.to(torch.float64)[..., None]
    top = torch.finfo(dtype).max
    if bool((out.abs() > top * (1 + 2 ** -6)).any()):  # beyond the rounding of a scale encode wrote
        raise BlobError(f"the int8 sink section decodes to values beyond {dtype}: the blob is corrupt or forged")
    return out.clamp_(-top, top).to(dtype)
