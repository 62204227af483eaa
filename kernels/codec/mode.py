"""A codec mode: how a cache's coded middle is quantized and stored (kernels/codec/modes.py lists them).

A mode owns what differs between modes: the bases it projects on, whether a spec can code it, the blob
sections of one stream's coded middle (written, read back, bounded before anything is inflated, and the
capacity check of a blob's declared tokens), and the resident form a running cache keeps
(kernels/codec/coefficients.py). `name` is the string blobs (their flags), chunk settings and the command
line carry. Methods take the KVTCCodec or CoefficientCoder whose stages, sections and held tensors they use.

Shapes: feat (mid, p) one stream's centred features; parts, per group, (feature columns, the matrix the
mode projects on or reconstructs with, the group's code) as KVTCCodec._params holds them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch

from kvtc.kernels.codec.blob import BlobHeader, Section, SectionBound
from kvtc.kernels.codec.spec import CodecSpec


@dataclass(frozen=True)
class Mode:
    """The interface every mode implements; see the module docstring."""

    name: ClassVar[str]

    def __str__(self) -> str:
        return self.name

    def codes(self, spec: CodecSpec, stream: str) -> tuple:
        """Each group's code this mode projects on and reconstructs with (GroupCode or EcsqGroup)."""
        raise NotImplementedError

    def check(self, spec: CodecSpec) -> None:
        """ValueError where `spec` cannot code this mode."""

    def check_resident(self, spec: CodecSpec) -> None:
        """ValueError where `spec`'s codes cannot be held in this mode's resident form."""

    # the blob (KVTCCodec)
    def encode(self, codec: Any, feat: torch.Tensor, si: int, stream: str, dev: torch.device, ops: Any, parts: list,
               budget_scale: float) -> list[Section]:
        """One stream's coded-middle sections, in blob order."""
        raise NotImplementedError

    def decode(self, codec: Any, data: dict, si: int, stream: str, mid: int, feat: torch.Tensor, dev: torch.device,
               header: BlobHeader, ops: Any, parts: list) -> None:
        """Fill feat (mid, p) with one stream's reconstructed centred features; parts: _params(decode=True)."""
        self.decoder(codec, data, si, stream, mid, dev, header, ops, parts)(0, mid, feat)

    def decoder(self, codec: Any, data: dict, si: int, stream: str, mid: int, dev: torch.device, header: BlobHeader,
                ops: Any, parts: list) -> Callable[[int, int, torch.Tensor], None]:
        """One stream's coded middle read once (its symbols or packed codes, compact), as a function that fills
        feat (b - a, p) with the reconstructed centred features of coded tokens [a, b): decode works in
        bounded blocks of tokens, each row reconstructed exactly as a whole-stream decode would."""
        raise NotImplementedError

    def section_bounds(self, codec: Any, mid: int, table: dict, header: BlobHeader) -> list[SectionBound]:
        """Every coded-middle section a blob of `mid` coded tokens holds, in order, with the raw bytes it may
        inflate to; `table`: the blob's sections by key, for a bound that depends on another's stored length."""
        raise NotImplementedError

    def check_capacity(self, codec: Any, mid: int, sections: list[Section], header: BlobHeader) -> None:
        """BlobError when the sections cannot hold `mid` coded tokens, before any per-token array is built."""

    # the resident form (CoefficientCoder, CodedTokens)
    def encode_resident(self, coder: Any, z: torch.Tensor, stream: str, gi: int, ops: Any, batch: int, n: int) -> tuple:
        """z (batch * n, kept) of one group -> what CodedTokens.blocks holds for it."""
        raise NotImplementedError

    def coefficients(self, coder: Any, coded: Any, stream: str, gi: int) -> torch.Tensor:
        """Dequantized coefficients z (batch * n, kept) float32 of one group."""
        raise NotImplementedError

    def resident_nbytes(self, blocks: dict) -> int:
        """Bytes CodedTokens.blocks hold."""
        raise NotImplementedError

    def select(self, blocks: dict, batch: int, tokens: int, index: torch.Tensor) -> dict:
        """CodedTokens.blocks of the sequences `index` (B',) picks (kept, repeated or reordered)."""
        raise NotImplementedError
