"""Stream shard payloads through a pool of Ray worker actors, each loading the model once.

Work in flight is bounded (`in_flight` tasks per actor). Actors restart when their process
dies and Ray retries the task they were running on the restarted actor, so a killed worker costs
a retry. Every task is identified by its shard id and writes its result to the shard store
itself; what comes back through Ray is a small dict of plain values (no tensors, no custom
classes), so nothing is double-counted: the reducer folds each shard's stored entry once.
"""
from __future__ import annotations

import itertools
import logging
import os
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import ray

from kvtc.pipeline.job.pool_run import PoolRun
from kvtc.pipeline.job.progress import ShardProgress


@dataclass(frozen=True)
class PoolSettings:
    workers: int
    threads_per_worker: int = 1
    in_flight: int = 2
    gpus_per_worker: float = 0.0
    env_inherited: bool = False  # the workers inherit this process's KVTC_* environment (a local Ray it started)

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if self.threads_per_worker < 1:
            raise ValueError(f"threads per worker must be >= 1, got {self.threads_per_worker}")
        if self.in_flight < 1:
            raise ValueError(f"in_flight must be >= 1, got {self.in_flight}")


def cluster_gpus() -> float:
    return float(ray.cluster_resources().get("GPU", 0.0))


def _gpu_total_memory() -> int:
    import torch

    return int(torch.cuda.get_device_properties(0).total_memory)


def gpu_inventory() -> tuple[int, int]:
    """(bytes of one GPU, GPUs of the largest node) of the joined cluster: the memory as a one-GPU
    Ray task's torch sees it (Ray itself reports GPU counts, not their memory)."""
    per_node = max((int(n["Resources"].get("GPU", 0)) for n in ray.nodes() if n.get("Alive")), default=0)
    memory = ray.get(ray.remote(num_gpus=1, num_cpus=0)(_gpu_total_memory).remote())
    return int(memory), per_node


def job_env() -> dict[str, str]:
    """Environment a joined cluster's workers get: usage stats off, and this process's KVTC_* settings."""
    return {"RAY_USAGE_STATS_ENABLED": "0", **{k: v for k, v in os.environ.items() if k.startswith("KVTC_")}}


def actor_env_options(kvtc_env: dict[str, str], job_env_vars: dict[str, str], env_inherited: bool) -> dict:
    """Actor options that hand `kvtc_env` to the workers: none when they have it already (inherited
    by a local Ray, or in the job's runtime environment), so the actors can run in the workers Ray
    started with the job; else a runtime environment of their own."""
    if env_inherited or all(job_env_vars.get(k) == v for k, v in kvtc_env.items()):
        return {}
    return {"runtime_env": {"env_vars": dict(kvtc_env)}}


def start_ray(address: str | None, num_cpus: int | None, verbose: bool = True) -> bool:
    """Join `address` (or $RAY_ADDRESS, as inside `ray job submit`), else start a local Ray.
    Returns True when this call started Ray and the caller should shut it down.

    A joined cluster gets the KVTC_* settings through the job's runtime environment. A local Ray
    gets them as its processes' inherited environment and no runtime environment at all: the
    worker processes it starts with the first driver then serve the actors (pass
    PoolSettings(env_inherited=True)); with a runtime environment they could not, and Ray would
    shut them down as idle, which at times crashes in Ray's teardown and prints a stack dump.
    verbose=False keeps the workers' output (model conversion and loading bars) in Ray's log files
    instead of this process's terminal; `worker_log_dir()` says where."""
    if ray.is_initialized():
        return False
    if address or os.environ.get("RAY_ADDRESS"):
        ray.init(address=address or None, log_to_driver=verbose, runtime_env={"env_vars": job_env()})
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # a task the memory monitor kills comes back to the reduce (one line, a rerun alone from its checkpoint)
    # instead of Ray retrying it without end beside the tasks that starved it
    os.environ.setdefault("RAY_task_oom_retries", "0")
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=verbose,
             logging_level=logging.WARNING)
    return True


def worker_log_dir() -> str | None:
    """Where this Ray session writes its workers' output (None when unknown)."""
    try:
        return ray._private.worker.global_worker.node.get_logs_dir_path()
    except Exception:  # a private API: the path is a convenience, not needed for the job
        return None


def run_pool(
    actor_cls: type,
    actor_kwargs: dict,
    payloads: Iterable[dict],
    settings: PoolSettings,
    route: Callable[[dict], int | None] | None = None,
    total: Callable[[], int] | None = None,
) -> PoolRun:
    """Run `actor.process(payload)` for every payload.
    `route(payload)` pins a payload to actor `route(payload) % workers` (None: the least loaded);
    payloads pinned to one actor run there in the order given (Ray runs one caller's actor tasks
    in submission order, retries included); `total()`: the payloads expected, for the progress bar."""
    it: Iterator[dict] = iter(payloads)
    first = next(it, None)
    if first is None:  # everything cached: no actor, no model load
        return PoolRun([], 0.0, 0.0)
    it = itertools.chain([first], it)
    kvtc_env = {k: v for k, v in job_env().items() if k.startswith("KVTC_")}
    job_env_vars = (ray.get_runtime_context().runtime_env or {}).get("env_vars") or {}
    remote_cls = ray.remote(actor_cls).options(
        num_cpus=settings.threads_per_worker,
        num_gpus=settings.gpus_per_worker,
        max_restarts=-1,
        max_task_retries=-1,
        **actor_env_options(kvtc_env, job_env_vars, settings.env_inherited),
    )
    actors = [remote_cls.remote(**actor_kwargs) for _ in range(settings.workers)]
    load = {i: 0 for i in range(len(actors))}
    pending: dict = {}
    results: list[dict] = []
    exhausted = False
    held: dict | None = None  # the next payload, waiting for its pinned actor to have room
    start = time.perf_counter()
    startup_s = 0.0
    bar = ShardProgress(total)
    try:
        ray.get([a.ready.remote() for a in actors])  # models loaded: the throughput clock starts here
        startup_s = time.perf_counter() - start
        start = bar.start = time.perf_counter()
        while True:
            while not exhausted or held is not None:
                if held is None:
                    try:
                        held = next(it)
                    except StopIteration:
                        exhausted = True
                        break
                pinned = None if route is None else route(held)
                free = [i for i, n in load.items() if n < settings.in_flight and (pinned is None or i == pinned % len(actors))]
                if not free:
                    break
                i = min(free, key=lambda j: load[j])
                pending[actors[i].process.remote(held)] = i
                load[i] += 1
                held = None
            if not pending:
                break
            done, _ = ray.wait(list(pending), num_returns=1)
            ref = done[0]
            i = pending.pop(ref)
            load[i] -= 1
            result = ray.get(ref)
            results.append(result)
            bar.advance(result)
        bar.close(finished=True)
    finally:
        bar.close()  # tqdm closes once
        for actor in actors:
            ray.kill(actor, no_restart=True)
    return PoolRun(results, startup_s, time.perf_counter() - start)
