"""RopeSpecs from a transformers config (the runtime math lives in kvtc.kernels.codec.rope).

A config carries one `rope_parameters` dict, or one per layer type (Gemma 3, OLMo 3: a dict keyed by
"full_attention", "sliding_attention", ...; a None entry means that type has no RoPE). Frequencies
come from transformers' own ROPE_INIT_FUNCTIONS (every scaled type it implements), per layer type;
"default" is computed here as transformers does (theta, partial rotary factor).
"""
from __future__ import annotations

from typing import Any

import torch

from kvtc.kernels.codec.rope import RopeSpec

# model types whose rotary embedding pairs dims (2i, 2i+1) (repeat_interleave / complex multiply);
# every other model rotates halves (HF rotate_half)
INTERLEAVED_MODEL_TYPES = frozenset({"cohere", "cohere2", "llama4", "llama4_text", "glm", "glm4", "gptj", "codegen",
                                     "chameleon"})


def nested_rope_parameters(config: Any) -> bool:
    """True when `rope_parameters` holds one dict per layer type rather than one for the model."""
    params = getattr(config, "rope_parameters", None) or {}
    return bool(params) and "rope_theta" not in params and all(v is None or isinstance(v, dict) for v in params.values())


def rope_for_layer_type(config: Any, layer_type: str | None = None) -> RopeSpec | None:
    """The RoPE of layers of `layer_type` (None: the model's single RoPE); None when that type has none.

    "dynamic" equals its base frequencies up to max_position_embeddings and "longrope" uses its
    short factors up to original_max_position_embeddings; callers must keep sequences within
    those limits (see kvtc.workers.capture.check_seq_len).
    """
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: PLC0415 - transformers loads only with a model

    all_params = dict(getattr(config, "rope_parameters", None) or {})
    nested = nested_rope_parameters(config)
    kind = layer_type if nested else None
    if nested and layer_type not in all_params:
        raise ValueError(f"config of model_type {getattr(config, 'model_type', '?')!r} has RoPE parameters per layer "
                         f"type {sorted(all_params)} but none for layer type {layer_type!r}")
    params = all_params[layer_type] if nested else all_params
    if params is None:
        return None
    params = dict(params)
    if "rope_theta" not in params:
        raise ValueError(f"config of model_type {getattr(config, 'model_type', '?')!r} has no RoPE parameters"
                         + (f" for layer type {layer_type!r}" if nested else ""))
    rope_type = params.get("rope_type", "default")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if rope_type == "default":
        dim = int(head_dim * params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0))
        inv = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        scaling = 1.0
    elif rope_type in ROPE_INIT_FUNCTIONS:
        inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None, layer_type=kind) if kind else \
            ROPE_INIT_FUNCTIONS[rope_type](config, None)
    else:
        raise ValueError(f"RoPE type {rope_type!r} is not supported; supported: default, {', '.join(ROPE_INIT_FUNCTIONS)}")
    layout = "interleaved" if getattr(config, "model_type", "") in INTERLEAVED_MODEL_TYPES else "half"
    return RopeSpec(rope_type=rope_type, theta=float(params["rope_theta"]), head_dim=int(head_dim),
                    rotary_dim=2 * int(inv.numel()), inv_freq=tuple(inv.to(torch.float32).tolist()),
                    attention_scaling=float(scaling), layout=layout)


def rope_from_config(config: Any) -> RopeSpec:
    """The model's RoPE for its full-attention layers (the first layer type with RoPE when none is full)."""
    if not nested_rope_parameters(config):
        rope = rope_for_layer_type(config)
    else:
        types = list(dict.fromkeys(["full_attention", *(getattr(config, "layer_types", None) or ()),
                                    *config.rope_parameters]))
        ropes = [rope_for_layer_type(config, t) for t in types if t in config.rope_parameters]
        rope = next((r for r in ropes if r is not None), None)
    if rope is None:
        raise ValueError(f"config of model_type {getattr(config, 'model_type', '?')!r} has no RoPE parameters")
    return rope
