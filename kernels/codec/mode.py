"""A codec mode: how a cache's coded middle is quantized and stored (kernels/codec/modes.py lists them).

A mode is its name, the codes it projects on (`codes`), whether a spec can code it (`check`) and the values it
admits (`admit`), and one small object per job, each owning its decisions:

  blob      BlobCoding: the blob sections of one stream's coded middle (written, read back, bounded before anything
            is inflated, and the capacity check of a blob's declared tokens), and the header fields they decide;
  sizes     SizeBounds: the size bound of that middle for a number of coded tokens, whether it is exact, and the
            mode a chunk falls back to where a blob may exceed it;
  resident  ResidentForm: the form a running cache keeps (kernels/codec/coefficients.py).

The mode object travels (a codec's, a chunk transform's and a coder's `coding`, CodedTokens.coding); its `name` is
the string only the edges carry: options, settings, the command line, a blob's header (kernels/codec/blob.py).

A mode never sees the codec: its blob coding gets tensors and a `BlobContext` the codec builds (the spec, the
device, the kernels, a StageTimer, a SectionCoder and the held ECSQ offsets, public objects, never the codec's
methods); its bounds get the spec; its resident form gets a `ResidentCoder` (the coder's public settings).

Shapes: feat (mid, p) one stream's centred features; parts, per group, (feature columns, the matrix the
mode projects on or reconstructs with, the group's code) as KVTCCodec._params holds them.
"""
from __future__ import annotations

import abc
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterator, Protocol

import torch

from kvtc.kernels.codec.backend import Ops
from kvtc.kernels.codec.basis_product import reconstruct
from kvtc.kernels.codec.blob import BlobHeader, Section, SectionBound, SectionKey
from kvtc.kernels.codec.entropy import encode_section
from kvtc.kernels.codec.spec import CodecSpec


@dataclass(frozen=True)
class StageTimer:
    """`with timer("project"):` adds the stage's seconds to `profile` (None: times nothing), synchronizing
    CUDA on `device` around it."""

    profile: dict[str, float] | None
    device: torch.device

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        if self.profile is None:
            yield
            return
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        yield
        if cuda:
            torch.cuda.synchronize(self.device)
        self.profile[name] = self.profile.get(name, 0.0) + time.perf_counter() - t0


@dataclass(frozen=True)
class SectionCoder:
    """Raw bytes -> a blob section entropy-coded at `level` with `coder` (kernels/codec/entropy.py), timed as
    the "entropy" stage."""

    level: int
    coder: str
    stage: StageTimer

    def __call__(self, key: SectionKey, raw: bytes) -> Section:
        with self.stage("entropy"):
            coding, stored = encode_section(raw, self.level, self.coder)
        return Section(key, coding, len(raw), stored)


@dataclass(frozen=True)
class HeldOffsets:
    """A spec's ECSQ centroid offsets on `device`, each group's moved there once (`held` is kept by the owner
    across blobs): `offsets(stream, group)`."""

    spec: CodecSpec
    device: torch.device
    held: dict = field(default_factory=dict)

    def __call__(self, stream: str, gi: int) -> torch.Tensor:
        key = (stream, gi, str(self.device))
        if key not in self.held:
            self.held[key] = self.spec.ecsq[stream][gi].offsets.to(self.device)
        return self.held[key]


@dataclass(frozen=True)
class BlobContext:
    """What a mode's blob methods get from the codec coding or decoding one blob on one device."""

    spec: CodecSpec
    device: torch.device
    ops: Ops  # the element-wise kernels on `device`
    stage: StageTimer  # `with ctx.stage("project"):` times a stage where the codec profiles
    section: SectionCoder  # raw bytes -> a section coded with the codec's level and coder
    offsets: HeldOffsets  # (stream, group) -> an ECSQ group's centroid offsets on `device`
    entropy_on_device: bool  # whether the rANS symbols are coded by the Triton kernels where the tensors are
    ecsq_format: str  # the ECSQ symbols' format new blobs are written in (decode follows the blob's header)
    rate_control: bool  # ECSQ: coarsen the step of a (stream, group) whose bytes would exceed its budget
    # (stream index, group) -> its projected coefficients, kept where the codec codes a stream more than once
    projections: dict | None = None
    truncate: bool = False  # ECSQ: a group may code fewer components to meet its budget (kernels/codec/ecsq.py)
    # ECSQ, beside `projections`: (stream index, group) -> the step exponent its last coding fitted, where the codec
    # codes a stream again at a smaller budget (the search starts there: ecsq.encode_group's `first`)
    steps: dict | None = None
    # ECSQ, where the codec reads its own coding back (the outlier stage): (stream index, group) -> (the symbols
    # (tokens, kept) int32 its last coding wrote, their step), the values a reader decodes from its sections
    symbols: dict | None = None


class ResidentCoder(Protocol):
    """What a mode's resident methods read of the coder (kernels/codec/coefficients.py's CoefficientCoder)."""

    spec: CodecSpec
    backend: str
    rate_control: bool
    ecsq_format: str


class BlobCoding(abc.ABC):
    """A mode's blob job: the sections of one stream's coded middle, and the header fields they decide."""

    def header_fields(self) -> dict[str, Any]:
        """BlobHeader fields this mode sets on every new blob (its layout), beside its name."""
        return {}

    def blob_fields(self, sections: list[Section]) -> dict[str, Any]:
        """BlobHeader fields that one blob's coded sections decide."""
        return {}

    @abc.abstractmethod
    def encode(self, ctx: BlobContext, feat: torch.Tensor, si: int, stream: str, parts: list,
               budget_scale: float) -> list[Section]:
        """One stream's coded-middle sections, in blob order."""

    @abc.abstractmethod
    def coefficients(self, ctx: BlobContext, data: dict, si: int, stream: str, mid: int, header: BlobHeader,
                     parts: list) -> Callable[[int, int], list[torch.Tensor]]:
        """One stream's coded middle read once (its symbols or packed codes, compact), as a function that gives
        the dequantized coefficients z_hat (b - a, k_g) float32 of each group for coded tokens [a, b)."""

    def decoder(self, ctx: BlobContext, data: dict, si: int, stream: str, mid: int, header: BlobHeader,
                parts: list) -> Callable[[int, int, torch.Tensor], None]:
        """`coefficients` as a function that fills feat (b - a, p) with the reconstructed centred features of coded
        tokens [a, b): decode works in bounded blocks of tokens, each row reconstructed exactly as a whole-stream
        decode would (parts: each group's decoding matrix)."""
        coefficients = self.coefficients(ctx, data, si, stream, mid, header, parts)

        def rows(a: int, b: int, feat: torch.Tensor) -> None:
            for (cols, comps, _), zhat in zip(parts, coefficients(a, b)):
                with ctx.stage("project"):
                    feat[:, cols] = reconstruct(zhat, comps)

        return rows

    @abc.abstractmethod
    def section_bounds(self, spec: CodecSpec, mid: int, table: dict, header: BlobHeader) -> list[SectionBound]:
        """Every coded-middle section a blob of `mid` coded tokens holds, in order, with the raw bytes it may
        inflate to; `table`: the blob's sections by key, for a bound that depends on another's stored length."""

    @abc.abstractmethod
    def check_capacity(self, spec: CodecSpec, mid: int, sections: list[Section], header: BlobHeader) -> None:
        """BlobError when the sections cannot hold `mid` coded tokens, before any per-token array is built."""


class SizeBounds(abc.ABC):
    """A mode's sizes (kernels/codec/chunk_serde.py, kernels/integrations/vllm_offload.py): the coded middle's
    bound, and the mode to fall back to where a blob may exceed it."""

    exact: ClassVar[bool]  # whether `bound_bytes` is every blob's exact size (then budget_scale changes nothing)

    @abc.abstractmethod
    def bound_bytes(self, spec: CodecSpec, tokens: int) -> int:
        """Most bytes the coded-middle sections of `tokens` coded tokens take, stored plain: their exact size
        where `exact`, else the rate control's budget."""

    def floor_bytes(self, spec: CodecSpec, tokens: int) -> int:
        """Fewest bytes the coded-middle sections of `tokens` coded tokens can take: bound_bytes where `exact`."""
        return self.bound_bytes(spec, tokens)

    @abc.abstractmethod
    def stream_bound_bytes(self, spec: CodecSpec, tokens: int, stream: str) -> int:
        """bound_bytes of one stream's sections."""

    @property
    @abc.abstractmethod
    def fallback(self) -> Mode | None:
        """The mode a chunk is coded in where this one cannot code it within `bound_bytes` (its rate control
        overshot, or values beyond any step); None where this mode's blobs always fit."""


class ResidentForm(abc.ABC):
    """A mode's resident form: what CodedTokens.blocks hold for a running cache (CoefficientCoder)."""

    @abc.abstractmethod
    def check(self, spec: CodecSpec) -> None:
        """ValueError where `spec`'s codes cannot be held in this form."""

    @abc.abstractmethod
    def encode(self, coder: ResidentCoder, z: torch.Tensor, stream: str, gi: int, ops: Ops, batch: int,
               n: int) -> tuple:
        """z (batch * n, kept) of one group on the device `ops` runs on -> what CodedTokens.blocks holds for it."""

    @abc.abstractmethod
    def coefficients(self, coder: ResidentCoder, coded: Any, stream: str, gi: int) -> torch.Tensor:
        """Dequantized coefficients z (batch * n, kept) float32 of one group of CodedTokens `coded`."""

    @abc.abstractmethod
    def nbytes(self, blocks: dict) -> int:
        """Bytes CodedTokens.blocks hold."""

    @abc.abstractmethod
    def select(self, blocks: dict, batch: int, tokens: int, index: torch.Tensor) -> dict:
        """CodedTokens.blocks of the sequences `index` (B',) picks (kept, repeated or reordered)."""


@dataclass(frozen=True)
class Mode(abc.ABC):
    """A mode: its name, codes and values, and its three jobs (see the module docstring)."""

    name: ClassVar[str]
    label: ClassVar[str]  # how messages name the mode ("fixed-rate", "ECSQ")
    blob: ClassVar[BlobCoding]
    sizes: ClassVar[SizeBounds]
    resident: ClassVar[ResidentForm]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for job, kind in (("blob", BlobCoding), ("sizes", SizeBounds), ("resident", ResidentForm)):
            if not isinstance(getattr(cls, job, None), kind):
                raise TypeError(f"mode {cls.__name__} must set {job} to a {kind.__name__}")

    def __str__(self) -> str:
        return self.name

    @abc.abstractmethod
    def codes(self, spec: CodecSpec, stream: str) -> tuple:
        """Each group's code this mode projects on and reconstructs with (GroupCode or EcsqGroup)."""

    @abc.abstractmethod
    def check(self, spec: CodecSpec) -> None:
        """ValueError where `spec` cannot code this mode."""

    @abc.abstractmethod
    def admit(self, x: torch.Tensor, stream: str) -> torch.Tensor:
        """The values of a cache this mode codes (kernels/codec/extremes.py): saturated, or a ValueError where
        they lie beyond what the mode can code."""
