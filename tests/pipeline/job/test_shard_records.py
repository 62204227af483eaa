"""The fold's typed seams: a planned shard and a worker's result, which crosses processes as a plain dict."""
import pytest

from kvtc.pipeline.job.shard_records import ShardEntry, ShardResult


def test_a_result_crosses_as_plain_numbers_and_strings_and_comes_back_equal():
    result = ShardResult("abc", 3, "train", 4096, 4096, 1 << 20, 1.5, capture_s=1.0, fold_s=0.25, checkpoint_s=0.25)
    wire = result.to_dict()
    assert all(isinstance(v, (str, int, float, bool)) for v in wire.values())
    assert ShardResult.from_dict(wire) == result


def test_a_result_from_other_code_and_a_bad_role_are_refused_by_name():
    with pytest.raises(ValueError, match=r"unknown fields \['gpu_s'\]"):
        ShardResult.from_dict({**ShardResult("a", 0, "eval", 1, 1, 1, 0.1).to_dict(), "gpu_s": 1.0})
    with pytest.raises(ValueError, match="role is one of"):
        ShardEntry("a", 0, "validation", 128)
    entry = ShardEntry("a", 0, "heldout", 128)
    entry.cached = True  # the planner sets it once it has looked in the store
    assert entry.cached
