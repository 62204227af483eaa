"""The fixed-rate mode: each group's kept components quantized per DP block with per-token scales.

In a blob (new blobs, format fixed-grouped, `grouped`), each (stream, group) with bits is two sections: every block's
per-token params, then every block's packed codes, each block's after the one before (DEFLATEd by the
codec's coder; `group_bytes` and `block_tensors` are their byte layout). A min/max block's params are an
fp16 shift and scale, an fp8 block's its fp16 scale alone, as the allocator charges them
(artifacts/blocks.scale_bits). Blobs written before the flag hold two sections per block, key block =
its index, with an fp16 shift of 0 beside each fp8 scale; they still decode. Resident, the same packed
codes and (N, 2) fp16 params as tensors, so they can be dequantized every step. Its sizes are exact: a
blob of a number of coded tokens always takes the same bytes (stored plain), and it needs no fallback.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator

import torch

from kvtc.kernels.codec.backend import Ops, resolve_ops
from kvtc.kernels.codec.basis_product import project
from kvtc.kernels.codec.bitpack import packed_nbytes
from kvtc.kernels.codec.blob import TAG_CODES, TAG_PARAMS, BlobHeader, Section, SectionBound, SectionKey
from kvtc.kernels.codec.extremes import saturate
from kvtc.kernels.codec.layout import codes_bytes, codes_from_bytes, params_bytes, params_from_bytes
from kvtc.kernels.codec.mode import BlobCoding, BlobContext, Mode, ResidentCoder, ResidentForm, SizeBounds
from kvtc.kernels.codec.quantize import quantize_pack_blocks
from kvtc.kernels.codec.spec import STREAMS, CodecSpec

BLOCK_TYPES = ("int1", "int2", "int3", "int4", "int5", "int6", "int7", "int8", "fp8", "none")


def _params_per_token(qtype: str, grouped: bool) -> int:
    """Bytes of a block's params per token: 2 for an fp8 block in a grouped blob (its scale), else 4."""
    return 2 if grouped and qtype == "fp8" else 4


def group_bytes(coded: list, blocks: tuple) -> tuple[bytes, bytes] | None:
    """A group's blocks' (packed codes, params) pairs (None: a block without bits) -> the raw bytes of its two
    sections (TAG_PARAMS, TAG_CODES) in a new blob; None where no block has bits."""
    pairs = [(params_bytes(c[1], scale_only=b.qtype == "fp8"), codes_bytes(c[0])) for c, b in zip(coded, blocks) if c]
    return (b"".join(p for p, _ in pairs), b"".join(c for _, c in pairs)) if pairs else None


def block_tensors(data: dict, si: int, gi: int, blocks: tuple, mid: int, dev: torch.device, grouped: bool
                  ) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """Each block's packed codes and params of `mid` tokens (None: no bits) from one group's sections, in the
    layout the header names (`group_bytes` inverted, or the per-block sections of blobs written before it)."""
    out: list[tuple[torch.Tensor, torch.Tensor] | None] = []
    if grouped and any(b.bits for b in blocks):
        params, codes = data[SectionKey(TAG_PARAMS, si, gi, 0)], data[SectionKey(TAG_CODES, si, gi, 0)]
    po = co = 0
    for bi, b in enumerate(blocks):
        if not b.bits:
            out.append(None)
            continue
        pn, cn = mid * _params_per_token(b.qtype, grouped), mid * packed_nbytes(b.size, b.bits)
        if not grouped:
            params, codes, po, co = data[SectionKey(TAG_PARAMS, si, gi, bi)], data[SectionKey(TAG_CODES, si, gi, bi)], 0, 0
        out.append((codes_from_bytes(codes[co:co + cn], mid, dev),
                    params_from_bytes(params[po:po + pn], mid, dev, scale_only=grouped and b.qtype == "fp8")))
        po, co = po + pn, co + cn
    return out


class FixedBlob(BlobCoding):
    """Per (stream, group) its blocks' params then their packed codes (`group_bytes`)."""

    def header_fields(self) -> dict[str, Any]:
        return {"grouped": True}

    def encode(self, ctx: BlobContext, feat: torch.Tensor, si: int, stream: str, parts: list,
               budget_scale: float) -> list[Section]:
        out = []
        for gi, (cols, comps, code) in enumerate(parts):
            with ctx.stage("project"):
                z = project(feat[:, cols], comps).contiguous()
            with ctx.stage("quantize_pack"):
                coded = group_bytes(quantize_pack_blocks(z, code.blocks, reference=ctx.ops.name == "torch"), code.blocks)
            if coded is not None:
                out.append(ctx.section(SectionKey(TAG_PARAMS, si, gi, 0), coded[0]))
                out.append(ctx.section(SectionKey(TAG_CODES, si, gi, 0), coded[1]))
        return out

    def coefficients(self, ctx: BlobContext, data: dict, si: int, stream: str, mid: int, header: BlobHeader,
                     parts: list) -> Callable[[int, int], list[torch.Tensor]]:
        dev, ops = ctx.device, ctx.ops
        held = [block_tensors(data, si, gi, code.blocks, mid, dev, header.grouped) for gi, (_, _, code) in enumerate(parts)]

        def coefficients(a: int, b: int) -> list[torch.Tensor]:
            out = []
            for gi, (_, _, code) in enumerate(parts):
                zhat = torch.zeros(b - a, code.kept, dtype=torch.float32, device=dev)
                with ctx.stage("dequantize"):
                    for block, pair in zip(code.blocks, held[gi]):
                        if pair is not None:
                            ops.unpack_dequantize(pair[0][a:b], pair[1][a:b], block.qtype, zhat, block.start, block.size)
                out.append(zhat)
            return out

        return coefficients

    def section_bounds(self, spec: CodecSpec, mid: int, table: dict, header: BlobHeader) -> list[SectionBound]:
        return list(self._bounds(spec, mid, header.grouped))

    @staticmethod
    def _bounds(spec: CodecSpec, mid: int, grouped: bool = True) -> Iterator[SectionBound]:
        """Every section with its exact raw size, in blob order (by default as new blobs store them)."""
        for si, stream in enumerate(STREAMS):
            for gi, g in enumerate(spec.streams[stream]):
                sizes = [(bi, mid * _params_per_token(b.qtype, grouped), mid * packed_nbytes(b.size, b.bits))
                         for bi, b in enumerate(g.blocks) if b.bits]
                if grouped and sizes:
                    sizes = [(0, sum(p for _, p, _ in sizes), sum(c for _, _, c in sizes))]
                for bi, params, codes in sizes:
                    yield SectionBound(SectionKey(TAG_PARAMS, si, gi, bi), params)
                    yield SectionBound(SectionKey(TAG_CODES, si, gi, bi), codes)

    def check_capacity(self, spec: CodecSpec, mid: int, sections: list[Section], header: BlobHeader) -> None:
        """Exact sizes: nothing to check beyond read_blob's bound on their stored bytes."""


class FixedSizes(SizeBounds):
    """Exact: a blob of a number of coded tokens always takes the same bytes (stored plain); no fallback."""

    exact = True

    def bound_bytes(self, spec: CodecSpec, tokens: int) -> int:
        """The exact size: every block's params and packed codes."""
        return sum(b.max_raw for b in FixedBlob._bounds(spec, tokens))

    def stream_bound_bytes(self, spec: CodecSpec, tokens: int, stream: str) -> int:
        return sum(b.max_raw for b in FixedBlob._bounds(spec, tokens) if b.key.stream == STREAMS.index(stream))

    @property
    def fallback(self) -> None:
        """None: its blobs always fit, their size being exact."""
        return None


class FixedResident(ResidentForm):
    """Packed codes and (N, 2) fp16 params as tensors, dequantized every step."""

    def check(self, spec: CodecSpec) -> None:
        for stream in STREAMS:
            for g in spec.streams[stream]:
                if any(b.qtype not in BLOCK_TYPES for b in g.blocks):
                    raise ValueError(f"{stream} group {g.group.label}: block types {sorted({b.qtype for b in g.blocks})} "
                                     f"are not all per-block min/max or fp8 types {BLOCK_TYPES}")

    def encode(self, coder: ResidentCoder, z: torch.Tensor, stream: str, gi: int, ops: Ops, batch: int,
                        n: int) -> tuple:
        coded = quantize_pack_blocks(z, coder.spec.streams[stream][gi].blocks, reference=ops.name == "torch")
        return tuple(None if c is None else (c[0].contiguous(), c[1].contiguous()) for c in coded)

    def coefficients(self, coder: ResidentCoder, coded: Any, stream: str, gi: int) -> torch.Tensor:
        g = coder.spec.streams[stream][gi]
        parts = coded.blocks[stream][gi]
        dev = next((p[0].device for p in parts if p is not None), torch.device("cpu"))
        z = torch.zeros(coded.batch * coded.tokens, g.kept, dtype=torch.float32, device=dev)
        ops = resolve_ops(coder.backend, dev)
        for b, pair in zip(g.blocks, parts):
            if pair is not None:
                ops.unpack_dequantize(pair[0], pair[1], b.qtype, z, b.start, b.size)
        return z

    def nbytes(self, blocks: dict) -> int:
        return sum(t.numel() * t.element_size() for groups in blocks.values() for group in groups
                   for pair in group if pair is not None for t in pair)

    def select(self, blocks: dict, batch: int, tokens: int, index: torch.Tensor) -> dict:
        def pick(x: torch.Tensor) -> torch.Tensor:
            return x.reshape(batch, tokens, -1)[index.to(x.device)].reshape(-1, x.shape[-1]).contiguous()

        return {s: tuple(tuple(None if p is None else (pick(p[0]), pick(p[1])) for p in group) for group in groups)
                for s, groups in blocks.items()}


class FixedMode(Mode):
    name = "fixed"
    label = "fixed-rate"
    blob = FixedBlob()
    sizes = FixedSizes()
    resident = FixedResident()

    def codes(self, spec: CodecSpec, stream: str) -> tuple:
        return spec.streams[stream]

    def check(self, spec: CodecSpec) -> None:
        """Every spec has its fixed-rate groups."""

    def admit(self, x: torch.Tensor, stream: str) -> torch.Tensor:
        """`x` saturated: never a transform that overflows."""
        return saturate(x)
