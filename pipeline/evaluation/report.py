"""`kvtc report`: the three diagnostic charts of KVTC.md section 6 and a report.md with the tables.

Charts (PNG, matplotlib Agg): charts/error_by_tokens.png (cross-domain error against calibration
tokens), charts/error_by_position.png (error against context position, every position including
sinks and window), charts/allocation.png (each ratio's bits shared between keys and values; group 0's DP blocks per component, log index).
`build(...)` returns {relative path: bytes} for ArtifactContent.extra_files; it reads only the
rows a calibration stores (metrics, curves, allocations), so it runs in the reduce or on a pulled
artifact. Relative error: ||X - X_hat||_F / ||X||_F over held-out tokens, whole p-vector.
"""
from __future__ import annotations

import json
import math

from kvtc.artifacts.groups import FeatureGroup
from kvtc.artifacts.schema import STREAMS
from kvtc.pipeline.evaluation import basis_size, rate_distortion
from kvtc.pipeline.evaluation.charts import caption, figure, png
from kvtc.workers.objective import recorded_objective

SPLIT_LABELS = {"heldout": "held-out, in-domain", "eval": "eval corpus"}


def _pct(x) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.2f}%"


def _md(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def _with_ci(value: float, ci: list | None) -> str:
    return f"{value:.4f}" if not ci else f"{value:.4f} [{ci[0]:.4f}, {ci[1]:.4f}]"


def quality_table(rows: list[dict]) -> str:
    """Markdown table of `kvtc eval` rows (95% intervals in brackets where the rows carry them)."""
    return _md(["method", "bytes/token", "CR", "keys rel. err", "values rel. err", "ppl ratio", "KL (nats)"],
               [[r["method"], f"{r['bytes_per_token']:.0f}", f"{r['cr']:.2f}", _pct(r["key_rel_error"]),
                 _pct(r["value_rel_error"]), _with_ci(r["ppl_ratio"], r.get("ppl_ratio_ci")),
                 _with_ci(r["kl"], r.get("kl_ci"))] for r in rows])


def needle_table(rows: list[dict]) -> str:
    """Markdown table of the served check's needle rows (kvtc.pipeline.job.served_check.needle_rows)."""
    return _md(["path", "CR", "found", "accuracy [95% interval]", "missed at depths", "answer NLL over raw, nats [95%]"],
               [[r["path"], "-" if r["ratio"] is None else f"{r['ratio']:g}", f"{r['correct']} / {r['samples']}",
                 f"{r['accuracy']:.0%} [{r['ci_low']:.0%}, {r['ci_high']:.0%}]",
                 ", ".join(f"{d:.2f}" for d in r["missed_depths"]) or "-", _gap(r)] for r in rows])


def _gap(row: dict) -> str:
    if row.get("path") == "raw" or row.get("nll_gap") is None:
        return "-"
    if row.get("nll_gap_ci_low") is None:
        return f"{row['nll_gap']:+.3f}"
    return f"{row['nll_gap']:+.3f} [{row['nll_gap_ci_low']:+.3f}, {row['nll_gap_ci_high']:+.3f}]"


def limit_table(rows: list[dict]) -> str:
    """Markdown table of `limit_rows`."""
    return _md(["CR", "stream", "codec rel. err", "Gaussian bound", "gap (dB)"],
               [[f"{r['ratio']:g}", r["stream"], _pct(r["rel_error"]), _pct(r["bound_rel_error"]), f"{r['gap_db']:.2f}"]
                for r in rows])


def limit_rows(metrics: list[dict], split: str = "heldout") -> list[dict]:
    """Per ratio and stream: the codec's calibration error, the Gaussian reverse water-filling bound
    at the same bits (KVTC.md section 7) and the gap 20 log10(error / bound) in dB."""
    got: dict[tuple, dict] = {}
    for m in metrics:
        if m.get("group") is None and m.get("split") == split and m.get("metric") in ("rel_error", "bound_rel_error"):
            got.setdefault((float(m["ratio"]), m["stream"]), {})[m["metric"]] = float(m["value"])
    rows = []
    for (ratio, stream), v in sorted(got.items()):
        if "rel_error" in v and "bound_rel_error" in v:
            gap = 20 * math.log10(v["rel_error"] / v["bound_rel_error"]) if v["bound_rel_error"] > 0 else float("inf")
            rows.append({"ratio": ratio, "stream": stream, "rel_error": v["rel_error"],
                         "bound_rel_error": v["bound_rel_error"], "gap_db": gap})
    return rows


def error_table(metrics: list[dict]) -> str:
    """Stream-level calibration errors per ratio: the codec's default mode first (ECSQ where the ratio
    has its metrics), its eval-corpus error, then fixed-rate beside it, PCA-only (group 0) and the bound."""
    by: dict[tuple, float] = {}
    for m in metrics:
        by[(float(m["ratio"]), m["stream"], m.get("group"), m["split"], m["metric"])] = float(m["value"])
    ratios = sorted({k[0] for k in by})
    rows = []
    for r in ratios:
        for s in STREAMS:
            ecsq = by.get((r, s, None, "heldout", "ecsq_rel_error")) is not None
            first = "ecsq_rel_error" if ecsq else "rel_error"
            rows.append([f"{r:g}", s, "ECSQ" if ecsq else "fixed", _pct(by.get((r, s, None, "heldout", first))),
                         _pct(by.get((r, s, None, "eval", first))),
                         _pct(by.get((r, s, None, "heldout", "rel_error"))),
                         _pct(by.get((r, s, 0, "heldout", "pca_rel_error"))),
                         _pct(by.get((r, s, None, "heldout", "bound_rel_error"))),
                         f"{by.get((r, s, None, 'heldout', 'bits_per_token'), float('nan')):.0f}"])
    return _md(["CR", "stream", "default mode", "held-out", "eval corpus", "fixed-rate held-out", "PCA only (group 0)",
                "Gaussian bound", "fixed-rate bits/token"], rows)


def chart_error_by_tokens(rows: list[dict], ratio: float | None = None, run_tokens: int | None = None,
                          attention: bool = False, published: dict | None = None) -> bytes | None:
    """rows {tokens, stream, split, rel_error} measured at compression ratio `ratio` (tokens: rows that built
    each prefix's basis). With `run_tokens` (every token the calibration ran, held-out shards, sinks and window
    included) the x-axis is tokens run: each prefix at its share of the run's rows, so the whole run's prefix
    ends at `run_tokens`, where `published` {(stream, split): rel_error} marks the published basis (stars).
    None when there are no rows. attention: the artifact's objective is the attention metric, while this
    curve's prefixes are solved without it (the cache's own error)."""
    if not rows:
        return None
    plt, fig, axes = figure(1)
    ax = axes[0]
    built = max(r["tokens"] for r in rows)
    scale = run_tokens / built if run_tokens and built else 1.0
    for stream, color in zip(STREAMS, ("tab:blue", "tab:orange")):
        for split, style in (("heldout", "-o"), ("eval", "--s")):
            pts = sorted((r["tokens"] * scale, r["rel_error"]) for r in rows if r["stream"] == stream
                         and r["split"] == split)
            if pts:
                ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], style, color=color,
                        label=f"{stream}, {SPLIT_LABELS.get(split, split)}")
            err = (published or {}).get((stream, split))
            if run_tokens and err is not None:
                ax.plot([run_tokens], [100 * err], "*", ms=13, color=color, mec="black", mew=0.6,
                        label=f"published basis: {stream}, {SPLIT_LABELS.get(split, split)}")
    right = built * scale
    ax.set_xlim(0, right * 1.04)
    at = f" at CR {ratio:g}" if ratio else ""
    xlabel = (f"calibration tokens run (the whole run: {run_tokens:,}, the published basis)" if run_tokens else
              "calibration tokens (rows that built the basis)")
    ax.set(xlabel=xlabel, ylabel="relative error (%)")
    ax.set_title(f"Error vs calibration tokens{at}" + ("\n(prefixes: unweighted PCA, the cache's own error)"
                                                        if attention else ""), fontsize=10)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7)
    return png(plt, fig)


def published_errors(metrics: list[dict], ratio: float | None) -> dict[tuple[str, str], float]:
    """{(stream, split): rel_error} of the published basis at `ratio` (its fixed-rate held-out and eval errors,
    as the curve's prefixes measure them)."""
    return {(m["stream"], m["split"]): float(m["value"]) for m in metrics if ratio is not None
            and float(m["ratio"]) == float(ratio) and m.get("group") is None and m["metric"] == "rel_error"
            and m["split"] in ("heldout", "eval") and m["stream"] in STREAMS}


def _stream_rows(rows: list[dict], stream: str) -> list[dict]:
    """One group's rows (group 0) of a per-group curve; stream-level when there is one group."""
    return [r for r in rows if r["stream"] == stream and r.get("group", 0) in (0, None)]


def chart_error_by_position(rows: list[dict], pca_rows: list[dict] | None = None, ratio: float | None = None,
                            sinks: int | None = None, window: int | None = None,
                            seq_len: int | None = None, long_rows: list[dict] | None = None) -> bytes | None:
    """rows {stream, group, ratio, lo, hi, rows, rel_error}: one panel per stream, `ratio` (default
    the middle stored ratio) bold, other ratios thin; pca_rows (same schema, optional) dashed; long_rows (same
    schema: one held-out sequence at the longest context the served check could score, through the codec) dotted,
    past the calibration's `seq_len`, which is marked. With sinks, window and seq_len, the positions the codec
    keeps raw in a calibration-length sequence are shaded. None when no rows."""
    if not rows and not long_rows:
        return None
    ratios = sorted({float(r["ratio"]) for r in rows or long_rows})
    ratio = ratios[len(ratios) // 2] if ratio is None else float(ratio)
    plt, fig, axes = figure(2)
    longest = max((int(r["hi"]) for r in long_rows or ()), default=0)
    for ax, stream in zip(axes, STREAMS):
        for source, style, what in ((rows, "-", ""), (pca_rows or [], "--", " PCA only"),
                                    (long_rows or [], ":", f", one {longest:,}-token sequence (own error)")):
            sel = _stream_rows(source, stream)
            for i, r in enumerate(sorted({float(x["ratio"]) for x in sel})):
                pts = sorted((x["lo"], x["hi"], x["rel_error"]) for x in sel if float(x["ratio"]) == r)
                xs = [(lo + hi - 1) / 2 for lo, hi, _ in pts]
                ax.plot(xs, [100 * e for *_, e in pts], style + ("o" if style != ":" else "s"), lw=2 if r == ratio else 0.8,
                        ms=4 if r == ratio else 2, alpha=1 if r == ratio else 0.5, label=f"CR {r:g}{what}",
                        color=f"C{ratios.index(r) % 10}" if r in ratios else None)
        if longest and seq_len:
            ax.axvline(seq_len, color="black", ls="--", lw=0.8, label=f"calibration --seq-len {seq_len}")
        if sinks:
            ax.axvspan(0, sinks - 0.5, color="grey", alpha=0.15, label=f"kept raw: {sinks} sinks")
        if window and seq_len:
            ax.axvspan(seq_len - window - 0.5, seq_len - 1, color="green", alpha=0.1,
                       label=f"kept raw: last {window} (window)")
        ax.set_xscale("symlog", linthresh=1)
        if longest:
            ax.set_xlim(0, longest * 1.1)
        ax.set(xlabel="context position (bucket centre)", ylabel="relative error (%)", title=f"{stream}: error vs position")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=6, framealpha=0.6)
    return png(plt, fig)


def bits_per_component(blocks, amortise: bool = True) -> list[float]:
    """blocks [(start, size, type, bits, scale_bits)] -> bits per component: the block's quantizer bits, with
    its scale's cost spread over its components when `amortise`."""
    kept = max((b[0] + b[1] for b in blocks if b[3]), default=0)
    out = [0.0] * kept
    for start, size, _t, bits, *rest in blocks:
        sb = rest[0] if rest and amortise else 0
        for i in range(start, min(start + size, kept)):
            out[i] = bits + sb / size if bits else 0.0
    return out


def allocation_steps(bits: list[float], features: int | None = None) -> tuple[list[int], list[float]]:
    """Step-plot points of one allocation (`bits_per_component`, 1-based component index): the kept
    components, then 0 bits from the first dropped one to `features` (at least twice the kept)."""
    tail = max(len(bits) + 1, features or 0, 2 * len(bits))
    return [*range(1, len(bits) + 2), tail], [*bits, 0.0, 0.0]


def stream_bits(allocations: dict, split: dict | None = None) -> dict[float, dict[str, tuple[int, int]]]:
    """{ratio: {stream: (bits per token over its groups, the even share: floor(16 p / CR) summed)}}."""
    out: dict[float, dict[str, list[int]]] = {}
    shares = [(b["ratio"], b["stream"], b["bits"], b["own"]) for b in (split or {}).get("bits", [])] or \
        [(r, s, info["budget_bits"], info["budget_bits"]) for (r, s, _), info in sorted(allocations.items())]
    for ratio, stream, bits, own in shares:
        acc = out.setdefault(float(ratio), {}).setdefault(stream, [0, 0])
        acc[0] += int(bits)
        acc[1] += int(own)
    return {r: {s: (a, b) for s, (a, b) in by.items()} for r, by in out.items()}


def chart_allocation(allocations: dict, features: int | None = None, split: dict | None = None) -> bytes | None:
    """Left: each ratio's bits per token as the streams share them (the joint split; a marker at each stream's
    even share, floor(16 p / CR) per basis). Right: group 0's DP allocation per component, keys solid and
    values dashed: each step is one block, drawn at its quantizer's bits (int2 2, int4 4, fp8 8); the block's
    scale is not spread over it, so a one-component block is not a spike. 0 bits past the last kept component,
    to `features` (group 0's p) when given."""
    if not allocations:
        return None
    plt, fig, (left, right_ax) = figure(2)
    shares = stream_bits(allocations, split)
    ratios = sorted(shares)
    width = 0.38
    for j, stream in enumerate(STREAMS):
        xs = [i + (j - 0.5) * width for i in range(len(ratios))]
        got = [shares[r].get(stream, (0, 0))[0] for r in ratios]
        even = [shares[r].get(stream, (0, 0))[1] for r in ratios]
        left.bar(xs, got, width, label=stream)
        left.scatter(xs, even, marker="_", s=300, color="black", zorder=3,
                     label="even share (16 p / CR per basis)" if j == 0 else None)
        for x, g in zip(xs, got):
            left.annotate(f"{g}", (x, g), ha="center", va="bottom", fontsize=7)
    left.set_xticks(range(len(ratios)), [f"CR {r:g}" for r in ratios])
    unit = (split or {}).get("unit")
    left.set(ylabel="bits per token (all groups)", title="bits per token: " + ("joint split" if unit else "even split"))
    left.set_yscale("log")
    left.legend(fontsize=7)
    right = 2
    for (ratio, s, g), info in sorted(allocations.items()):
        if g != 0:
            continue
        bits = bits_per_component(info["blocks"], amortise=False)
        if bits:
            xs, ys = allocation_steps(bits, features)
            color = f"C{ratios.index(float(ratio)) % 10}" if float(ratio) in ratios else None
            right_ax.step(xs, ys, where="post", color=color, linestyle="-" if s == "keys" else "--",
                          label=f"{s} CR {ratio:g} ({len(bits)} kept)")
            right = max(right, xs[-1])
    right_ax.set_xscale("log")
    right_ax.set_xlim(1, right)
    right_ax.set_ylim(bottom=0)
    right_ax.set(xlabel="component index", ylabel="quantizer bits (a step: one DP block)",
                 title="group 0 blocks: keys solid, values dashed")
    right_ax.legend(fontsize=7)
    return png(plt, fig)


def _charts(curves: dict, allocations: dict, cal: dict, curve: dict, features: int | None,
            metrics: list[dict] = ()) -> dict[str, bytes | None]:
    return {
        "charts/error_by_tokens.png": chart_error_by_tokens(curves.get("error_by_tokens", []), curve.get("ratio"),
                                                            cal.get("tokens"), recorded_objective(cal).captures_metric,
                                                            published_errors(list(metrics), curve.get("ratio"))),
        "charts/error_by_position.png": chart_error_by_position(curves.get("error_by_position", []),
                                                                curves.get("error_by_position_pca"),
                                                                sinks=cal.get("sinks"), window=cal.get("window"),
                                                                seq_len=cal.get("seq_len"),
                                                                long_rows=curves.get("error_by_position_long")),
        "charts/allocation.png": chart_allocation(allocations, features, cal.get("bit_split")),
        "charts/rate_distortion.png": rate_distortion.chart(curves.get("rate_distortion", [])),
        "charts/basis_size.png": basis_size.chart(curves.get("basis_size", [])),
    }


def build(metrics: list[dict], curves: dict, allocations: dict, calibration: dict | None = None,
          model: dict | None = None, title: str = "KVTC calibration report", quality: dict | None = None) -> dict[str, bytes]:
    """{"report.md": ..., "charts/*.png": ...} from what a calibration stores. quality: a `kvtc eval` result."""
    files: dict[str, bytes] = {}
    cal = calibration or {}
    curve = cal.get("tokens_curve") or {}
    groups = cal.get("groups") or []
    features = None
    if model and groups:
        features = FeatureGroup.from_json(groups[0]).dim(int(model["num_kv_heads"]), int(model["head_dim"]))
    objective = recorded_objective(cal)
    with caption(objective.caption):
        charts = _charts(curves, allocations, cal, curve, features, metrics)
    md = [f"# {title}", ""]
    if model:
        md.append(f"Model: {model.get('spec')} ({model.get('architecture')}, {model.get('num_layers')} layers, "
                  f"{model.get('num_kv_heads')} KV heads, head_dim {model.get('head_dim')}).")
    if calibration:
        md.append(f"Calibration: {calibration.get('tokens')} tokens, seq_len {calibration.get('seq_len')}, sinks "
                  f"{calibration.get('sinks')}, window {calibration.get('window')}, groups {calibration.get('groups')}.")
    md += ["", objective.error_text(cal), "", "## Reconstruction error", "", error_table(metrics), "",
           "## Gap to the Gaussian reverse water-filling bound", "", limit_table(limit_rows(metrics)), ""]
    for rel, data in charts.items():
        if data is None:
            md += [f"_{rel}: no data stored._", ""]
        else:
            files[rel] = data
            md += [f"![{rel}]({rel})", ""]
    if quality:
        md += ["## Model quality with compressed caches", "",
               f"{quality.get('artifact')} on {quality.get('corpus')}, settings {json.dumps(quality.get('settings'))}; "
               "bytes per middle token, both streams.", "", quality_table(quality["rows"]), ""]
        if quality.get("long"):
            md += [f"At the longest context scored: one held-out sequence, {quality['long']['prefix']} prefix tokens.",
                   "", quality_table(quality["long"]["rows"]), ""]
            if quality["long"].get("needles"):
                md += ["Needles in that window (7-digit values planted at evenly spread depths of its prefix, each "
                       "asked after it; exact match of the greedy answer):", "",
                       needle_table(quality["long"]["needles"]), ""]
    files["report.md"] = "\n".join(md).encode()
    return files


def build_from_artifact(art, quality: dict | None = None) -> dict[str, bytes]:
    """`build` on a pulled Artifact."""
    curves = {name: art.curve(name) for name in art.curves()}
    return build(art.metrics(), curves, art.allocations(), art.manifest.get("calibration"), art.manifest.get("model"),
                 f"KVTC report: {art.name}@{art.version}", quality)
