"""The model's own KV cache for a capture: every position of every layer kept (kvtc.workers.capture, the
KL sensitivity and the RoPE check run their forwards through it)."""
from __future__ import annotations

from typing import Any


def full_cache(lm: Any, cls: type | None = None) -> Any:
    """The model's own cache (a DynamicCache, or its subclass `cls`), except that sliding-window and chunked
    layers keep every position."""
    from transformers import DynamicCache  # noqa: PLC0415 - transformers loads only with a model
    from transformers.cache_utils import DynamicLayer  # noqa: PLC0415 - transformers loads only with a model

    cache = (cls or DynamicCache)(config=lm.model.config)
    for i, layer in enumerate(lm.layers):
        if layer.kind in ("sliding", "chunked") and i < len(cache.layers):
            cache.layers[i] = DynamicLayer()
    return cache
