"""The model's KL sensitivity to its own cache: the Fisher information of each coded layer's keys and values.

An error e in one cached position's key or value moves the model's next-token distributions by a KL of about
e^T F e / 2, F the Fisher information of that cache entry: E_y[g g^T], g the gradient of log p(y) with
respect to it, y sampled from the model itself. It is what neither the queries' moments nor W_O can see:
how a layer's attention error grows or fades through the layers above it (an error in layer 0 passes 29
more layers of SmolLM2, one in the last none). Measured per sequence with one backward pass:

- the cache's keys and values enter attention as leaves (`LeafCache`): the gradient reaches a cached entry
  through every later query of its layer, then up the residual stream, never through another position's
  cached keys or values (those are stored, as a server stores them, not recomputed from the error);
- labels are drawn from the model's distribution at each position (a seeded generator), so the sum of
  g g^T over positions estimates the true Fisher, not the empirical one;
- summed over positions [sinks, T - window): the coded ones.

-> {"sensitivity_keys": (coded layers, kv_heads, head_dim) diagonal, each RoPE pair's two dims averaged (the
pair sum |g|^2 is the same in the cached and the RoPE-removed frames), "sensitivity_values": (coded layers,
kv_heads, head_dim, head_dim)}, float64 on the CPU: additive like the attention metric's sums.
"""
from __future__ import annotations

import zlib
from typing import Any

import torch
from transformers import DynamicCache

from kvtc.kernels.codec.layers import cached_layers
from kvtc.workers.attention_metric import pair_mean
from kvtc.workers.full_cache import full_cache


class LeafCache(DynamicCache):
    """A cache whose incoming keys and values become grad leaves (`leaves`: {layer: (keys, values)})."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.leaves: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        k = key_states.detach().requires_grad_(True)
        v = value_states.detach().requires_grad_(True)
        self.leaves[layer_idx] = (k, v)
        return super().update(k, v, layer_idx, *args, **kwargs)


def kl_sensitivity(lm: Any, input_ids: torch.Tensor, sinks: int, window: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """input_ids (1, T) -> the sequence's Fisher sums (module docstring); zeros when no position is coded."""
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"kl_sensitivity takes one sequence, input_ids of shape (1, T); got {tuple(input_ids.shape)}")
    coded = cached_layers(lm.layers)
    spec0 = lm.layers[coded[0]]
    shape = (len(coded), spec0.kv_heads, spec0.head_dim)
    keys = torch.zeros(shape, dtype=torch.float64)
    values = torch.zeros(shape + shape[-1:], dtype=torch.float64)
    t = int(input_ids.shape[1])
    lo, hi = sinks, t - window
    if hi <= lo:
        return {"sensitivity_keys": keys, "sensitivity_values": values}
    cache = full_cache(lm, LeafCache)
    ids = input_ids.to(lm.device)
    with torch.enable_grad():
        out = lm.model(input_ids=ids, past_key_values=cache, use_cache=True)
        logits = out.logits[0].float()  # (T, vocab)
        gen = torch.Generator(device=logits.device).manual_seed(
            (seed * 1_000_003 + zlib.crc32(input_ids.cpu().numpy().tobytes())) % (1 << 62))
        labels = torch.multinomial(torch.softmax(logits.detach(), -1), 1, generator=gen)[:, 0]
        loss = torch.nn.functional.cross_entropy(logits, labels, reduction="sum")
        missing = [i for i in coded if i not in cache.leaves]
        if missing:
            raise RuntimeError(f"layer {missing[0]} wrote no keys and values through the cache; the KL sensitivity "
                               "needs every coded layer's cache (pass --sensitivity 0 and --attention-balance layer)")
        leaves = [x for i in coded for x in cache.leaves[i]]
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    for slot, i in enumerate(coded):
        gk, gv = grads[2 * slot], grads[2 * slot + 1]
        if gk is not None:
            gk = gk[0, :, lo:hi].to(torch.float64)  # (kv_heads, n, d), RoPE applied as cached
            keys[slot] = pair_mean((gk * gk).sum(1), lm.layers[i]).cpu()
        if gv is not None:
            gv = gv[0, :, lo:hi].to(torch.float64)
            values[slot] = torch.einsum("hni,hnj->hij", gv, gv).cpu()
    return {"sensitivity_keys": keys, "sensitivity_values": values}
