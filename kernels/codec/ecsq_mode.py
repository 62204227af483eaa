"""The ECSQ mode: each group's kept components quantized with one global step and entropy-coded
(kernels/codec/ecsq.py), the step coarsened by rate control where a blob would exceed its budget.

In a blob, every (stream, group) is two sections, its coded symbols (stored plain: they are the coded
stream) then its escapes; resident, the same two byte strings per sequence, entropy-decoded when read.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from kvtc.kernels.codec import ecsq
from kvtc.kernels.codec.backend import Ops, resolve_ops
from kvtc.kernels.codec.basis_product import project
from kvtc.kernels.codec.blob import TAG_ECSQ, TAG_ESCAPES, BlobError, BlobHeader, Section, SectionBound, SectionKey
from kvtc.kernels.codec.entropy import PLAIN
from kvtc.kernels.codec.extremes import refuse_beyond
from kvtc.kernels.codec.fixed_mode import FixedMode
from kvtc.kernels.codec.mode import BlobCoding, BlobContext, Mode, ResidentCoder, ResidentForm, SizeBounds
from kvtc.kernels.codec.spec import STREAMS, CodecSpec


class EcsqSizes(SizeBounds):
    """Rate-controlled: the budget bounds each (stream, group), with fixed-rate to fall back to."""

    exact = False

    def bound_bytes(self, spec: CodecSpec, tokens: int) -> int:
        """The rate control's budget: each (stream, group)'s share of the ratio's bits per coded token, in bytes."""
        return sum(g.budget_bytes(spec.ratio, tokens) for groups in spec.ecsq.values() for g in groups) if tokens else 0

    def floor_bytes(self, spec: CodecSpec, tokens: int) -> int:
        """No component coded: each (stream, group)'s words header and coder states. A blob coded with `truncate`
        (a first chunk paying its sinks) codes fewer components where every symbol 0 would not fit."""
        return sum(ecsq.EMPTY_BYTES for groups in spec.ecsq.values() for _ in groups) if tokens else 0

    def stream_bound_bytes(self, spec: CodecSpec, tokens: int, stream: str) -> int:
        return sum(g.budget_bytes(spec.ratio, tokens) for g in spec.ecsq[stream]) if tokens else 0

    @property
    def fallback(self) -> Mode:
        """Fixed-rate: it saturates instead of refusing, and its sizes are exact."""
        return FixedMode()


class EcsqBlob(BlobCoding):
    """Per (stream, group) its words (stored plain) then its escapes."""

    def blob_fields(self, sections: list[Section]) -> dict[str, Any]:
        return {"truncated": any(ecsq.is_truncated(s.stored) for s in sections if s.key.tag == TAG_ECSQ)}

    def encode(self, ctx: BlobContext, feat: torch.Tensor, si: int, stream: str, parts: list,
               budget_scale: float) -> list[Section]:
        out = []
        for gi, (cols, comps, g) in enumerate(parts):
            z = None if ctx.projections is None else ctx.projections.get((si, gi))
            if z is None:
                with ctx.stage("project"):
                    z = project(feat[:, cols], comps)
                if ctx.projections is not None:
                    ctx.projections[(si, gi)] = z
            full = g.budget_bytes(ctx.spec.ratio, z.shape[0])
            budget = int(full * budget_scale) if ctx.rate_control else None
            first = 0 if ctx.steps is None else ctx.steps.get((si, gi), 0)
            coded: list | None = None if ctx.symbols is None else []
            with ctx.stage("entropy"):
                words, escapes = ecsq.encode_group(z, g, budget, ctx.ecsq_format, ctx.entropy_on_device,
                                                   truncate=ctx.truncate, min_words=full // ecsq.TRUNCATED_MIN_SHARE,
                                                   first=first, symbols=coded)
            if ctx.symbols is not None:
                ctx.symbols.pop((si, gi), None)
                if coded:  # the step exactly as decode_group derives it from the section
                    step = g.step * 2.0 ** (ecsq.step_exponent(words) / ecsq.STEP_GRID)
                    ctx.symbols[(si, gi)] = coded[0], step
            if ctx.steps is not None and budget is not None and len(words) + len(escapes) <= budget \
                    and not ecsq.is_truncated(words):  # fitted: a coding at a smaller budget starts from its step
                ctx.steps[(si, gi)] = ecsq.step_exponent(words)
            out.append(Section(SectionKey(TAG_ECSQ, si, gi, 0), PLAIN, len(words), words))
            out.append(ctx.section(SectionKey(TAG_ESCAPES, si, gi, 0), escapes))
        return out

    def coefficients(self, ctx: BlobContext, data: dict, si: int, stream: str, mid: int, header: BlobHeader,
                     parts: list) -> Callable[[int, int], list[torch.Tensor]]:
        dev, symbols = ctx.device, []
        for gi, (_, _, g) in enumerate(parts):
            own = None if ctx.symbols is None else ctx.symbols.get((si, gi))
            if own is not None:  # this codec's own coding, read back: the symbols it just wrote
                symbols.append((own[0].to(dev), own[1]))
                continue
            with ctx.stage("entropy_decode"):
                symbols.append(ecsq.decode_group_to(data[SectionKey(TAG_ECSQ, si, gi, 0)],
                                                    data[SectionKey(TAG_ESCAPES, si, gi, 0)], mid, g, header.ecsq_format,
                                                    dev, ctx.entropy_on_device))

        def coefficients(a: int, b: int) -> list[torch.Tensor]:
            with ctx.stage("dequantize"):
                return [ecsq.dequantize(q[a:b], step, ctx.offsets(stream, gi)) for gi, (q, step) in enumerate(symbols)]

        return coefficients

    def section_bounds(self, spec: CodecSpec, mid: int, table: dict, header: BlobHeader) -> list[SectionBound]:
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

    def check_capacity(self, spec: CodecSpec, mid: int, sections: list[Section], header: BlobHeader) -> None:
        """A lower bound on the words each token's symbols cost (the fixed mode's sections are exact sizes,
        bounded by their stored bytes in read_blob)."""
        if not mid or spec.ecsq is None:
            return
        table, truncated = {s.key: s for s in sections}, False
        for si, stream in enumerate(STREAMS):
            for gi, g in enumerate(spec.ecsq[stream]):
                words = table.get(SectionKey(TAG_ECSQ, si, gi, 0))
                if words is not None and words.coding == PLAIN:  # else refused as not plain (section_bounds)
                    ecsq.check_capacity(g, mid, words.stored, header.ecsq_format, g.budget_bytes(spec.ratio, mid))
                    truncated |= ecsq.is_truncated(words.stored)
                elif words is not None:
                    return
        if truncated != header.truncated:
            raise BlobError("the blob's truncated flag (some ECSQ sections truncated) disagrees with its sections: "
                            "the blob is corrupt")


class EcsqResident(ResidentForm):
    """Per (stream, group, sequence) its words and escapes, entropy-decoded when read."""

    def check(self, spec: CodecSpec) -> None:
        """Every ECSQ group can be held resident (its words and escapes, as in a blob)."""

    def encode(self, coder: ResidentCoder, z: torch.Tensor, stream: str, gi: int, ops: Ops, batch: int,
                        n: int) -> tuple:
        """Per sequence (words, escapes), budgeted like the codec's sections for n tokens."""
        g = coder.spec.ecsq[stream][gi]
        budget = g.budget_bytes(coder.spec.ratio, n) if coder.rate_control else None
        on_dev = z.device.type == "cuda" and ops.name == "triton"
        return tuple(ecsq.encode_group(z[b * n:(b + 1) * n], g, budget, coder.ecsq_format, on_dev) for b in range(batch))

    def coefficients(self, coder: ResidentCoder, coded: Any, stream: str, gi: int) -> torch.Tensor:
        g, dev = coder.spec.ecsq[stream][gi], torch.device(coded.device)
        parts, on_dev = [], dev.type == "cuda" and resolve_ops(coder.backend, dev).name == "triton"
        offsets = g.offsets.to(dev)
        for words, escapes in coded.blocks[stream][gi]:
            q, step = ecsq.decode_group_to(words, escapes, coded.tokens, g, coder.ecsq_format, dev, on_dev)
            parts.append(ecsq.dequantize(q, step, offsets))
        return torch.cat(parts)

    def nbytes(self, blocks: dict) -> int:
        """The ANS words and escapes (payload bytes, not counting Python's ~33-byte header per bytes object)."""
        return sum(len(w) + len(e) for groups in blocks.values() for seqs in groups for w, e in seqs)

    def select(self, blocks: dict, batch: int, tokens: int, index: torch.Tensor) -> dict:
        rows = [int(i) for i in index.tolist()]
        return {s: tuple(tuple(seqs[i] for i in rows) for seqs in groups) for s, groups in blocks.items()}


class EcsqMode(Mode):
    name = "ecsq"
    label = "ECSQ"
    blob = EcsqBlob()
    sizes = EcsqSizes()
    resident = EcsqResident()

    def codes(self, spec: CodecSpec, stream: str) -> tuple:
        return spec.ecsq[stream]

    def check(self, spec: CodecSpec) -> None:
        if spec.ecsq is None:
            raise ValueError(f"artifact {spec.name}@{spec.version} has no ECSQ tables for ratio {spec.ratio:g} "
                             f"(calibrated before the ECSQ mode existed, or without it): recalibrate with this release, "
                             f"e.g. `kvtc recalibrate {spec.name} --corpus SPEC` (cached shards are reused), or use "
                             f"mode='fixed'")

    def admit(self, x: torch.Tensor, stream: str) -> torch.Tensor:
        """`x`; ValueError beyond any step (the callers code such a cache fixed-rate)."""
        refuse_beyond(x, stream)
        return x
