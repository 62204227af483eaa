"""The pieces test_multinode.py drives on a live two-node cluster, without one: which stores a cluster of several
nodes refuses, how the fold pool moves a lost worker's accumulators, and `--json`'s stdout kept for the summary."""
import subprocess
import sys

import pytest

from kvtc.pipeline.job import ray_pool
from kvtc.pipeline.job.store_reach import check_store_reach, is_node_local


@pytest.mark.parametrize("uri, local", [("/var/kvtc/shards", True), ("relative/shards", True), ("file:///srv/shards", True),
                                        ("s3://bucket/kvtc-cache", False), ("gs://bucket/x", False),
                                        ("simplecache::s3://bucket/x", False)])
def test_a_plain_path_or_file_uri_is_node_local(uri, local):
    assert is_node_local(uri) is local


def test_a_local_store_is_refused_on_several_nodes_unless_declared_shared():
    check_store_reach("/var/kvtc/shards", shared=False, nodes=1)  # one node: its own disk is the store
    check_store_reach("/var/kvtc/shards", shared=True, nodes=4)  # every node mounts it
    check_store_reach("s3://bucket/kvtc-cache", shared=False, nodes=4)
    with pytest.raises(ValueError) as refused:
        check_store_reach("/var/kvtc/shards", shared=False, nodes=3, when="before the reduce")
    message = str(refused.value)
    assert "--store /var/kvtc/shards is a local path" in message and "3 alive nodes before the reduce" in message
    assert "s3://" in message and "--store-shared" in message


def test_a_memory_store_is_refused_on_any_ray_run():
    """memory:// lives in one process: the workers, other processes, would each write to their own."""
    with pytest.raises(ValueError, match="lives in this process's memory"):
        check_store_reach("memory://kvtc/shards", shared=True, nodes=1)


def _workers(n: int, in_flight: int = 2) -> ray_pool._Workers:
    return ray_pool._Workers([f"actor{i}" for i in range(n)], [f"node{i}" for i in range(n)], in_flight)


def test_a_lost_workers_accumulators_move_whole_to_the_live_worker_owning_fewest():
    w = _workers(3)
    assert [w.owner_of(a) for a in range(6)] == [0, 1, 2, 0, 1, 2]
    w.alive.discard(1)  # what `lose` does after killing the actor
    moved = {a: w.owner_of(a) for a in (1, 4)}
    assert set(moved.values()) == {0, 2} and moved[1] != moved[4]  # spread: each live worker took one
    assert [w.owner_of(a) for a in (0, 2, 3, 5)] == [0, 2, 0, 2]  # a live worker keeps what it owns
    w.alive.discard(0)
    assert {w.owner_of(a) for a in range(6)} == {2}


def test_a_routed_payload_waits_for_room_at_its_owner():
    w = _workers(2, in_flight=1)
    w.load[0] = 1
    assert w.slot(0) is None and w.slot(2) is None  # accumulators 0 and 2 belong to a full worker
    assert w.slot(1) == 1 and w.slot(None) == 1
    w.alive.discard(1)
    assert w.slot(None) is None and w.slot(1) is None  # moved to worker 0, which is full


SCRIPT = """
import os, sys
from kvtc.pipeline.json_stdout import stdout_to_stderr
with stdout_to_stderr(sys.argv[1] == "on"):
    print("a Ray error line")
    os.write(1, b"written by C code\\n")
print('{"summary": 1}')
"""


def test_json_keeps_stdout_for_the_summary():
    on = subprocess.run([sys.executable, "-P", "-c", SCRIPT, "on"], capture_output=True, text=True, timeout=60)
    assert on.returncode == 0, on.stderr
    assert on.stdout == '{"summary": 1}\n'
    assert "a Ray error line" in on.stderr and "written by C code" in on.stderr
    off = subprocess.run([sys.executable, "-P", "-c", SCRIPT, "off"], capture_output=True, text=True, timeout=60)
    assert off.stdout.splitlines() == ["a Ray error line", "written by C code", '{"summary": 1}']
