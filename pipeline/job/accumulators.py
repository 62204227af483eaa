"""Training statistics in a fixed number of accumulators, so the store does not grow with the shards.

Accumulator a owns the training shards whose stream index i has i % count == a, and folds them in
index order, one running total per accumulator. Its stored object (`ShardStore.put_acc`) is the
total plus the ids folded into it, rewritten after every shard, and named by the accumulator and
the id of its first shard: the same corpus extended with more tokens finds the object and folds
only the new shards; another corpus or seed gets other objects. The artifact sums the totals in
accumulator order, so it is bit-identical for any number of workers, and a killed worker's
restarted actor resumes from the last checkpoint (a shard already listed is skipped).

A stored total that is not a prefix of this run's shard list (a shorter run of the same corpus)
cannot have shards taken out: it is moved aside (``.stale``) before any of its shards is
submitted, and its shards are rerun into a fresh total. A task never resets a stored total, so a
retried task (a killed worker) can only find its shard already folded, never undo later shards.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvtc.pipeline.job.store import ShardStore


@dataclass(frozen=True)
class AccumulatorPlan:
    """`count` accumulators; the store holds count running totals per stream and group."""

    count: int = 4

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ValueError(f"--accumulators must be >= 1, got {self.count}")

    def owner(self, shard_index: int) -> int:
        return shard_index % self.count

    def name(self, accumulator: int, first_shard_id: str) -> str:
        return f"{self.count}-{accumulator}-{first_shard_id}"


@dataclass
class _Accumulator:
    index: int
    name: str
    stored: list[str]
    planned: list[str] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)  # payloads of stored shards, rerun on divergence
    diverged: bool = False


class FoldPlanner:
    """Turns training shards, in stream order, into fold tasks: {"shard", "role": "train",
    "acc", "acc_index", "after" (the shard folded just before in that accumulator, or None), "probe" (the first
    training shard: it also measures the copy probe, kvtc.workers.capture_settings.CaptureSettings.copy_probe)}.
    Shards already in a stored total yield no task."""

    def __init__(self, plan: AccumulatorPlan, store: ShardStore) -> None:
        self.plan, self.store = plan, store
        self._accs: dict[int, _Accumulator] = {}

    def _task(self, acc: _Accumulator, payload: dict, position: int) -> dict:
        after = acc.planned[position - 1] if position else None
        return {**payload, "role": "train", "acc": acc.name, "acc_index": acc.index, "after": after,
                "probe": acc.index == 0 and position == 0}  # the first training shard: the job's copy probe

    def _rerun(self, acc: _Accumulator) -> list[dict]:
        acc.diverged = True
        self.store.set_aside(acc.name, "stale")  # no task of this accumulator was submitted yet
        tasks = [self._task(acc, p, i) for i, p in enumerate(acc.skipped)]
        acc.skipped = []
        return tasks

    def add(self, index: int, shard_id: str, payload: dict) -> list[dict]:
        """Tasks to run for training shard `shard_id` at stream `index` (payload: {"shard": ...})."""
        a = self.plan.owner(index)
        acc = self._accs.get(a)
        if acc is None:
            name = self.plan.name(a, shard_id)
            acc = self._accs[a] = _Accumulator(a, name, self.store.acc_shards(name) or [])
        position = len(acc.planned)
        acc.planned.append(shard_id)
        if not acc.diverged and position < len(acc.stored):
            if acc.stored[position] == shard_id:
                acc.skipped.append(payload)
                return []
            return self._rerun_with(acc, payload)
        return [self._task(acc, payload, position)]

    def _rerun_with(self, acc: _Accumulator, payload: dict) -> list[dict]:
        tasks = self._rerun(acc)
        return tasks + [self._task(acc, payload, len(acc.planned) - 1)]

    def finish(self) -> list[dict]:
        """Tasks for accumulators whose stored total holds shards this run does not have."""
        tasks: list[dict] = []
        for a in sorted(self._accs):
            acc = self._accs[a]
            if not acc.diverged and len(acc.stored) > len(acc.planned):
                tasks += self._rerun(acc)
        return tasks

    @property
    def cached(self) -> int:
        """Training shards found already folded in a stored total (and kept)."""
        return sum(len(acc.skipped) for acc in self._accs.values())

    def accumulators(self) -> list[tuple[str, list[str]]]:
        """(object name, shard ids in fold order) of every accumulator this run uses, in accumulator order."""
        return [(self._accs[a].name, list(self._accs[a].planned)) for a in sorted(self._accs)]
