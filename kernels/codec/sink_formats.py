"""The raw sinks' two formats in a blob's TAG_RAW_HEAD sections (the raw window is always the cache's dtype).

`CacheSinks` stores them in the cache's dtype, as cached; `Int8Sinks` as int8 codes with a float32 scale per token
vector (kernels/codec/sinks_int8.py), about half the bytes of bfloat16 at about 1% error. Each encodes, decodes and
sizes its section; `name` is what options and a blob's header carry (kernels/codec/blob.py: the int8 sinks option).

Shapes: raw tokens (L, H, n, W), L layers, H KV heads, n tokens, W the stream's width.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvtc.kernels.codec.layout import bytes_to_tensor, tensor_bytes
from kvtc.kernels.codec.sinks_int8 import int8_bytes, sinks_from_int8, sinks_to_int8


@dataclass(frozen=True)
class SinkFormat(abc.ABC):
    name: ClassVar[str]

    @abc.abstractmethod
    def encode(self, x: torch.Tensor, cache_dtype: torch.dtype) -> bytes:
        """x (L, H, n, W) finite, of a cache stored in `cache_dtype` -> the section's raw bytes."""

    @abc.abstractmethod
    def decode(self, data: bytes, shape: tuple[int, int, int, int], dtype: torch.dtype, stored: torch.dtype
               ) -> torch.Tensor:
        """The section's bytes (length checked by the caller) -> (L, H, n, W), in `stored` or `dtype` (what the
        decoder computes in); BlobError for values encode never writes."""

    @abc.abstractmethod
    def nbytes(self, shape: tuple[int, int, int, int], item: int) -> int:
        """The section's raw bytes for raw tokens of `shape`, of a cache of `item` bytes a value."""


@dataclass(frozen=True)
class CacheSinks(SinkFormat):
    name = "cache"

    def encode(self, x: torch.Tensor, cache_dtype: torch.dtype) -> bytes:
        return tensor_bytes(x.to(cache_dtype))

    def decode(self, data: bytes, shape: tuple[int, int, int, int], dtype: torch.dtype, stored: torch.dtype
               ) -> torch.Tensor:
        return bytes_to_tensor(data, stored, shape)

    def nbytes(self, shape: tuple[int, int, int, int], item: int) -> int:
        L, H, n, W = shape
        return L * H * n * W * item


@dataclass(frozen=True)
class Int8Sinks(SinkFormat):
    name = "int8"

    def encode(self, x: torch.Tensor, cache_dtype: torch.dtype) -> bytes:
        return sinks_to_int8(x)

    def decode(self, data: bytes, shape: tuple[int, int, int, int], dtype: torch.dtype, stored: torch.dtype
               ) -> torch.Tensor:
        return sinks_from_int8(data, shape, dtype)

    def nbytes(self, shape: tuple[int, int, int, int], item: int) -> int:
        return int8_bytes(*shape)


CACHE = CacheSinks()
_BY_NAME: dict[str, SinkFormat] = {f.name: f for f in (CACHE, Int8Sinks())}


def sink_format_for(name: str) -> SinkFormat:
    """The format named `name` (an option's or a blob header's); ValueError naming the choices for any other."""
    try:
        return _BY_NAME[name]
    except (KeyError, TypeError):
        raise ValueError(f"sink_format must be one of {tuple(_BY_NAME)}, got {name!r}") from None
