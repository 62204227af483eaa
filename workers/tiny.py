"""Small random-weight models built in-process from transformers configs, for tests and demos.

Vocabulary size matches the embedded SmolLM2 tokenizer (49152) so its tokenizer drives them.
Each architecture also exercises one RoPE feature the codec must handle.

Geometry presets give a tiny model a real model's KV geometry (layers x KV heads x head_dim, so
the pipeline runs at production p) with a hidden size of 64: `tiny:llama@32x8x128` has the KV
cache shape of Llama-3.1-8B (p = 32768 per stream), `tiny:llama@80x8x128` that of Llama-3.1-70B.
"""
from __future__ import annotations

from typing import Any

import torch

from kvtc.workers.tiny_specs import (GEOMETRY_ARCHS, MIXED_ARCHS, MLA_ARCHS, MLA_GEOMETRY_ARCHS, TINY_ARCHS,  # noqa: F401
                                     UNIFORM_ARCHS, Geometry, parse_tiny)

TINY_VOCAB = 49152
_COMMON: dict[str, Any] = dict(
    vocab_size=TINY_VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
)


def tiny_config(arch: str, geometry: Geometry | None = None) -> Any:
    """The transformers config of a tiny model, with `geometry` applied when given."""
    if arch in MLA_GEOMETRY_ARCHS:
        return _mla_config(arch, geometry)
    config = _config(arch)
    if geometry is not None:
        if arch not in GEOMETRY_ARCHS:
            raise ValueError(f"tiny:{arch} takes no geometry; use one of {GEOMETRY_ARCHS}")
        config.num_hidden_layers = geometry.layers
        config.num_key_value_heads = geometry.kv_heads
        config.num_attention_heads = geometry.attention_heads or geometry.kv_heads
        config.head_dim = geometry.head_dim
        if hasattr(config, "layer_types") and config.layer_types is not None:
            config.layer_types = [config.layer_types[0]] * geometry.layers
    return config


def _config(arch: str) -> Any:
    import transformers as tf  # noqa: PLC0415 - transformers loads only with a model

    if arch == "llama":
        return tf.LlamaConfig(
            **_COMMON,
            head_dim=16,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256,
            },
        )
    if arch == "qwen2":
        return tf.Qwen2Config(
            **_COMMON,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 512,
            },
        )
    if arch == "qwen3":
        return tf.Qwen3Config(**_COMMON, head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    if arch == "mistral":
        common = {**_COMMON, "num_key_value_heads": 1}
        return tf.MistralConfig(
            **common,
            head_dim=16,
            sliding_window=None,
            rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
        )
    if arch == "gemma":
        return tf.GemmaConfig(**_COMMON, head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if arch == "phi":
        return tf.PhiConfig(
            **_COMMON,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        )
    return _mixed_config(arch)


def _mixed_config(arch: str) -> Any:
    """Models whose layers differ: sliding windows, chunked attention, NoPE layers, layers without a KV cache.
    Windows are short (8-16 positions) so that tests of a few dozen tokens exercise them."""
    import transformers as tf  # noqa: PLC0415 - transformers loads only with a model

    four = {**_COMMON, "num_hidden_layers": 4}
    if arch == "gemma3":  # sliding + global, two RoPE bases, linear scaling on the global layers
        return tf.Gemma3TextConfig(
            **four, head_dim=16, sliding_window=12, query_pre_attn_scalar=16,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    if arch == "gpt_oss":  # alternating sliding / full, YaRN, attention sinks, MoE
        return tf.GptOssConfig(
            **{**four, "intermediate_size": 32}, head_dim=16, sliding_window=10, num_local_experts=4,
            num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"] * 2,
            rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                             "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64})
    if arch == "smollm3":  # NoPE every fourth layer
        return tf.SmolLM3Config(**four, no_rope_layers=[1, 1, 1, 0], pad_token_id=0,
                                rope_parameters={"rope_type": "default", "rope_theta": 2e6})
    if arch == "qwen3_next":  # linear-attention layers (no KV cache), gated full attention, partial rotary
        return tf.Qwen3NextConfig(
            **{**four, "intermediate_size": 64}, head_dim=16, layer_types=["linear_attention"] * 3 + ["full_attention"],
            linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=32, decoder_sparse_step=1,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
    if arch == "cohere2":  # sliding layers with interleaved RoPE, NoPE global layers
        return tf.Cohere2Config(
            **four, sliding_window=12,
            layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if arch == "llama4":  # chunked attention with interleaved RoPE, NoPE full-attention layers
        return tf.Llama4TextConfig(
            **{**four, "intermediate_size": 64}, intermediate_size_mlp=64, head_dim=16, attention_chunk_size=8,
            no_rope_layers=[1, 1, 1, 0], num_local_experts=2, num_experts_per_tok=1, interleave_moe_layer_step=2,
            rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    return _mla_config(arch)


def _mla_config(arch: str, geometry: Geometry | None = None) -> Any:
    """Multi-head latent attention: the cache holds a latent of kv_lora_rank (32, or the geometry's second
    number) and a RoPE key of qk_rope_head_dim (8, or its third) per token and layer. deepseek_v3:
    q_lora_rank, interleaved RoPE weights, YaRN, MoE after the first layer; deepseek_v3_plain: no
    q_lora_rank, RoPE in halves; minicpm3: another family."""
    import transformers as tf  # noqa: PLC0415 - transformers loads only with a model

    mla = dict(kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)
    common = {**_COMMON, "num_key_value_heads": 4}
    if geometry is not None:
        mla.update(kv_lora_rank=geometry.kv_heads, qk_rope_head_dim=geometry.head_dim)
        common.update(num_hidden_layers=geometry.layers, num_attention_heads=geometry.attention_heads or 4,
                      num_key_value_heads=geometry.attention_heads or 4)
    if arch in ("deepseek_v3", "deepseek_v3_plain"):
        interleave = arch == "deepseek_v3"
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 512,
                "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0} if interleave else \
            {"rope_type": "default", "rope_theta": 10000.0}
        return tf.DeepseekV3Config(
            **common, **mla, q_lora_rank=24 if interleave else None,
            rope_interleave=interleave, moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1,
            num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, rope_parameters=rope)
    if arch == "minicpm3":
        return tf.MiniCPM3Config(**common, **mla, q_lora_rank=24,
                                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    raise ValueError(f"unknown tiny architecture {arch!r}; use one of {TINY_ARCHS}")


def build_tiny(arch: str, seed: int = 0, dtype: torch.dtype = torch.float32, geometry: Geometry | None = None) -> torch.nn.Module:
    """A seeded random-weight causal LM of the named architecture (global RNG state is preserved)."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415 - transformers loads only with a model

    config = tiny_config(arch, geometry)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()
