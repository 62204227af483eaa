"""Byte layouts of blob sections, chosen so DEFLATE sees similar symbols side by side.

Codes: packed (N, nbytes) uint8 stored byte-column major (nbytes, N): one component's symbols of
all tokens are adjacent. Params: (N, 2) fp16 stored as four byte planes (shift lo, shift hi,
scale lo, scale hi), each (N,); an fp8 block's, whose shift is always 0, as the scale's two planes
alone. Raw tensors: C-contiguous native little-endian bytes.
Every inverse copies into a fresh C-contiguous tensor before reinterpreting bytes: a transposed view
of one token, (1, 4), is "contiguous" with strides (1, 1), which a dtype view refuses.
"""
from __future__ import annotations

import torch


def tensor_bytes(x: torch.Tensor) -> bytes:
    """Any tensor -> its C-contiguous bytes (little endian)."""
    return x.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()


def bytes_to_tensor(b: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Inverse of tensor_bytes; the caller has checked len(b)."""
    return torch.frombuffer(bytearray(b), dtype=torch.uint8).view(dtype).reshape(shape)


def _transposed_copy(planes: torch.Tensor) -> torch.Tensor:
    """(a, n) -> a fresh (n, a) tensor with C strides (a, 1), whatever n is."""
    out = torch.empty(planes.shape[1], planes.shape[0], dtype=planes.dtype)
    out.copy_(planes.t())
    return out


def codes_bytes(packed: torch.Tensor) -> bytes:
    """packed (N, nbytes) uint8 -> bytes in (nbytes, N) order."""
    return packed.t().contiguous().cpu().numpy().tobytes()


def codes_from_bytes(b: bytes, n: int, device: torch.device) -> torch.Tensor:
    """bytes of (nbytes, N) -> packed (N, nbytes) uint8 on device."""
    planes = torch.frombuffer(bytearray(b), dtype=torch.uint8).reshape(-1, n)
    return _transposed_copy(planes).to(device)


def params_bytes(params: torch.Tensor, scale_only: bool = False) -> bytes:
    """params (N, 2) fp16 -> 4 byte planes of N bytes, or the scale's 2 (scale_only: an fp8 block's)."""
    planes = params.contiguous().view(torch.uint8).reshape(-1, 4).t()
    return (planes[2:] if scale_only else planes).contiguous().cpu().numpy().tobytes()


def params_from_bytes(b: bytes, n: int, device: torch.device, scale_only: bool = False) -> torch.Tensor:
    """Inverse of params_bytes -> (N, 2) fp16 on device (scale_only: a shift of 0)."""
    planes = torch.frombuffer(bytearray(b), dtype=torch.uint8).reshape(2 if scale_only else 4, n)
    if scale_only:
        planes = torch.cat([torch.zeros_like(planes), planes])
    return _transposed_copy(planes).view(torch.float16).to(device)
