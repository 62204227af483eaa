"""Tiny model specs (`tiny:ARCH[@LAYERSxKV_HEADSxHEAD_DIM]`) parsed without torch or transformers, so the
command line can check them in well under a second (kvtc.workers.model_limits); kvtc.workers.tiny builds them."""
from __future__ import annotations

from dataclasses import dataclass

UNIFORM_ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gemma", "phi")
MIXED_ARCHS = ("gemma3", "gpt_oss", "smollm3", "qwen3_next", "cohere2", "llama4")
MLA_ARCHS = ("deepseek_v3", "deepseek_v3_plain", "minicpm3")
TINY_ARCHS = UNIFORM_ARCHS + MIXED_ARCHS + MLA_ARCHS


@dataclass(frozen=True)
class Geometry:
    """KV geometry of a tiny model: layers x KV heads x head_dim; attention heads (0: as many as KV
    heads) must be a multiple of the KV heads (grouped-query attention)."""

    layers: int
    kv_heads: int
    head_dim: int
    attention_heads: int = 0

    def __post_init__(self) -> None:
        if min(self.layers, self.kv_heads, self.head_dim) < 1 or self.head_dim % 2:
            raise ValueError(f"geometry {self.layers}x{self.kv_heads}x{self.head_dim}: layers and KV heads must be "
                             ">= 1 and head_dim a positive even number")
        if self.attention_heads and self.attention_heads % self.kv_heads:
            raise ValueError(f"geometry: {self.attention_heads} attention heads are not a multiple of "
                             f"{self.kv_heads} KV heads")

    @classmethod
    def parse(cls, text: str) -> "Geometry":
        """'LAYERSxKV_HEADSxHEAD_DIM[xATTENTION_HEADS]', e.g. '32x8x128' or '32x8x128x32'."""
        parts = text.lower().split("x")
        if len(parts) not in (3, 4) or not all(p.isdigit() for p in parts):
            raise ValueError(f"geometry {text!r} must be LAYERSxKV_HEADSxHEAD_DIM[xATTENTION_HEADS], e.g. "
                             "tiny:llama@32x8x128")
        return cls(*(int(p) for p in parts))

    @property
    def features(self) -> int:
        """p = layers x kv_heads x head_dim, per stream."""
        return self.layers * self.kv_heads * self.head_dim


GEOMETRY_ARCHS = ("llama", "qwen3", "mistral", "gemma")  # the ones whose head_dim is free of hidden_size
# multi-head latent attention: LAYERSxKV_LORA_RANKxQK_ROPE_HEAD_DIM, e.g. tiny:deepseek_v3@61x512x64 (DeepSeek V3's cache)
MLA_GEOMETRY_ARCHS = ("deepseek_v3", "deepseek_v3_plain", "minicpm3")


def parse_tiny(spec: str) -> tuple[str, Geometry | None]:
    """'tiny:ARCH[@LxHxD]' (or 'ARCH[@LxHxD]') -> (arch, geometry or None)."""
    body = spec.removeprefix("tiny:")
    arch, _, geo = body.partition("@")
    if arch not in TINY_ARCHS:
        raise ValueError(f"unknown tiny architecture {arch!r}; use one of {TINY_ARCHS}")
    if not geo:
        return arch, None
    if arch not in GEOMETRY_ARCHS + MLA_GEOMETRY_ARCHS:
        raise ValueError(f"tiny:{arch} takes no geometry (its head_dim follows hidden_size); use one of "
                         f"{', '.join('tiny:' + a for a in GEOMETRY_ARCHS)} with @LAYERSxKV_HEADSxHEAD_DIM")
    return arch, Geometry.parse(geo)
