"""The measure stage of one stream and group: both codec modes' metrics on the held-out rows (middle
and every position) and the second domain, the spectrum, PCA-error, error-by-position,
rate-distortion and basis-size curves; and the stream-level rows over groups (`stream_rows`).

A `GroupMeasure` carries its own partial sums (`partials`: fixed mode, `ecsq_partials`: ECSQ mode),
keyed (ratio, stream, split); `stream_rows` adds them in the order given (stream, then group), so a
stream's figures are the same whichever worker measured which group.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from kvtc.pipeline.evaluation import basis_size, diagnostics, rate_distortion
from kvtc.pipeline.evaluation.metrics import evaluate, pca_rel_error
from kvtc.pipeline.fit.group_fit import GroupFit

PCA_KS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
CURVES = ("error_by_position", "error_by_position_pca", "spectrum", "pca_error", "rate_distortion", "basis_size")
_FIXED_METRICS = ("rel_error", "pca_rel_error", "bound_rel_error", "explained_variance", "bits_per_token", "kept", "rows")


@dataclass
class GroupMeasure:
    """Metric rows {ratio, stream, group, split, metric, value}; curves by name; `partials` (fixed mode):
    (ratio, stream, split) -> [squared error x norm, norm, squared bound x norm, bits per token];
    `ecsq_partials`: (ratio, stream, split) -> [squared error, norm, squared bound]; seconds."""

    metrics: list[dict] = field(default_factory=list)
    curves: dict[str, list[dict]] = field(default_factory=lambda: {name: [] for name in CURVES})
    partials: dict[tuple, list[float]] = field(default_factory=dict)
    ecsq_partials: dict[tuple, list[float]] = field(default_factory=dict)
    seconds: float = 0.0


def measure_group(fit: GroupFit, sinks: int, window: int, basis_size_curve: bool = True) -> GroupMeasure:
    """Measure one stream and group's fit on its held-out rows (`fit.rows`)."""
    t0 = time.perf_counter()
    stream, group, basis, allocs, fits = fit.stream, fit.group, fit.basis, fit.allocs, fit.fits
    rows_all, x_mid, z_mid = fit.rows.rows, fit.x_mid, fit.z_mid
    out = GroupMeasure()
    curves = out.curves
    curves["spectrum"] = [{"stream": stream, "group": group, "index": i, "eigenvalue": float(v)}
                          for i, v in enumerate(basis.eigenvalues)]
    ks = sorted({k for k in PCA_KS if k <= basis.k} | {basis.k})
    curves["pca_error"] = [{"stream": stream, "group": group, "components": int(k), "rel_error": float(e)}
                           for k, e in zip(ks, pca_rel_error(basis, x_mid, ks, projections=z_mid))]
    z_all = basis.project(rows_all) if fit.z_all is None else fit.z_all  # once per split: every metric shares it
    splits = [("heldout", x_mid, None, z_mid), ("heldout_all_positions", rows_all, fit.rows.positions, z_all)]
    if fit.rows.evals is not None:
        splits.append(("eval", fit.rows.evals, None, basis.project(fit.rows.evals)))
    for split, x, pos, z in splits:
        if pos is None:  # ECSQ mode
            out.metrics += rate_distortion.split_metrics(fits, basis, x, z, split, stream, group, out.ecsq_partials)
        norm = float(np.square(x, dtype=np.float64).sum())
        for a, ev in zip(allocs, evaluate(basis, allocs, x, positions=pos, projections=z)):
            if split == "heldout_all_positions":
                curves["error_by_position"] += [
                    {"stream": stream, "group": group, "ratio": a.ratio, "lo": b.lo, "hi": b.hi, "rows": b.rows,
                     "rel_error": b.rel_error} for b in ev.by_position]
                continue
            out.metrics += [{"ratio": a.ratio, "stream": stream, "group": group, "split": split, "metric": metric,
                             "value": float(getattr(ev, metric))} for metric in _FIXED_METRICS]
            out.partials[(a.ratio, stream, split)] = [ev.rel_error ** 2 * norm, norm, ev.bound_rel_error ** 2 * norm,
                                                      ev.bits_per_token]
    curves["error_by_position_pca"] = [{"stream": stream, "group": group, **r} for r in
                                       diagnostics.pca_error_by_position(basis, allocs, rows_all, fit.rows.positions,
                                                                         projections=z_all)]
    fixed_points = [(m["value"], next(r["value"] for r in out.metrics if r["metric"] == "rel_error" and r["split"] == "heldout"
                                      and r["ratio"] == m["ratio"]))
                    for m in out.metrics if m["metric"] == "bits_per_token" and m["split"] == "heldout"]
    measured = {f.ratio: out.ecsq_partials[(f.ratio, stream, "heldout")][0] for f in fits}  # split_metrics' own
    curves["rate_distortion"] = rate_distortion.curve_rows(basis, x_mid, z_mid, stream, group, fits, fixed_points,
                                                           measured=measured)
    if basis_size_curve:
        curves["basis_size"] = basis_size.curve_rows(basis, x_mid, z_mid, stream, group, [a.ratio for a in allocs],
                                                     fits=None if fit.max_components else fits)
    out.seconds = time.perf_counter() - t0
    return out


def stream_rows(measures: list[GroupMeasure]) -> list[dict]:
    """Stream-level metric rows (group None) of both modes: errors combined over groups weighted by
    their norms, bits per token summed; added in the order of `measures`."""
    fixed: dict[tuple, list[float]] = {}
    ecsq: dict[tuple, list[float]] = {}
    for m in measures:
        for source, acc in ((m.partials, fixed), (m.ecsq_partials, ecsq)):
            for key, values in source.items():
                a = acc.setdefault(key, [0.0] * len(values))
                for i, v in enumerate(values):
                    a[i] += v
    rows = rate_distortion.stream_metrics(ecsq)
    for (ratio, stream, split), (err, norm, bound, bits) in fixed.items():
        for metric, value in (("rel_error", math.sqrt(err / max(norm, 1e-300))),
                              ("bound_rel_error", math.sqrt(bound / max(norm, 1e-300))), ("bits_per_token", bits)):
            rows.append({"ratio": ratio, "stream": stream, "group": None, "split": split, "metric": metric, "value": value})
    return rows
