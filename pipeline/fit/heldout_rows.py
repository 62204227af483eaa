"""Held-out rows: whole held-out shards never folded into the statistics, captured at every position.

`HeldOut` holds one split for every feature (both streams); `GroupRows` is what one stream and group's
fit and measurement need: its columns of the held-out rows at every position, and of the second
domain's middle rows. The DP error tables, the ECSQ fit and the in-domain metrics use the middle
positions [sinks, seq_len - window); the error-by-position curve uses all of them.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class HeldOut:
    """Rows of one split: keys, values (N, p) float32; positions (N,) int64; seq_len of their shards."""

    keys: np.ndarray
    values: np.ndarray
    positions: np.ndarray
    seq_len: int

    def middle(self, sinks: int, window: int) -> np.ndarray:
        return (self.positions >= sinks) & (self.positions < self.seq_len - window)

    def strided(self, rows: int) -> "HeldOut":
        """At most `rows` of the rows, evenly strided (positions kept): a chart's sample."""
        step = max(1, -(-len(self.positions) // rows))
        if step == 1:
            return self
        return HeldOut(self.keys[::step], self.values[::step], self.positions[::step], self.seq_len)

    def group(self, stream: str, cols: slice | np.ndarray, evals: "HeldOut | None", sinks: int,
              window: int) -> "GroupRows":
        """One stream and group's columns of this split, and of `evals`' middle rows."""
        ev = None if evals is None else np.ascontiguousarray(getattr(evals, stream)[evals.middle(sinks, window)][:, cols])
        return GroupRows(np.ascontiguousarray(getattr(self, stream)[:, cols]), self.positions, self.seq_len, ev)


@dataclass
class GroupRows:
    """One stream and group's held-out rows: rows (N, p) float32 at every position, their positions
    (N,) and seq_len; evals (M, p) float32, the second domain's middle rows (None without one)."""

    rows: np.ndarray
    positions: np.ndarray
    seq_len: int
    evals: np.ndarray | None = None

    def middle(self, sinks: int, window: int) -> np.ndarray:
        return (self.positions >= sinks) & (self.positions < self.seq_len - window)

    def arrays(self) -> dict[str, np.ndarray]:
        """For the shard store (checksummed arrays, no pickle)."""
        out = {"rows": self.rows, "positions": self.positions.astype(np.int64)}
        if self.evals is not None:
            out["evals"] = self.evals
        return out

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray], seq_len: int) -> "GroupRows":
        return cls(arrays["rows"], arrays["positions"], int(seq_len), arrays.get("evals"))
