"""Reduce: fold the stored shard statistics in shard order, compute PCA bases and one DP bit
allocation per ratio, measure them on held-out rows (and the second domain), and publish.

Folding order is the shards' index order, whatever order the workers finished in, so the
artifact is bit-identical for any number of workers. Held-out rows come from whole held-out
shards (never in the statistics) captured at every position; the DP error tables and the
in-domain metrics use their positions [s, T - w), the error-by-position curve uses all of them.
"""
from __future__ import annotations

import math
import sys
import warnings
from dataclasses import dataclass
from typing import Callable

import numpy as np

from kvtc.pipeline.evaluation import diagnostics
from kvtc.pipeline.evaluation import rate_distortion, report
from kvtc.pipeline.fit import ecsq as ecsq_fit
from kvtc.pipeline.fit.allocator import AllocatorSettings, allocate
from kvtc.pipeline.evaluation.metrics import evaluate, pca_rel_error
from kvtc.pipeline.fit.pca import pca_from_moments
from kvtc.pipeline.job.store import ShardStore
from kvtc.workers.stats import STREAMS, CalibrationStats

MIN_HELDOUT_ROWS = 16


@dataclass
class HeldOut:
    """Rows of one split: keys, values (N, p) float32; positions (N,) int64; seq_len of their shards."""

    keys: np.ndarray
    values: np.ndarray
    positions: np.ndarray
    seq_len: int

    def middle(self, sinks: int, window: int) -> np.ndarray:
        return (self.positions >= sinks) & (self.positions < self.seq_len - window)


def fold_stats(store: ShardStore, shard_ids: list[str], checkpoints: list[int] = (),
               on_checkpoint: Callable[[CalibrationStats], None] | None = None) -> CalibrationStats:
    """Sum the stored statistics of `shard_ids`, in that order, each exactly once; after the
    first c shards for each c in `checkpoints`, call `on_checkpoint` with the running total."""
    if len(set(shard_ids)) != len(shard_ids):
        raise ValueError("a shard id appears twice in the fold list; each shard must be folded once")
    total: CalibrationStats | None = None
    for i, sid in enumerate(shard_ids):
        part = CalibrationStats.from_bytes(store.get_bytes(sid, "stats"))
        total = part if total is None else total.merge(part)
        if on_checkpoint is not None and i + 1 in checkpoints:
            on_checkpoint(total)
    if total is None:
        raise ValueError("no training shard: the corpus is too small for --tokens/--seqs-per-shard/--holdout-fraction")
    return total


def load_rows(store: ShardStore, shard_ids: list[str], cap: int) -> HeldOut | None:
    """Concatenate stored held-out rows in shard order, whole shards, until `cap` rows."""
    keys, values, positions, seq_len, n = [], [], [], 0, 0
    for sid in shard_ids:
        if n >= cap:
            break
        tensors, meta = store.get(sid, "rows")
        keys.append(tensors["keys"].astype(np.float32, copy=False))
        values.append(tensors["values"].astype(np.float32, copy=False))
        positions.append(tensors["positions"])
        seq_len = int(meta["seq_len"])
        n += len(tensors["positions"])
    if not keys:
        return None
    return HeldOut(np.concatenate(keys)[:cap], np.concatenate(values)[:cap], np.concatenate(positions)[:cap], seq_len)


def _group_cols(groups: list[tuple[int, int]], width: int) -> list[slice]:
    return [slice(a * width, b * width) for a, b in groups]


def reduce_and_publish(*, cfg, fingerprint: dict, capture, alloc: AllocatorSettings, store: ShardStore, shards: list[dict],
                       registry: str, tokens_requested: int, corpus_fp: dict | None = None,
                       alias_latest: bool = True, model_dtype: str = "float32") -> dict:
    """Everything after the shard pool: returns the job summary (name, version, per-ratio errors)."""
    from kvtc import artifacts

    notes: list[str] = []
    train = sorted((s for s in shards if s["role"] == "train"), key=lambda s: s["index"])
    heldout_ids = [s["id"] for s in sorted(shards, key=lambda s: s["index"]) if s["role"] == "heldout"]
    eval_ids = [s["id"] for s in sorted(shards, key=lambda s: s["index"]) if s["role"] == "eval"]
    tokens_in = sum(s["tokens"] for s in shards if s["role"] in ("train", "heldout"))
    if tokens_in < tokens_requested:
        msg = f"the corpus ran out after {tokens_in} tokens of the {tokens_requested} requested; calibrated on what exists"
        warnings.warn(msg, stacklevel=2)
        notes.append(msg)

    held = load_rows(store, heldout_ids, cfg.heldout_rows)
    if held is None:
        raise ValueError("no held-out shard; raise --holdout-fraction or --tokens")
    mid = held.middle(cfg.sinks, cfg.window)
    if int(mid.sum()) < MIN_HELDOUT_ROWS:
        raise ValueError(f"only {int(mid.sum())} held-out rows; at least {MIN_HELDOUT_ROWS} are needed")
    evals = load_rows(store, eval_ids, cfg.heldout_rows) if eval_ids else None
    emid = None if evals is None else evals.middle(cfg.sinks, cfg.window)

    # error against calibration tokens (chart 1): measured on prefixes of the same in-order fold
    curve_ratio = sorted(cfg.ratios)[len(cfg.ratios) // 2]
    by_tokens: list[dict] = []
    p_total = int(fingerprint["num_layers"]) * int(fingerprint["num_kv_heads"]) * int(fingerprint["head_dim"])
    curve_k = max(1, min(p_total, int(16 * p_total / curve_ratio) // 4))

    def on_prefix(total: CalibrationStats) -> None:
        by_tokens.extend(diagnostics.prefix_errors(total, held, evals, curve_ratio, cfg.sinks, cfg.window, k=curve_k))

    stats = fold_stats(store, [s["id"] for s in train], diagnostics.prefix_points(len(train), cfg.tokens_curve_points), on_prefix)

    width = int(fingerprint["num_kv_heads"]) * int(fingerprint["head_dim"])
    groups = [tuple(g) for g in stats.groups]
    cols = _group_cols(groups, width)
    bases: dict = {}
    allocations: dict = {}
    metrics: list[dict] = []
    curves: dict[str, list[dict]] = {"error_by_position": [], "error_by_position_pca": [], "spectrum": [],
                                     "pca_error": [], "error_by_tokens": by_tokens, "rate_distortion": []}
    ecsq_tables: dict = {}  # ECSQ mode: (ratio, stream, group) -> table
    ecsq_totals: dict = {}
    # per (ratio, stream, split): summed squared error and norm over groups, for stream-level figures
    agg: dict[tuple, list[float]] = {}

    for stream in STREAMS:
        for g, sl in enumerate(cols):
            n, s, gram = stats.stream(stream, g)
            basis = pca_from_moments(n, s, gram)
            del gram
            x_mid = getattr(held, stream)[mid][:, sl]
            z_mid = basis.project(x_mid)  # one GEMM serves the error tables and the held-out metrics
            allocs = allocate(cfg.ratios, basis, settings=alloc, projections=z_mid)
            notes.extend(w for a in allocs for w in a.warnings if w not in notes)
            fits = ecsq_fit.fit_ratios(cfg.ratios, z_mid, basis.dim)  # ECSQ mode
            ecsq_tables.update({(f.ratio, stream, g): f.to_table() for f in fits})
            kept = max([a.kept for a in allocs] + [f.kept for f in fits])
            curves["spectrum"] += [{"stream": stream, "group": g, "index": i, "eigenvalue": float(v)}
                                   for i, v in enumerate(basis.eigenvalues)]
            ks = sorted({k for k in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096) if k <= basis.k} | {basis.k})
            for k, e in zip(ks, pca_rel_error(basis, x_mid, ks, projections=z_mid)):
                curves["pca_error"].append({"stream": stream, "group": g, "components": int(k), "rel_error": float(e)})
            splits = [("heldout", x_mid, None, z_mid), ("heldout_all_positions", getattr(held, stream)[:, sl], held.positions, None)]
            if evals is not None:
                splits.append(("eval", getattr(evals, stream)[emid][:, sl], None, None))
            for split, x, pos, z in splits:
                if pos is None:  # ECSQ mode
                    metrics += rate_distortion.split_metrics(fits, basis, x, z, split, stream, g, ecsq_totals)
                norm = float(np.square(x, dtype=np.float64).sum())
                for a, ev in zip(allocs, evaluate(basis, allocs, x, positions=pos, projections=z)):
                    if split == "heldout_all_positions":
                        curves["error_by_position"] += [
                            {"stream": stream, "group": g, "ratio": a.ratio, "lo": b.lo, "hi": b.hi, "rows": b.rows,
                             "rel_error": b.rel_error} for b in ev.by_position]
                        continue
                    for metric in ("rel_error", "pca_rel_error", "bound_rel_error", "explained_variance", "bits_per_token", "kept", "rows"):
                        metrics.append({"ratio": a.ratio, "stream": stream, "group": g, "split": split,
                                        "metric": metric, "value": float(getattr(ev, metric))})
                    acc = agg.setdefault((a.ratio, stream, split), [0.0, 0.0, 0.0, 0.0])
                    acc[0] += ev.rel_error ** 2 * norm
                    acc[1] += norm
                    acc[2] += ev.bound_rel_error ** 2 * norm
                    acc[3] += ev.bits_per_token
            curves["error_by_position_pca"] += [
                {"stream": stream, "group": g, **r}
                for r in diagnostics.pca_error_by_position(basis, allocs, getattr(held, stream)[:, sl], held.positions)]
            fixed_points = [(m["value"], next(r["value"] for r in metrics if r["metric"] == "rel_error" and
                                              (r["ratio"], r["stream"], r["group"], r["split"]) == (m["ratio"], stream, g, "heldout")))
                            for m in metrics if m["metric"] == "bits_per_token" and m["split"] == "heldout"
                            and m["stream"] == stream and m["group"] == g]
            curves["rate_distortion"] += rate_distortion.curve_rows(basis, x_mid, z_mid, stream, g, fits, fixed_points)
            for a in allocs:
                allocations[(a.ratio, stream, g)] = {
                    "budget_bits": a.budget_bits, "cost_bits": a.cost_bits, "kept": a.kept,
                    "blocks": [(b.start, b.size, b.qtype, b.bits, b.scale_bits) for b in a.blocks],
                    "expected_error": a.expected_error, "heldout_rows": a.heldout_rows,
                }
            bases[(stream, g)] = (basis.mean.astype(np.float32), basis.eigenvalues[:kept].astype(np.float32),
                                  basis.components[:, :kept].astype(np.float32))
            print(f"kvtc reduce: {stream} group {g}: p={basis.dim}, kept {kept}", file=sys.stderr)

    metrics += rate_distortion.stream_metrics(ecsq_totals)
    for (ratio, stream, split), (err, norm, bound, bits) in agg.items():
        for metric, value in (("rel_error", math.sqrt(err / max(norm, 1e-300))),
                              ("bound_rel_error", math.sqrt(bound / max(norm, 1e-300))), ("bits_per_token", bits)):
            metrics.append({"ratio": ratio, "stream": stream, "group": None, "split": split, "metric": metric, "value": value})

    calibration = artifacts.CalibrationRecord(
        sinks=cfg.sinks, window=cfg.window, seq_len=cfg.seq_len, seed=cfg.seed, ratios=tuple(cfg.ratios),
        groups=tuple(groups), allocator=alloc.to_dict(), group_spec=cfg.groups, sample=cfg.sample,
        tokens_requested=tokens_requested, eval_tokens=cfg.eval_tokens, seqs_per_shard=cfg.seqs_per_shard,
        holdout_fraction=cfg.holdout_fraction, heldout_rows_cap=cfg.heldout_rows, text_column=cfg.text_column,
        dtype=cfg.dtype, model_dtype=model_dtype, keys=cfg.keys, tokens=tokens_in,
        train_rows=int(stats.metadata()["counts"]["keys/0"]), heldout_rows=int(mid.sum()),
        eval_rows=0 if emid is None else int(emid.sum()), notes=tuple(notes),
        tokens_curve={"ratio": curve_ratio, "components": curve_k, "method": "top-k randomized PCA, analytic DP"},
    ).to_manifest()
    corpus = corpus_fp or {
        "spec": cfg.corpus, "eval_spec": cfg.eval_corpus, "seq_len": cfg.seq_len, "seed": cfg.seed,
        "train_shards": [s["id"] for s in train], "heldout_shards": heldout_ids, "eval_shards": eval_ids,
        "tokens": {s["id"]: s["tokens"] for s in shards},
    }
    from kvtc.pipeline.job.corpus import describe

    corpus = dict(corpus, mixture=describe(str(corpus.get("spec", cfg.corpus))))  # sources, pkgdocs distributions
    extra = report.build(metrics, curves, allocations, calibration, fingerprint, f"KVTC report: {cfg.artifact_name}")
    content = artifacts.ArtifactContent(
        name=cfg.artifact_name, model=fingerprint, calibration=calibration, corpus=corpus, bases=bases,
        allocations=allocations, metrics=metrics, curves=curves, extra_files=extra, parent=cfg.parent,
        ecsq=ecsq_tables,
    )
    ref = artifacts.publish(content, registry=registry, alias_latest=alias_latest)
    return summarize(ref, metrics, notes)


def summarize(ref, metrics: list[dict], notes: list[str]) -> dict:
    """The `--json` summary: per ratio and stream, the stream-level held-out (and eval) errors."""
    table: dict = {}
    for m in metrics:
        entry = table.setdefault(m["ratio"], {}).setdefault(m["stream"], {})
        if m["group"] is None:
            entry[m["metric"] if m["split"] == "heldout" else f"{m['split']}_{m['metric']}"] = m["value"]
        elif m["metric"] == "kept" and m["split"] == "heldout":  # summed over groups
            entry["kept"] = entry.get("kept", 0) + int(m["value"])
    rows = [{"ratio": r, **v} for r, v in sorted(table.items())]
    return {"name": ref.name, "version": ref.version, "registry": ref.registry, "ratios": rows, "warnings": notes}
