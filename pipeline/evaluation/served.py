"""Served quality: a cache through the chunk path the serving integrations use, and the job's check of it.

`chunk_path` codes a prefix cache the way `kvtc lmcache-server` and the vLLM offloading tier store it:
256-token chunks at their true positions (kernels/codec/chunk_serde.py), bf16 as servers hold it, the first
chunk keeping the artifact's sinks raw, no recent window, every stored byte counted (frame and padding
included). `kvtc eval` reports it beside the offline codec (`kvtc-chunk-{r}x` rows), and the main job
scores a few of its own held-out sequences through it before publishing (kvtc.pipeline.job.served_check).
"""
from __future__ import annotations

from typing import Any, Callable, Iterator

import torch

from kvtc.kernels.codec.basis_product import converted_blocks, shared_projections
from kvtc.kernels.codec.chunk_serde import ChunkTransform
from kvtc.kernels.codec.held_basis import served_codec
from kvtc.kernels.codec.kvtc_codec import KVTCCodec
from kvtc.pipeline.evaluation.baselines import Reconstruction, features

CHUNK = 256  # LMCache's default chunk size


def chunk_transform(codec: Any) -> Any:
    """A KVTCCodec -> the ChunkTransform the servers run with it (its basis held as they hold it, in half precision:
    kernels/codec/held_basis.py, unless the codec pins basis_dtype=torch.float32), or None where the artifact is not
    served by chunks (a multi-head latent attention model, layers that keep no KV cache)."""
    if len(codec.spec.coded_layers) != codec.spec.num_layers:
        return None  # layers without a KV cache: the chunk serde does not serve such models
    try:
        return ChunkTransform(served_codec(codec), positions=True)
    except ValueError:
        return None


def chunk_path(artifact: Any, ratio: float, keys: torch.Tensor, values: torch.Tensor, chunk: int = CHUNK,
               mode: str | None = None, transform: Any = None) -> Reconstruction | None:
    """keys, values (L, H, T, D) -> the cache as the chunk path restores it, or None where the artifact is not
    served by chunks. `transform`: the ratio's `chunk_transform`, built once for many caches (else built here)."""
    if transform is None:
        transform = chunk_transform(KVTCCodec(artifact, ratio, mode=mode))
    return next((rec for _, rec in chunk_paths({ratio: transform}, keys, values, chunk)), None)


def chunk_paths(transforms: dict[float, Any], keys: torch.Tensor, values: torch.Tensor, chunk: int = CHUNK
                ) -> Iterator[tuple[float, Reconstruction]]:
    """`chunk_path` at several ratios of one artifact ({ratio: its `chunk_transform` or None}), each chunk coded at
    every ratio in turn (`restore_each`) -> (ratio, the cache as the chunk path restores it) in the given order, the
    ratios not served by chunks left out; each float32 cache is made as it is yielded, so one is held at a time."""
    served = [(r, t) for r, t in transforms.items() if t is not None and keys.shape[0] == t.codec.spec.num_layers]
    if not served:
        return
    restored = restore_each([t for _, t in served], keys, values, chunk)
    for i, (ratio, _) in enumerate(served):
        k, v, stored = restored(i)
        # bytes against every token: each is stored (the raw sinks in the first chunk's blob)
        yield ratio, Reconstruction(f"kvtc-chunk-{ratio:g}x", k, v, stored, keys.shape[2], features(keys, values))


def restore_through(transform: Any, keys: torch.Tensor, values: torch.Tensor, chunk: int = CHUNK
                    ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """keys, values (L, H, T, D) -> bf16 chunks of `chunk` tokens at their positions through a ChunkTransform's
    serialize and deserialize -> (keys, values) float32 as restored, and the bytes stored (frames, padding)."""
    return restore_each([transform], keys, values, chunk)(0)


def restore_each(transforms: list[Any], keys: torch.Tensor, values: torch.Tensor, chunk: int = CHUNK
                 ) -> Callable[[int], tuple[torch.Tensor, torch.Tensor, int]]:
    """`restore_through` through several transforms of one artifact, each chunk through all of them in turn, the
    widest first, so each chunk is projected once (`basis_product.shared_projections`: the same codings) ->
    i -> transforms[i]'s (keys, values) float32 and bytes stored, made when asked and only once (the bf16 caches
    restored are held until then)."""
    L, H, T, D = keys.shape
    kv = torch.stack([x.to(torch.bfloat16).permute(0, 2, 1, 3).reshape(L, T, H * D) for x in (keys, values)])
    outs: list[torch.Tensor | None] = [torch.empty_like(kv) for _ in transforms]
    stored = [0] * len(transforms)
    order = sorted(range(len(transforms)), key=lambda i: transforms[i].codec.spec.ratio)  # the most components first
    # the transforms' half bases converted once for every chunk, not once per chunk
    with converted_blocks(), shared_projections():
        for start in range(0, T, chunk):
            piece = kv[:, :, start:start + chunk].contiguous()
            for i in order:
                data = transforms[i].serialize(piece, start=start)
                transforms[i].deserialize(data, outs[i][:, :, start:start + chunk], start=start)
                stored[i] += len(data)
    del kv

    def restored(i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        out, outs[i] = outs[i], None
        if out is None:
            raise ValueError(f"transform {i}'s restored cache was read already")
        x = out.float().reshape(2, L, T, H, D).permute(0, 1, 3, 2, 4)
        return x[0].contiguous(), x[1].contiguous(), stored[i]

    return restored
