"""Rotary position embedding as a plain value: apply it to keys, or remove it exactly.

Pure torch: the runtime codec rebuilds a `RopeSpec` from an artifact manifest; workers.rope builds
one from a transformers config.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope", "proportional")
LAYOUTS = ("half", "interleaved")


@dataclass(frozen=True)
class RopeSpec:
    """Rotation angles `position * inv_freq[i]` on the first `rotary_dim` dims of each head.

    layout "half" pairs dim i with dim i + rotary_dim/2 (HF rotate_half, used by Llama, Qwen,
    Mistral, Gemma, Phi); "interleaved" pairs dims 2i and 2i+1 (GPT-J / Meta reference).
    `attention_scaling` multiplies cos and sin (YaRN / LongRoPE mscale), as HF does.
    """

    rope_type: str
    theta: float
    head_dim: int
    rotary_dim: int
    inv_freq: tuple[float, ...]
    attention_scaling: float = 1.0
    layout: str = "half"

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type {self.rope_type!r} is not supported; use one of {ROPE_TYPES}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout {self.layout!r} is not supported; use one of {LAYOUTS}")
        if self.head_dim <= 0 or self.rotary_dim <= 0 or self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ValueError(
                f"rotary_dim must be even and in (0, head_dim]; got rotary_dim={self.rotary_dim}, "
                f"head_dim={self.head_dim}"
            )
        if len(self.inv_freq) != self.rotary_dim // 2:
            raise ValueError(f"inv_freq needs rotary_dim/2 = {self.rotary_dim // 2} entries, got {len(self.inv_freq)}")
        if not (self.attention_scaling > 0 and math.isfinite(self.attention_scaling)):
            raise ValueError(f"attention_scaling must be a positive finite number, got {self.attention_scaling}")
        object.__setattr__(self, "inv_freq", tuple(float(f) for f in self.inv_freq))

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (T,) int -> (cos, sin) each (T, rotary_dim) float32, attention_scaling folded in."""
        inv = torch.tensor(self.inv_freq, dtype=torch.float32, device=positions.device)
        freqs = positions.to(torch.float32)[:, None] * inv[None, :]
        if self.layout == "half":
            emb = torch.cat((freqs, freqs), dim=-1)
        else:
            emb = torch.repeat_interleave(freqs, 2, dim=-1)
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling

    def _rotate(self, x: torch.Tensor) -> torch.Tensor:
        if self.layout == "half":
            h = x.shape[-1] // 2
            return torch.cat((-x[..., h:], x[..., :h]), dim=-1)
        pairs = x.unflatten(-1, (-1, 2))
        return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)

    def _check(self, x: torch.Tensor, positions: torch.Tensor) -> None:
        if x.shape[-1] != self.head_dim:
            raise ValueError(f"last dim of x must be head_dim={self.head_dim}, got shape {tuple(x.shape)}")
        if x.dim() < 2 or positions.shape != (x.shape[-2],):
            raise ValueError(f"positions must have shape (T,) = ({x.shape[-2]},), got {tuple(positions.shape)}")

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x (..., T, head_dim) -> same shape with RoPE applied, computed in float32, returned in x.dtype."""
        self._check(x, positions)
        cos, sin = self.cos_sin(positions)
        xf = x.to(torch.float32)
        rot = xf[..., : self.rotary_dim]
        out = rot * cos + self._rotate(rot) * sin
        return torch.cat((out, xf[..., self.rotary_dim :]), dim=-1).to(x.dtype)

    def remove(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Inverse of `apply`: x (..., T, head_dim) -> same shape, rotated back by the negative angle."""
        self._check(x, positions)
        cos, sin = self.cos_sin(positions)
        xf = x.to(torch.float32)
        rot = xf[..., : self.rotary_dim]
        out = (rot * cos - self._rotate(rot) * sin) / (self.attention_scaling**2)
        return torch.cat((out, xf[..., self.rotary_dim :]), dim=-1).to(x.dtype)

    def to_dict(self) -> dict[str, Any]:
        return {
            "rope_type": self.rope_type,
            "theta": self.theta,
            "head_dim": self.head_dim,
            "rotary_dim": self.rotary_dim,
            "inv_freq": list(self.inv_freq),
            "attention_scaling": self.attention_scaling,
            "layout": self.layout,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RopeSpec":
        missing = {"rope_type", "theta", "head_dim", "rotary_dim", "inv_freq"} - set(d)
        if missing:
            raise ValueError(f"rope dict is missing {sorted(missing)}")
        return cls(
            rope_type=str(d["rope_type"]),
            theta=float(d["theta"]),
            head_dim=int(d["head_dim"]),
            rotary_dim=int(d["rotary_dim"]),
            inv_freq=tuple(float(f) for f in d["inv_freq"]),
            attention_scaling=float(d.get("attention_scaling", 1.0)),
            layout=str(d.get("layout", "half")),
        )
