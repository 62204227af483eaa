"""The job on a Ray cluster of two nodes, on this machine as Ray tests itself (`ray.cluster_utils.Cluster`): a store
that is a local path is refused before any model work unless declared shared; with a store every node reaches
(an S3 endpoint on loopback) the artifact is the one-node run's, file for file; and a node removed while its fold
or reduce work is in flight costs a rerun on the node left, never a different or partial artifact."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray

from helpers import multinode as mn
from kvtc.pipeline.settings import JobSettings

pytestmark = pytest.mark.live

BIN = Path(sys.executable).parent


class TwoNodes:
    """The module's cluster: its head (where the driver runs) and, when present, its worker node."""

    def __init__(self) -> None:
        self.cluster, self.worker = mn.start_cluster()

    @property
    def address(self) -> str:
        return self.cluster.address

    def with_worker(self):
        """The worker node, added again when a test removed it."""
        if self.worker is None or self.worker not in self.cluster.worker_nodes:
            self.worker = mn.add_worker(self.cluster)
        return self.worker

    def without_worker(self) -> None:
        if self.worker is not None and self.worker in self.cluster.worker_nodes:
            self.cluster.remove_node(self.worker)
        self.worker = None


@pytest.fixture(scope="module")
def nodes(s3_endpoint, tmp_path_factory):
    """Two nodes started with the S3 endpoint and its credentials in their environment (every node reaches it)."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("AWS_ENDPOINT_URL", s3_endpoint)
        env.setenv("KVTC_CACHE", str(tmp_path_factory.mktemp("kvtc-cache")))
        ray.shutdown()
        two = TwoNodes()
        try:
            yield two
        finally:
            ray.shutdown()
            two.cluster.shutdown()


@pytest.fixture(scope="module")
def reference(nodes):
    """The untampered two-node run, store and registry on S3: (settings, summary, published digests)."""
    nodes.with_worker()
    bucket = mn.new_bucket()
    cfg = JobSettings.of(**mn.TINY, workers=2, address=nodes.address, name="tiny", store=f"{bucket}/store",
                         registry=f"{bucket}/reg")  # two workers: one on each node
    summary, _ = mn.run_job(cfg)
    return cfg, summary, mn.digests(summary)


def test_local_store_on_two_nodes_is_refused_before_model_work(nodes, tmp_path):
    nodes.with_worker()
    store = tmp_path / "store"
    cfg = JobSettings.of(**mn.TINY, address=nodes.address, store=str(store), registry=str(tmp_path / "reg"))
    t0 = time.perf_counter()
    with pytest.raises(ValueError) as refused:
        mn.run_job(cfg)
    message = str(refused.value)
    assert f"--store {store} is a local path" in message and "2 alive nodes" in message
    assert "s3://" in message and "--store-shared" in message
    assert not store.exists(), "the refused job wrote to the store"
    assert time.perf_counter() - t0 < 60


def test_cli_two_nodes_store_shared_node_lost_mid_fold(nodes, reference, tmp_path):
    """`kvtc calibrate --json` on two nodes, a local store declared shared (every node of this machine mounts
    it): the worker node is removed while its shards are folded; stdout stays one JSON document and the
    artifact is the untampered run's."""
    worker = nodes.with_worker()
    t = mn.TINY
    cmd = [str(BIN / "kvtc"), "calibrate", "--address", nodes.address, "--model", t["model"], "--corpus", t["corpus"],
           "--eval-corpus", "none", "--seq-len", str(t["seq_len"]), "--window", str(t["window"]), "--tokens",
           str(t["tokens"]), "--seqs-per-shard", str(t["seqs_per_shard"]), "--heldout-rows", str(t["heldout_rows"]),
           "--ratios", "4,8", "--served-sequences", "0", "--workers", "2", "--name", "tiny", "--store", str(tmp_path / "store"),
           "--store-shared", "--registry", str(tmp_path / "reg"), "--json"]
    with mn.node_removed_when_held(nodes.cluster, worker, "fold", tmp_path / "held") as removal:
        out = subprocess.run(cmd, env=dict(os.environ), cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    summary = _one_document(out.stdout)
    assert removal.held_units >= 1 and removal.removed_at is not None and not removal.errors, removal
    assert summary["run"]["workers_lost"] >= 1 and summary["run"]["shards_rerun"] >= 1, summary["run"]
    assert "worker(s) lost with their node" in out.stderr
    assert mn.digests(summary) == reference[2]


def _one_document(stdout: str) -> dict:
    """stdout parsed as exactly one JSON document (anything else on stdout fails, naming it)."""
    try:
        return json.loads(stdout)
    except json.JSONDecodeError as exc:
        raise AssertionError(f"stdout is not one JSON document ({exc}): ...{stdout[max(0, exc.pos - 300):exc.pos + 500]}")


def test_one_node_artifact_equals_two_node_artifact(nodes, reference):
    cfg, summary, digests = reference
    nodes.without_worker()
    bucket = mn.new_bucket()
    one, _ = mn.run_job(cfg.replace(workers=None, store=f"{bucket}/store", registry=f"{bucket}/reg"))
    assert summary["run"]["workers"] == 2 and one["run"]["workers"] == 1
    assert mn.digests(one) == digests
    assert one["version"] != summary["version"]


def test_node_lost_mid_reduce_reruns_its_group_on_the_node_left(nodes, reference, tmp_path):
    """The reference run's store (its shards all folded), a fresh registry: only the reduce runs, and the worker
    node goes while a group task waits there; Ray runs that task again on the head."""
    cfg, _, digests = reference
    worker = nodes.with_worker()
    registry = f"{mn.new_bucket()}/reg"
    with mn.node_removed_when_held(nodes.cluster, worker, "reduce", tmp_path / "held") as removal:
        summary, _ = mn.run_job(cfg.replace(registry=registry))
    assert removal.held_units >= 1 and removal.removed_at is not None and not removal.errors, removal
    assert summary["run"]["shards_run"] == 0  # the fold was cached: the node went mid-reduce
    assert mn.digests(summary) == digests
    from kvtc import artifacts

    assert artifacts.Registry(registry).versions("tiny") == [summary["version"]]  # one complete version
