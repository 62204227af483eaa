"""Allocation blocks: the one block type and the bit widths of its quantizer types.

A block is a contiguous range [start, start + size) of PCA components stored with one quantizer
type: "none" (0 bits, reconstructed as the mean), "int1".."int8" (per-token min/max: an fp16 shift
and scale, 32 bits of side information) or "fp8" (e4m3 with a per-token fp16 absmax scale, 16 bits).
The allocator produces blocks, the registry stores them, the runtime codec (kvtc.kernels.codec, whose
reference quantizers define the arithmetic) consumes them.
"""
from __future__ import annotations

import math
import numbers
from typing import Any, NamedTuple

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


def code_bits(qtype: str, size: int) -> int:
    """Bits per token a block's codes take as stored: `size` codes of the type's bits, padded to whole bytes
    (each token's row of a block is packed on its own; a 1-component int2 block stores 8 bits, not 2)."""
    return -(-size * qtype_bits(qtype) // 8) * 8


def block_cost_bits(qtype: str, size: int) -> int:
    """Bits per token that a block of `size` components of type `qtype` costs as stored: its codes padded to
    whole bytes and its per-token side information."""
    return code_bits(qtype, size) + scale_bits(qtype)


def check_ratios(ratios, where: str = "") -> tuple[float, ...]:
    """The one rule every compression ratio obeys, wherever it enters (options, settings, records, the
    allocator, `kvtc eval`): at least one, each finite and > 1, none twice; -> floats, in order.
    where: what names them in the error ("--ratios: ", "calibration record: ")."""
    try:
        out = tuple(float(r) for r in ratios)
    except (TypeError, ValueError):
        raise ValueError(f"{where}compression ratios must be numbers, got {ratios!r}") from None
    if not out:
        raise ValueError(f"{where}no compression ratios given; pass e.g. --ratios 8,16,32")
    for r in out:
        if not (math.isfinite(r) and r > 1):
            raise ValueError(f"{where}compression ratio {r:g} is refused: compression ratios must be > 1 and finite "
                             "(8 to 64 is usual)")
    if len(set(out)) != len(out):
        raise ValueError(f"{where}{[f'{r:g}' for r in out]} lists a ratio twice")
    return out


def budget_bits(p: int, ratio: float) -> int:
    """The bit budget of one token of one stream (p features of 16 bits) at compression `ratio`: floor(16 p / CR)."""
    return int(math.floor(16 * p / ratio + 1e-9))


def check_budget_split(budgets: dict, dims: dict, ranks: dict, what: str) -> None:
    """A ratio's bits shared between bases (a joint split) must add up to the ratio's total.

    budgets {(ratio, stream, group): bits per token}; dims {(stream, group): p}; ranks {group: the rank (its KV
    head range) whose total it shares}. Per ratio and rank, the bases' bits sum to the sum of floor(16 p / CR),
    and each basis's lie in [1, 16 p] (no basis goes without bits: the codec reads 0 as "unset"). ValueError naming
    the ratio and rank otherwise."""
    totals: dict[tuple, list[int]] = {}
    for (ratio, stream, group), bits in budgets.items():
        p = dims.get((stream, group))
        if p is None:
            continue  # a table without a basis: the caller's own check names it
        if isinstance(bits, bool) or not isinstance(bits, numbers.Integral) or not 1 <= int(bits) <= 16 * p:
            raise ValueError(f"{what} ({ratio:g}, {stream!r}, {group}): budget {bits!r} bits is outside [1, 16 p = {16 * p}]")
        acc = totals.setdefault((float(ratio), ranks.get(group)), [0, 0])
        acc[0] += int(bits)
        acc[1] += budget_bits(p, float(ratio))
    for (ratio, rank), (got, total) in totals.items():
        if got != total:
            where = "" if rank is None else f" of the rank holding KV heads {rank}"
            raise ValueError(f"{what}: the bases' budgets at CR {ratio:g}{where} add up to {got} bits per token, not the "
                             f"ratio's {total} (floor(16 p / CR) summed over its bases); the version is damaged or was "
                             "edited: republish it")


def ecsq_budget_bytes(p: int, ratio: float, tokens: int) -> int:
    """The byte budget of `tokens` ECSQ-coded tokens of one stream and group of p features."""
    return budget_bits(p, ratio) * tokens // 8


def cheapest_block_bits(types, sizes, p: int) -> int:
    """The fewest bits per token any quantized block (of `types`, a size in `sizes` up to p) costs."""
    return min(block_cost_bits(t, s) for t in types if t != "none" for s in sizes if s <= p)


def check_payable(ratios, p: int, types, sizes, where: str = "") -> None:
    """The one rule that a ratio must leave a stream of p features the bits of one quantized block (of `types`, a
    size in `sizes`): ValueError naming the first ratio that does not, and the largest that would."""
    cheapest = cheapest_block_bits(types, sizes, p)
    for r in ratios:
        if budget_bits(p, r) < cheapest:
            raise ValueError(f"{where}compression ratio {r:g} leaves {budget_bits(p, r)} bits per token for p={p}, less "
                             f"than the cheapest quantized block ({cheapest} bits); use a ratio <= {16 * p / cheapest:g}")


def cheapest_bits_per_component(types, sizes, p: int) -> float:
    """The fewest bits per token per component any quantized block (size up to p) costs."""
    return min(block_cost_bits(t, s) / s for t in types if t != "none" for s in sizes if s <= p)


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
        """Bits per token as stored: the codes padded to whole bytes, and per-token side information."""
        return block_cost_bits(self.qtype, self.size)

    def to_dict(self) -> dict:
        return {"start": self.start, "size": self.size, "type": self.qtype, "bits": self.bits,
                "scale_bits": self.scale_bits}


def normalize_block(block: Any, where: str) -> tuple[int, int, str, int, int]:
    """(start, size, type, bits[, scale_bits]) tuple, dict or Block-like object -> 5-tuple."""
    if isinstance(block, dict):
        fields = [block.get("start"), block.get("size"), block.get("type", block.get("qtype")), block.get("bits"),
                  block.get("scale_bits")]
    elif isinstance(block, (tuple, list)):
        if len(block) not in (4, 5):
            raise ValueError(f"{where}: a block is (start, size, type, bits[, scale_bits]), got {block!r}")
        fields = list(block) + [None] * (5 - len(block))
    else:
        fields = [getattr(block, "start", None), getattr(block, "size", None),
                  getattr(block, "type", getattr(block, "qtype", None)), getattr(block, "bits", None),
                  getattr(block, "scale_bits", None)]
    start, size, qtype, bits, scale = fields
    if qtype is None or start is None or size is None:
        raise ValueError(f"{where}: block {block!r} lacks start, size or type")
    bits = qtype_bits(str(qtype)) if bits is None else int(bits)
    if bits != qtype_bits(str(qtype)):
        raise ValueError(f"{where}: block type {qtype} has {qtype_bits(str(qtype))} bits, not {bits}")
    scale = scale_bits(str(qtype)) if scale is None else int(scale)
    if int(size) <= 0 or int(start) < 0 or scale < 0:
        raise ValueError(f"{where}: block {block!r} needs start >= 0, size > 0, scale_bits >= 0")
    return int(start), int(size), str(qtype), bits, scale
