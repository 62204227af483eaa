"""The fixed-rate mode: each group's kept components quantized per DP block with per-token scales.

In a blob, every block with bits is two sections, its per-token params then its packed codes (DEFLATEd
by the codec's coder; KVTCCodec._block_bytes and _block_tensors are their byte layout); resident, the
same packed codes and fp16 params as tensors, so they can be dequantized every step.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from kvtc.kernels.codec.bitpack import packed_nbytes
from kvtc.kernels.codec.blob import TAG_CODES, TAG_PARAMS, BlobHeader, Section, SectionBound, SectionKey
from kvtc.kernels.codec.mode import Mode
from kvtc.kernels.codec.quantize import quantize_pack_blocks
from kvtc.kernels.codec.spec import STREAMS, CodecSpec

BLOCK_TYPES = ("int1", "int2", "int3", "int4", "int5", "int6", "int7", "int8", "fp8", "none")


class FixedMode(Mode):
    name = "fixed"

    def codes(self, spec: CodecSpec, stream: str) -> tuple:
        return spec.streams[stream]

    def check_resident(self, spec: CodecSpec) -> None:
        for stream in STREAMS:
            for g in spec.streams[stream]:
                if any(b.qtype not in BLOCK_TYPES for b in g.blocks):
                    raise ValueError(f"{stream} group {g.group.label}: block types {sorted({b.qtype for b in g.blocks})} "
                                     f"are not all per-block min/max or fp8 types {BLOCK_TYPES}")

    def encode(self, codec: Any, feat: torch.Tensor, si: int, stream: str, dev: torch.device, ops: Any, parts: list,
               budget_scale: float) -> list[Section]:
        out = []
        for gi, (cols, comps, code) in enumerate(parts):
            with codec._stage("project", dev):
                z = (feat[:, cols].to(comps.dtype) @ comps).float().contiguous()
            with codec._stage("quantize_pack", dev):
                coded = quantize_pack_blocks(z, code.blocks, reference=ops.name == "torch")
                coded = [codec._block_bytes(*c) if c else None for c in coded]
            for bi, c in enumerate(coded):
                if c is not None:
                    out.append(codec._section(SectionKey(TAG_PARAMS, si, gi, bi), c[0], dev))
                    out.append(codec._section(SectionKey(TAG_CODES, si, gi, bi), c[1], dev))
        return out

    def decoder(self, codec: Any, data: dict, si: int, stream: str, mid: int, dev: torch.device, header: BlobHeader,
                ops: Any, parts: list) -> Callable[[int, int, torch.Tensor], None]:
        held = [[codec._block_tensors(data, si, gi, bi, mid, dev) if b.bits else None for bi, b in enumerate(code.blocks)]
                for gi, (_, _, code) in enumerate(parts)]

        def rows(a: int, b: int, feat: torch.Tensor) -> None:
            for gi, (cols, comps, code) in enumerate(parts):
                zhat = torch.zeros(b - a, code.kept, dtype=torch.float32, device=dev)
                with codec._stage("dequantize", dev):
                    for block, pair in zip(code.blocks, held[gi]):
                        if pair is not None:
                            ops.unpack_dequantize(pair[0][a:b], pair[1][a:b], block.qtype, zhat, block.start, block.size)
                with codec._stage("project", dev):
                    feat[:, cols] = zhat.to(comps.dtype) @ comps.T  # comps: the group's decoding matrix

        return rows

    def section_bounds(self, codec: Any, mid: int, table: dict, header: BlobHeader) -> list[SectionBound]:
        out = []
        for si, stream in enumerate(STREAMS):
            for gi, g in enumerate(codec.spec.streams[stream]):
                for bi, b in enumerate(g.blocks):
                    if b.bits:
                        out.append(SectionBound(SectionKey(TAG_PARAMS, si, gi, bi), mid * 4))
                        out.append(SectionBound(SectionKey(TAG_CODES, si, gi, bi), mid * packed_nbytes(b.size, b.bits)))
        return out

    def encode_resident(self, coder: Any, z: torch.Tensor, stream: str, gi: int, ops: Any, batch: int, n: int) -> tuple:
        coded = quantize_pack_blocks(z, coder.spec.streams[stream][gi].blocks, reference=ops.name == "torch")
        return tuple(None if c is None else (c[0].contiguous(), c[1].contiguous()) for c in coded)

    def coefficients(self, coder: Any, coded: Any, stream: str, gi: int) -> torch.Tensor:
        g = coder.spec.streams[stream][gi]
        parts = coded.blocks[stream][gi]
        dev = next((p[0].device for p in parts if p is not None), torch.device("cpu"))
        z = torch.zeros(coded.batch * coded.tokens, g.kept, dtype=torch.float32, device=dev)
        ops = coder._ops(dev)
        for b, pair in zip(g.blocks, parts):
            if pair is not None:
                ops.unpack_dequantize(pair[0], pair[1], b.qtype, z, b.start, b.size)
        return z

    def resident_nbytes(self, blocks: dict) -> int:
        return sum(t.numel() * t.element_size() for groups in blocks.values() for group in groups
                   for pair in group if pair is not None for t in pair)

    def select(self, blocks: dict, batch: int, tokens: int, index: torch.Tensor) -> dict:
        def pick(x: torch.Tensor) -> torch.Tensor:
            return x.reshape(batch, tokens, -1)[index.to(x.device)].reshape(-1, x.shape[-1]).contiguous()

        return {s: tuple(tuple(None if p is None else (pick(p[0]), pick(p[1])) for p in group) for group in groups)
                for s, groups in blocks.items()}
