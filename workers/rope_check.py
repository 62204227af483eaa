"""Per-layer RoPE exactness against the model's own code: f_model(remove(K)) == K for each coded layer.

The forward runs with the modeling module's rotary function wrapped, so each layer's call (its cos/sin
or frequencies, exactly as the model computed them) is recorded. For every coded layer, the cached keys K
(with RoPE, as the model cached them) are RoPE-removed with the layer's LayerSpec, then rotated again
by the model's own function with the recorded arguments; the relative round-trip error is reported.
A layer the model does not rotate must have no RoPE in the schema (and the reverse): otherwise inf.
Multi-head latent attention layers are checked on their RoPE key (the values slot). With `rope_interleave`
DeepSeek's rotary function takes interleaved dims and returns rotated halves: the cache holds the half
layout, so the round trip interleaves the RoPE-removed halves before calling it.
"""
from __future__ import annotations

import sys
from typing import Any, Callable

import torch

from kvtc.kernels.codec.layers import cached_layers
from kvtc.workers.full_cache import cache_kwargs, full_cache
from kvtc.workers.models import LoadedModel

ROTARY_FUNCTIONS = ("apply_rotary_pos_emb", "apply_rotary_emb")
INTERLEAVED_INPUT = "apply_rotary_pos_emb_interleave"  # DeepSeek (rope_interleave): interleaved in, halves out


def _rotary_functions(lm: LoadedModel) -> tuple[Any, dict[str, Callable]]:
    module = sys.modules[type(lm.base).__module__]
    found = {name: getattr(module, name) for name in (*ROTARY_FUNCTIONS, INTERLEAVED_INPUT)
             if callable(getattr(module, name, None))}
    if not found.keys() - {INTERLEAVED_INPUT}:
        raise RuntimeError(f"{module.__name__} has none of {ROTARY_FUNCTIONS}; cannot check RoPE against the model")
    return module, found


def _interleave(halves: torch.Tensor) -> torch.Tensor:
    """[a | b] -> (a0, b0, a1, b1, ...) on the last dim."""
    h = halves.shape[-1] // 2
    return torch.stack((halves[..., :h], halves[..., h:]), dim=-1).flatten(-2)


def rope_round_trip(lm: LoadedModel, input_ids: torch.Tensor) -> dict[int, float]:
    """input_ids (B, T) -> {coded layer: max |f_model(remove(K)) - K| / max |K|} (0.0 for NoPE layers)."""
    module, originals = _rotary_functions(lm)
    current: list[int] = [-1]
    calls: dict[int, tuple[str, tuple, dict]] = {}

    def recorder(name: str, fn: Callable) -> Callable:
        def recording(*args: Any, **kwargs: Any) -> Any:
            calls[current[0]] = (name, args, kwargs)
            return fn(*args, **kwargs)
        return recording

    hooks = [layer.register_forward_pre_hook(lambda _m, _a, i=i: current.__setitem__(0, i))
             for i, layer in enumerate(lm.base.layers)]
    for name, fn in originals.items():
        setattr(module, name, recorder(name, fn))
    try:
        with torch.inference_mode():
            out = lm.base(input_ids=input_ids.to(lm.device), **cache_kwargs(lm.base, full_cache(lm)), use_cache=True)
    finally:
        for name, fn in originals.items():
            setattr(module, name, fn)
        for h in hooks:
            h.remove()
    cache = out.cache if "cache" in out else out.past_key_values
    positions = torch.arange(input_ids.shape[1], device=lm.device)
    errors = {}
    for i in cached_layers(lm.layers):
        rope = lm.layers[i].rope
        keys = getattr(cache.layers[i], lm.layers[i].rope_stream).float()  # an MLA layer's RoPE key: the values slot
        if (i in calls) != (rope is not None):
            errors[i] = float("inf")
            continue
        if rope is None:
            errors[i] = 0.0
            continue
        name, args, kwargs = calls[i]
        original = originals[name]
        removed = rope.remove(keys, positions)
        recorded_k = args[1]
        r = recorded_k.shape[-1]  # models that split off the rotary part before the call (Phi) pass fewer dims
        transposed = recorded_k.shape[:-1] != keys.shape[:-1]
        k_in = removed[..., :r].transpose(1, 2) if transposed else removed[..., :r]
        k_in = _interleave(k_in) if name == INTERLEAVED_INPUT else k_in
        rest = [a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args[2:]]
        with torch.inference_mode():
            _, k_out = original(k_in.clone(), k_in.clone(), *rest, **kwargs)
        k_out = k_out.float().transpose(1, 2) if transposed else k_out.float()
        k_out = torch.cat([k_out, removed[..., r:]], dim=-1)
        errors[i] = float((k_out - keys).abs().max() / keys.abs().max().clamp_min(1e-30))
    return errors
