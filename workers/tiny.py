"""Small random-weight models built in-process from transformers configs, for tests and demos.

Vocabulary size matches the embedded SmolLM2 tokenizer (49152) so its tokenizer drives them.
Each architecture also exercises one RoPE feature the codec must handle.
"""
from __future__ import annotations

from typing import Any

import torch

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


def _config(arch: str) -> Any:
    import transformers as tf

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
    raise ValueError(f"unknown tiny architecture {arch!r}; use one of {TINY_ARCHS}")


TINY_ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gemma", "phi")


def build_tiny(arch: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A seeded random-weight causal LM of the named architecture (global RNG state is preserved)."""
    from transformers import AutoModelForCausalLM

    config = _config(arch)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()
