"""A small reduce in a shard store (keys and values of one group, p = 48, in this process), for the tests and
bench/hostile.py's checkpoint families: its tasks' checkpoints, spectra and results swapped or copied from another job,
then the reduce resumed."""
from __future__ import annotations

import os
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from kvtc.pipeline.fit.allocator import AllocatorSettings
from kvtc.pipeline.fit.heldout_rows import GroupRows
from kvtc.pipeline.job.group_task import GroupTask, solved_name, spectrum_name
from kvtc.pipeline.job.reduce_tasks import Placement, result_name, rows_name, run_groups
from kvtc.pipeline.job.store import ShardStore
from kvtc.workers.capture import CaptureSettings
from kvtc.workers.stats import CalibrationStats, _upper_gram_update

P = 48


def _rows(stream: str, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed + (0 if stream == "keys" else 100))
    scale = np.linspace(3, 0.2, P) if stream == "keys" else np.linspace(1, 0.5, P) ** 3
    return (rng.standard_normal((600, P)) * scale).astype(np.float32)


def make_store(root: str | os.PathLike, seed: int = 0, accumulator: str = "acc0") -> ShardStore:
    """A store holding one accumulator of both streams (400 rows each) under scope ("m", "c")."""
    store = ShardStore(str(root), "m", "c")
    stats = CalibrationStats.new({"num_layers": 1, "num_kv_heads": 1, "head_dim": P}, CaptureSettings(sinks=0, window=0),
                                 shard_ids=("s0",))
    for stream in ("keys", "values"):
        x = _rows(stream, seed)
        m = stats._get(stream, 0, torch.device("cpu"))
        m.n = 400
        m.sum += torch.from_numpy(x[:400]).double().sum(0)
        _upper_gram_update(m.gram, torch.from_numpy(x[:400]))
    store.put_acc(accumulator, stats)
    return store


def make_tasks(ratios: tuple[float, ...] = (4.0,), accumulator: str = "acc0") -> list[GroupTask]:
    return [GroupTask(index=i, stream=stream, group=0, p=P, accumulators=(accumulator,), ratios=ratios,
                      allocator=AllocatorSettings(), sinks=0, window=0, threads=1)
            for i, stream in enumerate(("keys", "values"))]


def put_rows(store: ShardStore, tasks: list[GroupTask], seed: int = 0) -> None:
    for task in tasks:
        rows = GroupRows(_rows(task.stream, seed)[400:], np.arange(200) % 100, 100)
        store.put_basis(rows_name(task), rows.arrays(), {"seq_len": 100})


def reduce_once(store: ShardStore, tasks: list[GroupTask], solve_only: bool = False, seed: int = 0) -> list:
    """The reduce's `run_groups` in this process (rows written first, kept after)."""
    put_rows(store, tasks, seed)
    run = [replace(t, solve_only=True) for t in tasks] if solve_only else tasks
    return run_groups(run, store, Placement(0, 1), [0] * len(run), 1 << 40, keep_rows=True)


def object_path(store: ShardStore, name: str) -> Path:
    return Path(store._basis_path(name))


def swap(store: ShardStore, a: str, b: str) -> None:
    """Exchange two stored objects' files (a writer of the store with no key)."""
    pa, pb = object_path(store, a), object_path(store, b)
    tmp = pa.with_suffix(".swap")
    os.replace(pa, tmp)
    os.replace(pb, pa)
    os.replace(tmp, pb)


def copy_from(source: ShardStore, name: str, store: ShardStore, as_name: str) -> None:
    """Copy another job's object under this job's name."""
    target = object_path(store, as_name)
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(object_path(source, name), target)


def same_results(a: list, b: list) -> bool:
    """Two reduces' GroupResults are the same basis and allocations, bit for bit."""
    return all(np.array_equal(x.basis[2], y.basis[2]) and np.array_equal(x.basis[0], y.basis[0])
               and x.allocations == y.allocations for x, y in zip(a, b)) and len(a) == len(b)


__all__ = ["P", "make_store", "make_tasks", "put_rows", "reduce_once", "object_path", "swap", "copy_from",
           "same_results", "solved_name", "spectrum_name", "result_name"]
