"""KV chunks as a storage layer hands them (LMCache: (2, layers, tokens, kv_heads * head_dim)) <->
fixed-size KVTC bytes. The pure transform behind kernels/lmcache_serde.py; imports no LMCache.

A chunk is coded whole: no sinks, no recent window. Storage layers identify a chunk by a content
hash, not by its position in the sequence, so RoPE cannot be removed: the artifact must have been
calibrated with keys as cached (`kvtc calibrate --keys rope-kept`). Sections are stored plain (no
DEFLATE), which makes the size a function of the chunk's shape: LMCache's filesystem adapter reads
back exactly the size the serde estimated, so a variable size would read as a miss.

Bytes: "<Q" blob length, then the blob (kernels/blob.py), then zero padding up to the estimate.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, replace
from typing import Any

import torch

from kvtc.kernels.blob import BlobHeader, Section, write_blob
from kvtc.kernels.codec import KVTCCodec

_LENGTH = struct.Struct("<Q")
_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
_KWARGS = ("artifact", "ratio", "registry", "backend", "model", "max_workers")


@dataclass(frozen=True)
class ChunkSerdeSettings:
    """Serde kwargs: artifact "NAME[@VERSION|ALIAS]", ratio, registry URI, backend, model (hub id or
    local dir whose config is checked against the artifact), max_workers (LMCache's thread pool)."""

    artifact: str
    ratio: float
    registry: str | None = None
    backend: str = "auto"
    model: str | None = None
    max_workers: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.artifact, str) or not self.artifact:
            raise ValueError('the kvtc serde needs "artifact": "NAME[@VERSION|ALIAS]" in its kwargs')
        if not isinstance(self.ratio, (int, float)) or isinstance(self.ratio, bool) or not self.ratio > 1:
            raise ValueError(f'the kvtc serde needs "ratio": a number > 1 the artifact was allocated for, '
                             f"got {self.ratio!r}")
        if not isinstance(self.max_workers, int) or self.max_workers < 1:
            raise ValueError(f"max_workers must be an integer >= 1, got {self.max_workers!r}")

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, object]) -> "ChunkSerdeSettings":
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
    """codec: a KVTCCodec whose artifact keeps RoPE on the keys; model_config: checked if given."""

    def __init__(self, codec: KVTCCodec, model_config: Any = None) -> None:
        spec = codec.spec
        if spec.rope is not None:
            raise ValueError(f"artifact {spec.name}@{spec.version} codes keys with RoPE removed, which needs each "
                             "token's position; a storage layer hands the serde chunks by content hash, without "
                             "positions. Calibrate with --keys rope-kept for chunk stores")
        if model_config is not None:
            from kvtc.kernels.kvtc_cache import check_config

            check_config(spec, model_config)
        self.spec = replace(spec, sinks=0, window=0)
        self.codec = KVTCCodec(self.spec, backend=codec.backend, level=0, ecsq_format=codec.ecsq_format,
                               basis_dtype=codec.basis_dtype)

    @classmethod
    def from_settings(cls, settings: ChunkSerdeSettings) -> "ChunkTransform":
        """Pull the artifact (verified) and build the transform; every bad setting fails here."""
        model_config = None
        if settings.model:
            from transformers import AutoConfig

            model_config = AutoConfig.from_pretrained(settings.model)
        codec = KVTCCodec.from_registry(settings.artifact, settings.ratio, registry=settings.registry,
                                        backend=settings.backend)
        return cls(codec, model_config)

    def _check(self, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[int, int]:
        s = self.spec
        width = s.kv_heads * s.head_dim
        if len(shape) != 4 or shape[0] != 2 or shape[1] != s.num_layers:
            raise ValueError(f"expected a KV chunk (2, layers={s.num_layers}, tokens, {width}), got {tuple(shape)}: "
                             f"is artifact {s.name}@{s.version} for this model?")
        if shape[3] != width:
            raise ValueError(f"chunk rows hold {shape[3]} features, the artifact {s.name}@{s.version} covers "
                             f"{s.kv_heads} KV heads x {s.head_dim} = {width}; a tensor-parallel rank holding a "
                             "subset of the heads needs an artifact calibrated per rank, which is not supported yet")
        if dtype not in _DTYPE_NAMES:
            raise ValueError(f"chunk dtype {dtype} is not supported; use float16, bfloat16 or float32")
        return int(shape[2]), width

    def serialized_size(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        """Exact byte size of a chunk of this shape (and the upper bound LMCache asks for)."""
        tokens, _ = self._check(shape, dtype)
        s = self.spec
        header = BlobHeader(s.name, s.version, s.model_id, s.ratio, _DTYPE_NAMES[dtype], s.num_layers, s.kv_heads,
                            tokens, s.head_dim, 0, 0, 0, 0, 0)
        sections = [Section(key, 0, n, b"") for key, n in self.codec.expected_sections(header)]
        return _LENGTH.size + len(write_blob(header, sections)) + sum(n for _, n in self.codec.expected_sections(header))

    def serialize(self, kv: torch.Tensor) -> bytes:
        """kv (2, L, T, H * D) -> bytes of exactly serialized_size(kv.shape, kv.dtype)."""
        tokens, _ = self._check(tuple(kv.shape), kv.dtype)
        s = self.spec
        x = kv.reshape(2, s.num_layers, tokens, s.kv_heads, s.head_dim).permute(0, 1, 3, 2, 4)
        blob = self.codec.encode(x[0], x[1], start=0)
        size = self.serialized_size(tuple(kv.shape), kv.dtype)
        out = _LENGTH.pack(len(blob)) + blob
        if len(out) > size:
            raise RuntimeError(f"kvtc serde wrote {len(out)} bytes, above its own bound {size}")
        return out + bytes(size - len(out))

    def deserialize(self, data: bytes | bytearray | memoryview, out: torch.Tensor) -> None:
        """Bytes from `serialize` -> written into out (2, L, T, H * D) in its dtype; BlobError if corrupt."""
        from kvtc.kernels.blob import BlobError

        tokens, _ = self._check(tuple(out.shape), out.dtype)
        view = memoryview(data).cast("B")
        if len(view) < _LENGTH.size:
            raise BlobError(f"kvtc chunk of {len(view)} bytes is too short")
        (n,) = _LENGTH.unpack(view[:_LENGTH.size])
        if n > len(view) - _LENGTH.size:
            raise BlobError(f"kvtc chunk declares {n} blob bytes, holds {len(view) - _LENGTH.size}")
        keys, values = self.codec.decode(view[_LENGTH.size:_LENGTH.size + n], device=out.device)
        if keys.shape[2] != tokens:
            raise BlobError(f"kvtc chunk holds {keys.shape[2]} tokens, the destination expects {tokens}")
        s = self.spec
        for i, x in enumerate((keys, values)):
            out[i].copy_(x.permute(0, 2, 1, 3).reshape(s.num_layers, tokens, s.kv_heads * s.head_dim))
