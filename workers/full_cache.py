"""The model's own KV cache for a capture: every position of every layer kept (kvtc.workers.capture, the
KL sensitivity and the RoPE check run their forwards through it), and the keyword a forward takes it by."""
from __future__ import annotations

import functools
import inspect
from typing import Any


def cache_kwargs(module: Any, cache: Any) -> dict[str, Any]:
    """{keyword: cache} for `module`'s forward: `cache` where it takes one (transformers 5.x), else the deprecated
    `past_key_values`, which 5.x still reads but warns about on every call."""
    return {_cache_keyword(type(module)): cache}


@functools.lru_cache(maxsize=None)
def _cache_keyword(cls: type) -> str:
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


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
