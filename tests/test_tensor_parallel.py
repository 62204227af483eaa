"""Tensor-parallel ranks: the KV heads each rank holds (vLLM / SGLang QKVParallelLinear), bad TP sizes,
per-rank bases calibrated on an 8-KV-head geometry and each rank's codec on its local cache."""
from __future__ import annotations

import pytest

from kvtc.artifacts.tensor_parallel import TensorParallelLayout


@pytest.mark.parametrize("tp, heads, shards", [
    (1, [(0, 8)], [(0, 8)]),
    (2, [(0, 4), (4, 8)], [(0, 4), (4, 8)]),
    (4, [(0, 2), (2, 4), (4, 6), (6, 8)], [(0, 2), (2, 4), (4, 6), (6, 8)]),
    (8, [(h, h + 1) for h in range(8)], [(h, h + 1) for h in range(8)]),
    (16, [(r // 2, r // 2 + 1) for r in range(16)], [(h, h + 1) for h in range(8)]),  # each head on 2 ranks
])
def test_ranks_hold_the_heads_the_engines_give_them(tp, heads, shards):
    layout = TensorParallelLayout(tp, 8, 32)
    assert [layout.heads(r) for r in range(tp)] == heads
    assert layout.shards == shards
    assert layout.replicas == max(1, tp // 8)
    assert TensorParallelLayout.from_dict(layout.to_dict()) == layout


def test_replicated_heads_map_consecutive_ranks_to_one_shard():
    layout = TensorParallelLayout(16, 8)
    assert [layout.shard_of(r) for r in range(16)] == [r // 2 for r in range(16)]
    assert TensorParallelLayout(6, 2).shards == [(0, 1), (1, 2)]
    assert [TensorParallelLayout(6, 2).shard_of(r) for r in range(6)] == [0, 0, 0, 1, 1, 1]


@pytest.mark.parametrize("tp, kv, attn, message", [
    (3, 8, 0, "--tp 3 does not shard 8 KV heads"),
    (12, 8, 0, "--tp 12 does not shard 8 KV heads"),
    (6, 4, 0, "--tp 6 does not shard 4 KV heads"),
    (0, 8, 0, "--tp must be an integer >= 1"),
    (4, 8, 6, "does not divide the model's 6 attention heads"),
])
def test_tp_sizes_the_engines_refuse_are_refused(tp, kv, attn, message):
    with pytest.raises(ValueError, match=message):
        TensorParallelLayout(tp, kv, attn)


def test_a_rank_outside_the_layout_and_a_forged_rank_table_are_refused():
    layout = TensorParallelLayout(4, 8)
    with pytest.raises(ValueError, match=r"rank must be an integer in \[0, 4\)"):
        layout.heads(4)
    forged = layout.to_dict()
    forged["ranks"][1]["heads"] = [0, 2]
    with pytest.raises(ValueError, match="do not follow the engines' sharding"):
        TensorParallelLayout.from_dict(forged)
