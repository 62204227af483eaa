"""What the fold knows of each shard: the driver's `ShardEntry` (planned, maybe cached) and a worker's
`ShardResult` (what running it did). A result crosses from the worker as a plain dict of numbers and
strings (`to_dict`, `from_dict`), never as a pickled object."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

ROLES = ("train", "heldout", "eval")


def _check_role(role: str) -> None:
    if role not in ROLES:
        raise ValueError(f"a shard's role is one of {ROLES}, got {role!r}")


@dataclass
class ShardEntry:
    """A shard the fold planned: its id, index in the corpus stream, role, tokens, and whether the store
    already held its result (set once the planner has looked)."""

    id: str
    index: int
    role: str
    tokens: int
    cached: bool = False

    def __post_init__(self) -> None:
        _check_role(self.role)


@dataclass(frozen=True)
class ShardResult:
    """One shard run by a worker: tokens run, rows folded (train) or stored (held-out, eval), bytes written,
    seconds; a training shard also its capture, fold and checkpoint seconds; where it ran (node, GPU ids,
    torch device). skipped: the shard's accumulator was already complete, nothing ran."""

    shard_id: str
    index: int
    role: str
    tokens_run: int
    rows: int
    bytes: int
    seconds: float
    skipped: bool = False
    capture_s: float = 0.0
    fold_s: float = 0.0
    checkpoint_s: float = 0.0
    node: str = ""  # the Ray node the worker ran on ("" in-process)
    gpus: str = ""  # the GPU ids Ray gave the worker, comma separated
    device: str = ""  # where torch ran it (cuda:0, or cpu where no CUDA is present, whatever Ray's GPU ids)

    def __post_init__(self) -> None:
        _check_role(self.role)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "ShardResult":
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"a shard result carries unknown fields {unknown}: the worker runs other code than the driver")
        return cls(**data)
