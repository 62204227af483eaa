"""Held-out error against basis size: what a basis budget costs, per ratio (the ECSQ mode's code).

Curve rows "basis_size": {stream, group, ratio, cap, components, basis_elements, rel_error} for the
ECSQ fit at each ratio with its components capped at p/16, p/8, p/4, p/2 and uncapped (cap 0);
relative error over a sample of the held-out middle rows, whole p-vector (as the rate-distortion
curve). Uncapped, and any cap at or above what the stored fit keeps, is the stored fit itself.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from kvtc.pipeline.evaluation.rate_distortion import CURVE_ROWS, sample_rows, split_base, split_error
from kvtc.pipeline.fit.ecsq import EcsqFit, EcsqSettings, fit_ecsq, heldout_variances
from kvtc.pipeline.evaluation.charts import figure, png
from kvtc.pipeline.fit.pca import Basis

STREAMS = ("keys", "values")
CAP_FRACTIONS = (16, 8, 4, 2)


def caps(p: int) -> list[int]:
    """The capped sizes charted for a group of p features, then 0 (uncapped)."""
    return sorted({max(1, p // d) for d in CAP_FRACTIONS}) + [0]


def curve_rows(basis: Basis, x: np.ndarray, z: torch.Tensor, stream: str, group: int, ratios,
               settings: EcsqSettings = EcsqSettings(iterations=16), max_rows: int = CURVE_ROWS,
               fits: list[EcsqFit] | None = None) -> list[dict]:
    """Held-out rows x (N, p), projections z (N, k) -> one row per ratio and cap, fitted and measured on at
    most max_rows rows, evenly strided (a chart, not the stored fits). `fits`: the stored fits by ratio;
    a cap at or above the components a fit keeps is that fit, measured, not refitted."""
    x, z = sample_rows(x, z, max_rows)
    sigma = np.sqrt(heldout_variances(torch.as_tensor(z, dtype=torch.float32)))
    norm = float(torch.as_tensor(x, dtype=torch.float32).double().square().sum())
    stored = {f.ratio: f for f in fits or []}
    base = split_base(basis, x, z)
    rows = []
    for ratio in ratios:
        uncapped = stored.get(float(ratio))
        for cap in caps(basis.dim):
            if uncapped is not None and (cap == 0 or cap >= uncapped.kept):
                fit = uncapped
            else:
                fit = fit_ecsq(ratio, z, basis.dim, dataclasses.replace(settings, max_components=cap), sigma)
            err, _ = split_error(fit, basis, x, z, base)
            rows.append({"stream": stream, "group": group, "ratio": float(ratio), "cap": int(cap),
                         "components": fit.kept, "basis_elements": basis.dim * (fit.kept + 1),
                         "rel_error": math.sqrt(err / max(norm, 1e-300))})
    return rows


def cost_db(rows: list[dict], stream: str, ratio: float, cap: int) -> float | None:
    """Error cost (dB, 20 log10 of the relative-error ratio) of `cap` against uncapped, summed over groups."""
    def err(c: int) -> float | None:
        pts = [r["rel_error"] for r in rows if r["stream"] == stream and r["ratio"] == ratio and r["cap"] == c]
        return math.sqrt(sum(e * e for e in pts)) if pts else None

    capped, free = err(cap), err(0)
    return None if capped is None or not free else 20 * math.log10(capped / free)


def chart(rows: list[dict]) -> bytes | None:
    """PNG: held-out relative error (dB) against components held (group 0), one line per ratio, per stream."""
    if not rows:
        return None

    plt, fig, axes = figure(2)
    for ax, stream in zip(axes, STREAMS):
        for ratio in sorted({r["ratio"] for r in rows}):
            pts = sorted((r["components"], r["rel_error"]) for r in rows
                         if r["stream"] == stream and r["group"] == 0 and r["ratio"] == ratio and r["rel_error"] > 0)
            if pts:
                k, e = zip(*pts)
                ax.plot(k, 20 * np.log10(e), "o-", label=f"CR {ratio:g}", markersize=4)
        ax.set_xscale("log")
        ax.set(xlabel="components held (group 0)", ylabel="held-out relative error (dB, 20 log10)",
               title=f"{stream}: error against basis size (ECSQ)")
        if ax.lines:
            ax.legend(fontsize=8)
    return png(plt, fig)
