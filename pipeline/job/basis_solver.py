"""The reducer's heavy step: sum the accumulators of one stream and group, and solve its PCA.

One stream and group at a time, from the packed upper triangles: the running sum and the
accumulator being added (two packed Grams), then one p x p float64 matrix for the eigensolver once
the sum is unpacked (the packed sum is released): about 3 packed Grams at the peak. Only the
components the least aggressive ratio could keep are computed (`max_components`).

Where: on a cluster with GPUs, a Ray task with one GPU runs it (torch `eigh` in float64 on the
device) and hands the basis back through the shard store (checksummed arrays, no pickle);
otherwise it runs in this process on the CPU, on every core (`every_core`).

How (`choose_solver`, from k / p): exact (one LAPACK solve, pca.exact_eigh) whenever the
allocation may need most components and the exact solve fits in memory, or p is small; subspace
iteration only when the allocation can keep few components (k <= p / FEW_SHARE), or the exact
solve does not fit. A subspace that the allocation fills (keeps > 80% of it) is followed by one
exact solve if it fits, else a subspace twice as wide.
"""
from __future__ import annotations

import hashlib
import json
import time

import numpy as np

from kvtc.pipeline.fit.allocator import AllocatorSettings
from kvtc.pipeline.fit.pca import EXACT_MAX_P, Basis, every_core, pca_from_packed
from kvtc.pipeline.job.store import ShardStore


def max_components(p: int, ratios, settings: AllocatorSettings) -> int:
    """Most components any allocation at `ratios` can keep, within the basis budget (AllocatorSettings.kept_bound)."""
    return settings.kept_bound(p, ratios)


FEW_SHARE = 8  # subspace iteration pays when the allocation can keep at most p / FEW_SHARE components
SUBSPACE_START = 512  # first subspace width: max(SUBSPACE_START, p / 16)


def exact_bytes(p: int) -> int:
    """Peak bytes of an exact CPU solve: the packed Gram, the p x p float64 matrix, syevd's workspace."""
    return 8 * (p * (p + 1) // 2) + 8 * p * p * 3


def choose_solver(p: int, bound: int, on_gpu: bool, free_bytes: int) -> tuple[str, int]:
    """(method, k) of the first solve of a group of p features whose allocations keep at most `bound`."""
    if on_gpu or p <= EXACT_MAX_P:
        return "exact", bound
    if bound * FEW_SHARE <= p:
        return "subspace", bound
    if exact_bytes(p) <= free_bytes:
        return "exact", bound
    return "subspace", min(bound, max(SUBSPACE_START, p // 16))


def next_solve(p: int, k: int, bound: int, free_bytes: int) -> tuple[str, int]:
    """(method, k) after a subspace of k components that the allocation filled."""
    return ("exact", bound) if exact_bytes(p) <= free_bytes else ("subspace", min(bound, 2 * k))


def sum_accumulators(store: ShardStore, names: list[str], stream: str, group: int) -> tuple[int, np.ndarray, np.ndarray]:
    """(n, sum (p,), packed Gram (p(p+1)/2,)) of (stream, group) over `names`, added in that order."""
    n, total, packed = 0, None, None
    for name in names:
        part = store.get_acc(name, keys=[(stream, group)])
        pn, ps, pg = part.packed(stream, group)
        if packed is None:
            n, total, packed = pn, ps.copy(), pg
        else:
            n += pn
            total += ps
            packed += pg
        del part, pg
    if packed is None:
        raise ValueError("no training statistics to reduce; the corpus gave no training shard")
    return n, total, packed


def solve(store: ShardStore, names: list[str], stream: str, group: int, k: int, device: str = "cpu",
          method: str = "auto") -> tuple[Basis, dict]:
    """Basis of (stream, group) from the stored accumulators -> (basis, timings {sum_s, eig_s})."""
    t0 = time.perf_counter()
    n, total, packed = sum_accumulators(store, names, stream, group)
    t1 = time.perf_counter()
    p = total.shape[0]
    k = min(k, p)
    if method == "auto" or device.startswith("cuda") or k == p:
        method = "exact" if device.startswith("cuda") or p <= EXACT_MAX_P or k == p else "subspace"
    with every_core():
        basis = pca_from_packed(n, total, packed, k=k, device=device, method=method)
    return basis, {"sum_s": t1 - t0, "eig_s": time.perf_counter() - t1, "method": method}


def _task_name(names: list[str], stream: str, group: int, k: int) -> str:
    key = json.dumps([names, stream, group, k]).encode()
    return f"{stream}-g{group}-{hashlib.sha256(key).hexdigest()[:16]}"


def solve_on_gpu_task(root: str, model_id: str, capture_key: str, names: list[str], stream: str, group: int, k: int) -> dict:
    """Body of the Ray task: solve on the GPU torch sees (CPU if none), write the basis to the store."""
    import torch

    store = ShardStore(root, model_id, capture_key)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    basis, timing = solve(store, names, stream, group, k, device)
    name = _task_name(names, stream, group, k)
    store.put_basis(name, {"mean": basis.mean, "eigenvalues": basis.eigenvalues, "components": basis.components},
                    {"total_variance": basis.total_variance, "n": basis.n})
    return {"name": name, "device": device, **timing}


def solve_group(store: ShardStore, names: list[str], stream: str, group: int, k: int, on_cluster_gpu: bool,
                method: str = "auto") -> tuple[Basis, dict]:
    """Basis of one stream and group: a one-GPU Ray task when `on_cluster_gpu`, else in-process on CPU."""
    if not on_cluster_gpu:
        basis, timing = solve(store, names, stream, group, k, "cpu", method)
        return basis, {**timing, "device": "cpu (driver)"}
    import ray

    task = ray.remote(num_gpus=1, num_cpus=1, max_retries=2)(solve_on_gpu_task)
    out = ray.get(task.remote(store.root, store.model_id, store.capture_key, names, stream, group, k))
    arrays, meta = store.get_basis(out["name"])
    store.drop_basis(out["name"])
    basis = Basis(arrays["mean"], arrays["eigenvalues"], arrays["components"], float(meta["total_variance"]), int(meta["n"]))
    return basis, {"sum_s": out["sum_s"], "eig_s": out["eig_s"], "method": out["method"], "device": f"{out['device']} (Ray task)"}
