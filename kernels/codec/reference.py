"""Plain-torch reference quantizers: the definition every kernel and the allocator's error
tables must match.

A block is a contiguous range of PCA components, quantized per token (per row); types, bit widths
and costs are defined in kvtc.artifacts.blocks:

- ``intB`` (B in 1..8): shift = min, scale = (max - min) / (2^B - 1), both stored as fp16;
  code = clamp(round((z - shift) / scale), 0, 2^B - 1); z_hat = shift + code * scale.
  Cost: size * B + 32 bits per token.
- ``fp8``: e4m3 with a per-token absmax scale stored as fp16:
  scale = absmax / 448; code = e4m3(clamp(z / scale, -448, 448)); z_hat = code * scale.
  Cost: size * 8 + 16 bits per token.
- ``none``: nothing stored; z_hat = 0 (the component is reconstructed as the mean).

Shapes: z (N, size) float32; codes (N, size) uint8; params (N, 2) float16 = (shift, scale)
for intB and (0, scale) for fp8.
"""
from __future__ import annotations

import torch

from kvtc.artifacts.blocks import qtype_bits

FP8_MAX = 448.0
FP16_MAX = 65504.0


def quantize_block(z: torch.Tensor, qtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """z (N, size) float -> codes (N, size) uint8, params (N, 2) float16."""
    z = z.float()
    n = z.shape[0]
    if qtype == "none":
        return torch.zeros_like(z, dtype=torch.uint8), torch.zeros(n, 2, dtype=torch.float16, device=z.device)
    if qtype == "fp8":
        absmax = z.abs().amax(dim=1).clamp(max=FP16_MAX * FP8_MAX)
        scale = (absmax / FP8_MAX).to(torch.float16)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = (z / scale.float()[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        params = torch.stack([torch.zeros_like(scale), scale], dim=1)
        return q.view(torch.uint8), params
    levels = (1 << qtype_bits(qtype)) - 1
    lo = z.amin(dim=1).clamp(-FP16_MAX, FP16_MAX).to(torch.float16)
    hi = z.amax(dim=1)
    scale = ((hi - lo.float()) / levels).clamp(max=FP16_MAX).to(torch.float16)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round((z - lo.float()[:, None]) / scale.float()[:, None]).clamp(0, levels)
    return codes.to(torch.uint8), torch.stack([lo, scale], dim=1)


def dequantize_block(codes: torch.Tensor, params: torch.Tensor, qtype: str) -> torch.Tensor:
    """codes (N, size) uint8, params (N, 2) float16 -> z_hat (N, size) float32."""
    if qtype == "none":
        return torch.zeros(codes.shape, dtype=torch.float32, device=codes.device)
    scale = params[:, 1].float()[:, None]
    if qtype == "fp8":
        return codes.view(torch.float8_e4m3fn).float() * scale
    qtype_bits(qtype)
    return params[:, 0].float()[:, None] + codes.float() * scale


def quantize_dequantize(z: torch.Tensor, qtype: str) -> torch.Tensor:
    """Round trip of one block: z (N, size) -> z_hat (N, size) float32."""
    codes, params = quantize_block(z, qtype)
    return dequantize_block(codes, params, qtype)
