"""Where the reduce's per-group work runs: in this process, one group after another, or as Ray tasks
on the job's workers, admitted while the memory they need together fits the node (`reduce_plan`).

A task gets its inputs from the shard store (the accumulators, and its group's held-out rows,
written once by the driver as a checksummed object) and writes its `GroupResult` there; only names
and timings travel through Ray. Each task runs on the same number of CPU threads whatever the
number of workers, and results are taken in task order, so the artifact is bit-identical for any
number of workers.

Nothing solved is lost: a task checkpoints its solve (`group_task.save_solved`) and its result,
and an attempt that finds them resumes after them; results stay in the store until the artifact is
published (`clear`), so a job stopped in its reduce resumes at the groups it had not finished. A
task the node kills for memory is one line on the console naming the group and what it needs, and
runs again alone, from its checkpoint; killed again alone, the job stops and says so.
"""
from __future__ import annotations

import functools
import sys
from dataclasses import dataclass, replace

import torch

from kvtc.pipeline.fit.heldout_rows import GroupRows
from kvtc.pipeline.job.fault_hooks import hold_if_asked
from kvtc.pipeline.job.group_task import GroupResult, GroupTask, drop_solved, run_group, solved_name, spectrum_name
from kvtc.pipeline.job.progress import ReduceProgress
from kvtc.pipeline.job.reduce_plan import GIB, admit
from kvtc.pipeline.job.store import ShardStore


@dataclass(frozen=True)
class Placement:
    """How the reduce runs: at most `workers` tasks at a time on Ray (0: in this process), each asking for
    `threads` CPUs, and one GPU (of `gpu_bytes`, 0: unknown) when `gpu`; `cluster`: on a joined cluster
    (its nodes' memory is Ray's to report), else on this node."""

    workers: int
    threads: int
    gpu: bool = False
    gpu_bytes: int = 0
    cluster: bool = False

    def __post_init__(self) -> None:
        if self.workers < 0 or self.threads < 1:
            raise ValueError(f"reduce placement: workers must be >= 0 and threads >= 1, got {self.workers}, {self.threads}")


def rows_name(task: GroupTask) -> str:
    return f"rows-{task.key()}"


def result_name(task: GroupTask) -> str:
    """Where a task's result goes: its GroupResult, or with `solve_only` its spectrum."""
    return spectrum_name(task) if task.solve_only else f"result-{task.pass_key()}"


def result_bound(task: GroupTask) -> dict:
    """What the task's stored result is bound to (`GroupTask.bound`): its spectrum's, or its result's."""
    return task.bound("spectrum" if task.solve_only else "result")


def run_stored(task: GroupTask, store: ShardStore) -> str:
    """Run one task from the store (its rows written by the driver) into the store: the result's name.
    A result already there (an earlier attempt, or a stopped job) is taken as it is (`vet_stored` checked it)."""
    name = result_name(task)
    if store.has_basis(name):
        return name
    arrays, meta = store.get_basis(rows_name(task))
    result = run_group(task, store, GroupRows.from_arrays(arrays, meta["seq_len"]))
    del arrays
    if task.solve_only:  # the spectrum is stored; the checkpoint stays for the pass with budgets
        return name
    store.put_basis(name, *result.arrays_and_meta(), result_bound(task))
    drop_solved(store, task)
    return name


def vet_stored(tasks: list[GroupTask], store: ShardStore) -> list[str]:
    """Before any task runs, each task's stored result and solve checkpoint must be bound to that task (its name,
    stream, group, settings, pass and this job's store scope, inside the authenticated footer): one that is not (a
    keys and values checkpoint swapped, another job's copied under this name, an earlier release's) is moved aside
    and named once on stderr, so the task computes it again. Reads footers only. -> the messages."""
    out = []
    for task in tasks:
        for name, bound in ((result_name(task), result_bound(task)), (solved_name(task), task.bound("solved"))):
            if not store.has_basis(name):
                continue
            try:
                store.check_basis(name, bound)
            except ValueError as exc:  # CorruptStats: moved aside by the store
                out.append(f"kvtc: {exc}; recomputing it")
                print(out[-1], file=sys.stderr)
    return out


def clear(tasks: list[GroupTask], store: ShardStore) -> None:
    """Drop the tasks' rows, checkpoints and results (once the artifact is published)."""
    for task in tasks:
        for name in (rows_name(task), result_name(task), spectrum_name(task)):
            store.drop_basis(name)
        drop_solved(store, task)


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
    """Body of a Ray task: `run_stored` on the task's worker; returns the result's name."""
    hold_if_asked("reduce")
    task = GroupTask.from_json(task_json)
    if task.device == "cuda" and not torch.cuda.is_available():  # Ray's GPU ids say nothing about torch
        task = replace(task, device="cpu")
    return run_stored(task, ShardStore(root, model_id, capture_key))


def _node_memory() -> int:
    import ray  # noqa: PLC0415 - Ray loads only on a Ray run (tests stand a fake in for it)

    return int(max((n["Resources"].get("memory", 0) for n in ray.nodes() if n.get("Alive")), default=0))


def run_groups(tasks: list[GroupTask], store: ShardStore, placement: Placement, peaks: list[int], budget: int,
               progress: ReduceProgress | None = None, keep_rows: bool = False) -> list:
    """The results in task order (GroupResults; for `solve_only` tasks, (eigenvalues, meta) of each spectrum).
    The tasks' rows are in the store (`rows_name`), and dropped after unless `keep_rows`; `peaks`: each task's
    planned peak bytes; `budget`: bytes the tasks may hold together."""
    progress = progress or ReduceProgress([f"{t.stream} group {t.group}" for t in tasks], [t.p for t in tasks])
    try:
        vet_stored(tasks, store)
        stored = [i for i, task in enumerate(tasks) if store.has_basis(result_name(task))]
        for i in stored:  # a stopped job's finished groups: taken as they are
            progress.resumed(i)
        todo = [i for i in range(len(tasks)) if i not in stored]
        if placement.workers == 0:
            for i in todo:
                progress.started(i)
                run_stored(tasks[i], store)
                progress.done(i)
        else:
            _on_ray(tasks, todo, store, placement, peaks, budget, progress)
        names = [result_name(task) for task in tasks]
    finally:
        progress.close()
        for task in tasks if not keep_rows else ():
            store.drop_basis(rows_name(task))
    results = []
    for task, name in zip(tasks, names):
        arrays, meta = store.get_basis(name, result_bound(task))
        results.append((arrays["eigenvalues"], meta) if task.solve_only else GroupResult.from_stored(arrays, meta))
    return results


def _killed_for_memory(exc: Exception) -> bool:
    import ray.exceptions  # noqa: PLC0415 - as above

    return isinstance(exc, ray.exceptions.OutOfMemoryError) or "OutOfMemoryError" in type(exc).__name__


def _on_ray(tasks, todo, store, placement, peaks, budget, progress) -> None:
    """Run tasks[i] for i in `todo` on Ray; their results go to the store."""
    import ray  # noqa: PLC0415 - as above

    cap = _node_memory()
    where = (store.root, store.model_id, store.capture_key)
    group_fn = ray.remote(max_retries=2)(_group_task_body)  # a lost worker: the retry resumes from the checkpoint
    pending: dict = {}
    names: dict[int, str] = {}
    errors: list[dict] = []
    queue = list(todo)
    killed: set[int] = set()
    alone: int | None = None  # a task killed for memory runs again with nothing beside it
    try:
        while queue or pending:
            while queue and not errors and len(pending) < placement.workers and alone not in pending.values():
                i = queue[0]
                if pending and (i == alone or not admit([peaks[j] for j in pending.values()], peaks[i], budget,
                                                         placement.workers)):
                    break
                queue.pop(0)
                opts = {"num_cpus": placement.threads, "num_gpus": 1 if placement.gpu else 0}
                if cap:
                    opts["memory"] = max(1, min(peaks[i], cap))
                pending[group_fn.options(**opts).remote(*where, tasks[i].to_json())] = i
                progress.started(i)
            if not pending:
                break
            done, _ = ray.wait(list(pending), num_returns=1)
            i = pending.pop(done[0])
            try:
                out = ray.get(done[0])
            except Exception as exc:
                if not _killed_for_memory(exc):
                    raise
                beside = len(pending)
                if i in killed and beside == 0:
                    raise MemoryError(
                        f"the node killed the reduce task of {progress.names[i]} for memory twice, the second time "
                        f"running alone (planned peak {peaks[i] / GIB:.1f} GiB, budget {budget / GIB:.1f} GiB): free "
                        "memory on the node, or split the features into smaller groups (--groups layers:K); its "
                        "solve is checkpointed in the store, and a rerun resumes from it") from None
                killed.add(i)
                alone = i
                queue.insert(0, i)
                progress.killed(i, f"the node killed {progress.names[i]} for memory (planned peak {peaks[i] / GIB:.1f} GiB, "
                              f"{beside} other task(s) running); it runs again alone, from its checkpoint")
                continue
            if "error" in out:  # let the running tasks end: one may name the cause (a corrupt object)
                errors.append(out["error"])
            else:
                names[i] = out["ok"]
                if alone == i:
                    alone = None
            progress.done(i)
        if errors:  # tasks sharing a corrupt accumulator: one moved it aside, the others found it missing
            raise _error(next((e for e in errors if e["kind"] in ("CorruptStats", "DegenerateStats")), errors[0]))
    finally:
        for ref in pending:
            ray.cancel(ref, force=True)
    missing = [progress.names[i] for i in todo if i not in names]
    if missing:
        raise RuntimeError(f"reduce: no result for {', '.join(missing)}")
