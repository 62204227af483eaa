"""The error-by-calibration-tokens curve of a finished calibration, from its shard store (the
calibration job computes the same rows while it folds; this recomputes them, e.g. with another
allocator setting or for an artifact stored without the curve)."""
from __future__ import annotations

from kvtc.pipeline.evaluation.diagnostics import prefix_errors, prefix_points
from kvtc.pipeline.fit.allocator import AllocatorSettings
from kvtc.pipeline.job.reduce import HeldOut, fold_stats
from kvtc.pipeline.job.store import ShardStore


def error_by_tokens(store: ShardStore, accumulators: list[str], heldout: HeldOut, evals: HeldOut | None, ratio: float,
                    sinks: int, window: int, points: int = 4, k: int = 1024,
                    settings: AllocatorSettings | None = None) -> list[dict]:
    """Curve "error_by_tokens" rows {tokens, stream, split, rel_error}: calibrate on growing prefixes
    of the stored accumulators (the manifest's corpus["accumulators"], in order, `prefix_points`)
    and measure each with `prefix_errors`; tokens = rows that built the basis."""
    if not accumulators:
        raise ValueError("error_by_tokens needs at least one accumulator of training statistics")
    rows: list[dict] = []
    fold_stats(store, accumulators, checkpoints=prefix_points(len(accumulators), points),
               on_checkpoint=lambda total: rows.extend(prefix_errors(total, heldout, evals, ratio, sinks, window, k, settings)))
    return rows
