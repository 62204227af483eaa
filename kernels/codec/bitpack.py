"""Plain-torch bit packing: the layout every packing kernel must reproduce.

A row of `size` codes of `bits` bits each becomes ceil(size * bits / 8) bytes. Code i occupies
stream bits [i * bits, (i + 1) * bits), least significant bit first; stream bit g lives in byte
g // 8 at bit g % 8. Trailing pad bits are zero.
"""
from __future__ import annotations

import torch


def packed_nbytes(size: int, bits: int) -> int:
    """Bytes per row for `size` codes of `bits` bits."""
    return (size * bits + 7) // 8


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes (N, size) uint8 with values < 2^bits -> packed (N, packed_nbytes(size, bits)) uint8."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    n, size = codes.shape
    if bits == 8:
        return codes.to(torch.uint8).contiguous()
    if 8 % bits == 0:
        per = 8 // bits
        nbytes = packed_nbytes(size, bits)
        padded = torch.nn.functional.pad(codes.to(torch.int32), (0, nbytes * per - size))
        shifts = torch.arange(0, 8, bits, device=codes.device, dtype=torch.int32)
        return (padded.reshape(n, nbytes, per) << shifts).sum(dim=2).to(torch.uint8)
    shifts = torch.arange(bits, device=codes.device, dtype=torch.int32)
    stream = ((codes.to(torch.int32)[:, :, None] >> shifts) & 1).reshape(n, size * bits)
    nbytes = packed_nbytes(size, bits)
    pad = nbytes * 8 - size * bits
    if pad:
        stream = torch.nn.functional.pad(stream, (0, pad))
    weights = torch.tensor([1 << k for k in range(8)], device=codes.device, dtype=torch.int32)
    return (stream.reshape(n, nbytes, 8) * weights).sum(dim=2).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, size: int, bits: int) -> torch.Tensor:
    """packed (N, nbytes) uint8 -> codes (N, size) uint8; inverse of pack_codes."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    n, nbytes = packed.shape
    if nbytes != packed_nbytes(size, bits):
        raise ValueError(f"packed rows have {nbytes} bytes, expected {packed_nbytes(size, bits)}")
    if bits == 8:
        return packed.contiguous()
    if 8 % bits == 0:
        shifts = torch.arange(0, 8, bits, device=packed.device, dtype=torch.int32)
        codes = (packed.to(torch.int32)[:, :, None] >> shifts) & ((1 << bits) - 1)
        return codes.reshape(n, nbytes * (8 // bits))[:, :size].to(torch.uint8)
    shifts = torch.arange(8, device=packed.device, dtype=torch.int32)
    stream = ((packed.to(torch.int32)[:, :, None] >> shifts) & 1).reshape(n, nbytes * 8)
    stream = stream[:, : size * bits].reshape(n, size, bits)
    weights = torch.tensor([1 << k for k in range(bits)], device=packed.device, dtype=torch.int32)
    return (stream * weights).sum(dim=2).to(torch.uint8)
