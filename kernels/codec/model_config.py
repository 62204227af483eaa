"""A model's config against the artifact a codec was made for: its shape and its layers' kinds.

`check_config(spec, config)` is what every server-side entry point runs before it codes a model's cache
(KVTCCache, the chunk transforms behind LMCache's serde and vLLM's tier): a transformers config (or its
text config) whose layers, KV heads, head width, layer kinds or RoPE theta differ from the artifact's is
refused with a ValueError naming both. transformers is imported only when a config is checked.
"""
from __future__ import annotations

from typing import Any

from kvtc.kernels.codec.spec import CodecSpec

_KINDS = {"full_attention": "full", "sliding_attention": "sliding", "chunked_attention": "chunked"}


def config_dims(config: Any) -> tuple[int, int, int]:
    """(layers, KV heads, head width) of a model config; a multi-head latent attention model: one latent head."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    if getattr(text, "kv_lora_rank", None):  # MLA: one latent "head" per token
        return text.num_hidden_layers, 1, int(text.kv_lora_rank)
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return text.num_hidden_layers, getattr(text, "num_key_value_heads", None) or heads, head_dim


def spec_kinds(spec: CodecSpec) -> list[str]:
    """Each model layer's kind as the artifact records it ("full" throughout for a uniform model)."""
    return ["full"] * spec.num_layers if spec.layers is None else [l.kind for l in spec.layers]


def check_config(spec: CodecSpec, config: Any) -> None:
    """Raise ValueError unless the model config has the artifact's shape and layer kinds."""
    from transformers.cache_utils import get_layer_types_and_kwargs  # noqa: PLC0415 - transformers loads only to check a config

    layers, kv_heads, head_dim = config_dims(config)
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    mla = bool(getattr(text, "kv_lora_rank", None))
    if mla or spec.value_dim is not None:
        rope_width = int(getattr(text, "qk_rope_head_dim", 0) or 0) if mla else None
        if not mla or (layers, head_dim, rope_width) != (spec.num_layers, spec.head_dim, spec.value_dim):
            got = f"{layers} layers, latent width {head_dim}, rope width {rope_width}" if mla else \
                f"{layers} layers x {kv_heads} KV heads x head_dim {head_dim} (no latent)"
            raise ValueError(f"the codec's artifact {spec.name}@{spec.version} is for a model with {spec.num_layers} "
                             f"layers, {spec.widths}; this model has {got}: use an artifact calibrated for this model")
    elif (layers, kv_heads, head_dim) != (spec.num_layers, spec.kv_heads, spec.head_dim):
        raise ValueError(f"the codec's artifact {spec.name}@{spec.version} is for a model with {spec.num_layers} "
                         f"layers x {spec.kv_heads} KV heads x head_dim {spec.head_dim}; this model has {layers} x "
                         f"{kv_heads} x {head_dim}: use an artifact calibrated for this model")
    types, _ = get_layer_types_and_kwargs(text)
    kinds = [_KINDS.get(t, "none") for t in types]
    if mla:
        kinds = ["mla" if k == "full" else k for k in kinds]
    if kinds != spec_kinds(spec):
        raise ValueError(f"the artifact {spec.name}@{spec.version} was calibrated for layers {spec_kinds(spec)}; this model "
                         f"has {kinds}: use an artifact calibrated for this model")
    params = getattr(text, "rope_parameters", None) or {}
    theta = params.get("rope_theta", getattr(text, "rope_theta", None))
    if spec.layers is None and spec.rope and theta is not None \
            and abs(float(theta) - float(spec.rope["theta"])) > 1e-6 * float(theta):
        raise ValueError(f"the artifact was calibrated with RoPE theta {spec.rope['theta']}, this model uses {theta}: "
                         "use an artifact calibrated for this model")
