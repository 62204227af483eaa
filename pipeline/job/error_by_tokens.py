"""The error-by-calibration-tokens curve (chart 1) of a finished calibration: calibrate on growing
prefixes of the stored accumulators, in order, and measure each on a sample of the held-out rows
(CURVE_ROWS), e.g. with another allocator setting or for an artifact stored without the curve. The
calibration job computes it in its group tasks instead (`group_task.run_group`: each group's prefix
sums are kept while it sums its accumulators, and solved on its own basis's subspace)."""
from __future__ import annotations

from typing import Callable

from kvtc.pipeline.evaluation.diagnostics import CURVE_ROWS, prefix_errors, prefix_points
from kvtc.pipeline.fit.allocator import AllocatorSettings
from kvtc.pipeline.fit.heldout_rows import HeldOut
from kvtc.pipeline.job.store import ShardStore
from kvtc.workers.stats import CalibrationStats


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


def error_by_tokens(store: ShardStore, accumulators: list[str], heldout: HeldOut, evals: HeldOut | None, ratio: float,
                    sinks: int, window: int, points: int = 4, k: int = 1024,
                    settings: AllocatorSettings | None = None) -> list[dict]:
    """Curve "error_by_tokens" rows {tokens, stream, split, rel_error}: calibrate on growing prefixes
    of the stored accumulators (the manifest's corpus["accumulators"], in order, `prefix_points`)
    and measure each with `prefix_errors`; tokens = rows that built the basis."""
    if not accumulators:
        raise ValueError("error_by_tokens needs at least one accumulator of training statistics")
    heldout = heldout.strided(CURVE_ROWS)  # a chart: measured on a sample, the stored metrics use every row
    evals = None if evals is None else evals.strided(CURVE_ROWS)
    rows: list[dict] = []
    solvers: dict = {}  # one PrefixSolver per stream and group, carried from prefix to prefix
    fold_stats(store, accumulators, checkpoints=prefix_points(len(accumulators), points),
               on_checkpoint=lambda total: rows.extend(prefix_errors(total, heldout, evals, ratio, sinks, window, k,
                                                                     settings, solvers)))
    return rows
