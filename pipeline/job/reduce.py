"""Reduce: from the stored accumulators, compute PCA bases and one DP bit allocation per ratio for
every stream and group, measure them on held-out rows (and the second domain), and publish.

Stages, one stream and group at a time (its basis is the largest object): solve
(`kvtc.pipeline.job.basis_solver`: a GPU Ray task when the cluster has GPUs, this process on every
core otherwise; the solver chosen from k / p, see `choose_solver`) -> fit (`fit_group`: DP
allocations and ECSQ tables, a `GroupFit`) -> measure (`measure_group`: both modes' metrics and the
curves, a `GroupResult`); then `aggregate` (stream-level figures over groups) and publish
(`publish_calibration`: manifest fields, report, registry). A subspace solve whose components the
allocation fills is followed by an exact solve (or a wider subspace where that does not fit).
Each stage's seconds go to `timing` (solve_s, fit_s, measure_s, publish_s).

Accumulators are summed in accumulator order, each folded in shard order, so the artifact is
bit-identical for any number of workers. Held-out rows come from whole held-out shards (never in
the statistics) captured at every position; the DP error tables and the in-domain metrics use
their positions [s, T - w), the error-by-position curve uses all of them.
"""
from __future__ import annotations

import math
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from kvtc.artifacts.groups import FeatureGroup, group_columns
from kvtc.artifacts.tensor_parallel import TensorParallelLayout
from kvtc.kernels.layers import layers_of, layers_to_json, stream_dims
from kvtc.pipeline.evaluation import diagnostics
from kvtc.pipeline.evaluation import basis_size, rate_distortion, report
from kvtc.pipeline.fit import ecsq as ecsq_fit
from kvtc.pipeline.evaluation.metrics import evaluate, pca_rel_error
from kvtc.pipeline.fit.allocator import AllocatorSettings, allocate
from kvtc.pipeline.fit.pca import Basis, every_core
from kvtc.pipeline.job.basis_solver import choose_solver, max_components, next_solve, solve_group
from kvtc.pipeline.job.store import ShardStore
from kvtc.pipeline.settings import JobSettings
from kvtc.workers.stats import STREAMS, CalibrationStats

MIN_HELDOUT_ROWS = 16
KEEP_MARGIN = 0.8  # a truncated basis stands when every allocation keeps fewer than this share of it
_PCA_KS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


@dataclass
class HeldOut:
    """Rows of one split: keys, values (N, p) float32; positions (N,) int64; seq_len of their shards."""

    keys: np.ndarray
    values: np.ndarray
    positions: np.ndarray
    seq_len: int

    def middle(self, sinks: int, window: int) -> np.ndarray:
        return (self.positions >= sinks) & (self.positions < self.seq_len - window)


def fold_stats(store: ShardStore, accumulators: list[str], checkpoints: list[int] = (),
               on_checkpoint: Callable[[CalibrationStats], None] | None = None) -> CalibrationStats:
    """Sum whole stored accumulators (every stream and group), in the given order; after the first c
    accumulators for each c in `checkpoints`, call `on_checkpoint` with the running total.
    For diagnostics at small p: the reducer itself sums one stream and group at a time."""
    if len(set(accumulators)) != len(accumulators):
        raise ValueError("an accumulator appears twice in the fold list; each must be folded once")
    total: CalibrationStats | None = None
    for i, name in enumerate(accumulators):
        part = store.get_acc(name)
        if total is None:
            total = part
        else:
            total.fold(part)
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


@dataclass
class GroupResult:
    """Everything one stream and group contributes to the artifact. `partials` maps (ratio, stream,
    split) to [squared error x norm, norm, squared bound x norm, bits per token] for `aggregate`."""

    stream: str
    group: int
    basis: tuple[np.ndarray, np.ndarray, np.ndarray]
    allocations: dict = field(default_factory=dict)
    metrics: list[dict] = field(default_factory=list)
    curves: dict[str, list[dict]] = field(default_factory=dict)
    partials: dict[tuple, list[float]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    ecsq: dict = field(default_factory=dict)  # ECSQ mode: (ratio, stream, group) -> table


@dataclass
class GroupFit:
    """The fit stage's hand-off for one stream and group: its basis, its held-out rows (all positions
    `rows_all` (N, p); the middle ones `x_mid` and their projections `z_mid` (M, k)), the DP
    allocations and the ECSQ fits at every ratio, and the seconds the fit took."""

    stream: str
    group: int
    basis: Basis
    rows_all: np.ndarray
    x_mid: np.ndarray
    z_mid: torch.Tensor
    allocs: list
    fits: list
    seconds: float = 0.0

    @property
    def kept(self) -> int:
        return max([a.kept for a in self.allocs] + [f.kept for f in self.fits])


def fit_group(stream: str, group: int, basis: Basis, ratios, alloc: AllocatorSettings, held: HeldOut,
              cols: slice | np.ndarray, sinks: int, window: int) -> GroupFit:
    """Fit: DP allocations and ECSQ tables at `ratios` on the held-out middle rows' projections."""
    t0 = time.perf_counter()
    rows_all = getattr(held, stream)[:, cols]
    x_mid = rows_all[held.middle(sinks, window)]
    z_mid = basis.project(x_mid)  # one GEMM serves the error tables, the ECSQ fit and the held-out metrics
    allocs = allocate(ratios, basis, settings=alloc, projections=z_mid)
    fits = ecsq_fit.fit_ratios(ratios, z_mid, basis.dim,  # ECSQ mode, within the basis budget
                               ecsq_fit.EcsqSettings(max_components=alloc.max_components))
    return GroupFit(stream, group, basis, rows_all, x_mid, z_mid, allocs, fits, time.perf_counter() - t0)


def measure_group(fit: GroupFit, held: HeldOut, evals: HeldOut | None, cols: slice | np.ndarray, sinks: int,
                  window: int, ecsq_totals: dict) -> GroupResult:
    """Measure: metrics of both modes on held-out (middle and all positions) and eval rows, spectrum,
    PCA-error and rate-distortion curves; `ecsq_totals` gathers the ECSQ stream-level sums over groups."""
    stream, group, basis, allocs, fits = fit.stream, fit.group, fit.basis, fit.allocs, fit.fits
    rows_all, x_mid, z_mid, kept = fit.rows_all, fit.x_mid, fit.z_mid, fit.kept
    out = GroupResult(stream, group, (basis.mean.astype(np.float32), basis.eigenvalues[:kept].astype(np.float32),
                                      basis.components[:, :kept].astype(np.float32)))
    out.notes = list(dict.fromkeys(w for a in allocs for w in a.warnings))
    out.ecsq = {(f.ratio, stream, group): f.to_table() for f in fits}
    curves = out.curves = {"error_by_position": [], "error_by_position_pca": [], "spectrum": [], "pca_error": [],
                           "rate_distortion": [], "basis_size": []}
    curves["spectrum"] = [{"stream": stream, "group": group, "index": i, "eigenvalue": float(v)}
                          for i, v in enumerate(basis.eigenvalues)]
    ks = sorted({k for k in _PCA_KS if k <= basis.k} | {basis.k})
    curves["pca_error"] = [{"stream": stream, "group": group, "components": int(k), "rel_error": float(e)}
                           for k, e in zip(ks, pca_rel_error(basis, x_mid, ks, projections=z_mid))]
    splits = [("heldout", x_mid, None, z_mid), ("heldout_all_positions", rows_all, held.positions, None)]
    if evals is not None:
        splits.append(("eval", getattr(evals, stream)[evals.middle(sinks, window)][:, cols], None, None))
    for split, x, pos, z in splits:
        if pos is None:  # ECSQ mode
            out.metrics += rate_distortion.split_metrics(fits, basis, x, z, split, stream, group, ecsq_totals)
        norm = float(np.square(x, dtype=np.float64).sum())
        for a, ev in zip(allocs, evaluate(basis, allocs, x, positions=pos, projections=z)):
            if split == "heldout_all_positions":
                curves["error_by_position"] += [
                    {"stream": stream, "group": group, "ratio": a.ratio, "lo": b.lo, "hi": b.hi, "rows": b.rows,
                     "rel_error": b.rel_error} for b in ev.by_position]
                continue
            for metric in ("rel_error", "pca_rel_error", "bound_rel_error", "explained_variance", "bits_per_token", "kept", "rows"):
                out.metrics.append({"ratio": a.ratio, "stream": stream, "group": group, "split": split,
                                    "metric": metric, "value": float(getattr(ev, metric))})
            out.partials[(a.ratio, stream, split)] = [ev.rel_error ** 2 * norm, norm, ev.bound_rel_error ** 2 * norm,
                                                      ev.bits_per_token]
    curves["error_by_position_pca"] = [{"stream": stream, "group": group, **r}
                                       for r in diagnostics.pca_error_by_position(basis, allocs, rows_all, held.positions)]
    fixed_points = [(m["value"], next(r["value"] for r in out.metrics if r["metric"] == "rel_error" and r["split"] == "heldout"
                                      and r["ratio"] == m["ratio"]))
                    for m in out.metrics if m["metric"] == "bits_per_token" and m["split"] == "heldout"]
    curves["rate_distortion"] = rate_distortion.curve_rows(basis, x_mid, z_mid, stream, group, fits, fixed_points)
    for a in allocs:
        out.allocations[(a.ratio, stream, group)] = {
            "budget_bits": a.budget_bits, "cost_bits": a.cost_bits, "kept": a.kept,
            "blocks": [(b.start, b.size, b.qtype, b.bits, b.scale_bits) for b in a.blocks],
            "expected_error": a.expected_error, "heldout_rows": a.heldout_rows,
        }
    return out


def _free_bytes() -> int:
    import psutil

    return int(psutil.virtual_memory().available)


def aggregate(results: list[GroupResult]) -> list[dict]:
    """Stream-level metric rows (group None): errors combined over groups weighted by their norms,
    bits per token summed."""
    acc: dict[tuple, list[float]] = {}
    for r in results:
        for key, (err, norm, bound, bits) in r.partials.items():
            a = acc.setdefault(key, [0.0, 0.0, 0.0, 0.0])
            a[0] += err
            a[1] += norm
            a[2] += bound
            a[3] += bits
    rows = []
    for (ratio, stream, split), (err, norm, bound, bits) in acc.items():
        for metric, value in (("rel_error", math.sqrt(err / max(norm, 1e-300))),
                              ("bound_rel_error", math.sqrt(bound / max(norm, 1e-300))), ("bits_per_token", bits)):
            rows.append({"ratio": ratio, "stream": stream, "group": None, "split": split, "metric": metric, "value": value})
    return rows


def reduce_and_publish(*, cfg: JobSettings, fingerprint: dict, store: ShardStore, shards: list[dict],
                       accumulators: list[tuple[str, list[str]]], registry: str, alias_latest: bool = True,
                       model_dtype: str = "float32", on_cluster_gpu: bool = False, timing: dict | None = None) -> dict:
    """Everything after the shard pool: returns the job summary (name, version, per-ratio errors).
    `accumulators`: (object name, shard ids) in accumulator order; `timing` receives reduce figures."""
    timing = {} if timing is None else timing
    t0 = time.perf_counter()
    alloc, cap, red = cfg.allocator, cfg.capture, cfg.reduce
    tokens_requested = int(cfg.plan.tokens or 0)
    notes: list[str] = []
    by_index = sorted(shards, key=lambda s: s["index"])
    heldout_ids = [s["id"] for s in by_index if s["role"] == "heldout"]
    eval_ids = [s["id"] for s in by_index if s["role"] == "eval"]
    tokens_in = sum(s["tokens"] for s in shards if s["role"] in ("train", "heldout"))
    if tokens_in < tokens_requested:
        msg = f"the corpus ran out after {tokens_in} tokens of the {tokens_requested} requested; calibrated on what exists"
        warnings.warn(msg, stacklevel=2)
        notes.append(msg)
    names = [name for name, _ in accumulators]
    if not names:
        raise ValueError("no training shard: the corpus is too small for --tokens/--seqs-per-shard/--holdout-fraction")

    held = load_rows(store, heldout_ids, red.heldout_rows)
    if held is None:
        raise ValueError("no held-out shard; raise --holdout-fraction or --tokens")
    mid = held.middle(cap.sinks, cap.window)
    if int(mid.sum()) < MIN_HELDOUT_ROWS:
        raise ValueError(f"only {int(mid.sum())} held-out rows; at least {MIN_HELDOUT_ROWS} are needed")
    evals = load_rows(store, eval_ids, red.heldout_rows) if eval_ids else None

    kv_heads, head_dim = int(fingerprint["num_kv_heads"]), int(fingerprint["head_dim"])
    groups = cap.group_layers(layers_of(fingerprint), kv_heads)
    dims = stream_dims(fingerprint)  # MLA: the streams (latent, rope key) differ in width
    columns_of = {stream: group_columns(groups, *dims[stream]) for stream in STREAMS}
    # error against calibration tokens (chart 1): prefixes of the accumulators, in order
    curve_ratio = red.curve_ratio
    p_total = sum(g.dim(kv_heads, head_dim) for g in groups)
    curve_k = max(1, min(p_total, int(16 * p_total / curve_ratio) // 4))
    by_tokens: list[dict] = []
    if red.tokens_curve_points > 0:
        fold_stats(store, names, diagnostics.prefix_points(len(names), red.tokens_curve_points),
                   lambda total: by_tokens.extend(
                       diagnostics.prefix_errors(total, held, evals, curve_ratio, cap.sinks, cap.window, k=curve_k)))
    t_curve = time.perf_counter()

    results: list[GroupResult] = []
    stage_s = {"fit": 0.0, "measure": 0.0}
    ecsq_totals: dict = {}
    solve_timings: list[dict] = []
    train_rows = 0
    from tqdm import tqdm

    bar = tqdm(total=len(STREAMS) * len(groups), unit="group", desc="reduce", dynamic_ncols=True, disable=None,
               file=sys.stderr)
    for stream in STREAMS:
        columns = columns_of[stream]
        for g, group in enumerate(groups):
            p = group.dim(*dims[stream])
            bound = max_components(p, red.ratios, alloc)
            method, k = choose_solver(p, bound, on_cluster_gpu, _free_bytes())
            while True:  # a subspace the allocation fills is followed by an exact solve (or a wider one)
                basis, solved = solve_group(store, names, stream, g, k, on_cluster_gpu, method)
                solve_timings.append({"stream": stream, "group": g, "p": p, "k": basis.k, **solved})
                totals = {key: list(v) if isinstance(v, list) else v for key, v in ecsq_totals.items()}
                with every_core():
                    fitted = fit_group(stream, g, basis, red.ratios, alloc, held, columns[g], cap.sinks, cap.window)
                    t_measure = time.perf_counter()
                    result = measure_group(fitted, held, evals, columns[g], cap.sinks, cap.window, totals)
                stage_s["fit"] += fitted.seconds
                stage_s["measure"] += time.perf_counter() - t_measure
                del fitted
                train_rows = basis.n
                if solved["method"] == "exact" or k >= bound or result.basis[2].shape[1] < KEEP_MARGIN * k:
                    ecsq_totals = totals
                    x_mid = getattr(held, stream)[held.middle(cap.sinks, cap.window)][:, columns[g]]
                    with every_core():
                        result.curves["basis_size"] = basis_size.curve_rows(basis, x_mid, basis.project(x_mid), stream,
                                                                            g, red.ratios)
                    del basis, x_mid
                    break
                del basis
                method, k = next_solve(p, k, bound, _free_bytes())
            results.append(result)
            line = (f"{stream} group {g}: p={p}, solved {solve_timings[-1]['k']} components on {solved['device']} "
                    f"({solved['method']}) in {solved['eig_s']:.1f} s, kept {results[-1].basis[2].shape[1]}")
            if cfg.runtime.verbose:
                bar.write(f"kvtc reduce: {line}", file=sys.stderr)
            bar.update(1)
            bar.set_postfix_str(f"{stream} g{g}: {solved['method']} {solved['eig_s']:.0f} s", refresh=False)
    bar.close()
    for r in results:
        notes.extend(w for w in r.notes if w not in notes)
    timing.update(curve_s=t_curve - t0, solve_s=sum(t["sum_s"] + t["eig_s"] for t in solve_timings),
                  eig_s=sum(t["eig_s"] for t in solve_timings), groups=solve_timings, fit_s=stage_s["fit"],
                  measure_s=stage_s["measure"])
    t_publish = time.perf_counter()


    calibration = calibration_record(cfg, groups, model_dtype, tokens_in, int(train_rows), int(mid.sum()),
                                     0 if evals is None else int(evals.middle(cap.sinks, cap.window).sum()), notes,
                                     {"ratio": curve_ratio, "components": curve_k,
                                      "method": "top-k randomized PCA, analytic DP",
                                      "prefixes": "whole accumulators, in order"}, kv_heads).to_manifest()
    # the per-layer attention schema, on every artifact (the fingerprint carries it only for mixed models,
    # so uniform models keep their model ids): kind, window/chunk, RoPE or none, KV heads, head dim
    calibration["layers"] = layers_to_json(layers_of(fingerprint))
    corpus = {
        "spec": cfg.plan.corpus, "eval_spec": cfg.plan.eval_corpus, "seq_len": cfg.plan.seq_len, "seed": cap.seed,
        "train_shards": [s["id"] for s in by_index if s["role"] == "train"], "heldout_shards": heldout_ids,
        "eval_shards": eval_ids, "accumulators": names, "tokens": {s["id"]: s["tokens"] for s in shards},
    }
    from kvtc.pipeline.job.corpus import describe

    corpus = dict(corpus, mixture=describe(str(corpus.get("spec", cfg.plan.corpus))))  # sources, pkgdocs distributions
    summary = publish_calibration(cfg, fingerprint, calibration, corpus, results, by_tokens, registry, alias_latest,
                                  notes, rate_distortion.stream_metrics(ecsq_totals))
    timing["reduce_s"] = time.perf_counter() - t0
    timing["publish_s"] = time.perf_counter() - t_publish
    return summary


def calibration_record(cfg: JobSettings, groups: list[FeatureGroup], model_dtype: str, tokens: int,
                       train_rows: int, heldout_rows: int, eval_rows: int, notes: list[str], tokens_curve: dict,
                       kv_heads: int = 0):
    """The manifest's CalibrationRecord: the settings verbatim, their flat fields for readers, the results
    (and with --tp, the layout of the model's `kv_heads` over the ranks)."""
    from kvtc.artifacts import CalibrationRecord

    cap, plan = cfg.capture, cfg.plan
    return CalibrationRecord(
        sinks=cap.sinks, window=cap.window, seq_len=plan.seq_len, seed=cap.seed, ratios=cfg.reduce.ratios,
        groups=tuple(groups), allocator=cfg.allocator.to_dict(), group_spec=cap.groups, sample=cap.sample,
        tokens_requested=plan.tokens, eval_tokens=plan.eval_tokens, seqs_per_shard=plan.seqs_per_shard,
        holdout_fraction=plan.holdout_fraction, heldout_rows_cap=cfg.reduce.heldout_rows, text_column=plan.text_column,
        dtype=cfg.model.dtype, model_dtype=model_dtype, keys=cap.keys, tokens=tokens, train_rows=train_rows,
        heldout_rows=heldout_rows, eval_rows=eval_rows, notes=tuple(notes), tokens_curve=tokens_curve,
        settings=cfg.computational(),
        tensor_parallel=None if cap.tp == 1 else TensorParallelLayout(cap.tp, kv_heads).to_dict(groups),
    )


def publish_calibration(cfg: JobSettings, fingerprint: dict, calibration: dict, corpus: dict, results: list[GroupResult],
                        by_tokens: list[dict], registry: str, alias_latest: bool, notes: list[str],
                        ecsq_metrics: list[dict]) -> dict:
    """Assemble the artifact from the per-group results, store report and charts, publish."""
    from kvtc import artifacts

    metrics = [m for r in results for m in r.metrics] + ecsq_metrics + aggregate(results)
    curves: dict[str, list[dict]] = {"error_by_position": [], "error_by_position_pca": [], "spectrum": [],
                                     "pca_error": [], "error_by_tokens": by_tokens, "rate_distortion": [],
                                     "basis_size": []}
    for r in results:
        for name, rows in r.curves.items():
            curves[name] += rows
    allocations = {key: value for r in results for key, value in r.allocations.items()}
    bases = {(r.stream, r.group): r.basis for r in results}
    extra = report.build(metrics, curves, allocations, calibration, fingerprint, f"KVTC report: {cfg.artifact_name}")
    content = artifacts.ArtifactContent(
        name=cfg.artifact_name, model=fingerprint, calibration=calibration, corpus=corpus, bases=bases,
        allocations=allocations, metrics=metrics, curves=curves, extra_files=extra, parent=cfg.runtime.parent,
        ecsq={key: table for r in results for key, table in r.ecsq.items()},
    )
    ref = artifacts.publish(content, registry=registry, alias_latest=alias_latest)
    return summarize(ref, metrics, notes)


def summarize(ref, metrics: list[dict], notes: list[str]) -> dict:
    """The `--json` summary: per ratio, the codec's default mode ("ecsq" where the artifact has its
    tables, else "fixed") and per stream that mode's held-out and second-domain errors and kept
    components first, then each mode's figures under "ecsq" and "fixed" and the Gaussian bound."""
    modes: dict = {}
    for m in metrics:
        if m["split"] not in ("heldout", "eval") or (m["group"] is not None and m["metric"] not in ("kept", "ecsq_kept")):
            continue
        mode, metric = ("ecsq", m["metric"][5:]) if m["metric"].startswith("ecsq_") else ("fixed", m["metric"])
        if metric == "heldout_bound_rel_error":
            mode, metric = "bound", "rel_error"
        entry = modes.setdefault(m["ratio"], {}).setdefault(m["stream"], {}).setdefault(mode, {})
        name = metric if m["split"] == "heldout" else f"eval_{metric}"
        if metric == "kept":
            if m["split"] == "heldout" and m["group"] is not None:  # summed over groups
                entry["kept"] = entry.get("kept", 0) + int(m["value"])
        elif m["group"] is None:
            entry[name] = m["value"]
    rows = []
    for ratio, streams in sorted(modes.items()):
        default = "ecsq" if all("rel_error" in s.get("ecsq", {}) for s in streams.values()) else "fixed"
        row: dict = {"ratio": ratio, "mode": default}
        for stream, by_mode in streams.items():
            first = by_mode.get(default, {})
            row[stream] = {**{k: first[k] for k in ("rel_error", "eval_rel_error", "kept") if k in first},
                           "ecsq": by_mode.get("ecsq", {}), "fixed": by_mode.get("fixed", {}),
                           "bound_rel_error": by_mode.get("bound", {}).get("rel_error")}
        rows.append(row)
    return {"name": ref.name, "version": ref.version, "registry": ref.registry, "ratios": rows, "warnings": notes}
