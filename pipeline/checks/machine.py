"""Every resource argument of a calibration bounded before anything starts.

`check_job(settings, machine, context_limit)` runs in the command line before torch, Ray or a model is
loaded (well under a second): worker actors and their threads against this machine's CPUs and GPUs (a
local run) or against hard caps (a cluster, whose resources are only known once joined), accumulators
against the shards the run plans, shards against the tokens, `--seq-len` against the model's context
(those three once the sequence defaults are known: `PlanSettings.resolved`).
`check_cluster(runtime, nodes)` runs once a job has joined a cluster and before any actor is created:
the same arguments against the alive nodes Ray reports. An actor no node can place would otherwise wait
forever, and a million of them exhaust the head node (the driver and Ray's GCS grew by gigabytes within a
minute, and the memory monitor then killed other jobs' workers).

Imports nothing heavy: the CLI calls it.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from typing import Any

from kvtc.pipeline.settings import DEFAULT_CPU_TOKENS, DEFAULT_GPU_TOKENS, JobSettings, ReduceSettings, RuntimeSettings

MAX_WORKERS = 4096  # actors of one job on a cluster (Ray's own scale tests run a few thousand)
MAX_THREADS = 1024  # CPUs of the largest node anyone runs
MAX_GPUS_PER_WORKER = 64  # GPUs one worker spreads a model over, within one node
MAX_ACCUMULATORS = 1024  # running totals the store keeps per stream and group
MAX_TOKENS = 10**12  # a hundred times the largest calibration ever described; the paper's runs hold 1e5-1e6
DEFAULT_ACCUMULATORS = ReduceSettings().accumulators  # always accepted, however few shards the run plans


@dataclass(frozen=True)
class Machine:
    """What a job may use: `cpus` and `gpus` of this machine (a local Ray gets them all), or `cluster` when
    it joins one (then they are checked against the cluster's nodes once joined: `check_cluster`)."""

    cpus: int
    gpus: int
    cluster: bool = False

    def __post_init__(self) -> None:
        if self.cpus < 1 or self.gpus < 0:
            raise ValueError(f"machine: cpus must be >= 1 and gpus >= 0, got {self.cpus}, {self.gpus}")

    @classmethod
    def of(cls, runtime: RuntimeSettings) -> "Machine":
        """This machine, or a cluster when --address or $RAY_ADDRESS names one."""
        return cls(max(1, os.cpu_count() or 1), local_gpus(), runtime.cluster_address is not None)


def local_gpus() -> int:
    """NVIDIA GPUs this process may use, without importing torch: the driver's device list, narrowed by
    CUDA_VISIBLE_DEVICES (Ray reads the same list when it starts)."""
    try:
        found = len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return found
    return min(found, len([d for d in visible.split(",") if d.strip() and not d.strip().startswith("-")]))


def planned_sequences(settings: JobSettings, gpus: int) -> tuple[int, int]:
    """(tokens, training-stream sequences) the plan asks for: --tokens, or the default the job would pick."""
    tokens = settings.plan.tokens or (DEFAULT_GPU_TOKENS if gpus else DEFAULT_CPU_TOKENS)
    return tokens, tokens // settings.plan.seq_len


def check_job(settings: JobSettings, machine: Machine, context_limit: int | None = None) -> None:
    """ValueError naming the first resource argument that no run on `machine` can honour (module docstring).
    context_limit: the model's longest sequence (None: checked by the plan stage once its config is read)."""
    rt, plan = settings.runtime, settings.plan
    threads, gpw = rt.threads_per_worker, rt.gpus_per_worker
    _cap("--threads-per-worker", threads, MAX_THREADS, "CPUs of the largest node anyone runs")
    _cap("--gpus-per-worker", gpw, MAX_GPUS_PER_WORKER, "GPUs of one node")
    _cap("--workers", rt.workers, MAX_WORKERS, "actors of one job on any cluster")
    _cap("--accumulators", settings.reduce.accumulators, MAX_ACCUMULATORS, "running totals one store keeps")
    _cap("--tokens", plan.tokens, MAX_TOKENS, "tokens of any calibration corpus this job runs")
    if not machine.cluster:
        if threads > machine.cpus:
            raise ValueError(f"--threads-per-worker {threads}: this machine has {machine.cpus} CPUs, so no worker could "
                             f"start; use at most {machine.cpus}, or join a cluster with larger nodes (--address)")
        if gpw and machine.gpus < gpw:
            have = f"{machine.gpus} GPU(s)" if machine.gpus else "no GPU torch can see"
            raise ValueError(f"--gpus-per-worker {gpw}: this machine has {have}; omit it to run on "
                             f"{'the GPUs there are' if machine.gpus else 'CPUs'}, or join a cluster with GPUs (--address)")
        if rt.workers:
            most = machine.cpus // threads
            if machine.gpus:
                most = min(most, machine.gpus // (gpw or 1))
            if rt.workers > most:
                what = f"{machine.cpus} CPUs" + (f" and {machine.gpus} GPUs" if machine.gpus else "")
                raise ValueError(f"--workers {rt.workers}: this machine has {what}, room for {most} worker(s) of "
                                 f"{threads} thread(s){f' and {gpw or 1} GPU(s)' if machine.gpus else ''} each; the rest "
                                 f"could never start. Use --workers {most} or fewer (or omit it), or join a cluster "
                                 "(--address)")
    if plan.seq_len is None and context_limit is None:
        return  # the sequence defaults follow the model's limit: the plan stage checks the rest once it has read it
    plan = plan.resolved(context_limit)
    if context_limit is not None and plan.seq_len > context_limit:
        raise ValueError(f"--seq-len {plan.seq_len} exceeds the model's limit of {context_limit} positions; use "
                         f"--seq-len {context_limit} or less")
    tokens, sequences = planned_sequences(replace(settings, plan=plan), machine.gpus)
    if sequences <= plan.seqs_per_shard:
        raise ValueError(f"--seqs-per-shard {plan.seqs_per_shard}: {tokens} tokens make {sequences} sequence(s) of "
                         f"{plan.seq_len}, one shard at most, and a run needs a shard to train on and one to hold out; "
                         f"use --seqs-per-shard {max(1, sequences - 1)} or less, or more --tokens")
    shards = math.ceil(sequences / plan.seqs_per_shard)
    accumulators = settings.reduce.accumulators
    if accumulators > max(shards, DEFAULT_ACCUMULATORS):
        raise ValueError(f"--accumulators {accumulators}: the run plans {shards} shards ({tokens} tokens in shards of "
                         f"{plan.seqs_per_shard} x {plan.seq_len}), and an accumulator without a shard holds nothing; "
                         f"use --accumulators {max(shards, DEFAULT_ACCUMULATORS)} or less")


def check_cluster(runtime: RuntimeSettings, nodes: list[dict[str, Any]]) -> None:
    """ValueError when the joined cluster's alive `nodes` (ray.nodes()) cannot place the workers asked for:
    a worker's threads (and GPUs) must fit one node, and --workers of them the whole cluster."""
    alive = [n.get("Resources") or {} for n in nodes if n.get("Alive")]
    cpus = [int(r.get("CPU", 0)) for r in alive]
    gpus = [int(r.get("GPU", 0)) for r in alive]
    threads, gpw = runtime.threads_per_worker, runtime.gpus_per_worker
    if threads > max(cpus, default=0):
        raise ValueError(f"--threads-per-worker {threads}: the cluster's largest node has {max(cpus, default=0)} CPUs, "
                         f"so no worker could be placed; use at most {max(cpus, default=0)}, or add larger nodes")
    if gpw and gpw > max(gpus, default=0):
        raise ValueError(f"--gpus-per-worker {gpw}: the cluster's largest node has {max(gpus, default=0)} GPU(s), and a "
                         "worker's GPUs must be on one node; use fewer, or add a node type with more (ray_cluster.yaml)")
    if runtime.workers:
        most = sum(c // threads for c in cpus) if not gpw and not any(gpus) else \
            sum(min(c // threads, g // (gpw or 1)) for c, g in zip(cpus, gpus))
        if runtime.workers > most:
            raise ValueError(f"--workers {runtime.workers}: the cluster's {len(alive)} alive node(s) ({sum(cpus)} CPUs"
                             f"{f', {sum(gpus)} GPUs' if any(gpus) else ''}) have room for {most} worker(s) of {threads} "
                             f"thread(s){f' and {gpw or 1} GPU(s)' if any(gpus) else ''}; the rest could never be "
                             f"placed. Use --workers {most} or fewer (or omit it), or add nodes")


def _cap(flag: str, value: int | None, cap: int, what: str) -> None:
    if value is not None and value > cap:
        raise ValueError(f"{flag} {value} is beyond what this job accepts: at most {cap} ({what}); "
                         "check the value (a typo?)")
