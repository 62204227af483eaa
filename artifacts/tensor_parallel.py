"""Tensor-parallel KV-head layout: which KV heads each rank holds when a serving engine shards the
model at TP size N, the way vLLM and SGLang do it (`QKVParallelLinear`):

- kv_heads >= N: N must divide kv_heads; rank r holds the contiguous heads [r * kv_heads / N, (r + 1) * kv_heads / N);
- kv_heads < N: kv_heads must divide N; every head is replicated on N / kv_heads consecutive ranks,
  rank r holds head r // (N / kv_heads).

Both engines also split the query heads evenly (attention heads % N == 0). Ranks holding the same
head range share one basis: an artifact stores each distinct range once (its "shards", in head
order) and maps every rank to its shard.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from kvtc.artifacts.groups import FeatureGroup


@dataclass(frozen=True)
class TensorParallelLayout:
    """tp: ranks; kv_heads: the model's KV heads; attention_heads: its query heads (0: not checked)."""

    tp: int
    kv_heads: int
    attention_heads: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.tp, int) or self.tp < 1:
            raise ValueError(f"--tp must be an integer >= 1, got {self.tp!r}")
        if self.kv_heads < 1:
            raise ValueError(f"the model has {self.kv_heads} KV heads; tensor-parallel bases need at least one")
        n, h = self.tp, self.kv_heads
        if (h >= n and h % n) or (h < n and n % h):
            fits = sorted({d for d in range(1, h + 1) if h % d == 0} | {h * m for m in (2, 4, 8)})
            raise ValueError(f"--tp {n} does not shard {h} KV heads the way vLLM and SGLang do (the TP size must "
                             f"divide the KV heads, or the KV heads the TP size); use one of {fits}")
        if self.attention_heads and self.attention_heads % n:
            raise ValueError(f"--tp {n} does not divide the model's {self.attention_heads} attention heads; "
                             "vLLM and SGLang need attention heads % TP size == 0")

    @property
    def replicas(self) -> int:
        """Ranks that hold each KV head (1 unless tp > kv_heads)."""
        return max(1, self.tp // self.kv_heads)

    @property
    def shards(self) -> list[tuple[int, int]]:
        """Distinct head ranges [h0, h1), in head order: one basis each."""
        per = max(1, self.kv_heads // self.tp)
        return [(h, h + per) for h in range(0, self.kv_heads, per)]

    def shard_of(self, rank: int) -> int:
        """Index into `shards` of the head range rank `rank` holds."""
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < self.tp:
            raise ValueError(f"rank must be an integer in [0, {self.tp}) for TP size {self.tp}, got {rank!r}")
        return rank // self.replicas if self.tp > self.kv_heads else rank

    def heads(self, rank: int) -> tuple[int, int]:
        """[h0, h1): the KV heads rank `rank` holds."""
        return self.shards[self.shard_of(rank)]

    def rank_groups(self, rank: int, groups: Sequence[FeatureGroup]) -> list[int]:
        """Indices of the groups (bases) rank `rank` codes: those over exactly its KV heads."""
        heads = self.heads(rank)
        return [i for i, g in enumerate(groups) if g.head_range(self.kv_heads) == heads]

    def to_dict(self, groups: Sequence[FeatureGroup] | None = None) -> dict[str, Any]:
        """The manifest's "tensor_parallel" section; with the calibration's `groups`, each rank lists
        the indices of its groups."""
        ranks = [{"rank": r, "heads": list(self.heads(r)), "shard": self.shard_of(r)} for r in range(self.tp)]
        if groups is not None:
            for r in ranks:
                r["groups"] = self.rank_groups(r["rank"], groups)
        return {"tp": self.tp, "kv_heads": self.kv_heads, "attention_heads": self.attention_heads,
                "replicas": self.replicas, "shards": [list(s) for s in self.shards], "ranks": ranks}

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None, groups: Sequence[FeatureGroup] | None = None
                  ) -> "TensorParallelLayout | None":
        """None for artifacts without the section (single-rank); a section that disagrees with the
        sharding rule (or, given the calibration's `groups`, with them) is refused."""
        if not d:
            return None
        try:
            layout = cls(int(d["tp"]), int(d["kv_heads"]), int(d.get("attention_heads") or 0))
            ranks = list(d.get("ranks") or [])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"the manifest's tensor_parallel section is malformed ({exc})") from None
        want = layout.to_dict(groups)["ranks"]
        keys = ("rank", "heads", "shard") if groups is None else ("rank", "heads", "shard", "groups")
        if ranks and [{k: r.get(k) for k in keys} for r in ranks] != [{k: r[k] for k in keys} for r in want]:
            raise ValueError(f"the manifest's tensor_parallel ranks do not follow the engines' sharding at TP "
                             f"{layout.tp} over {layout.kv_heads} KV heads (or not the calibration's groups)")
        if groups is not None and any(not r["groups"] for r in want):
            raise ValueError(f"the calibration's groups do not cover every rank's KV heads at TP {layout.tp}")
        return layout
