"""The error a multi-head latent attention model feels: the cache's latent and RoPE key after up-projection.

An MLA layer caches the latent c (kv_lora_rank) and one RoPE key k_rot (qk_rope_head_dim) per token; attention
reads, per head h, the key [W_UK_h c ; k_rot] and the value W_UV_h c, where `kv_b_proj` holds W_UK and W_UV
(rows per head: qk_nope_head_dim key rows, then v_head_dim value rows). A latent error e therefore costs
||W_UK_h e|| in every head's key and ||W_UV_h e|| in its value: that, not ||e||, is the error that matters.
`upprojected_error` gives the relative error of the reconstructed per-head keys (nope and rope parts, the
RoPE key counted once per head, as attention reads it) and values over every MLA layer, head and token.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from kvtc.kernels.codec.layers import LayerSpec


@dataclass(frozen=True)
class UpProjection:
    """One layer's W_UK (heads, qk_nope_head_dim, kv_lora_rank) and W_UV (heads, v_head_dim, kv_lora_rank), float32."""

    w_uk: torch.Tensor
    w_uv: torch.Tensor

    def __post_init__(self) -> None:
        if self.w_uk.ndim != 3 or self.w_uv.ndim != 3 or self.w_uk.shape[::2] != self.w_uv.shape[::2]:
            raise ValueError(f"W_UK {tuple(self.w_uk.shape)} and W_UV {tuple(self.w_uv.shape)} must be "
                             "(heads, rows, kv_lora_rank) with the same heads and rank")

    @property
    def heads(self) -> int:
        return int(self.w_uk.shape[0])


def up_projections(model: torch.nn.Module, layers: Sequence[LayerSpec]) -> dict[int, UpProjection]:
    """{MLA layer index: its kv_b_proj split into W_UK and W_UV}, read from the model's attention modules."""
    config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    nope, v = int(config.qk_nope_head_dim), int(config.v_head_dim)
    out = {}
    for i, spec in enumerate(layers):
        if spec.kind != "mla":
            continue
        weight = model.model.layers[i].self_attn.kv_b_proj.weight.detach().float().cpu()
        rank = weight.shape[1]
        if rank != spec.head_dim or weight.shape[0] % (nope + v):
            raise ValueError(f"layer {i}: kv_b_proj {tuple(weight.shape)} does not up-project a latent of "
                             f"{spec.head_dim} into heads of {nope} key + {v} value rows")
        per_head = weight.view(-1, nope + v, rank)
        out[i] = UpProjection(per_head[:, :nope].contiguous(), per_head[:, nope:].contiguous())
    return out


def upprojected_sums(projections: dict[int, UpProjection], coded: Sequence[int], latent: torch.Tensor,
                     latent_hat: torch.Tensor, rope: torch.Tensor, rope_hat: torch.Tensor) -> dict[str, float]:
    """latent, latent_hat (L, 1, T, kv_lora_rank); rope, rope_hat (L, 1, T, qk_rope_head_dim), L = the MLA
    layers `coded` in order -> squared errors and norms {"k_err", "k_norm", "v_err", "v_norm"} of the per-head
    keys ([W_UK_h c ; k_rot]) and values (W_UV_h c) attention reads, over every layer, head and token."""
    sums = {"k_err": 0.0, "k_norm": 0.0, "v_err": 0.0, "v_norm": 0.0}
    for j, layer in enumerate(coded):
        up = projections[layer]
        c, d = latent[j, 0].double(), (latent_hat[j, 0] - latent[j, 0]).double()  # (T, r)
        r, dr = rope[j, 0].double(), (rope_hat[j, 0] - rope[j, 0]).double()
        for name, w in (("k", up.w_uk.double()), ("v", up.w_uv.double())):
            sums[f"{name}_err"] += float(torch.einsum("hdr,tr->htd", w, d).square().sum())
            sums[f"{name}_norm"] += float(torch.einsum("hdr,tr->htd", w, c).square().sum())
        sums["k_err"] += up.heads * float(dr.square().sum())  # the shared RoPE key, read by every head
        sums["k_norm"] += up.heads * float(r.square().sum())
    return sums


def relative(sums: dict[str, float]) -> dict[str, float]:
    """upprojected_sums (or their totals over sequences) -> {"keys": rel. error, "values": rel. error}."""
    return {"keys": (sums["k_err"] / max(sums["k_norm"], 1e-300)) ** 0.5,
            "values": (sums["v_err"] / max(sums["v_norm"], 1e-300)) ** 0.5}


def upprojected_error(projections: dict[int, UpProjection], coded: Sequence[int], latent: torch.Tensor,
                      latent_hat: torch.Tensor, rope: torch.Tensor, rope_hat: torch.Tensor) -> dict[str, float]:
    """{"keys", "values"}: relative errors of the per-head keys and values (see upprojected_sums)."""
    return relative(upprojected_sums(projections, coded, latent, latent_hat, rope, rope_hat))
