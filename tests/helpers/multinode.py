"""A Ray cluster of several nodes on this machine, as Ray tests itself (`ray.cluster_utils.Cluster`), an S3
endpoint on loopback (moto's server) standing in for storage every node reaches, and what the multi-node
tests and bench/multinode.py compare: the published files' digests, and the run with a node removed while
its work is in flight (the `kvtc.pipeline.job.fault_hooks` hold)."""
from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

TINY = dict(model="tiny:llama", corpus="pydoc", eval_corpus=None, seq_len=128, window=16, tokens=2048,
            seqs_per_shard=2, heldout_rows=1024, ratios=(4.0, 8.0), served_sequences=0)
NODE_MEMORY = 100 << 20  # each node's object store: the job passes only names and small dicts through it


def start_cluster(head_cpus: int = 1, worker_cpus: int = 2):
    """A head (where the driver runs) and one worker node, without dashboards; -> (cluster, worker node)."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args=dict(num_cpus=head_cpus, object_store_memory=NODE_MEMORY,
                                                                include_dashboard=False))
    return cluster, add_worker(cluster, worker_cpus)


def add_worker(cluster, cpus: int = 2):
    """A worker node joined to `cluster`, alive once this returns."""
    node = cluster.add_node(num_cpus=cpus, object_store_memory=NODE_MEMORY)
    cluster.wait_for_nodes(timeout=120)
    return node


def node_id(node) -> str:
    """Ray's id of a node started by `Cluster.add_node`."""
    return node.node_id


@contextlib.contextmanager
def loopback_s3() -> Iterator[str]:
    """A moto S3 server on loopback, with the credentials and endpoint in this process's environment (set
    before the cluster starts, every node's processes inherit them); yields a fresh bucket's URI."""
    import s3fs
    from moto.server import ThreadedMotoServer

    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION",
                                           "AWS_ENDPOINT_URL")}
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)  # binds a free port itself
    server.start()
    port = server.get_host_and_port()[1]
    try:
        wait_listening(port)
        os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1",
                          AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}")
        yield new_bucket()
    finally:
        server.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        s3fs.S3FileSystem.clear_instance_cache()


def new_bucket() -> str:
    """A fresh bucket on the endpoint in $AWS_ENDPOINT_URL: its URI."""
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()  # an instance cached earlier points at another server
    bucket = f"kvtc-{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem().mkdir(bucket)
    return f"s3://{bucket}"


def wait_listening(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def digests(summary: dict) -> dict[str, str]:
    """sha256 of every published file of the summary's version, from its verified manifest: what it holds,
    without manifest.json itself (the version's id and creation time)."""
    from kvtc import artifacts

    art = artifacts.pull(summary["name"], summary["version"], registry=summary["registry"])
    return {rel: entry["sha256"] for rel, entry in art.manifest["files"].items()}


def run_job(cfg) -> tuple[dict, float]:
    """`kvtc.pipeline.job.calibrate.run(cfg)` on the cluster at cfg's address, joined afresh (the KVTC_*
    environment goes with the job) and left after; -> (summary, wall seconds)."""
    import ray

    from kvtc.pipeline.job.calibrate import run

    ray.shutdown()
    t0 = time.perf_counter()
    try:
        return run(cfg), time.perf_counter() - t0
    finally:
        ray.shutdown()


@dataclass
class Removal:
    """What removing a node cost: when its held work appeared, when the node was gone, the units held."""

    held_at: float | None = None
    removed_at: float | None = None
    held_units: int = 0
    errors: list[str] = field(default_factory=list)


@contextlib.contextmanager
def node_removed_when_held(cluster, node, stage: str, marker: Path, timeout: float = 300.0) -> Iterator[Removal]:
    """While the body runs: `stage`'s work on `node` waits (fault_hooks.HOLD_ENV) and, once some is
    waiting, the node is removed from the cluster. Yields what it cost, filled in as it happens."""
    from kvtc.pipeline.job.fault_hooks import HOLD_ENV

    removal = Removal()
    stop = threading.Event()

    def watch() -> None:
        deadline = time.monotonic() + timeout
        while not marker.exists():
            if stop.wait(0.1) or time.monotonic() > deadline:
                return
        removal.held_at = time.perf_counter()
        time.sleep(0.5)  # the node's other workers reach their hold too
        removal.held_units = len(marker.read_text().splitlines())
        try:
            cluster.remove_node(node)
        except Exception as exc:  # reported by the caller's assertions
            removal.errors.append(f"{type(exc).__name__}: {exc}")
        removal.removed_at = time.perf_counter()

    os.environ[HOLD_ENV] = f"{stage}:{node_id(node)}:{marker}"
    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        yield removal
    finally:
        stop.set()
        thread.join(timeout=120)
        os.environ.pop(HOLD_ENV, None)
