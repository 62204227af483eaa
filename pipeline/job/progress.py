"""Progress on the console: the fold's shards (`ShardProgress`: shards done of those expected, tokens
per second, an ETA) and the reduce's groups (`ReduceProgress`: groups done of groups planned, what
runs, and an ETA).

On a terminal a tqdm bar (its postfix names the running groups); elsewhere (`ray job submit` logs,
files) one line per group started and finished, with the time left estimated from the groups done,
each weighted by p^3 (the solve dominates). Notes (a task killed for memory) are one line either way.
"""
from __future__ import annotations

import sys
import time
from typing import Callable

from tqdm import tqdm


def _clock(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


class ReduceProgress:
    """Progress of `names` (one per group task, p features each), reported to `stream`."""

    def __init__(self, names: list[str], ps: list[int], stream=None, bar: bool | None = None) -> None:
        self.names, self.stream = names, stream or sys.stderr
        self.weights = [float(p) ** 3 for p in ps]
        self.t0 = time.perf_counter()
        self.begun: dict[int, float] = {}
        self.finished: set[int] = set()
        self.most_at_once = 0  # the most tasks that ran side by side
        self.kills = 0  # tasks the node killed for memory
        self.bar = None
        interactive = bar if bar is not None else getattr(self.stream, "isatty", lambda: False)()
        if interactive and names:
            self.bar = tqdm(total=len(names), unit="group", desc="reduce", dynamic_ncols=True, file=self.stream)

    def eta(self) -> float | None:
        """Seconds left, from the weight done per second so far (None before the first group ends)."""
        done = sum(self.weights[i] for i in self.finished)
        if not done:
            return None
        left = sum(w for i, w in enumerate(self.weights) if i not in self.finished)
        return (time.perf_counter() - self.t0) * left / done

    def _line(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(f"reduce: {text}", file=self.stream)
        else:
            print(f"reduce: {text}", file=self.stream, flush=True)

    def _running(self) -> str:
        return ", ".join(self.names[i] for i in self.begun if i not in self.finished)

    def started(self, i: int) -> None:
        self.begun[i] = time.perf_counter()
        self.finished.discard(i)
        self.most_at_once = max(self.most_at_once, sum(j not in self.finished for j in self.begun))
        if self.bar is not None:
            self.bar.set_postfix_str(self._running(), refresh=True)
        else:
            self._line(f"{self.names[i]} started ({len(self.finished)}/{len(self.names)} done; running: {self._running()})")

    def done(self, i: int) -> None:
        self.finished.add(i)
        took = time.perf_counter() - self.begun.get(i, self.t0)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(self._running(), refresh=True)
            return
        eta = self.eta()
        left = "" if eta is None or len(self.finished) == len(self.names) else f", about {_clock(eta)} left"
        self._line(f"{len(self.finished)}/{len(self.names)} groups done ({self.names[i]} in {_clock(took)}){left}")

    def resumed(self, i: int) -> None:
        """Task i's result was already in the store (a stopped job resumed): done, not run."""
        self.finished.add(i)
        self.weights[i] = 0.0  # took no time: the ETA counts only what runs
        if self.bar is not None:
            self.bar.update(1)
        else:
            self._line(f"{self.names[i]}: resumed from its stored result ({len(self.finished)}/{len(self.names)} done)")

    def killed(self, i: int, text: str) -> None:
        """Task i was killed (it will start again): one line."""
        self.kills += 1
        self.begun.pop(i, None)
        self._line(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class ShardProgress:
    """The fold's progress: shards done of the shards expected (`total()`, read after each shard: cached
    shards lower it as the plan finds them), tokens and tokens per second; tqdm's ETA from them."""

    def __init__(self, total: Callable[[], int] | None = None) -> None:
        self.total, self.tokens, self.start = total, 0, time.perf_counter()
        self.bar = tqdm(total=total() if total else None, unit="shard", desc="calibrate", dynamic_ncols=True)

    def advance(self, result: dict) -> None:
        self.tokens += int(result.get("tokens_run", 0))
        if self.total is not None:
            self.bar.total = max(self.total(), self.bar.n + 1)
        self.bar.update(1)
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix(tokens=self.tokens, tok_s=f"{self.tokens / elapsed:.0f}", refresh=False)

    def close(self, finished: bool = False) -> None:
        """finished: every shard ran (the corpus ran out early, or shards were cached): the bar ends full."""
        if finished and self.bar.total != self.bar.n:
            self.bar.total = self.bar.n
            self.bar.refresh()
        self.bar.close()

    def __enter__(self) -> "ShardProgress":
        return self

    def __exit__(self, *exc) -> None:
        self.close(finished=exc[0] is None)
