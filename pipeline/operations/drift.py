"""`kvtc drift`: measure a published artifact on a fresh sample of a corpus and compare with the
held-out errors its manifest recorded.

The sample is captured in-process (no Ray) with the artifact's own capture settings (seq_len,
sinks, window, seed) and excludes the shards the artifact's bases were built from. Relative
error is ||X - X_hat||_F / ||X||_F per (ratio, stream) over the whole p-vector, groups summed,
positions [sinks, seq_len - window), exactly as calibration reports its "heldout" split. A
(ratio, stream) has drifted when its error exceeds the recorded one by more than --threshold
(relative: 0.10 = 10% worse). Explained variance (of the sample's variance around the
calibrated mean, by the kept components) is reported next to the recorded calibration value.

Exit codes: 0 within the threshold, 3 drifted, 4 the model is not the artifact's, 2 other errors (with the
defaults, in the light kvtc.pipeline.operations.drift_settings the command line reads).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvtc import artifacts
from kvtc.artifacts.fingerprint import model_id
from kvtc.pipeline.operations.drift_meter import Meter, sample_rows, total_variances
from kvtc.pipeline.operations.drift_settings import DEFAULT_THRESHOLD, ModelMismatchError, default_tokens
from kvtc.workers import models

IGNORED_FINGERPRINT_KEYS = ("spec", "source", "revision")  # how a model was named, not what it computes


def check_model(fingerprint: dict, expected: dict, what: str) -> None:
    """Raise ModelMismatchError naming the fields where `fingerprint` differs from the artifact's."""
    if model_id(fingerprint) == model_id(expected):
        return
    keys = sorted(set(fingerprint) | set(expected))
    diff = [k for k in keys if fingerprint.get(k) != expected.get(k) and k not in IGNORED_FINGERPRINT_KEYS]
    if diff:
        shown = ", ".join(f"{k}: {expected.get(k)!r} -> {fingerprint.get(k)!r}" for k in diff if k != "rope")
        raise ModelMismatchError(
            f"model {fingerprint.get('spec')!r} is not the model {what} was calibrated for "
            f"({expected.get('spec')!r}); differing fields: {', '.join(diff)}{' (' + shown + ')' if shown else ''}. "
            "Pass the artifact's model (--model), or calibrate a new artifact for this model with `kvtc calibrate`")


@dataclass
class Comparison:
    """One (ratio, stream): recorded vs measured held-out relative error and explained variance."""

    ratio: float
    stream: str
    recorded: float
    measured: float
    change: float
    drifted: bool
    explained_variance: float | None = None
    recorded_explained_variance: float | None = None


@dataclass
class DriftReport:
    artifact: str
    corpus: str
    threshold: float
    rows: int
    tokens: int
    comparisons: list[Comparison] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def drifted(self) -> bool:
        return any(c.drifted for c in self.comparisons)

    @property
    def worst(self) -> Comparison | None:
        return max(self.comparisons, key=lambda c: math.inf if math.isnan(c.change) else c.change, default=None)

    def to_dict(self) -> dict:
        return {"artifact": self.artifact, "corpus": self.corpus, "threshold": self.threshold, "rows": self.rows,
                "tokens": self.tokens, "drifted": self.drifted, "notes": self.notes,
                "comparisons": [vars(c) for c in self.comparisons]}


def recorded_errors(art) -> dict[tuple[float, str], float]:
    """{(ratio, stream): stream-level held-out relative error} from the artifact's metrics table."""
    return {(float(m["ratio"]), m["stream"]): float(m["value"]) for m in art.metrics()
            if m["split"] == "heldout" and m["group"] is None and m["metric"] == "rel_error"}


def recorded_explained(art) -> dict[tuple[float, str], float]:
    """{(ratio, stream): calibration explained variance}, groups weighted by their total variance."""
    tv = total_variances(art)
    acc: dict[tuple[float, str], list[float]] = {}
    for m in art.metrics():
        if m["split"] == "heldout" and m["group"] is not None and m["metric"] == "explained_variance":
            a = acc.setdefault((float(m["ratio"]), m["stream"]), [0.0, 0.0])
            w = tv.get((m["stream"], int(m["group"])), 1.0)
            a[0] += float(m["value"]) * w
            a[1] += w
    return {k: v[0] / v[1] for k, v in acc.items() if v[1] > 0}


def compare(recorded: dict, measured: dict, threshold: float, explained: dict | None = None,
            recorded_ev: dict | None = None) -> list[Comparison]:
    """Every (ratio, stream) in both tables; drifted when measured > recorded * (1 + threshold), and whenever a
    figure is NaN (fails closed: a figure that cannot be compared is never "within the threshold")."""
    out = []
    for key in sorted(set(recorded) & set(measured)):
        rec, mea = recorded[key], measured[key]
        change = mea / rec - 1.0 if rec > 0 else (0.0 if mea <= 0 else float("inf"))
        if math.isnan(rec) or math.isnan(mea):
            change = float("nan")
        out.append(Comparison(key[0], key[1], rec, mea, change, not change <= threshold,
                              (explained or {}).get(key), (recorded_ev or {}).get(key)))
    return out


def nan_notes(comparisons: list[Comparison]) -> list[str]:
    """A note per comparison whose figures are NaN: counted as drifted, never as within the threshold."""
    return [f"CR {c.ratio:g} {c.stream}: {'recorded' if math.isnan(c.recorded) else 'measured'} error is NaN "
            "(a corrupt artifact or sample); counted as drifted: recalibrate, or check the artifact with `kvtc verify`"
            for c in comparisons if math.isnan(c.change)]


def check_drift(target: str, corpus: str | None = None, registry: str | None = None, tokens: int | None = None,
                threshold: float = DEFAULT_THRESHOLD, model: str | None = None, lm=None,
                text_column: str | None = None, cache_dir: str | None = None) -> DriftReport:
    """Pull `target` (NAME[@REF]), load its model (or use `lm`), sample `corpus` and compare."""
    if not threshold >= 0 or threshold == float("inf"):
        raise ValueError(f"--threshold must be >= 0 and finite (a relative increase, 0.10 = 10% worse), got {threshold}")
    if tokens is not None and tokens < 1:
        raise ValueError(f"--tokens must be >= 1, got {tokens}")
    art = artifacts.pull(target, registry=registry)
    manifest = art.manifest
    corpus = corpus or manifest["corpus"]["spec"]
    if lm is None:
        lm = models.load_model(model or manifest["model"]["spec"], cache_dir=cache_dir)
    check_model(lm.fingerprint, manifest["model"], f"{art.name}@{art.version}")
    seq_len = int(manifest["calibration"]["seq_len"])
    tokens = tokens or default_tokens(seq_len)
    meter = Meter(art)
    exclude = set(manifest["corpus"].get("train_shards", []))
    used = 0
    for keys, values, n_tokens in sample_rows(lm, manifest, corpus, tokens, exclude, text_column):
        meter.add("keys", keys)
        meter.add("values", values)
        used += n_tokens
    if meter.rows == 0:
        raise ValueError(f"corpus {corpus!r} has no sequence of {seq_len} tokens outside {art.name}@{art.version}'s "
                         "training shards; pass a corpus with new data (--corpus)")
    measured, explained = meter.stream_errors()
    report = DriftReport(f"{art.name}@{art.version}", corpus, threshold, meter.rows, used)
    report.comparisons = compare(recorded_errors(art), measured, threshold, explained, recorded_explained(art))
    if not report.comparisons:
        raise ValueError(f"{art.name}@{art.version} records no held-out errors to compare with")
    report.notes += nan_notes(report.comparisons)
    if used < tokens:
        report.notes.append(f"the corpus held only {used} new tokens of the {tokens} requested")
    return report
