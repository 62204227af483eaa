"""Stream shard payloads through a pool of Ray worker actors, each loading the model once.

Work in flight is bounded (`in_flight` tasks per actor). Actors restart when their process
dies and Ray retries the task they were running on the restarted actor, so a killed worker costs
a retry. A worker whose node is lost is killed instead (its actor could wait forever for room to
restart) and its unfinished shards run on the workers left, each accumulator resumed whole from its
last checkpoint by one of them. Every task is identified by its shard id and writes its result to the shard store
itself; what comes back through Ray is a small dict of plain values (no tensors, no custom
classes), so nothing is double-counted: the reducer folds each shard's stored entry once.
"""
from __future__ import annotations

import itertools
import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import psutil
import ray
import torch
from tqdm import tqdm

from kvtc.pipeline.job.pool_run import PoolRun
from kvtc.pipeline.job.progress import ShardProgress


@dataclass(frozen=True)
class PoolSettings:
    workers: int
    threads_per_worker: int = 1
    in_flight: int = 2
    gpus_per_worker: float = 0.0
    env_inherited: bool = False  # the workers inherit this process's KVTC_* environment (a local Ray it started)
    memory: int = 0  # bytes each actor asks Ray for (its planned peak; 0: none), so a node takes what it holds

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if self.threads_per_worker < 1:
            raise ValueError(f"threads per worker must be >= 1, got {self.threads_per_worker}")
        if self.in_flight < 1:
            raise ValueError(f"in_flight must be >= 1, got {self.in_flight}")


def cluster_gpus() -> float:
    return float(ray.cluster_resources().get("GPU", 0.0))


@dataclass(frozen=True)
class GpuInventory:
    """The cluster's GPUs as a one-GPU Ray task sees them: `gpu_bytes` of one, `gpus_per_node` on the largest
    node, and `cuda`: whether torch there sees a GPU at all. Ray's GPUs are logical (a node may declare GPUs
    it does not have, as Ray's own tests do): then the workers run on the CPU, each GPU standing for an equal
    share of the node's available memory, and every line of the GPU placement still runs."""

    gpu_bytes: int
    gpus_per_node: int
    cuda: bool = True


def _device_memory() -> tuple[int, bool]:
    """(bytes of this task's GPU, True), or where torch sees none (bytes of this node's available memory, False)."""
    if torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(0).total_memory), True
    return int(psutil.virtual_memory().available), False


def gpu_inventory() -> GpuInventory:
    """The joined cluster's GPUs (GpuInventory): Ray reports GPU counts, a one-GPU task's torch their memory."""
    per_node = max((int(n["Resources"].get("GPU", 0)) for n in ray.nodes() if n.get("Alive")), default=0)
    memory, cuda = ray.get(ray.remote(num_gpus=1, num_cpus=0)(_device_memory).remote())
    return GpuInventory(int(memory) if cuda else int(memory) // max(1, per_node), per_node, bool(cuda))


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
    """Join `address` (RuntimeSettings.cluster_address: --address, else $RAY_ADDRESS as inside `ray job submit`), else
    start a local Ray.
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
    if address:  # RuntimeSettings.cluster_address: --address, else $RAY_ADDRESS
        ray.init(address=address, log_to_driver=verbose, runtime_env={"env_vars": job_env()})
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # a task the memory monitor kills comes back to the reduce (one line, a rerun alone from its checkpoint)
    # instead of Ray retrying it without end beside the tasks that starved it
    os.environ.setdefault("RAY_task_oom_retries", "0")
    # Ray says on every start that its default, token authentication, is on: true of a Ray only this job's processes
    # use, and nothing the job's user acts on (it stays on; RAY_AUTH_MODE still chooses)
    notice = logging.getLogger("ray._private.authentication.authentication_token_setup")
    level = notice.level
    notice.setLevel(logging.ERROR)
    try:
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=verbose,
                 logging_level=logging.WARNING)
    finally:
        notice.setLevel(level)
    return True


def worker_log_dir() -> str | None:
    """Where this Ray session writes its workers' output (None when unknown)."""
    try:
        return ray._private.worker.global_worker.node.get_logs_dir_path()
    except Exception:  # a private API: the path is a convenience, not needed for the job
        return None


NODE_CHECK_S = 2.0  # while shards run, how often the pool asks Ray which nodes are alive
LOST_WAIT_S = 60.0  # how long a killed worker's tasks may take to fail


class _Workers:
    """The pool's actors: the node each runs on (`ready()`'s answer; not a string: unknown), its tasks in
    flight, and the owner of every route (an accumulator: route % workers at first). A worker whose node is
    lost is killed; each route it owned moves whole to the live worker owning the fewest, which resumes that
    accumulator from its last checkpoint. A route never moves away from a live worker, so no two workers
    ever hold the same accumulator's running total."""

    def __init__(self, actors: list, nodes: list, in_flight: int) -> None:
        self.actors, self.nodes, self.in_flight = list(actors), list(nodes), in_flight
        self.count = len(actors)
        self.alive = set(range(len(actors)))
        self.load = [0] * len(actors)
        self.owner: dict[int, int] = {}

    def add(self, actor, node) -> None:
        """A replacement worker (started when none is left)."""
        self.actors.append(actor)
        self.nodes.append(node)
        self.load.append(0)
        self.alive.add(len(self.actors) - 1)

    def owner_of(self, route: int) -> int:
        i = self.owner.setdefault(route, route % self.count)
        if i not in self.alive:
            owned = lambda j: sum(o == j for o in self.owner.values())  # noqa: E731
            i = self.owner[route] = min(self.alive, key=lambda j: (owned(j), self.load[j], j))
        return i

    def slot(self, route: int | None) -> int | None:
        """The worker that takes a payload of `route` now (None: it must wait for room)."""
        if route is not None:
            i = self.owner_of(route)
            return i if self.load[i] < self.in_flight else None
        free = [i for i in self.alive if self.load[i] < self.in_flight]
        return min(free, key=lambda i: (self.load[i], i)) if free else None

    def on_lost_nodes(self) -> set[int]:
        """Live workers whose node Ray no longer reports alive."""
        known = {i for i in self.alive if isinstance(self.nodes[i], str) and self.nodes[i]}
        if not known:
            return set()
        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        return {i for i in known if self.nodes[i] not in alive}

    def lose(self, lost: set[int]) -> None:
        for i in lost:
            ray.kill(self.actors[i], no_restart=True)
            self.alive.discard(i)


def _take_back(workers: _Workers, lost: set[int], pending: dict, results: list[dict], bar: ShardProgress
               ) -> list[tuple[int, dict]]:
    """Kill the `lost` workers; -> (sequence number, payload) of their tasks that did not finish, to run
    again on the others (a shard a lost worker had checkpointed is then found folded and skipped)."""
    workers.lose(lost)
    refs = [ref for ref, (i, _, _) in pending.items() if i in lost]
    if refs:
        ray.wait(refs, num_returns=len(refs), timeout=LOST_WAIT_S)
    again = []
    for ref in refs:
        i, n, payload = pending.pop(ref)
        workers.load[i] -= 1
        try:
            result = ray.get(ref, timeout=0)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            again.append((n, payload))
            continue
        results.append(result)
        bar.advance(result)
    return again


def run_pool(
    actor_cls: type,
    actor_kwargs: dict,
    payloads: Iterable[dict],
    settings: PoolSettings,
    route: Callable[[dict], int | None] | None = None,
    total: Callable[[], int] | None = None,
    on_idle: Callable[[int], None] | None = None,
) -> PoolRun:
    """Run `actor.process(payload)` for every payload.
    `route(payload)` pins a payload to actor `route(payload) % workers` (None: the least loaded);
    payloads pinned to one actor run there in the order given (Ray runs one caller's actor tasks
    in submission order, retries included); `total()`: the payloads expected, for the progress bar;
    `on_idle(n)`: called once, when every payload is handed out and n live workers have none left (their CPUs
    idle until the last ones finish).
    A worker whose node is lost (Ray reports the node dead, or the actor dead) is killed and its
    unfinished payloads run again, in their order, on the workers left (see `_Workers`)."""
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
        **({"memory": settings.memory} if settings.memory else {}),
        **actor_env_options(kvtc_env, job_env_vars, settings.env_inherited),
    )
    actors = [remote_cls.remote(**actor_kwargs) for _ in range(settings.workers)]
    workers = _Workers(actors, [None] * len(actors), settings.in_flight)
    pending: dict = {}  # ref -> (worker, sequence number, payload)
    results: list[dict] = []
    exhausted = False
    order = itertools.count()
    held: tuple[int, dict] | None = None  # the next payload, waiting for its pinned actor to have room
    again: list[tuple[int, dict]] = []  # payloads of lost workers, by sequence number: before the stream's next
    lost_workers = rerun = 0
    start = time.perf_counter()
    startup_s = 0.0
    bar = ShardProgress(total)
    try:
        workers.nodes = ray.get([a.ready.remote() for a in actors])  # models loaded: the throughput clock starts here
        startup_s = time.perf_counter() - start
        start = bar.start = time.perf_counter()
        next_check = time.monotonic() + NODE_CHECK_S
        while True:
            while True:
                if held is None:
                    if again:
                        held = again.pop(0)
                    elif exhausted:
                        break
                    else:
                        try:
                            held = (next(order), next(it))
                        except StopIteration:
                            exhausted = True
                            break
                if not workers.alive:  # every worker lost: a new one, wherever Ray can place it
                    actor = remote_cls.remote(**actor_kwargs)
                    workers.add(actor, ray.get(actor.ready.remote()))
                i = workers.slot(None if route is None else route(held[1]))
                if i is None:
                    break
                pending[workers.actors[i].process.remote(held[1])] = (i, *held)
                workers.load[i] += 1
                held = None
            if not pending:
                break
            if on_idle is not None and exhausted and held is None and not again:
                idle = sum(1 for i in workers.alive if workers.load[i] == 0)
                if idle:
                    on_idle(idle)
                    on_idle = None
            done, _ = ray.wait(list(pending), num_returns=1, timeout=NODE_CHECK_S)
            lost: set[int] = set()
            if done:
                i, n, payload = pending[done[0]]
                try:
                    result = ray.get(done[0])
                except ray.exceptions.RayActorError:  # the actor is gone for good
                    lost.add(i)
                else:
                    del pending[done[0]]
                    workers.load[i] -= 1
                    results.append(result)
                    bar.advance(result)
            if not done or time.monotonic() >= next_check:
                next_check = time.monotonic() + NODE_CHECK_S
                lost |= workers.on_lost_nodes()
            if lost:
                back = _take_back(workers, lost, pending, results, bar)
                lost_workers, rerun = lost_workers + len(lost), rerun + len(back)
                again = sorted(again + back + ([held] if held else []), key=lambda t: t[0])
                held = None
                tqdm.write(f"calibrate: {len(lost)} worker(s) lost with their node; {len(back)} shard(s) run again "
                           f"on the {len(workers.alive)} left, from the last checkpoints", file=sys.stderr)
        bar.close(finished=True)
    finally:
        bar.close()  # tqdm closes once
        for actor in workers.actors:
            ray.kill(actor, no_restart=True)
    return PoolRun(results, startup_s, time.perf_counter() - start, lost_workers, rerun)
