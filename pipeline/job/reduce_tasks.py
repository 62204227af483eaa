"""Where the reduce's per-group work runs: in this process, one group after another, or as Ray tasks
on the job's workers, at most `workers` at a time.

A Ray task gets its inputs from the shard store (the accumulators, and its group's held-out rows,
written once by the driver as a checksummed object) and writes its `GroupResult` there; only names
and timings travel through Ray. Each task runs on the same number of CPU threads whatever the
number of workers, and results are taken in task order, so the artifact is bit-identical for any
number of workers. A task asks Ray for the memory its group needs (`memory_plan.group_task_bytes`),
so large groups do not run side by side on a node that cannot hold them. The error-by-tokens
curve (a refold of the accumulators) is one more task, run beside the groups.
"""
from __future__ import annotations

import functools
import hashlib
import json
import sys
from dataclasses import dataclass
from typing import Callable

from tqdm import tqdm

from kvtc.pipeline.fit.heldout_rows import GroupRows
from kvtc.pipeline.fit.pca import cpu_threads
from kvtc.pipeline.job.error_by_tokens import curve_from_store
from kvtc.pipeline.job.group_task import GroupResult, GroupTask, run_group
from kvtc.pipeline.job.store import ShardStore


@dataclass(frozen=True)
class Placement:
    """How the reduce runs: `workers` tasks at a time on Ray (0: in this process), each asking for
    `threads` CPUs, and one GPU when `gpu`."""

    workers: int
    threads: int
    gpu: bool = False

    def __post_init__(self) -> None:
        if self.workers < 0 or self.threads < 1:
            raise ValueError(f"reduce placement: workers must be >= 0 and threads >= 1, got {self.workers}, {self.threads}")


def _object_name(kind: str, task: GroupTask) -> str:
    key = json.dumps(task.to_json(), sort_keys=True).encode()
    return f"{kind}-{task.stream}-g{task.group}-{hashlib.sha256(key).hexdigest()[:16]}"


def _reported(body):
    """A task body whose failure comes back as plain values {"error": {kind, message}} (exceptions would
    cross Ray pickled, and some do not unpickle): the driver raises it again (`_raise`)."""

    @functools.wraps(body)
    def run(*args):
        try:
            return {"ok": body(*args)}
        except Exception as exc:
            return {"error": {"kind": type(exc).__name__, "message": str(exc)}}

    return run


_KINDS = {"CorruptStats": ValueError, "DegenerateStats": ValueError, "ValueError": ValueError, "FileNotFoundError": FileNotFoundError,
          "MemoryError": MemoryError, "PermissionError": PermissionError}


def _error(err: dict) -> Exception:
    kind, message = err["kind"], err["message"]
    return _KINDS[kind](message) if kind in _KINDS else RuntimeError(f"reduce task failed: {kind}: {message}")


@_reported
def _group_task_body(root: str, model_id: str, capture_key: str, task_json: dict) -> str:
    """Body of a Ray task: read the group's rows, run it, store the result; returns the result's name."""
    import torch

    task = GroupTask.from_json(task_json)
    if task.device == "cuda" and not torch.cuda.is_available():  # Ray's GPU ids say nothing about torch
        task = GroupTask.from_json({**task_json, "device": "cpu"})
    store = ShardStore(root, model_id, capture_key)
    arrays, meta = store.get_basis(_object_name("rows", task))
    result = run_group(task, store, GroupRows.from_arrays(arrays, meta["seq_len"]))
    name = _object_name("result", task)
    store.put_basis(name, *result.arrays_and_meta())
    return name


@_reported
def _tokens_curve_body(root: str, model_id: str, capture_key: str, threads: int, curve_args: dict) -> str:
    """Body of the error-by-tokens task: the curve rows as JSON."""
    with cpu_threads(threads):
        return json.dumps(curve_from_store(ShardStore(root, model_id, capture_key), **curve_args))


def _node_memory() -> int:
    import ray

    return int(max((n["Resources"].get("memory", 0) for n in ray.nodes() if n.get("Alive")), default=0))


def run_groups(tasks: list[GroupTask], rows: list[GroupRows], store: ShardStore, placement: Placement,
               memory: list[int], tokens_curve: dict | None = None,
               local_curve: Callable[[], list[dict]] | None = None) -> tuple[list[GroupResult], list[dict]]:
    """(results in task order, error-by-tokens rows). `tokens_curve`: curve_from_store's arguments,
    computed by `local_curve` in this process, or as a task beside the groups on Ray."""
    bar = tqdm(total=len(tasks), unit="group", desc="reduce", dynamic_ncols=True, disable=None, file=sys.stderr)
    try:
        if placement.workers == 0:
            by_tokens = local_curve() if tokens_curve is not None and local_curve is not None else []
            results = []
            for task, r in zip(tasks, rows):
                results.append(run_group(task, store, r))
                bar.update(1)
            return results, by_tokens
        return _on_ray(tasks, rows, store, placement, memory, tokens_curve, bar)
    finally:
        bar.close()


def _on_ray(tasks, rows, store, placement, memory, tokens_curve, bar) -> tuple[list[GroupResult], list[dict]]:
    import ray

    cap = _node_memory()
    for task, r in zip(tasks, rows):
        store.put_basis(_object_name("rows", task), r.arrays(), {"seq_len": r.seq_len})
    where = (store.root, store.model_id, store.capture_key)
    group_fn = ray.remote(max_retries=2)(_group_task_body)
    curve_ref = None
    if tokens_curve is not None:  # the refold holds every group's statistics at once: it asks for what they need
        curve_ref = ray.remote(max_retries=2)(_tokens_curve_body).options(num_cpus=placement.threads).remote(
            *where, placement.threads, tokens_curve)
    pending: dict = {}
    names: dict[int, str] = {}
    errors: list[Exception] = []
    queue = list(range(len(tasks)))
    try:
        while queue or pending:
            while queue and not errors and len(pending) < placement.workers:
                i = queue.pop(0)
                opts = {"num_cpus": placement.threads, "num_gpus": 1 if placement.gpu else 0}
                if cap:
                    opts["memory"] = max(1, min(memory[i], cap))
                pending[group_fn.options(**opts).remote(*where, tasks[i].to_json())] = i
            if not pending:
                break
            done, _ = ray.wait(list(pending), num_returns=1)
            i = pending.pop(done[0])
            out = ray.get(done[0])
            if "error" in out:  # let the running tasks end: one may name the cause (a corrupt object)
                errors.append(out["error"])
            else:
                names[i] = out["ok"]
            bar.update(1)
        curve = ray.get(curve_ref) if curve_ref is not None else {"ok": "[]"}
        if "error" in curve:
            errors.append(curve["error"])
        if errors:  # tasks sharing a corrupt accumulator: one moved it aside, the others found it missing
            raise _error(next((e for e in errors if e["kind"] in ("CorruptStats", "DegenerateStats")), errors[0]))
        by_tokens = json.loads(curve["ok"])
    finally:
        for ref in pending:
            ray.cancel(ref, force=True)
        for task in tasks:
            store.drop_basis(_object_name("rows", task))
    results = []
    for i in range(len(tasks)):
        arrays, meta = store.get_basis(names[i])
        store.drop_basis(names[i])
        results.append(GroupResult.from_stored(arrays, meta))
    return results, by_tokens
