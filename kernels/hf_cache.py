"""transformers DynamicCache <-> KVTC blob, for one sequence (batch size 1).

transformers is imported inside the functions only; the kernels package never needs it.
"""
from __future__ import annotations

from typing import Any

import torch

from kvtc.kernels.codec import KVTCCodec


def _layers(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return [(layer.keys, layer.values) for layer in layers]
    if hasattr(cache, "key_cache"):
        return list(zip(cache.key_cache, cache.value_cache))
    raise ValueError(f"expected a transformers DynamicCache, got {type(cache).__name__}")


def cache_tensors(cache: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """DynamicCache with batch 1 -> keys, values (layers, kv_heads, tokens, head_dim)."""
    pairs = _layers(cache)
    if not pairs or any(k is None or k.ndim != 4 for k, _ in pairs):
        raise ValueError("the cache is empty or not initialised; run the model with use_cache=True first")
    if len({k.shape[2] for k, _ in pairs}) != 1:
        raise ValueError("cache layers hold different token counts (sliding-window layers?); the codec needs "
                         "full-attention caches")
    if pairs[0][0].shape[0] != 1:
        raise ValueError(f"compress_cache handles one sequence; the cache has batch size {pairs[0][0].shape[0]}")
    return torch.stack([k[0] for k, _ in pairs]), torch.stack([v[0] for _, v in pairs])


def compress_cache(codec: KVTCCodec, cache: Any, start: int = 0) -> bytes:
    """DynamicCache (batch 1, tokens from absolute position `start`) -> blob bytes."""
    keys, values = cache_tensors(cache)
    return codec.encode(keys, values, start=start)


def restore_cache(codec: KVTCCodec, blob: bytes, config: Any = None, device: str | torch.device = "cpu") -> Any:
    """blob -> DynamicCache the model can continue from (pass the model config for sliding-window models)."""
    from transformers import DynamicCache

    keys, values = codec.decode(blob, device=device)
    cache = DynamicCache(config=config) if config is not None else DynamicCache()
    for layer in range(keys.shape[0]):
        cache.update(keys[layer][None].contiguous(), values[layer][None].contiguous(), layer)
    return cache
