"""Caches whose layers hold different token counts: sliding-window and chunked layers keep only their
recent positions, layers without a KV cache hold nothing. Encoded as a per-layer container blob
(kernels/codec/blob.py, the layered option): the layers are cut into segments of equal token count, and each segment
is coded alone as an ordinary blob by the spec restricted to its layers (`restrict`). Groups must not
straddle segments (`--groups auto` keeps full-attention and sliding layers apart).

Per-layer form: a sequence of num_layers entries, each (kv_heads, tokens, head_dim) for a layer that keeps
a KV cache, None for one that does not. All layers end at the same position; `start` is the absolute
position of the longest layer's first token, so a layer of T_l tokens starts at start + T_max - T_l.
"""
from __future__ import annotations

import dataclasses
import struct
from typing import Callable, Sequence

import torch

from kvtc.artifacts.groups import FeatureGroup
from kvtc.kernels.codec.blob import (FORMAT_VERSION, NO_CACHE, TAG_LAYOUT, TAG_SEGMENT, BlobError, BlobHeader, Section,
                                     SectionBound, SectionKey, read_blob, write_blob)
from kvtc.kernels.codec.entropy import PLAIN, check_sections, decode_sections
from kvtc.kernels.codec.spec import CodecSpec

PerLayer = list[torch.Tensor | None]


def restrict(spec: CodecSpec, layers: Sequence[int]) -> CodecSpec:
    """The spec of `layers` alone, renumbered 0..n-1 in the given order; ValueError for a group that has
    layers both inside and outside them."""
    local = {l: i for i, l in enumerate(layers)}

    def inside(group: FeatureGroup) -> bool:
        hits = [l in local for l in group.layers]
        if any(hits) and not all(hits):
            raise ValueError(f"group {group.label} spans layers whose caches hold different token counts; "
                             "calibrate with --groups auto (one basis per layer kind) or --groups layer")
        return all(hits)

    def moved(code):
        return dataclasses.replace(code, group=FeatureGroup(tuple(local[l] for l in code.group.layers), code.group.heads))

    streams = {st: tuple(moved(g) for g in gs if inside(g.group)) for st, gs in spec.streams.items()}
    ecsq = None if spec.ecsq is None else {st: tuple(moved(g) for g in gs if inside(g.group)) for st, gs in spec.ecsq.items()}
    schema = None if spec.layers is None else tuple(spec.layers[l] for l in layers)
    return dataclasses.replace(spec, num_layers=len(layers), streams=streams, ecsq=ecsq, layers=schema)


def layer_counts(spec: CodecSpec, keys: Sequence, values: Sequence) -> list[int]:
    """Validate a per-layer cache -> token count per layer (NO_CACHE for layers without a KV cache)."""
    if len(keys) != spec.num_layers or len(values) != spec.num_layers:
        raise ValueError(f"a per-layer cache needs {spec.num_layers} entries (None for layers without a KV cache), "
                         f"got {len(keys)} keys and {len(values)} values")
    coded = set(spec.coded_layers)
    counts, first = [], None
    for i, (k, v) in enumerate(zip(keys, values)):
        if i not in coded:
            if k is not None or v is not None:
                raise ValueError(f"layer {i} keeps no KV cache in this model; pass None for it")
            counts.append(NO_CACHE)
            continue
        kd, vd = spec.dim("keys"), spec.dim("values")
        if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor) or k.ndim != 3 or v.ndim != 3 \
                or k.shape[:2] != v.shape[:2] or k.shape[0] != spec.kv_heads or (k.shape[2], v.shape[2]) != (kd, vd):
            got = tuple(tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__ for x in (k, v))
            raise ValueError(f"layer {i}: keys and values must be shaped (kv_heads, tokens, width) = "
                             f"({spec.kv_heads}, tokens, {kd}) and ({spec.kv_heads}, tokens, {vd}) for the artifact "
                             f"({spec.widths}), got {got[0]} and {got[1]}")
        first = k if first is None else first
        if (k.dtype, k.device) != (first.dtype, first.device) or (v.dtype, v.device) != (first.dtype, first.device):
            raise ValueError("every layer's keys and values must share one dtype and device")
        counts.append(int(k.shape[1]))
    return counts


def segments(counts: Sequence[int]) -> list[tuple[int, ...]]:
    """Layers with a cache, cut into sets of equal token count, ordered by their first layer."""
    out: dict[int, list[int]] = {}
    for i, n in enumerate(counts):
        if n != NO_CACHE:
            out.setdefault(n, []).append(i)
    return [tuple(ix) for ix in out.values()]


def encode_layered(spec: CodecSpec, sub: Callable[[tuple[int, ...]], "object"], keys: Sequence, values: Sequence,
                   start: int, dtype_name: str, mode: str, version: int = FORMAT_VERSION) -> bytes:
    """Per-layer cache -> container blob in format `version`; `sub(layers)` is the codec of the spec restricted to
    `layers` (its segments are written in its options' version)."""
    counts = layer_counts(spec, keys, values)
    longest = max(n for n in counts if n != NO_CACHE)
    sections = [Section(SectionKey(TAG_LAYOUT, 0, 0, 0), PLAIN, 4 * len(counts), struct.pack(f"<{len(counts)}I", *counts))]
    for si, layers in enumerate(segments(counts)):
        n = counts[layers[0]]
        inner = b"" if n == 0 else sub(layers).encode(torch.stack([keys[l] for l in layers]),
                                                      torch.stack([values[l] for l in layers]), start + longest - n)
        sections.append(Section(SectionKey(TAG_SEGMENT, 0, si, 0), PLAIN, len(inner), inner))
    header = BlobHeader(spec.name, spec.version, spec.model_id, spec.ratio, dtype_name, spec.num_layers, spec.kv_heads,
                        longest, spec.head_dim, start, spec.sinks, spec.window, 0, 0, mode=mode, layered=True)
    return write_blob(header, sections, version)


def decode_layered(spec: CodecSpec, sub: Callable[[tuple[int, ...]], "object"], header: BlobHeader,
                   sections: list[Section], device: torch.device, max_tokens: int) -> tuple[PerLayer, PerLayer]:
    """Container header and sections -> per-layer keys, values."""
    if (header.layers, header.kv_heads, header.head_dim) != (spec.num_layers, spec.kv_heads, spec.head_dim):
        raise BlobError("per-layer blob shape does not match the codec's artifact")
    layout_key = SectionKey(TAG_LAYOUT, 0, 0, 0)
    if not sections or sections[0].key != layout_key:
        raise BlobError(f"per-layer blob needs a layout of {spec.num_layers} layer token counts first")
    check_sections(sections[:1], [SectionBound(layout_key, 4 * spec.num_layers, True, True)])
    counts = list(struct.unpack(f"<{spec.num_layers}I", bytes(sections[0].stored)))
    coded = set(spec.coded_layers)
    if any((n == NO_CACHE) != (i not in coded) or (n != NO_CACHE and n > header.tokens) for i, n in enumerate(counts)) \
            or header.tokens not in counts:
        raise BlobError("per-layer blob layout does not fit the artifact's layers or declares inconsistent tokens")
    runs = segments(counts)
    bounds = [SectionBound(layout_key, 4 * spec.num_layers, True, True)] + [
        SectionBound(SectionKey(TAG_SEGMENT, 0, si, 0), len(sections[1 + si].stored) if 1 + si < len(sections) else 0,
                     True, True) for si in range(len(runs))]
    data = decode_sections(sections, bounds)
    dtype = getattr(torch, header.dtype)
    out_k: PerLayer = [None] * spec.num_layers
    out_v: PerLayer = [None] * spec.num_layers
    for si, layers in enumerate(runs):
        n, inner = counts[layers[0]], data[SectionKey(TAG_SEGMENT, 0, si, 0)]
        if n == 0:
            if inner:
                raise BlobError("per-layer blob has bytes for an empty segment")
            k, v = (torch.empty(len(layers), spec.kv_heads, 0, spec.dim(st), dtype=dtype, device=device)
                    for st in ("keys", "values"))
        else:
            inner_header, _ = read_blob(inner)
            if inner_header.layered:
                raise BlobError("a per-layer blob segment is itself a per-layer container (containers do not nest): "
                                "the blob is corrupt")
            if inner_header.start != header.start + header.tokens - n or inner_header.mode != header.mode:
                raise BlobError("a per-layer blob segment starts at another position or mode than its layout says")
            if inner_header.tokens != n:
                raise BlobError("a per-layer blob segment does not hold the tokens its layout declares")
            k, v = sub(layers).decode(bytes(inner), device, max_tokens=min(n, max_tokens))
            if k.shape != (len(layers), spec.kv_heads, n, spec.head_dim) or k.dtype != dtype:
                raise BlobError("a per-layer blob segment does not hold the tokens its layout declares")
        for j, l in enumerate(layers):
            out_k[l], out_v[l] = k[j], v[j]
    return out_k, out_v
