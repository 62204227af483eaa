"""One bit budget across streams and groups: each ratio's total split between the bases where it lowers
the model's error most.

A ratio's total is what the bases would get one by one, the sum of floor(16 p / CR) over the bases a
rank holds (every basis of a single-rank artifact; with --tp, each rank's own). It is split so that one
quantizer step, in a unit the model feels, serves every basis: reverse water-filling across bases, the
optimum of entropy-coded scalar quantization at high rate. A basis whose error weighs `weight` times more
per whitened unit gets a step sqrt(weight) times finer. Each basis's share is predicted from its spectrum
(the Gaussian rate of a unit-step quantizer, `gaussian_bits`); its ECSQ fit and DP then meet that share
exactly on held-out rows, so the stored size per token is the ratio's total whatever the prediction's error.

Shares are kept within [1/MAX_SHIFT, MAX_SHIFT] times a basis's own share, and integers summing to the
total (largest remainders).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.special import ndtr

from kvtc.artifacts.blocks import budget_bits
from kvtc.artifacts.groups import layer_slots

SPLITS = ("joint", "even")
MAX_SHIFT = 4.0
DROP_BELOW = 12 ** -0.5  # the ECSQ fit's: a component whose std is below this many steps is dropped


@dataclass(frozen=True)
class BasisSpectrum:
    """One basis's part in the split: stream, group, p, its eigenvalues (descending, in the space its fit
    runs in), the components it may keep, `weight` (the model's error per unit of its squared error) and
    `pool` (bases of one pool share one total: the rank's groups; with an mse objective, also one stream)."""

    stream: str
    group: int
    p: int
    eigenvalues: np.ndarray
    kept_bound: int
    weight: float = 1.0
    pool: tuple = ()
    least_bits: int = 0  # the fewest bits its allocators can use (the cheapest quantized block)


def _entropy_table() -> tuple[np.ndarray, np.ndarray]:
    """Bits of N(0, s^2) quantized with a unit step, on a log grid of s (exact sums)."""
    logs = np.linspace(math.log(DROP_BELOW), math.log(64.0), 400)
    bits = []
    for s in np.exp(logs):
        r = int(math.ceil(8 * s)) + 1
        edges = (np.arange(-r, r + 2) - 0.5) / s
        mass = np.diff(ndtr(edges))
        mass = mass[mass > 0]
        bits.append(float(-(mass * np.log2(mass)).sum()))
    return logs, np.asarray(bits)


_LOGS, _BITS = _entropy_table()


def gaussian_bits(sigma_steps: np.ndarray) -> np.ndarray:
    """Per component, the bits a unit-step entropy-coded quantizer spends on N(0, s^2): 0 below the drop line,
    log2(s sqrt(2 pi e)) at high rate."""
    s = np.asarray(sigma_steps, dtype=np.float64)
    out = np.zeros_like(s)
    live = s > DROP_BELOW
    ls = np.log(np.maximum(s, 1e-300))
    high = live & (ls >= _LOGS[-1])
    out[high] = np.log2(s[high] * math.sqrt(2 * math.pi * math.e))
    mid = live & ~high
    out[mid] = np.interp(ls[mid], _LOGS, _BITS)
    return out


def predicted_bits(spec: BasisSpectrum, step: float) -> float:
    sigma = np.sqrt(np.maximum(spec.eigenvalues[:spec.kept_bound], 0.0))
    return float(gaussian_bits(sigma / step).sum())


def split_budget(bases: list[BasisSpectrum], ratio: float) -> list[int]:
    """Each basis's bits per token at `ratio` (input order): per pool, the pool's total split at one step in the
    weights' common unit; each share within [own / MAX_SHIFT, own * MAX_SHIFT]; integers, summing to the total."""
    out = [budget_bits(b.p, ratio) for b in bases]
    pools: dict[tuple, list[int]] = {}
    for i, b in enumerate(bases):
        pools.setdefault(b.pool, []).append(i)
    for members in pools.values():
        if len(members) < 2:
            continue
        own = np.array([budget_bits(bases[i].p, ratio) for i in members], dtype=np.float64)
        total = int(own.sum())
        least = np.array([bases[i].least_bits for i in members], dtype=np.float64)
        lo = np.minimum(np.maximum(own / MAX_SHIFT, least), own)
        hi = np.minimum(own * MAX_SHIFT, np.array([16.0 * bases[i].p for i in members]))

        def shares(t: float) -> np.ndarray:
            pred = np.array([predicted_bits(bases[i], math.exp(t) / math.sqrt(bases[i].weight)) for i in members])
            return np.clip(pred, lo, hi)

        tops = [math.sqrt(max(float(bases[i].eigenvalues[:1].max(initial=0.0)), 1e-300) * bases[i].weight)
                for i in members]
        a, b = math.log(min(tops) * 1e-6), math.log(max(tops) * 64)
        for _ in range(60):  # predicted bits fall as the step grows: bisect the step whose shares fill the total
            mid = (a + b) / 2
            if shares(mid).sum() > total:
                a = mid
            else:
                b = mid
        share = shares(b)  # continuous and falling in the step: its sum meets the total up to the drop line's steps
        ints = np.floor(share).astype(np.int64)
        whole, part = divmod(total - int(ints.sum()), len(members))
        ints += whole
        ints[np.argsort(-(share - np.floor(share)), kind="stable")[:part]] += 1
        if int(ints.sum()) != total:
            raise RuntimeError(f"joint budget bug: shares {ints.tolist()} do not add up to {total}")
        for j, i in enumerate(members):
            out[i] = int(ints[j])
    return out


def split_unit(metric, weighed: bool) -> str:
    """The common unit a joint split puts its bases' errors in, as the manifest records it."""
    if not weighed:
        return "each stream's squared error"
    if metric.balance.scaled_by_sensitivity:
        return "the model's KL (the sensitivity balance: keys and values in one unit)"
    return "attention output error (keys weighed against values)"


def attention_weights(metric, sums: dict[str, np.ndarray], tokens: int, groups: list, kv_heads: int,
                      query_heads: int) -> dict[tuple[str, int], float] | None:
    """Each basis's weight in the attention objective: the model's output error per unit of the basis's
    whitened squared error, in each layer's value units (values 1); None when the statistics hold no keys'
    reach (captured by an earlier release).

    A value error e at position j reaches the layer's output as a_tj W_O e for each query t: the output feels
    sum_t a_tj^2 e^T G e (G = sum_h W_O,h^T W_O,h; the sum of a^2 is the concentration c): the values' metric.
    A key error shifts the logits by delta = q . e and the weights by a_tj (delta - mean delta), which moves
    the output by a_tj delta W_O (v_j - o_t): it feels E[delta^2] times the keys' reach R = sum_t sum_j
    a_tj^2 |W_O,h (v_j - o_t)|^2 per query head (captured beside the concentration). Per KV head of n_q query
    heads, one unit of the keys' metric (c Q, Q the queries' scaled second moments) is R / (n_q c) output
    units; in whitened units (each block divided by its balance divisor n) a key unit weighs
    n_k R / (n_q c n_v) value units. A basis's weight is the mean of its blocks'. With the "sensitivity"
    balance every block is already in one unit, the model's KL: every weight is 1."""
    if metric.balance.scaled_by_sensitivity:  # every block is already in the model's KL (metric.AttentionMetric.sensitivity)
        return {(stream, g): 1.0 for g in range(len(groups)) for stream in ("keys", "values")}
    if "reach" not in sums:
        return None
    reach = np.asarray(sums["reach"], dtype=np.float64)
    per_query = (np.asarray(sums["concentration"], dtype=np.float64) if metric.weighting.by_concentration
                 else np.full(reach.shape, float(tokens)))
    slots = layer_slots(groups)
    out: dict[tuple[str, int], float] = {}
    for g, group in enumerate(groups):
        keys = metric.weighted(sums, tokens, "keys", group, groups, kv_heads)  # (L, H, d, d)
        values = metric.weighted(sums, tokens, "values", group, groups, kv_heads)
        h0, h1 = group.head_range(kv_heads)
        r = np.stack([reach[slots[layer], h0:h1] for layer in group.layers])
        c = np.stack([per_query[slots[layer], h0:h1] for layer in group.layers])
        ratio = metric.divisors(keys) * r / (max(query_heads, 1) * np.maximum(c, 1e-300)) / metric.divisors(values)
        out[("keys", g)] = float(ratio.mean())
        out[("values", g)] = 1.0
    return out
