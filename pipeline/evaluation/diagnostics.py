"""Diagnostic curves computed from shard statistics and held-out rows, stored in every artifact:
error against calibration tokens (growing prefixes of the in-order fold, `prefix_errors`; the
store-based curve of a finished calibration is `error_by_tokens`) and
the PCA-only error by context position. `kvtc.pipeline.evaluation.report` draws them.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from kvtc.artifacts.groups import group_columns, stream_dims
from kvtc.artifacts.schema import STREAMS
from kvtc.pipeline.evaluation.metrics import default_edges, evaluate, pca_rel_error
from kvtc.pipeline.fit.allocator import AllocatorSettings, allocate
from kvtc.pipeline.fit.pca import Basis, covariance_f32, fix_signs

CURVE_ROWS = 2048  # held-out (and second-domain) rows each prefix is measured on, evenly strided


def curve_components(p_total: int, ratio: float) -> int:
    """Components of each error-by-tokens prefix basis: a quarter of what the ratio's budget pays for over
    all p_total features (each group's basis is cut to its own p)."""
    return max(1, min(p_total, int(16 * p_total / ratio) // 4))


def top_basis(n: int, sum_, gram, k: int, iters: int = 2, seed: int = 0):
    """Leading k principal components of merged moments (gram: (p, p), or its packed upper triangle) by
    randomized subspace iteration (float32 GEMMs, float64 Rayleigh-Ritz): far cheaper than a full eigh
    at p in the thousands."""
    return PrefixSolver(k, iters, seed)(n, sum_, gram)


class PrefixSolver:
    """Top-k bases of growing prefixes of one stream and group's statistics, called in prefix order: the
    first by `iters` subspace iterations from random vectors, each later one by a single power step from
    the previous prefix's subspace (a prefix holds the previous one's rows, so no later data reaches an
    earlier point, and a step from a near subspace costs half an iteration from random vectors)."""

    def __init__(self, k: int, iters: int = 2, seed: int = 0) -> None:
        self.k, self.iters, self.seed = int(k), iters, seed
        self.q: torch.Tensor | None = None

    def __call__(self, n: int, sum_, gram) -> Basis:
        mu = np.asarray(sum_, dtype=np.float64) / n
        if np.ndim(gram) == 1:
            cov = covariance_f32(n, mu, np.asarray(gram, dtype=np.float64))
        else:
            cov = torch.from_numpy(np.asarray(gram, dtype=np.float64) / n - np.outer(mu, mu)).float()
        p = cov.shape[0]
        if self.q is None:
            q = torch.randn(p, min(p, self.k + 32), generator=torch.Generator().manual_seed(self.seed))
            steps = self.iters + 1
        else:
            q, steps = self.q, 1
        for _ in range(steps):
            q, _ = torch.linalg.qr(cov @ q)
        evals, vecs = torch.linalg.eigh((q.T @ cov @ q).double())
        self.q = q
        order = torch.argsort(evals, descending=True)[: min(self.k, p)]
        comps = (q.double() @ vecs[:, order]).numpy()
        return Basis(mu, np.clip(evals[order].numpy(), 0.0, None), np.ascontiguousarray(fix_signs(comps)),
                     float(max(torch.diagonal(cov).double().sum().item(), 0.0)), int(n))


def group_prefix_partials(basis: Basis, rows, ratio: float, sinks: int, window: int,
                          settings: AllocatorSettings | None = None) -> dict[str, list[float]]:
    """One stream and group's share of an error-by-tokens point: split -> [squared error x norm, norm] of
    `basis` with one DP allocation at `ratio` (analytic error model unless `settings` says), on a sample
    of CURVE_ROWS of its held-out rows (`rows`: a GroupRows; middle positions) and of its second domain."""
    settings = settings or AllocatorSettings(error_model="analytic")
    step = max(1, -(-len(rows.positions) // CURVE_ROWS))
    sample, positions = rows.rows[::step], rows.positions[::step]
    mid = sample[(positions >= sinks) & (positions < rows.seq_len - window)]
    (alloc,) = allocate([ratio], basis, mid, settings)
    splits = [("heldout", mid)]
    if rows.evals is not None:
        splits.append(("eval", rows.evals[::max(1, -(-rows.evals.shape[0] // CURVE_ROWS))]))
    out = {}
    for name, x in splits:
        norm = float(np.square(x, dtype=np.float64).sum())
        (ev,) = evaluate(basis, [alloc], x)
        out[name] = [ev.rel_error ** 2 * norm, norm]
    return out


def stream_prefix_rows(parts: list[tuple[str, list[dict]]]) -> list[dict]:
    """Curve rows {tokens, stream, split, rel_error} from every group's `by_tokens` partials
    ({tokens, split, err, norm}), given as (stream, partials) in (stream, group) order."""
    acc: dict[tuple, list[float]] = {}
    for stream, partials in parts:
        for r in partials:
            a = acc.setdefault((int(r["tokens"]), stream, r["split"]), [0.0, 0.0])
            a[0] += r["err"]
            a[1] += r["norm"]
    return [{"tokens": t, "stream": s, "split": split, "rel_error": math.sqrt(e / max(n, 1e-300))}
            for (t, s, split), (e, n) in sorted(acc.items(), key=lambda kv: (kv[0][0], STREAMS.index(kv[0][1]), kv[0][2]))]


def prefix_points(n_shards: int, points: int) -> list[int]:
    """Prefix lengths (in training shards) of the error-by-tokens curve: doubling, the last one all."""
    return sorted({max(1, n_shards >> i) for i in range(points)}) if n_shards and points > 0 else []


def prefix_errors(total, heldout, evals, ratio: float, sinks: int, window: int, k: int = 1024,
                  settings=None, solvers: dict | None = None) -> list[dict]:
    """Rows {tokens, stream, split, rel_error} of one prefix: `total` is the CalibrationStats folded
    so far; a top-k basis (a `PrefixSolver` per stream and group, kept in `solvers` across the prefixes),
    one DP allocation at `ratio` (analytic error model unless `settings` says), stream-level error over all
    groups on held-out (and eval) rows."""
    solvers = {} if solvers is None else solvers
    dims = stream_dims(total.fingerprint)  # an MLA model's streams differ in width
    parts = []
    for stream in STREAMS:
        for g, cols in enumerate(group_columns(total.groups, *dims[stream])):
            n, s, gram = total.stream(stream, g)
            solver = solvers.setdefault((stream, g), PrefixSolver(min(k, total.stream_dims(stream)[g])))
            basis = solver(n, s, gram)
            group_rows = heldout.group(stream, cols, evals, sinks, window)
            parts.append((stream, [{"tokens": int(n), "split": split, "err": err, "norm": norm} for split, (err, norm)
                                   in group_prefix_partials(basis, group_rows, ratio, sinks, window, settings).items()]))
    return stream_prefix_rows(parts)


def pca_error_by_position(basis, allocations, x, positions, edges=None, projections=None) -> list[dict]:
    """PCA-only relative error by position bucket: rows {ratio, lo, hi, rows, rel_error}, one per
    allocation and bucket, with each allocation's kept components unquantized. x (N, p) raw rows at
    `positions` (N,); buckets as kvtc.pipeline.evaluation.metrics.default_edges. projections: the rows'
    centered projections (N, >= max kept), if already computed."""
    pos = np.asarray(positions).reshape(-1)
    edges = edges or default_edges(int(pos.max()) if pos.size else 0)
    ks = sorted({a.kept for a in allocations})
    out = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        sel = (pos >= lo) & (pos < hi)
        if sel.any():
            z = None if projections is None else projections[torch.from_numpy(sel)]
            errs = dict(zip(ks, pca_rel_error(basis, x[sel], ks, projections=z)))
            out += [{"ratio": a.ratio, "lo": int(lo), "hi": int(hi), "rows": int(sel.sum()), "rel_error": float(errs[a.kept])}
                    for a in allocations]
    return out
