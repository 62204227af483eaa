"""RopeSpec from a transformers config (the runtime math lives in kvtc.kernels.rope)."""
from __future__ import annotations

from typing import Any

import torch

from kvtc.kernels.rope import ROPE_TYPES, RopeSpec


def rope_from_config(config: Any) -> RopeSpec:
    """Build from a transformers config with the library's own RoPE init functions.

    "dynamic" equals its base frequencies up to max_position_embeddings and "longrope" uses its
    short factors up to original_max_position_embeddings; callers must keep sequences within
    those limits (see kvtc.workers.capture.check_seq_len).
    """
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = dict(getattr(config, "rope_parameters", None) or {})
    if "rope_theta" not in params:
        raise ValueError(f"config of model_type {getattr(config, 'model_type', '?')!r} has no RoPE parameters")
    rope_type = params.get("rope_type", "default")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if rope_type == "default":
        dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        inv = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        scaling = 1.0
    elif rope_type in ROPE_TYPES:
        inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None)
    else:
        raise ValueError(f"RoPE type {rope_type!r} is not supported; supported: {ROPE_TYPES}")
    return RopeSpec(
        rope_type=rope_type,
        theta=float(params["rope_theta"]),
        head_dim=int(head_dim),
        rotary_dim=2 * int(inv.numel()),
        inv_freq=tuple(inv.to(torch.float32).tolist()),
        attention_scaling=float(scaling),
        layout="half",
    )
