"""What running the shards returns, on a Ray pool or in this process."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PoolRun:
    """The workers' result dicts in completion order; startup_s: the workers loading the model;
    run_s: the shards, after start-up; workers_lost: workers whose node was lost; rerun: payloads
    that ran again on the workers left."""

    results: list[dict]
    startup_s: float
    run_s: float
    workers_lost: int = 0
    rerun: int = 0
