"""`kvtc recalibrate NAME[@REF]`: recalibrate a published artifact on new data, safely.

1. Load the model (the parent's manifest model unless --model) and refuse another model.
2. Settings default to the parent's (corpus, ratios, seq_len, sinks, window, ...); options override.
3. Nothing to do when the planned shards and settings are exactly the parent's (unless --force),
   or, with --if-drift T, when the parent has not drifted by more than T on the corpus.
4. Run the calibration job: shards already in the shard store are reused, new ones run through
   the model. The new version names its parent and is published without moving any alias.
5. Validate parent and new version on the parent's held-out rows (from the shard store); move
   `latest` (unless it moved meanwhile) and every --alias only when the new version is no worse
   (every ratio/stream error <= parent's * (1 + --tolerance)); otherwise keep it unaliased.

A failure before publishing leaves the registry as it was (versions appear atomically).
Exit codes: 0 promoted or nothing to do, 5 published but kept unaliased (worse than its parent),
4 the model is not the parent's, 2 other errors.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvtc import artifacts
from kvtc.artifacts.calibration import CalibrationRecord
from kvtc.artifacts.errors import InputError
from kvtc.artifacts.fingerprint import model_id
from kvtc.artifacts.names import check_name
from kvtc.pipeline.job.calibrate import run
from kvtc.pipeline.job.heldout_store import load_rows
from kvtc.pipeline.job.store import ShardStore, capture_key, default_store_uri
from kvtc.pipeline.operations.drift import check_drift, check_model
from kvtc.pipeline.operations.drift_meter import measure_rows
from kvtc.pipeline.operations.recalibrate_plan import build_configs, planned_shards, same_run
from kvtc.pipeline.settings import settings_from_manifest
from kvtc.workers import models

# the command line (options, handler, printing) is kvtc.pipeline.commands.recalibrate, which imports this module
# when it runs

EXIT_OK, EXIT_KEPT = 0, 5


@dataclass
class Result:
    status: str  # "up_to_date" | "no_drift" | "promoted" | "kept_unaliased"
    parent: str
    version: str | None = None
    aliases: list[str] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    validation: list[dict] = field(default_factory=list)
    drift: dict | None = None
    summary: dict | None = None
    notes: list[str] = field(default_factory=list)


def heldout_store(manifest: dict, store_root: str | None):
    """The shard store scope (model, capture settings) where the parent's held-out rows live: the capture
    settings its calibration recorded (its KL sensitivity and copy probe among them), not today's defaults."""
    rec = CalibrationRecord.from_manifest(manifest)
    return ShardStore(store_root or default_store_uri(), model_id(manifest["model"]),
                      capture_key(settings_from_manifest(manifest).capture.to_dict(), rec.model_dtype))


def validate(parent, child, store, tolerance: float) -> tuple[list[dict], list[str]]:
    """Both artifacts on the parent's held-out rows -> (comparison rows, reasons the child is worse)."""
    rec = CalibrationRecord.from_manifest(parent.manifest)
    held = load_rows(store, list(parent.manifest["corpus"]["heldout_shards"]), rec.heldout_rows_cap or 1 << 62)
    mid = held.middle(rec.sinks, rec.window)
    old = measure_rows(parent, held.keys[mid], held.values[mid])
    new = measure_rows(child, held.keys[mid], held.values[mid])
    rows, reasons = [], []
    for (ratio, stream), before in sorted(old.items()):
        after = new.get((ratio, stream))
        rows.append({"ratio": ratio, "stream": stream, "parent": before, "new": after})
        if after is None:
            reasons.append(f"CR {ratio:g} is missing from the new version")
        elif after > before * (1.0 + tolerance) + 1e-12:
            reasons.append(f"CR {ratio:g} {stream}: held-out error {100 * after:.3f}% > parent's {100 * before:.3f}%"
                           + (f" (+{100 * tolerance:g}% tolerance)" if tolerance else ""))
    return rows, reasons


def recalibrate(target: str, given: dict, if_drift: float | None = None, drift_tokens: int | None = None,
                aliases: tuple[str, ...] = (), tolerance: float = 0.0, force: bool = False) -> Result:
    if tolerance < 0:
        raise ValueError(f"--tolerance must be >= 0, got {tolerance}")
    aliases = tuple(dict.fromkeys(check_name("alias", a) for a in ("latest", *aliases)))
    registry = artifacts.Registry(given.get("registry"))
    parent = artifacts.pull(target, registry=registry)
    latest = registry.aliases(parent.name).get("latest")
    label = f"{parent.name}@{parent.version}"
    cfg = build_configs(parent.manifest, given, parent.version)[0]
    lm = models.load_model(cfg.model.model, dtype=cfg.model.dtype, cache_dir=cfg.runtime.cache_dir)
    check_model(lm.fingerprint, parent.manifest["model"], label)
    result = Result("up_to_date", label)
    same = None if force else same_run(registry, parent, cfg, planned_shards(cfg, lm.tokenizer, lm.max_positions))
    if same is not None:
        what = "was calibrated" if same == parent.version else f"was already recalibrated as {parent.name}@{same}"
        result.version = None if same == parent.version else same
        result.reasons.append(f"{label} {what} with the same model, settings and shards; nothing to publish")
        return result
    if if_drift is not None:
        report = check_drift(label, cfg.plan.corpus, registry.uri, drift_tokens, if_drift, lm=lm,
                             text_column=cfg.plan.text_column)
        result.drift = report.to_dict()
        if not report.drifted:
            result.status = "no_drift"
            worst = report.worst
            result.reasons.append(f"no drift beyond +{100 * if_drift:g}% (worst {100 * worst.change:+.1f}%, CR "
                                  f"{worst.ratio:g} {worst.stream}); nothing to publish")
            return result
    del lm
    store = heldout_store(parent.manifest, cfg.runtime.store)
    missing = [i for i in parent.manifest["corpus"]["heldout_shards"] if not store.has(i, "rows")]
    if missing:
        raise FileNotFoundError(f"the held-out rows of {label} ({len(missing)} shards, e.g. {missing[0]}) are not in "
                                f"the shard store {store.root}; pass the --store it was calibrated with")
    summary = run(cfg, alias_latest=False)
    result.summary, result.version = summary, summary["version"]
    try:
        child = artifacts.pull(summary["name"], summary["version"], registry=registry)
        result.validation, result.reasons = validate(parent, child, store, tolerance)
        trained = set(parent.manifest["corpus"]["heldout_shards"]) & set(child.manifest["corpus"]["train_shards"])
        if trained:
            result.notes.append(f"{len(trained)} of the parent's held-out shards trained the new version (the corpus "
                                "grew past them); its validation errors are optimistic")
    except (ValueError, LookupError, OSError) as exc:  # bad input stays bad input; a bug propagates as one
        raise InputError(f"{parent.name}@{result.version} was published but validating it failed ({exc}); "
                         "no alias was moved") from exc
    if result.reasons:
        result.status = "kept_unaliased"
        return result
    result.status = "promoted"
    for alias in aliases:
        current = registry.aliases(parent.name).get(alias)
        if alias == "latest" and current != latest:
            result.reasons.append(f"latest moved to {current} during the run; left it there")
            continue
        registry.set_alias(parent.name, alias, result.version)
        result.aliases.append(alias)
    return result
