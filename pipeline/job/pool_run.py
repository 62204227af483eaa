"""What running the shards returns, on a Ray pool or in this process."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PoolRun:
    """The workers' result dicts in completion order; startup_s: the workers loading the model;
    run_s: the shards, after start-up."""

    results: list[dict]
    startup_s: float
    run_s: float
