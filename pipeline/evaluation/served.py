"""Served quality: a cache through the chunk path the serving integrations use, and the job's check of it.

`chunk_path` codes a prefix cache the way `kvtc lmcache-server` and the vLLM offloading tier store it:
256-token chunks at their true positions (kernels/codec/chunk_serde.py), bf16 as servers hold it, the first
chunk keeping the artifact's sinks raw, no recent window, every stored byte counted (frame and padding
included). `kvtc eval` reports it beside the offline codec (`kvtc-chunk-{r}x` rows), and the main job
scores a few of its own held-out sequences through it before publishing (kvtc.pipeline.job.served_check).
"""
from __future__ import annotations

from typing import Any

import torch

from kvtc.kernels.codec.basis_product import converted_blocks
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
    if transform is None or keys.shape[0] != transform.codec.spec.num_layers:
        return None
    k, v, stored = restore_through(transform, keys, values, chunk)
    # bytes against every token: each is stored (the raw sinks in the first chunk's blob)
    return Reconstruction(f"kvtc-chunk-{ratio:g}x", k, v, stored, keys.shape[2], features(keys, values))


def restore_through(transform: Any, keys: torch.Tensor, values: torch.Tensor, chunk: int = CHUNK
                    ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """keys, values (L, H, T, D) -> bf16 chunks of `chunk` tokens at their positions through a ChunkTransform's
    serialize and deserialize -> (keys, values) float32 as restored, and the bytes stored (frames, padding)."""
    with converted_blocks():  # the transform's half bases converted once for every chunk, not once per chunk
        return _restore_through(transform, keys, values, chunk)


def _restore_through(transform: Any, keys: torch.Tensor, values: torch.Tensor, chunk: int
                     ) -> tuple[torch.Tensor, torch.Tensor, int]:
    L, H, T, D = keys.shape
    kv = torch.stack([x.to(torch.bfloat16).permute(0, 2, 1, 3).reshape(L, T, H * D) for x in (keys, values)])
    out, stored = torch.empty_like(kv), 0
    for start in range(0, T, chunk):
        piece = kv[:, :, start:start + chunk].contiguous()
        data = transform.serialize(piece, start=start)
        transform.deserialize(data, out[:, :, start:start + chunk], start=start)
        stored += len(data)
    x = out.float().reshape(2, L, T, H, D).permute(0, 1, 3, 2, 4)
    return x[0].contiguous(), x[1].contiguous(), stored
