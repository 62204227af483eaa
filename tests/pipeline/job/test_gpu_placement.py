"""The GPU placement code runs as on a GPU cluster: a Ray node that declares logical GPUs (as Ray's own tests
do) drives one worker per GPU, `--gpus-per-worker` spreading a worker over a node's GPUs, and the reduce's GPU
tasks and solver choice; where torch sees no CUDA the device itself falls back to the CPU (float32), so every
line up to the device runs here."""
from __future__ import annotations

import pytest
import ray

from helpers import multinode as mn
from kvtc import artifacts
from kvtc.artifacts.calibration import CalibrationRecord
from kvtc.pipeline.job.calibrate import _gpu_plan
from kvtc.pipeline.settings import JobSettings

pytestmark = pytest.mark.live


@pytest.fixture(scope="module")
def gpu_node(tmp_path_factory):
    """One node of 2 CPUs and 2 logical GPUs (no CUDA behind them)."""
    from ray.cluster_utils import Cluster

    with pytest.MonkeyPatch.context() as env:
        env.setenv("KVTC_CACHE", str(tmp_path_factory.mktemp("kvtc-cache")))
        ray.shutdown()
        cluster = Cluster(initialize_head=True, head_node_args=dict(
            num_cpus=2, num_gpus=2, object_store_memory=mn.NODE_MEMORY, include_dashboard=False))
        try:
            yield cluster
        finally:
            ray.shutdown()
            cluster.shutdown()


def _run(cluster, tmp_path, **flat) -> dict:
    cfg = JobSettings.of(**{**mn.TINY, "tokens": 1024}, address=cluster.address, name="tiny",
                         store=str(tmp_path / "store"), registry=str(tmp_path / "reg"), **flat)
    summary, _ = mn.run_job(cfg)
    return summary


def test_one_worker_per_logical_gpu_on_the_cpu(gpu_node, tmp_path):
    summary = _run(gpu_node, tmp_path)
    run = summary["run"]
    assert run["workers"] == 2  # one per GPU, not one per CPU
    placement = run["placement"]
    assert sorted(p["gpus"] for p in placement) == ["0", "1"], placement  # each worker its own GPU
    assert {p["device"] for p in placement} == {"cpu"}  # torch sees no CUDA: the CPU ran the model
    assert len({p["node"] for p in placement}) == 1 and sum(p["shards"] for p in placement) == run["shards_run"]
    # the reduce asked Ray for a GPU per group task, planned the GPU solver, and ran it on the CPU torch had
    assert run["reduce_plan"]["solvers"] == ["exact/evd/cuda"], run["reduce_plan"]  # planned: cuSOLVER's syevd
    solves = [s for g in run["groups"] for s in g["solves"]]
    assert solves and {s["device"] for s in solves} == {"cpu"} and {s["method"] for s in solves} == {"exact"}
    manifest = artifacts.pull(summary["name"], summary["version"], registry=summary["registry"]).manifest
    assert CalibrationRecord.from_manifest(manifest).model_dtype == "float32"  # the statistics' scope: what ran


def test_gpus_per_worker_spreads_one_worker_over_the_node(gpu_node, tmp_path):
    run = _run(gpu_node, tmp_path, gpus_per_worker=2)["run"]
    assert run["workers"] == 1
    assert [(p["gpus"], p["device"]) for p in run["placement"]] == [("0,1", "cpu")]


def test_the_gpu_plan_sizes_cpu_fallback_workers_in_float32(gpu_node):
    """The plan sizes a worker's weights in the dtype its device runs: bfloat16 on CUDA, float32 where the GPUs
    are logical, so the same GPU memory holds half as many layers."""
    from kvtc.pipeline.job.calibrate import Planned
    from kvtc.workers.models import load_spec

    info = load_spec("tiny:llama@4x2x64")
    planned = Planned(JobSettings.of(model="tiny:llama@4x2x64", seq_len=128), "reg", "store", info.tokenizer,
                      info.fingerprint, 0.0, info.config)
    on_cuda = _gpu_plan(planned, 2, 64 << 20, 2, cuda=True)
    on_cpu = _gpu_plan(planned, 2, 64 << 20, 2, cuda=False)
    assert on_cpu.weights > 1.99 * on_cuda.weights  # float32 parameters (a few buffers stay as they are)


@pytest.mark.parametrize("flat, message", [(dict(workers=3), "room for 2 worker"),
                                           (dict(threads_per_worker=3), "largest node has 2 CPUs"),
                                           (dict(gpus_per_worker=3), "largest node has 2 GPU")])
def test_the_joined_cluster_refuses_workers_no_node_can_place(gpu_node, tmp_path, flat, message):
    """Checked against the nodes once joined, before any model work: no actor waits forever for room."""
    import kvtc.workers.models as models

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(models, "load_model", lambda *a, **k: pytest.fail("model work started before the check"))
        with pytest.raises(ValueError, match=message):
            _run(gpu_node, tmp_path, **flat)
