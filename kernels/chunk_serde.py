"""KV chunks as a storage layer hands them (LMCache: (2, layers, tokens, kv_heads * head_dim)) <->
bounded-size KVTC bytes. The pure transform behind kernels/lmcache_serde.py; imports no LMCache.

A chunk is coded whole: no sinks, no recent window. Storage layers identify a chunk by a content
hash, not by its position in the sequence, so RoPE cannot be removed: the artifact must have been
calibrated with keys as cached (`kvtc calibrate --keys rope-kept`).

Mode: the artifact's default (ECSQ where it carries ECSQ tables for the ratio, else fixed-rate), or
`mode=` explicitly. Size bound (`serialized_size`): ECSQ's rate control coarsens the step of any
(stream, group) whose bytes would exceed the ratio's budget, so an ECSQ blob is at most its header
plus the budgets; a chunk that no step can fit (values thousands of times the calibration's) is
coded fixed-rate instead, whose size is exact. The bound is the larger of the two, and every chunk
is stored. Sections are stored plain (no DEFLATE).

Bytes: "<Q" blob length, then the blob (kernels/blob.py); with `pad` (the default), zero padding up
to the bound, for storage layers that read back exactly the bound (LMCache's filesystem adapter);
without it, exactly the blob, for layers that keep variable-size objects.
"""
from __future__ import annotations

import inspect
import struct
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch

from kvtc.artifacts.blocks import ecsq_budget_bytes
from kvtc.kernels.blob import BlobError, BlobHeader, Section, write_blob
from kvtc.kernels.codec import KVTCCodec

_LENGTH = struct.Struct("<Q")
_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
_KWARGS = ("artifact", "ratio", "registry", "backend", "model", "max_workers", "mode", "pad")
MODES = ("ecsq", "fixed")


@dataclass(frozen=True)
class ChunkSerdeSettings:
    """Serde kwargs: artifact "NAME[@VERSION|ALIAS]", ratio, registry URI, backend, model (hub id or
    local dir whose config is checked against the artifact), max_workers (LMCache's thread pool),
    mode ("ecsq" | "fixed"; default: the artifact's), pad (pad every chunk to the size bound)."""

    artifact: str
    ratio: float
    registry: str | None = None
    backend: str = "auto"
    model: str | None = None
    max_workers: int = 1
    mode: str | None = None
    pad: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.artifact, str) or not self.artifact:
            raise ValueError('the kvtc serde needs "artifact": "NAME[@VERSION|ALIAS]" in its kwargs')
        if not isinstance(self.ratio, (int, float)) or isinstance(self.ratio, bool) or not self.ratio > 1:
            raise ValueError(f'the kvtc serde needs "ratio": a number > 1 the artifact was allocated for, '
                             f"got {self.ratio!r}")
        if not isinstance(self.max_workers, int) or self.max_workers < 1:
            raise ValueError(f"max_workers must be an integer >= 1, got {self.max_workers!r}")
        if self.mode is not None and self.mode not in MODES:
            raise ValueError(f'kvtc serde "mode" must be one of {MODES} (or absent: the artifact\'s default), '
                             f"got {self.mode!r}")
        if not isinstance(self.pad, bool):
            raise ValueError(f'kvtc serde "pad" must be true or false, got {self.pad!r}')

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, object]) -> "ChunkSerdeSettings":
        """kwargs: the "serde" dict, with or without its "type" (LMCache revisions differ)."""
        kwargs = dict(kwargs)
        kind = kwargs.pop("type", "kvtc")
        if kind != "kvtc":
            raise ValueError(f'the kvtc serde was handed a config of type {kind!r}')
        unknown = sorted(set(kwargs) - set(_KWARGS))
        if unknown:
            raise ValueError(f"unknown kvtc serde option(s) {unknown}; accepted: {list(_KWARGS)}")
        missing = [k for k in ("artifact", "ratio") if k not in kwargs]
        if missing:
            raise ValueError(f'the kvtc serde needs {missing} in its kwargs, e.g. '
                             '{"type": "kvtc", "artifact": "llama-3.1-8b@production", "ratio": 16, '
                             '"registry": "s3://bucket/kvtc"}')
        return cls(**kwargs)  # type: ignore[arg-type]


class ChunkTransform:
    """One rank's transform. codec: a KVTCCodec whose artifact keeps RoPE on the keys; model_config:
    checked if given; mode: None keeps the codec's mode; pad: see the module docstring."""

    def __init__(self, codec: KVTCCodec, model_config: Any = None, *, mode: str | None = None,
                 pad: bool = True) -> None:
        spec = codec.spec
        if spec.value_dim is not None:
            raise ValueError(f"artifact {spec.name}@{spec.version} is for a multi-head latent attention model "
                             f"({spec.widths}): servers move its cache as one latent plane per token (kv_size 1), "
                             "which the chunk serde does not code; use KVTCCodec or KVTCCache for MLA caches")
        if spec.rope is not None:
            raise ValueError(f"artifact {spec.name}@{spec.version} codes keys with RoPE removed, which needs each "
                             "token's position; a storage layer hands the serde chunks by content hash, without "
                             "positions. Calibrate with --keys rope-kept for chunk stores")
        if model_config is not None:
            from kvtc.kernels.kvtc_cache import check_config

            check_config(spec, model_config)
        self.spec = replace(spec, sinks=0, window=0)
        if mode is None:  # the codec's mode where this serde knows its size bound
            mode = codec.mode if codec.mode in MODES else ("ecsq" if spec.ecsq is not None else "fixed")
        if mode not in MODES:
            raise ValueError(f"the kvtc chunk serde bounds the sizes of modes {MODES}, not {mode!r}")
        options = dict(backend=codec.backend, level=0, ecsq_format=codec.ecsq_format, basis_dtype=codec.basis_dtype)
        self.codec = KVTCCodec(self.spec, mode=mode, **options)
        self.mode = self.codec.mode
        self.fixed = self.codec if self.mode == "fixed" else KVTCCodec(self.spec, mode="fixed", **options)
        self.pad = pad

    @classmethod
    def from_settings(cls, settings: ChunkSerdeSettings, rank: int = 0) -> "ChunkTransform":
        """Pull the artifact (verified) and build rank `rank`'s transform; every bad setting fails here."""
        model_config = None
        if settings.model:
            from transformers import AutoConfig

            model_config = AutoConfig.from_pretrained(settings.model)
        codec = load_rank_codec(settings.artifact, settings.ratio, rank, registry=settings.registry,
                                backend=settings.backend)
        return cls(codec, model_config, mode=settings.mode, pad=settings.pad)

    def check(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        """-> tokens; ValueError naming what does not match the artifact."""
        s = self.spec
        width = s.kv_heads * s.head_dim
        if len(shape) != 4 or shape[0] != 2 or shape[1] != s.num_layers:
            raise ValueError(f"expected a KV chunk (2, layers={s.num_layers}, tokens, {width}), got {tuple(shape)}: "
                             f"is artifact {s.name}@{s.version} for this model?")
        if shape[3] != width:
            raise ValueError(f"chunk rows hold {shape[3]} features, the artifact {s.name}@{s.version} covers "
                             f"{s.kv_heads} KV heads x {s.head_dim} = {width}: a tensor-parallel rank holding a "
                             "subset of the heads needs an artifact calibrated per rank (kvtc calibrate --tp N)")
        if dtype not in _DTYPE_NAMES:
            raise ValueError(f"chunk dtype {dtype} is not supported; use float16, bfloat16 or float32")
        return int(shape[2])

    def _header_bytes(self, codec: KVTCCodec, tokens: int, dtype: torch.dtype) -> tuple[int, list]:
        s = self.spec
        header = BlobHeader(s.name, s.version, s.model_id, s.ratio, _DTYPE_NAMES[dtype], s.num_layers, s.kv_heads,
                            tokens, s.head_dim, 0, 0, 0, 0, 0, mode=codec.mode)
        expected = codec.expected_sections(header)
        return len(write_blob(header, [Section(key, 0, 0, b"") for key, _ in expected])), expected

    def fixed_size(self, tokens: int, dtype: torch.dtype) -> int:
        """Exact blob bytes of a fixed-rate chunk of `tokens` tokens."""
        head, expected = self._header_bytes(self.fixed, tokens, dtype)
        return head + sum(n or 0 for _, n in expected)

    def ecsq_bound(self, tokens: int, dtype: torch.dtype) -> int:
        """Largest ECSQ blob of `tokens` tokens rate control lets through: header plus each (stream,
        group)'s budget (the codec's: floor(16 p / ratio) bits per token, in bytes over the chunk)."""
        head, _ = self._header_bytes(self.codec, tokens, dtype)
        budget = sum(ecsq_budget_bytes(g.mean.shape[0], self.spec.ratio, tokens)
                     for groups in self.spec.ecsq.values() for g in groups) if tokens else 0
        return head + budget

    def blob_bound(self, tokens: int, dtype: torch.dtype) -> int:
        fixed = self.fixed_size(tokens, dtype)
        return fixed if self.mode == "fixed" else max(fixed, self.ecsq_bound(tokens, dtype))

    def serialized_size(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        """Upper bound on `serialize`'s output for a chunk of this shape (what LMCache allocates), exact
        for every chunk when padding."""
        return _LENGTH.size + self.blob_bound(self.check(shape, dtype), dtype)

    def encode(self, kv: torch.Tensor) -> bytes:
        """kv (2, L, T, H * D) -> blob: the transform's mode, or fixed-rate where ECSQ cannot meet its bound."""
        tokens = self.check(tuple(kv.shape), kv.dtype)
        if not bool(torch.isfinite(kv).all()):
            raise ValueError("the chunk holds NaN or infinite values; it is not stored (check the model's numerics)")
        s = self.spec
        x = kv.reshape(2, s.num_layers, tokens, s.kv_heads, s.head_dim).permute(0, 1, 3, 2, 4)
        if self.mode == "ecsq":
            blob = self.codec.encode(x[0], x[1], start=0)
            if len(blob) <= self.ecsq_bound(tokens, kv.dtype):
                return blob
        return self.fixed.encode(x[0], x[1], start=0)

    def serialize(self, kv: torch.Tensor, size: int | None = None) -> bytes:
        """kv (2, L, T, H * D) -> bytes: at most `size` (default serialized_size(kv.shape, kv.dtype)),
        padded to exactly `size` when padding."""
        blob = self.encode(kv)
        size = self.serialized_size(tuple(kv.shape), kv.dtype) if size is None else size
        out = _LENGTH.pack(len(blob)) + blob
        if len(out) > size:
            raise RuntimeError(f"kvtc serde wrote {len(out)} bytes, above its bound {size}")
        return out + bytes(size - len(out)) if self.pad else out

    def deserialize(self, data: bytes | bytearray | memoryview, out: torch.Tensor) -> None:
        """Bytes from `serialize` (trailing bytes ignored) -> written into out (2, L, T, H * D) in its
        dtype; BlobError if corrupt or not this artifact's, and `out` is left untouched then."""
        tokens = self.check(tuple(out.shape), out.dtype)
        view = memoryview(data).cast("B")
        if len(view) < _LENGTH.size:
            raise BlobError(f"kvtc chunk of {len(view)} bytes is too short")
        (n,) = _LENGTH.unpack(view[:_LENGTH.size])
        if n > len(view) - _LENGTH.size:
            raise BlobError(f"kvtc chunk declares {n} blob bytes, holds {len(view) - _LENGTH.size}")
        keys, values = self.codec.decode(view[_LENGTH.size:_LENGTH.size + n], device=out.device, max_tokens=tokens)
        if keys.shape[2] != tokens:
            raise BlobError(f"kvtc chunk holds {keys.shape[2]} tokens, the destination expects {tokens}")
        s = self.spec
        for i, x in enumerate((keys, values)):
            out[i].copy_(x.permute(0, 2, 1, 3).reshape(s.num_layers, tokens, s.kv_heads * s.head_dim))


def load_rank_codec(ref: str, ratio: float, rank: int, **kwargs: Any) -> KVTCCodec:
    """Rank `rank`'s codec: `KVTCCodec.from_registry(ref, ratio, rank=rank)` where the codec takes ranks;
    otherwise rank 0 is the single-rank artifact and any other rank a clear error."""
    if _codec_takes_rank():
        return KVTCCodec.from_registry(ref, ratio, rank=rank, **kwargs)
    if rank != 0:
        raise ValueError(f"kv_rank {rank}: artifact {ref} has one basis for all KV heads (a single rank); a "
                         "tensor-parallel deployment needs per-rank bases (kvtc calibrate --tp N), which this "
                         "kvtc release does not load")
    return KVTCCodec.from_registry(ref, ratio, **kwargs)


def _codec_takes_rank() -> bool:
    return "rank" in inspect.signature(KVTCCodec.from_registry).parameters


class RankedChunkTransforms:
    """Per-rank transforms, built on first use of each rank (LMCache keys carry `kv_rank`)."""

    def __init__(self, build: Callable[[int], ChunkTransform]) -> None:
        self._build = build
        self._ranks: dict[int, ChunkTransform] = {0: build(0)}

    def __call__(self, rank: int | None) -> ChunkTransform:
        rank = 0 if rank is None else rank
        if not isinstance(rank, int) or rank < 0:
            raise ValueError(f"kv_rank must be an integer >= 0, got {rank!r}")
        if rank not in self._ranks:
            self._ranks[rank] = self._build(rank)
        return self._ranks[rank]

    def serialized_size(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        """The bound over every rank loaded (ranks of one artifact share shapes and the ratio's budget)."""
        return max(t.serialized_size(shape, dtype) for t in self._ranks.values())
