"""The codec at long context: how long a sequence the driver can score, and the error by position of one long
held-out sequence through the offline codec, across the model's context (the main job's served check adds both:
charts/error_by_position.png then spans the context, the calibration's own --seq-len marked)."""
from __future__ import annotations

import math
from typing import Any

import torch

from kvtc.kernels.codec.layers import cached_layers

CACHE_COPIES = 8  # the float32 cache, each ratio's decoded copy and the scoring's own cache, measured under 8
LOGIT_COPIES = 2  # the forward's float32 logits over every position, and their log-softmax


def long_bytes(lm: Any, tokens: int) -> int:
    """Bytes one sequence of `tokens` needs beside the model while it is captured, coded and scored."""
    L, H, D = len(cached_layers(lm.layers)) if lm.layers else lm.num_layers, lm.num_kv_heads, lm.head_dim
    config = getattr(lm.config, "text_config", None) or lm.config
    vocab, hidden = int(getattr(config, "vocab_size", 0) or 0), int(getattr(config, "hidden_size", 0) or 0)
    cache = 2 * L * H * tokens * D * 4
    return CACHE_COPIES * cache + LOGIT_COPIES * tokens * vocab * 4 + 16 * tokens * hidden * 4


def longest_window(lm: Any, available: int, free: int, shortest: int) -> int | None:
    """The longest sequence, up to the model's context and the `available` held-out tokens, whose scoring fits
    `free` bytes (halving from there); None where it is not longer than `shortest` (the calibration's)."""
    length = min(int(lm.max_positions or available), available)
    while length > shortest and long_bytes(lm, length) > free:
        length //= 2
    return length if length > shortest else None


def position_edges(tokens: int, sinks: int, per_octave: int = 2) -> list[int]:
    """Bucket edges over [0, tokens): the sinks alone, then `per_octave` buckets per doubling of the position."""
    edges = {0, min(sinks, tokens), tokens}
    octaves = math.log2(max(tokens, 2))
    edges |= {min(tokens, round(2 ** (i / per_octave))) for i in range(int(octaves * per_octave) + 1)}
    return sorted(e for e in edges if e >= min(sinks, tokens) or e == 0)


def position_errors(keys: torch.Tensor, values: torch.Tensor, k_hat: torch.Tensor, v_hat: torch.Tensor, ratio: float,
                    sinks: int) -> list[dict]:
    """A cache (layers, heads, T, d) and its reconstruction through the offline codec at `ratio` (sinks and window
    raw) -> curve rows {stream, group: None, ratio, lo, hi, rows, rel_error}: the relative error by position
    bucket over every coded layer and head. The served check hands it the long window's own reconstruction (its
    scoring made it): no second prefill, no second coding."""
    edges = position_edges(keys.shape[2], sinks)
    rows = []
    for stream, x, x_hat in (("keys", keys, k_hat), ("values", values, v_hat)):
        err = (x_hat.float() - x.float()).pow(2).sum(dim=(0, 1, 3), dtype=torch.float64)
        norm = x.float().pow(2).sum(dim=(0, 1, 3), dtype=torch.float64)
        for lo, hi in zip(edges, edges[1:]):
            n = float(norm[lo:hi].sum())
            rows.append({"stream": stream, "group": None, "ratio": float(ratio), "lo": lo, "hi": hi,
                         "rows": hi - lo, "rel_error": math.sqrt(float(err[lo:hi].sum()) / n) if n else 0.0})
    return rows
