"""The per-layer attention schema of a model, read from its transformers config.

Each decoder layer is full attention, sliding window (its window), chunked attention (its chunk), or
keeps no KV cache (linear attention, SSM, conv, MLP-only or KV-sharing layers). Layer types come from
`config.layer_types` or, without it, from transformers' own inference (sliding_window /
attention_chunk_size). RoPE per layer: the layer type's RoPE parameters, none for NoPE layers
(`no_rope_layers` zeros: SmolLM3, Llama 4; the global layers of Cohere 2 and EXAONE 4, which rotate
only their sliding layers). A layer kind the service cannot code is refused here, before any model
work, naming the kind and the layer.

Multi-head latent attention (configs with `kv_lora_rank`): each attention layer is kind "mla", one cached
"head" of kv_lora_rank (the normalized latent c_KV, keys slot) and one of qk_rope_head_dim (the shared RoPE
key, values slot). transformers caches k_rot in the half layout even when `rope_interleave` is set: its
interleaved rotary function takes interleaved dims and returns rotated halves (kvtc.workers.rope_check
checks this against the model's own function), so the schema's RoPE is always "half" for MLA layers.
"""
from __future__ import annotations

import dataclasses
import sys
from typing import Any

from kvtc.kernels.codec.layers import LayerSpec
from kvtc.workers.rope import nested_rope_parameters, rope_for_layer_type

KIND_OF_TYPE = {"full_attention": "full", "sliding_attention": "sliding", "chunked_attention": "chunked",
                "linear_attention": "none", "conv": "none", "mamba": "none", "dummy": "none", "moe": "none",
                "mlp": "none", "dense": "none", "sparse": "none"}
# models that rotate keys only in their sliding layers when they have any (their global layers are NoPE)
SLIDING_ONLY_ROPE = frozenset({"cohere2", "exaone4"})


def text_config(config: Any) -> Any:
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def layer_types(config: Any) -> list[str]:
    """transformers' layer types of the decoder (KV-sharing and MLP-only layers as "dummy")."""
    from transformers.cache_utils import get_layer_types_and_kwargs  # noqa: PLC0415 - transformers loads only with a model

    text = text_config(config)
    try:
        types, _ = get_layer_types_and_kwargs(text)
    except (AttributeError, TypeError, ValueError):
        types = list(getattr(text, "layer_types", None) or ["full_attention"] * int(text.num_hidden_layers))
    return list(types)


@dataclasses.dataclass(frozen=True)
class KnownLayout:
    """What a known model's config must say of its layers (a GGUF may not carry it): each layer's type, the sliding
    window, and the default RoPE base of each layer type."""

    name: str
    layer_types: tuple[str, ...]
    sliding_window: int
    rope_theta: dict[str, float]


_LAYOUT_NOTED: set[str] = set()


def layout_differences(config: Any, layout: KnownLayout) -> list[str]:
    """What `config` says otherwise than `layout` (empty: it is the model's real layout)."""
    text = text_config(config)
    out = []
    types = list(getattr(text, "layer_types", None) or [])
    if types != list(layout.layer_types):
        def where(kinds) -> list[int]:
            return [i for i, t in enumerate(kinds) if t == "full_attention"]
        out.append(f"global layers {where(types)} of {len(types)} (the model's: {where(layout.layer_types)} of "
                   f"{len(layout.layer_types)})")
    if getattr(text, "sliding_window", None) != layout.sliding_window:
        out.append(f"sliding_window {getattr(text, 'sliding_window', None)} (the model's: {layout.sliding_window})")
    params = getattr(text, "rope_parameters", None) or {}
    for kind, theta in layout.rope_theta.items():
        got = params.get(kind) if nested_rope_parameters(text) else None
        if not isinstance(got, dict) or got.get("rope_theta") != theta or got.get("rope_type", "default") != "default":
            out.append(f"{kind} RoPE {got} (the model's: default, base {theta:g})")
    return out


def with_known_layout(config: Any, layout: KnownLayout | None) -> Any:
    """`config` with `layout`'s layer types, sliding window and per-type RoPE bases wherever it says otherwise
    (a GGUF that lost them, a reader that filled them with other defaults), said once per model on stderr."""
    if layout is None:
        return config
    wrong = layout_differences(config, layout)
    if not wrong:
        return config
    text = text_config(config)
    text.layer_types = list(layout.layer_types)
    text.sliding_window = layout.sliding_window
    params = dict(getattr(text, "rope_parameters", None) or {}) if nested_rope_parameters(text) else {}
    for kind, theta in layout.rope_theta.items():
        params[kind] = {**(params.get(kind) or {}), "rope_type": "default", "rope_theta": theta}
    text.rope_parameters = params
    if hasattr(text, "rope_local_base_freq"):  # the field of earlier transformers releases
        text.rope_local_base_freq = layout.rope_theta.get("sliding_attention", text.rope_local_base_freq)
    if layout.name not in _LAYOUT_NOTED:
        _LAYOUT_NOTED.add(layout.name)
        print(f"kvtc: {layout.name}: the loaded config says {'; '.join(wrong)}; set to the model's own layout "
              "(its GGUF does not carry it)", file=sys.stderr)
    return config


def layer_schema(config: Any) -> tuple[LayerSpec, ...]:
    """One LayerSpec per decoder layer; ValueError naming the kind and index of a layer that cannot be coded."""
    text = text_config(config)
    model_type = getattr(text, "model_type", "?")
    types = layer_types(text)
    if getattr(text, "kv_lora_rank", None):
        return _mla_schema(text, types)
    if len(types) != int(text.num_hidden_layers):
        raise ValueError(f"config of {model_type!r} lists {len(types)} layer types for {text.num_hidden_layers} layers")
    heads = int(text.num_attention_heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    if isinstance(kv_heads, (list, tuple)):
        raise ValueError(f"config of {model_type!r} has a KV head count per layer ({list(kv_heads)}); the service "
                         "needs one KV head count for every coded layer")
    nope = list(getattr(text, "no_rope_layers", None) or [])
    sliding_only = model_type in SLIDING_ONLY_ROPE and "sliding_attention" in types
    nested = nested_rope_parameters(text)
    ropes: dict[str | None, Any] = {}
    out = []
    for i, t in enumerate(types):
        kind = KIND_OF_TYPE.get(t)
        if kind is None:
            raise ValueError(f"layer {i} of {model_type!r} is {t!r}: the service cannot code that layer kind "
                             f"(supported: full_attention, sliding_attention, chunked_attention, and layers "
                             f"without a KV cache)")
        if kind == "none":
            out.append(LayerSpec("none", 0, 0))
            continue
        span = None
        if kind == "sliding":
            span = int(getattr(text, "sliding_window", None) or 0) or None
        elif kind == "chunked":
            span = int(getattr(text, "attention_chunk_size", None) or 0) or None
        if kind != "full" and span is None:
            raise ValueError(f"layer {i} of {model_type!r} is {t!r} but the config gives no window/chunk size")
        rope = None
        if not (nope and i < len(nope) and not nope[i]) and not (sliding_only and kind == "full"):
            key = t if nested else None
            if key not in ropes:
                ropes[key] = rope_for_layer_type(text, key)
            rope = ropes[key]
        out.append(LayerSpec(kind, int(kv_heads), head_dim, rope, span))
    if not any(l.cached for l in out):
        raise ValueError(f"no layer of {model_type!r} keeps a KV cache: there is nothing to code")
    return tuple(out)


def _mla_schema(text: Any, types: list[str]) -> tuple[LayerSpec, ...]:
    """The schema of a multi-head latent attention model: full-attention layers are "mla"; any other cached kind
    (sliding, chunked, or one the service does not know) is refused, naming it and its layer."""
    model_type = getattr(text, "model_type", "?")
    rank, rope_dim = int(text.kv_lora_rank), int(getattr(text, "qk_rope_head_dim", 0) or 0)
    if rope_dim < 2:
        raise ValueError(f"config of {model_type!r} has kv_lora_rank {rank} but no qk_rope_head_dim: the width of "
                         "its cached RoPE key is unknown")
    if len(types) != int(text.num_hidden_layers):
        raise ValueError(f"config of {model_type!r} lists {len(types)} layer types for {text.num_hidden_layers} layers")
    rope = rope_for_layer_type(text, "full_attention" if nested_rope_parameters(text) else None)
    if rope is not None:
        if rope.rotary_dim != rope_dim:
            raise ValueError(f"config of {model_type!r}: RoPE rotates {rope.rotary_dim} dims, its cached RoPE key has "
                             f"qk_rope_head_dim {rope_dim}")
        rope = dataclasses.replace(rope, head_dim=rope_dim, layout="half")
    out = []
    for i, t in enumerate(types):
        kind = KIND_OF_TYPE.get(t)
        if kind == "none":
            out.append(LayerSpec("none", 0, 0))
        elif kind == "full":
            out.append(LayerSpec("mla", 1, rank, rope, value_dim=rope_dim))
        else:
            raise ValueError(f"layer {i} of {model_type!r} is {t!r} in a multi-head latent attention model (latent "
                             f"width {rank}, rope width {rope_dim}): the service codes MLA layers and layers without "
                             "a KV cache, not a mix with other attention kinds")
    if not any(l.cached for l in out):
        raise ValueError(f"no layer of {model_type!r} keeps a KV cache: there is nothing to code")
    return tuple(out)
