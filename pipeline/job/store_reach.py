"""Whether every node of the job's Ray cluster reaches the shard store.

Shard workers write accumulators and held-out rows to the store and the reduce's group tasks read
them back on whatever node they run. A store given as a plain path (fsspec protocol "file") is a
different directory on every node unless all of them mount it: on a cluster of more than one node
such a store is refused unless declared shared (`--store-shared`).
"""
from __future__ import annotations

from fsspec.core import split_protocol

from kvtc.pipeline.checks.words import PROCESS_PROTOCOLS, check_uri

LOCAL_PROTOCOLS = (None, "file", "local")


def is_node_local(store_root: str) -> bool:
    """True for a plain path or a file:// URI (a node's own disk), False for any other fsspec URI; in a chained
    URI (`simplecache::s3://...`) the last one is where the objects live."""
    return split_protocol(store_root.split("::")[-1])[0] in LOCAL_PROTOCOLS


def alive_nodes() -> int:
    """Alive nodes of the Ray cluster this process has joined."""
    import ray  # noqa: PLC0415 - only on a Ray run; the job imports this module in-process too

    return sum(1 for node in ray.nodes() if node.get("Alive"))


def check_store_reach(store_root: str, shared: bool, nodes: int, when: str = "") -> None:
    """Refuse a node-local store (a plain path, not declared `shared`) on a cluster of `nodes` > 1.
    `when`: what the job is about to do, for the message (e.g. "before the reduce")."""
    at = f" {when}" if when else ""
    if split_protocol(store_root.split("::")[-1])[0] in PROCESS_PROTOCOLS:  # the command line refused it (check_uri)
        check_uri("--store", store_root, starts_ray=True)  # a job started from Python: the same rule, named the same
    if nodes <= 1 or shared or not is_node_local(store_root):
        return
    raise ValueError(
        f"--store {store_root} is a local path, and the Ray cluster has {nodes} alive nodes{at}: each node would "
        "write its shard statistics to its own disk and the reduce would not find them. Pass --store an fsspec URI "
        "every node reaches (e.g. s3://bucket/kvtc-cache), or, if every node mounts this path (NFS, a shared "
        "volume), say so with --store-shared")
