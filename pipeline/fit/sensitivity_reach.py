"""What the KL sensitivity misses when it measures only a sequence's first tokens, in a model whose layers differ.

The sensitivity pass measures each layer's Fisher information on a shard sequence's first SENSITIVITY_TOKENS tokens
(kvtc.workers.sensitivity: its cost grows as the square of the length). An error in a cached key or value at position
j reaches every later query that reads it: a full-attention layer's reaches (T - j) of them, a sliding layer's at most
its window. Over the calibration's sequences of T tokens a full layer's errors therefore reach about (T + 1) / 2
queries each, against (S + 1) / 2 on the S tokens measured, while a sliding layer's reach stops at its window: the
measured sensitivity understates the full layers' share by their ratio (3.2x for Gemma 3's 512-token windows at
T = 4,096, S = 1,024). `reach_factors` gives each layer's factor, mean_reach(T) / mean_reach(S); models whose layers
are alike get None (every layer the same factor: nothing changes), and so does any model calibrated at T <= S.
"""
from __future__ import annotations

from typing import Sequence

from kvtc.kernels.codec.layers import LayerSpec


def mean_reach(length: int, window: int | None) -> float:
    """Mean, over the positions of a `length`-token sequence, of the queries that read a position's key and value
    (itself included): min(window, length - j) for position j; a full layer's window is the sequence."""
    w = length if window is None else min(window, length)
    return ((length - w + 1) * w + w * (w - 1) / 2) / length


def reach_factors(layers: Sequence[LayerSpec], seq_len: int, measured: int) -> tuple[float, ...] | None:
    """Each layer's factor mean_reach(seq_len) / mean_reach(min(seq_len, measured)) (1 for layers without a cache),
    or None where every cached layer's is the same."""
    short = min(seq_len, measured)

    def factor(layer: LayerSpec) -> float:
        if not layer.cached or layer.kind == "chunked":  # a chunk's queries read only their own chunk, at any length
            return 1.0
        window = layer.span if layer.kind == "sliding" else None
        return mean_reach(seq_len, window) / mean_reach(short, window)

    factors = tuple(factor(l) for l in layers)
    cached = {round(f, 12) for f, l in zip(factors, layers) if l.cached}
    return None if len(cached) <= 1 else factors
