"""Allocation blocks: the one block type and the bit widths of its quantizer types.

A block is a contiguous range [start, start + size) of PCA components stored with one quantizer
type: "none" (0 bits, reconstructed as the mean), "int1".."int8" (per-token min/max: an fp16 shift
and scale, 32 bits of side information) or "fp8" (e4m3 with a per-token fp16 absmax scale, 16 bits).
The allocator produces blocks, the registry stores them, the runtime codec (kvtc.kernels, whose
reference quantizers define the arithmetic) consumes them.
"""
from __future__ import annotations

from typing import NamedTuple

QTYPES = ("none", "int1", "int2", "int3", "int4", "int5", "int6", "int7", "int8", "fp8")


def qtype_bits(qtype: str) -> int:
    """Bits per component of a block type."""
    if qtype == "none":
        return 0
    if qtype == "fp8":
        return 8
    if qtype.startswith("int") and qtype[3:].isdigit() and 1 <= int(qtype[3:]) <= 8:
        return int(qtype[3:])
    raise ValueError(f"unknown block type {qtype!r}; expected one of {', '.join(QTYPES)}")


def scale_bits(qtype: str) -> int:
    """Per-token side information of one block, in bits (fp16 shift + scale, or an fp16 scale)."""
    if qtype == "none":
        return 0
    return 16 if qtype == "fp8" else 32


def block_cost_bits(qtype: str, size: int) -> int:
    """Bits per token that a block of `size` components of type `qtype` costs."""
    return size * qtype_bits(qtype) + scale_bits(qtype)


class Block(NamedTuple):
    """Components [start, start + size) quantized as `qtype` with `bits` per component. A tuple, so
    it unpacks as (start, size, qtype, bits) and compares equal to that tuple."""

    start: int
    size: int
    qtype: str
    bits: int

    @classmethod
    def of(cls, start: int, size: int, qtype: str) -> "Block":
        """A block with its type's bit width."""
        return cls(int(start), int(size), str(qtype), qtype_bits(str(qtype)))

    @property
    def type(self) -> str:
        return self.qtype

    @property
    def end(self) -> int:
        return self.start + self.size

    @property
    def scale_bits(self) -> int:
        return scale_bits(self.qtype)

    @property
    def cost_bits(self) -> int:
        """Bits per token: size * bits + per-token side information."""
        return self.size * self.bits + self.scale_bits

    def to_dict(self) -> dict:
        return {"start": self.start, "size": self.size, "type": self.qtype, "bits": self.bits,
                "scale_bits": self.scale_bits}
