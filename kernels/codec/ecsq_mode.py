"""The ECSQ mode: each group's kept components quantized with one global step and entropy-coded
(kernels/codec/ecsq.py), the step coarsened by rate control where a blob would exceed its budget.

In a blob, every (stream, group) is two sections, its coded symbols (stored plain: they are the coded
stream) then its escapes; resident, the same two byte strings per sequence, entropy-decoded when read.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from kvtc.kernels.codec import ecsq
from kvtc.kernels.codec.blob import TAG_ECSQ, TAG_ESCAPES, BlobError, BlobHeader, Section, SectionBound, SectionKey
from kvtc.kernels.codec.entropy import PLAIN
from kvtc.kernels.codec.mode import Mode
from kvtc.kernels.codec.spec import STREAMS, CodecSpec


class EcsqMode(Mode):
    name = "ecsq"

    def codes(self, spec: CodecSpec, stream: str) -> tuple:
        return spec.ecsq[stream]

    def check(self, spec: CodecSpec) -> None:
        if spec.ecsq is None:
            raise ValueError(f"artifact {spec.name}@{spec.version} has no ECSQ tables for ratio {spec.ratio:g} "
                             f"(calibrated before the ECSQ mode existed, or without it): recalibrate with this release, "
                             f"e.g. `kvtc recalibrate {spec.name} --corpus SPEC` (cached shards are reused), or use "
                             f"mode='fixed'")

    def encode(self, codec: Any, feat: torch.Tensor, si: int, stream: str, dev: torch.device, ops: Any, parts: list,
               budget_scale: float) -> list[Section]:
        out, on_dev = [], codec.on_device(dev, ops.name)
        for gi, (cols, comps, g) in enumerate(parts):
            with codec._stage("project", dev):
                z = (feat[:, cols].to(comps.dtype) @ comps).float()
            budget = int(g.budget_bytes(codec.spec.ratio, z.shape[0]) * budget_scale) if codec.rate_control else None
            with codec._stage("entropy", dev):
                words, escapes = ecsq.encode_group(z, g, budget, codec.ecsq_format, on_dev)
            out.append(Section(SectionKey(TAG_ECSQ, si, gi, 0), PLAIN, len(words), words))
            out.append(codec._section(SectionKey(TAG_ESCAPES, si, gi, 0), escapes, dev))
        return out

    def decoder(self, codec: Any, data: dict, si: int, stream: str, mid: int, dev: torch.device, header: BlobHeader,
                ops: Any, parts: list) -> Callable[[int, int, torch.Tensor], None]:
        on_dev, symbols = codec.on_device(dev, ops.name), []
        for gi, (_, _, g) in enumerate(parts):
            with codec._stage("entropy_decode", dev):
                symbols.append(ecsq.decode_group_to(data[SectionKey(TAG_ECSQ, si, gi, 0)],
                                                    data[SectionKey(TAG_ESCAPES, si, gi, 0)], mid, g, header.ecsq_format,
                                                    dev, on_dev))

        def rows(a: int, b: int, feat: torch.Tensor) -> None:
            for gi, (cols, comps, _) in enumerate(parts):
                q, step = symbols[gi]
                with codec._stage("dequantize", dev):
                    zhat = ecsq.dequantize(q[a:b], step, codec._offsets(stream, gi, dev))
                with codec._stage("project", dev):
                    feat[:, cols] = zhat.to(comps.dtype) @ comps.T

        return rows

    def section_bounds(self, codec: Any, mid: int, table: dict, header: BlobHeader) -> list[SectionBound]:
        spec = codec.spec
        if spec.ecsq is None:
            raise BlobError(f"blob was written in the ECSQ mode; artifact {spec.name}@{spec.version} has "
                            f"no ECSQ tables for ratio {spec.ratio:g}")
        out = []
        for si, stream in enumerate(STREAMS):
            for gi, g in enumerate(spec.ecsq[stream]):
                key = SectionKey(TAG_ECSQ, si, gi, 0)
                words = table[key].raw_len if key in table and table[key].coding == PLAIN else None
                words_max, escapes_max = ecsq.section_bounds(g, mid, words, header.ecsq_format)
                out.append(SectionBound(key, words_max, exact=False, plain=True))
                out.append(SectionBound(SectionKey(TAG_ESCAPES, si, gi, 0), escapes_max, exact=False))
        return out

    def check_capacity(self, codec: Any, mid: int, sections: list[Section], header: BlobHeader) -> None:
        """A lower bound on the words each token's symbols cost (the fixed mode's sections are exact sizes,
        bounded by their stored bytes in read_blob)."""
        if not mid or codec.spec.ecsq is None:
            return
        table = {s.key: s for s in sections}
        for si, stream in enumerate(STREAMS):
            for gi, g in enumerate(codec.spec.ecsq[stream]):
                words = table.get(SectionKey(TAG_ECSQ, si, gi, 0))
                if words is not None:
                    ecsq.check_capacity(g, mid, len(words.stored), header.ecsq_format)

    def encode_resident(self, coder: Any, z: torch.Tensor, stream: str, gi: int, ops: Any, batch: int, n: int) -> tuple:
        """Per sequence (words, escapes), budgeted like the codec's sections for n tokens."""
        g = coder.spec.ecsq[stream][gi]
        budget = g.budget_bytes(coder.spec.ratio, n) if coder.rate_control else None
        on_dev = z.device.type == "cuda" and coder._ops(z.device).name == "triton"
        return tuple(ecsq.encode_group(z[b * n:(b + 1) * n], g, budget, coder.ecsq_format, on_dev) for b in range(batch))

    def coefficients(self, coder: Any, coded: Any, stream: str, gi: int) -> torch.Tensor:
        g, dev = coder.spec.ecsq[stream][gi], torch.device(coded.device)
        parts, on_dev = [], dev.type == "cuda" and coder._ops(dev).name == "triton"
        for words, escapes in coded.blocks[stream][gi]:
            q, step = ecsq.decode_group_to(words, escapes, coded.tokens, g, coder.ecsq_format, dev, on_dev)
            parts.append(ecsq.dequantize(q, step, coder._offsets(stream, gi, dev)))
        return torch.cat(parts)

    def resident_nbytes(self, blocks: dict) -> int:
        """The ANS words and escapes (payload bytes, not counting Python's ~33-byte header per bytes object)."""
        return sum(len(w) + len(e) for groups in blocks.values() for seqs in groups for w, e in seqs)

    def select(self, blocks: dict, batch: int, tokens: int, index: torch.Tensor) -> dict:
        rows = [int(i) for i in index.tolist()]
        return {s: tuple(tuple(seqs[i] for i in rows) for seqs in groups) for s, groups in blocks.items()}
