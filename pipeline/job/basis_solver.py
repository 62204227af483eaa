"""The reducer's heavy step: sum the accumulators of one stream and group, and solve its PCA.

One stream and group at a time, from the packed upper triangles: the running sum and the
accumulator being added (two packed Grams), then one p x p float64 matrix for the eigensolver once
the sum is unpacked (the packed sum is released): about 3 packed Grams at the peak. Only the
components the least aggressive ratio could keep are computed (`max_components`).

Where: the group's reduce task (`group_task.run_group`) calls it, on its device (torch `eigh` in
float64 on a GPU; LAPACK on the CPU threads the task holds).

How (`reduce_plan.choose`, from k / p and the task's memory): exact (one LAPACK solve in place,
pca.exact_eigh: syevd; above EXACT_MAX_P syevd in float32, or float64 syevr where only its smaller
peak fits) whenever the allocation may need
most components, or p is small; subspace iteration only when the allocation can keep few components
(k <= p / FEW_SHARE), or no exact solve fits. A subspace that the allocation fills (keeps > 80% of
it) is followed by one exact solve if it fits, else a subspace twice as wide (`reduce_plan.widen`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from kvtc.pipeline.fit.allocator import AllocatorSettings
from kvtc.pipeline.fit.metric import AttentionMetric, Whitening
from kvtc.pipeline.fit.pca import (EXACT_MAX_P, Basis, basis_from_covariance, covariance_f32, covariance_upper,
                                   pca_from_packed)
from kvtc.pipeline.job.store import ShardStore
from kvtc.workers.stats_file import CorruptStats
from kvtc.workers.triangle import diagonal


def max_components(p: int, ratios, settings: AllocatorSettings) -> int:
    """Most components any allocation at `ratios` can keep, within the basis budget (AllocatorSettings.kept_bound)."""
    return settings.kept_bound(p, ratios)


Moments = tuple[int, np.ndarray, np.ndarray]  # (n, sum (p,), packed upper Gram (p(p+1)/2,)), float64


@dataclass
class Solution:
    """One solve: the basis, how it was computed (method, LAPACK driver), the seconds of its sum and of
    its eigensolver."""

    basis: Basis
    method: str
    driver: str
    sum_s: float
    eig_s: float


def sum_accumulators(store: ShardStore, names: list[str], stream: str, group: int,
                     checkpoints: tuple[int, ...] = (), prefixes: list[Moments] | None = None) -> Moments:
    """(n, sum (p,), packed Gram (p(p+1)/2,)) of (stream, group) over `names`, added in that order; a copy
    of the running sums after the first c accumulators, for each c in `checkpoints`, goes to `prefixes`."""
    n, total, packed = 0, None, None
    for i, name in enumerate(names):
        part = store.get_acc(name, keys=[(stream, group)])
        pn, ps, pg = part.packed(stream, group)
        if packed is None:
            n, total, packed = pn, ps.copy(), pg
        else:
            n += pn
            total += ps
            packed += pg
        del part, pg
        if prefixes is not None and i + 1 in checkpoints:
            prefixes.append((n, total.copy(), packed.copy()))
    if packed is None:
        raise ValueError("no training statistics to reduce; the corpus gave no training shard")
    return n, total, packed


def metric_whitening(store: ShardStore, names: list[str], stream: str, group: int, metric: AttentionMetric) -> Whitening:
    """The attention metric's whitening of (stream, group), from the metric sums of the accumulators `names`."""
    sums, tokens, stats = metric_sums(store, names)
    blocks = metric.blocks(sums, tokens, stream, stats.groups[group], stats.groups, int(stats.fingerprint["num_kv_heads"]))
    return Whitening.of(blocks)


def metric_sums(store: ShardStore, names: list[str]):
    """The attention-metric sums of the accumulators `names` -> (sums {key: array}, query tokens, the last
    accumulator's statistics, moments not read). Every accumulator is read before any error is raised: all that
    are corrupt or out of range are moved aside at once (one rerun recomputes them all), and the first is raised
    naming how many more were set aside."""
    sums: dict[str, np.ndarray] = {}
    tokens, stats, bad = 0, None, []
    for name in names:
        try:
            stats = store.get_acc(name, keys=[])
        except CorruptStats as exc:  # moved aside by the store
            bad.append(exc)
            continue
        if not stats.metric:
            raise ValueError(f"statistics object {name} holds no attention metric; it was captured with --objective "
                             "mse: recalibrate with a fresh --store or with --objective mse")
        for key, t in stats.metric.items():
            sums[key] = sums[key] + t.numpy() if key in sums else t.numpy().copy()
        tokens += stats.metric_tokens
    if len(bad) > 1:
        bad[0].args = (f"{bad[0].args[0]} ({len(bad) - 1} more statistics object(s) moved aside with it)",)
    if bad:
        raise bad[0]
    if stats is None:
        raise ValueError("no training statistics to reduce; the corpus gave no training shard")
    return sums, tokens, stats


def prefix_moments(store: ShardStore, names: list[str], stream: str, group: int, checkpoints: tuple[int, ...],
                   whitening: Whitening | None = None) -> list[Moments]:
    """The running sums of (stream, group) after the first c accumulators, for each c in `checkpoints`
    (in the whitened space with a whitening)."""
    prefixes: list[Moments] = []
    if checkpoints:
        sum_accumulators(store, names[:max(checkpoints)], stream, group, checkpoints, prefixes)
        if whitening is not None:
            for _, s, g in prefixes:
                whitening.whiten_packed(s, g)
    return prefixes


def solve(store: ShardStore, names: list[str], stream: str, group: int, k: int, device: str = "cpu",
          method: str = "auto", whitening: Whitening | None = None, driver: str = "evd",
          checkpoints: tuple[int, ...] = (), on_prefixes: Callable[[list[Moments]], None] | None = None) -> Solution:
    """Basis of (stream, group) from the stored accumulators; with a whitening, the basis of the whitened
    features (orthonormal in the metric's space). An exact solve releases the packed Gram once the p x p
    matrix holds it (reduce_plan.solve_bytes). `on_prefixes` is given the running sums after the first c
    accumulators for each c in `checkpoints` (the last may be all of them), before the eigensolver starts."""
    t0 = time.perf_counter()
    prefixes: list[Moments] = []
    short = tuple(c for c in checkpoints if c < len(names)) if on_prefixes is not None else ()
    n, total, packed = sum_accumulators(store, names, stream, group, short, prefixes)
    if whitening is not None:
        whitening.whiten_packed(total, packed)
        for _, s, g in prefixes:
            whitening.whiten_packed(s, g)
    if on_prefixes is not None and checkpoints:
        on_prefixes(prefixes + ([(n, total, packed)] if len(names) in checkpoints else []))
    del prefixes
    t1 = time.perf_counter()
    p = total.shape[0]
    k = min(k, p)
    if method == "auto" or device.startswith("cuda") or k == p:
        method = "exact" if device.startswith("cuda") or p <= EXACT_MAX_P or k == p else "subspace"
    if method != "exact" or int(n) < 2 or not (np.isfinite(total).all() and np.isfinite(packed).all()):
        basis = pca_from_packed(n, total, packed, k=k, device=device, method=method)  # its checks name the problem
    else:
        mu = total / n
        variance = float(max((diagonal(packed, p) / n - mu * mu).sum(), 0.0))
        if driver == "evd32" and not device.startswith("cuda"):
            cov = covariance_f32(n, mu, packed).numpy()  # built in float64 row blocks, stored in float32
        else:
            cov = covariance_upper(n, mu, packed)
        del packed
        basis = basis_from_covariance(cov, mu, variance, int(n), k, device, driver)
    return Solution(basis, method, driver, t1 - t0, time.perf_counter() - t1)
