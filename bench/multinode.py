"""The job on two Ray nodes against one node, and what losing a node costs (issue 46), on this machine as Ray
tests itself: `ray.cluster_utils.Cluster` (a head of 1 CPU where the driver runs, a worker node of 2 CPUs),
the shard store and the registry on an S3 endpoint on loopback (moto's server) that every node reaches,
the tiny model (`tiny:llama`, 2048 tokens). Four runs, each with a fresh store:

  two-node      untampered, two workers (one per node);
  fold-loss     the worker node removed while its worker holds a folded, checkpointed shard
                (`kvtc.pipeline.job.fault_hooks`): its shards run again on the head's worker;
  one-node      the head alone, one worker;
  reduce-loss   a worker node added again, and removed while a group task waits there: Ray runs it again.

Prints each run's wall time and stages, whether its published files' digests equal the two-node run's, and
what a removal cost: the seconds against the untampered run (wall, and the stage it hit), the workers lost
and the shards or group tasks that ran again.

    .venv/bin/python -P bench/multinode.py

--private-store (root: a mount namespace) runs instead what issue 46 describes for a store that is a plain
path: the worker node started by `ray start` in its own mount namespace with a tmpfs over the store's path
(the same path, another disk), the job run twice with a local store declared `--store-shared`.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the fixtures: tests/helpers
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TRITON_INTERPRET", "1")

from helpers import multinode as mn  # noqa: E402


def _settings(address: str, bucket: str, run: str, workers: int | None):
    from kvtc.pipeline.settings import JobSettings

    return JobSettings.of(**mn.TINY, workers=workers, address=address, name="tiny", store=f"{bucket}/{run}/store",
                          registry=f"{bucket}/{run}/reg")


def _row(name: str, summary: dict, wall: float, same: bool | None, extra: str = "") -> str:
    st = summary["run"]["stages"]
    stages = ", ".join(f"{k} {st[k]:g}" for k in ("plan", "startup", "fold", "reduce", "publish"))
    digest = "reference" if same is None else ("equal" if same else "DIFFERENT")
    return f"| {name} | {summary['run']['workers']} | {wall:.1f} | {stages} | {digest} | {extra} |"


def compare() -> int:
    root = Path(tempfile.mkdtemp(prefix="kvtc-multinode-"))
    os.environ["KVTC_CACHE"] = str(root / "cache")
    rows, costs = [], []
    from kvtc.pipeline.json_stdout import stdout_to_stderr
    from kvtc.workers.models import load_spec

    load_spec(mn.TINY["model"])  # the driver's imports and tokenizer, once: every run's plan then costs the same
    with mn.loopback_s3() as bucket, stdout_to_stderr():  # Ray's lines on stderr: stdout holds the figures
        cluster, worker = mn.start_cluster()
        try:
            two, two_s = mn.run_job(_settings(cluster.address, bucket, "two", 2))
            reference = mn.digests(two)
            rows.append(_row("two-node", two, two_s, None))

            with mn.node_removed_when_held(cluster, worker, "fold", root / "held-fold") as removal:
                fold, fold_s = mn.run_job(_settings(cluster.address, bucket, "fold", 2))
            run = fold["run"]
            rows.append(_row("fold-loss", fold, fold_s, mn.digests(fold) == reference,
                             f"{run['workers_lost']} worker(s) lost, {run['shards_rerun']} shard(s) run again"))
            costs.append(f"fold-loss: wall {fold_s - two_s:+.1f} s, fold stage {run['stages']['fold'] - two['run']['stages']['fold']:+.1f} s "
                         f"against two-node; {run['workers_lost']} worker(s) lost, {run['shards_rerun']} shard(s) run again "
                         f"({removal.held_units} held when the node went, removed {removal.removed_at - removal.held_at:.1f} s "
                         "after the hold)")

            if worker in cluster.worker_nodes:
                cluster.remove_node(worker)
            one, one_s = mn.run_job(_settings(cluster.address, bucket, "one", None))
            same_one = mn.digests(one) == reference
            rows.append(_row("one-node", one, one_s, same_one))

            worker = mn.add_worker(cluster)
            with mn.node_removed_when_held(cluster, worker, "reduce", root / "held-reduce") as removal:
                red, red_s = mn.run_job(_settings(cluster.address, bucket, "reduce", 2))
            rows.append(_row("reduce-loss", red, red_s, mn.digests(red) == reference,
                             f"{removal.held_units} group task(s) run again"))
            costs.append(f"reduce-loss: wall {red_s - two_s:+.1f} s, reduce stage "
                         f"{red['run']['stages']['reduce'] - two['run']['stages']['reduce']:+.1f} s against two-node; "
                         f"{removal.held_units} group task(s) on the lost node run again by Ray on the head "
                         f"(removed {removal.removed_at - removal.held_at:.1f} s after the hold)")
        finally:
            cluster.shutdown()
            shutil.rmtree(root, ignore_errors=True)
    print("| run | workers | wall (s) | stages (s) | published files vs two-node | node loss |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))
    print(f"two-node vs one-node digests: {'equal' if same_one else 'DIFFERENT'} "
          f"({len(reference)} files); wall two-node {two_s:.1f} s, one-node {one_s:.1f} s")
    print("\n".join(costs))
    return 0 if all("DIFFERENT" not in r for r in rows) else 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def private_store() -> int:
    """The failure a plain-path store meets when the nodes do not share it (see the module's doc)."""
    import ray

    root = Path(tempfile.mkdtemp(prefix="kvtc-private-"))
    store = root / "cache" / "shards"
    store.mkdir(parents=True)
    os.environ["KVTC_CACHE"] = str(root / "cache")
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args=dict(num_cpus=1, object_store_memory=mn.NODE_MEMORY,
                                                                include_dashboard=False))
    start = (f"mount -t tmpfs tmpfs {store} && exec {Path(sys.executable).parent / 'ray'} start "
             f"--address={cluster.address} --num-cpus=2 --object-store-memory={mn.NODE_MEMORY} "
             f"--dashboard-agent-listen-port={_free_port()} --metrics-export-port={_free_port()} --min-worker-port=0 "
             "--max-worker-port=0 --block --disable-usage-stats")
    node = subprocess.Popen(["unshare", "-m", "--propagation", "private", "sh", "-c", start], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        ray.init(address=cluster.address, logging_level="ERROR")
        while sum(n["Alive"] for n in ray.nodes()) < 2:
            if node.poll() is not None:
                raise SystemExit("the private-store node did not start (root and `unshare -m` are needed)")
            time.sleep(0.5)
        ray.shutdown()
        from kvtc.pipeline.settings import JobSettings

        for shared in (False, True, True):
            cfg = JobSettings.of(**mn.TINY, address=cluster.address, name="tiny", registry=str(root / "reg"),
                                 store_shared=shared)
            try:
                summary, wall = mn.run_job(cfg)
                print(f"--store-shared {shared}: published {summary['version']} in {wall:.1f} s")
            except Exception as exc:
                print(f"--store-shared {shared}: {type(exc).__name__}: {exc}")
    finally:
        os.killpg(node.pid, signal.SIGTERM)
        node.wait(60)
        cluster.shutdown()
        shutil.rmtree(root, ignore_errors=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--private-store", action="store_true", help="show a plain-path store on nodes that do not share it")
    args = ap.parse_args()
    return private_store() if args.private_store else compare()


if __name__ == "__main__":
    sys.exit(main())
