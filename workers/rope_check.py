"""Per-layer RoPE exactness against the model's own code: f_model(remove(K)) == K for each coded layer.

The forward runs with the modeling module's rotary function wrapped, so each layer's call (its cos/sin
or frequencies, exactly as the model computed them) is recorded. For every coded layer, the cached keys K
(with RoPE, as the model cached them) are RoPE-removed with the layer's LayerSpec, then rotated again
by the model's own function with the recorded arguments; the relative round-trip error is reported.
A layer the model does not rotate must have no RoPE in the schema (and the reverse): otherwise inf.
"""
from __future__ import annotations

import sys
from typing import Any, Callable

import torch

from kvtc.kernels.layers import cached_layers
from kvtc.workers.models import LoadedModel

ROTARY_FUNCTIONS = ("apply_rotary_pos_emb", "apply_rotary_emb")


def _rotary_function(lm: LoadedModel) -> tuple[Any, str, Callable]:
    module = sys.modules[type(lm.base).__module__]
    for name in ROTARY_FUNCTIONS:
        fn = getattr(module, name, None)
        if callable(fn):
            return module, name, fn
    raise RuntimeError(f"{module.__name__} has none of {ROTARY_FUNCTIONS}; cannot check RoPE against the model")


def rope_round_trip(lm: LoadedModel, input_ids: torch.Tensor) -> dict[int, float]:
    """input_ids (B, T) -> {coded layer: max |f_model(remove(K)) - K| / max |K|} (0.0 for NoPE layers)."""
    from kvtc.workers.capture import full_cache

    module, name, original = _rotary_function(lm)
    current: list[int] = [-1]
    calls: dict[int, tuple[tuple, dict]] = {}

    def recording(*args: Any, **kwargs: Any) -> Any:
        calls[current[0]] = (args, kwargs)
        return original(*args, **kwargs)

    hooks = [layer.register_forward_pre_hook(lambda _m, _a, i=i: current.__setitem__(0, i))
             for i, layer in enumerate(lm.base.layers)]
    setattr(module, name, recording)
    try:
        with torch.inference_mode():
            out = lm.base(input_ids=input_ids.to(lm.device), past_key_values=full_cache(lm), use_cache=True)
    finally:
        setattr(module, name, original)
        for h in hooks:
            h.remove()
    cache = out.cache if "cache" in out else out.past_key_values
    positions = torch.arange(input_ids.shape[1], device=lm.device)
    errors = {}
    for i in cached_layers(lm.layers):
        keys, rope = cache.layers[i].keys.float(), lm.layers[i].rope
        if (i in calls) != (rope is not None):
            errors[i] = float("inf")
            continue
        if rope is None:
            errors[i] = 0.0
            continue
        args, kwargs = calls[i]
        removed = rope.remove(keys, positions)
        recorded_k = args[1]
        r = recorded_k.shape[-1]  # models that split off the rotary part before the call (Phi) pass fewer dims
        transposed = recorded_k.shape[:-1] != keys.shape[:-1]
        k_in = removed[..., :r].transpose(1, 2) if transposed else removed[..., :r]
        rest = [a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args[2:]]
        with torch.inference_mode():
            _, k_out = original(k_in.clone(), k_in.clone(), *rest, **kwargs)
        k_out = k_out.float().transpose(1, 2) if transposed else k_out.float()
        k_out = torch.cat([k_out, removed[..., r:]], dim=-1)
        errors[i] = float((k_out - keys).abs().max() / keys.abs().max().clamp_min(1e-30))
    return errors
