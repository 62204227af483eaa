"""Rate-distortion of the ECSQ mode against the fixed-rate mode and the Gaussian bounds.

Metric rows per (ratio, stream, group, split): ecsq_rel_error, ecsq_bits_per_token, ecsq_kept,
heldout_bound_rel_error (reverse water-filling on held-out variances at the ratio's budget).
Curve rows "rate_distortion": {stream, group, mode (ecsq | fixed | bound_calibration |
bound_heldout), bits_per_token, rel_error} on the held-out rows, and their chart.
Relative error: ||X - X_hat||_F / ||X||_F over held-out rows, whole p-vector, keys RoPE-removed.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from kvtc.pipeline.evaluation.metrics import waterfilling_distortion
from kvtc.pipeline.fit.ecsq import EcsqFit, EcsqSettings, fit_ecsq, heldout_variances, squared_error
from kvtc.pipeline.evaluation.charts import figure, png
from kvtc.pipeline.fit.pca import Basis

STREAMS = ("keys", "values")


def split_base(basis: Basis, x: np.ndarray, z: torch.Tensor | None = None) -> tuple[float, float, torch.Tensor]:
    """What every fit's error on rows x (N, p) shares: (variance outside the basis's k columns, summed
    ||x||^2, projections z (N, k))."""
    xt = torch.as_tensor(x, dtype=torch.float32)
    z = basis.project(xt) if z is None else torch.as_tensor(z, dtype=torch.float32)
    centered = float((xt - torch.from_numpy(basis.mean).float()).double().square().sum())
    outside = max(centered - float(z.double().square().sum()), 0.0)
    return outside, float(xt.double().square().sum()), z


def split_error(fit: EcsqFit, basis: Basis, x: np.ndarray, z: torch.Tensor | None = None,
                base: tuple[float, float, torch.Tensor] | None = None) -> tuple[float, float]:
    """Raw rows x (N, p) -> (summed squared error of the ECSQ reconstruction, summed ||x||^2).
    base: `split_base` of the same rows, when several fits are measured on them."""
    outside, norm, z = base if base is not None else split_base(basis, x, z)
    return squared_error(fit, z) + outside, norm


def split_metrics(fits: list[EcsqFit], basis: Basis, x: np.ndarray, z: torch.Tensor | None, split: str,
                  stream: str, group: int, totals: dict) -> list[dict]:
    """Metric rows of every ratio's fit on one split; adds (error, norm) into totals[(ratio, stream, split)]."""
    z = basis.project(torch.as_tensor(x, dtype=torch.float32)) if z is None else z
    rows = []
    variance = heldout_variances(z) if split == "heldout" else None
    base = split_base(basis, x, z)
    for f in fits:
        err, norm = split_error(f, basis, x, z, base)
        acc = totals.setdefault((f.ratio, stream, split), [0.0, 0.0, 0.0])
        acc[0] += err
        acc[1] += norm
        values = {"ecsq_rel_error": math.sqrt(err / max(norm, 1e-300)), "ecsq_kept": f.kept,
                  "ecsq_bits_per_token": f.bits_per_token}
        if variance is not None:
            bound = waterfilling_distortion(variance, f.budget_bits) * z.shape[0]
            acc[2] += bound
            values["heldout_bound_rel_error"] = math.sqrt(bound / max(norm, 1e-300))
        rows += [{"ratio": f.ratio, "stream": stream, "group": group, "split": split, "metric": m, "value": float(v)}
                 for m, v in values.items()]
    return rows


def stream_metrics(totals: dict) -> list[dict]:
    """Stream-level rows (group None) from split_metrics' totals."""
    rows = []
    for (ratio, stream, split), (err, norm, bound) in sorted(totals.items()):
        rows.append({"ratio": ratio, "stream": stream, "group": None, "split": split, "metric": "ecsq_rel_error",
                     "value": math.sqrt(err / max(norm, 1e-300))})
        if split == "heldout":
            rows.append({"ratio": ratio, "stream": stream, "group": None, "split": split,
                         "metric": "heldout_bound_rel_error", "value": math.sqrt(bound / max(norm, 1e-300))})
    return rows


CURVE_ROWS = 512  # held-out rows (evenly strided) the chart's extra refits are fitted and measured on


def sample_rows(x: np.ndarray, z: torch.Tensor, rows: int = CURVE_ROWS) -> tuple[np.ndarray, torch.Tensor]:
    """At most `rows` of x (N, p) and their projections z (N, k), evenly strided."""
    stride = max(1, x.shape[0] // rows)
    return x[::stride][:rows], z[::stride][:rows]


def curve_rows(basis: Basis, x: np.ndarray, z: torch.Tensor, stream: str, group: int, fits: list[EcsqFit],
               fixed: list[tuple[float, float]], extra_ratios=(4, 12, 24, 64),
               settings: EcsqSettings = EcsqSettings(iterations=16), measured: dict | None = None) -> list[dict]:
    """Rate-distortion curve rows on held-out rows x (N, p) with projections z (N, k): the fitted
    ratios (measured on every row) plus `extra_ratios` for ECSQ (refitted and measured on a sample of
    CURVE_ROWS rows: a chart, not the stored fits) and both bounds; fixed: (bits per token, rel error)
    points of the fixed-rate allocations. measured: {ratio: summed squared error} of the fitted ratios on these
    same rows where `split_metrics` measured them already (each costs a reconstruction of every row)."""
    norm = float(torch.as_tensor(x, dtype=torch.float32).double().square().sum())
    n = x.shape[0]
    tail = max(basis.total_variance - float(basis.eigenvalues.sum()), 0.0)
    held = heldout_variances(z)
    sigma = np.sqrt(held)
    done = {f.ratio for f in fits}
    xs, zs = sample_rows(x, z)
    norm_s = float(torch.as_tensor(xs, dtype=torch.float32).double().square().sum())
    extra = [fit_ecsq(r, zs, basis.dim, settings, sigma) for r in extra_ratios
             if r not in done and 16 * basis.dim / r >= 1 and zs.shape[0] >= 16]
    rows = []
    measured = measured or {}
    sample = split_base(basis, xs, zs)
    full = split_base(basis, x, z) if any(f.ratio not in measured for f in fits) else None
    for f in list(fits) + extra:
        sampled = f in extra
        err = split_error(f, basis, xs, zs, sample)[0] if sampled else measured[f.ratio] if f.ratio in measured \
            else split_error(f, basis, x, z, full)[0]
        bits = float(f.budget_bits)
        for mode, value in (("ecsq", err / (norm_s if sampled else norm)),
                            ("bound_calibration", waterfilling_distortion(basis.eigenvalues, bits, tail) * n / norm),
                            ("bound_heldout", waterfilling_distortion(held, bits) * n / norm)):
            rows.append({"stream": stream, "group": group, "mode": mode,
                         "bits_per_token": float(f.bits_per_token if mode == "ecsq" else bits),
                         "rel_error": math.sqrt(max(value, 0.0))})
    rows += [{"stream": stream, "group": group, "mode": "fixed", "bits_per_token": float(b), "rel_error": float(e)}
             for b, e in fixed]
    return rows


def chart(rows: list[dict]) -> bytes | None:
    """Rate-distortion PNG: relative error (dB) against bits per token, group 0, one panel per stream."""
    if not rows:
        return None

    import matplotlib.ticker  # noqa: PLC0415 - as every chart: commands that draw nothing never load matplotlib

    plt, fig, axes = figure(2)
    styles = {"fixed": ("o-", "fixed-rate (DP blocks, budget before DEFLATE)"), "ecsq": ("s-", "ECSQ (entropy-coded)"),
              "bound_heldout": ("--", "Gaussian bound, held-out variances"),
              "bound_calibration": (":", "Gaussian bound, calibration eigenvalues")}
    for ax, stream in zip(axes, STREAMS):
        for mode, (style, label) in styles.items():
            pts = sorted((r["bits_per_token"], r["rel_error"]) for r in rows
                         if r["stream"] == stream and r["group"] == 0 and r["mode"] == mode and r["rel_error"] > 0)
            if pts:
                b, e = zip(*pts)
                ax.plot(b, 20 * np.log10(e), style, label=label, markersize=4)
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set(xlabel="bits per middle token (group 0)", ylabel="relative error (dB, 20 log10)",
               title=f"{stream}: rate-distortion on held-out rows")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return png(plt, fig)
