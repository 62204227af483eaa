"""The reduce's memory plan (pipeline/job/reduce_plan.py): each solver's true peak, the solver chosen
within a task's budget, tasks admitted while their sum fits, the refusal naming what would fit, and
a group task that resumes after its checkpointed solve instead of solving again."""
import tracemalloc

import numpy as np
import pytest

from kvtc.pipeline.fit.pca import exact_eigh, exact_peak_bytes, fix_signs
from kvtc.pipeline.job import reduce_plan as rp
from kvtc.pipeline.job.reduce_plan import GIB, GpuSolve, Planned, Solver, choose, schedule, task_bytes, widen


@pytest.mark.parametrize("driver", ["evd", "evr", "evd32"])
def test_exact_solve_works_in_place_within_its_planned_peak(driver):
    p, k = 700, 690
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2 * p, p)) * np.linspace(2, 0.1, p)
    full = x.T @ x / (2 * p)
    want_vals, want_vecs = np.linalg.eigh(full)
    single = driver == "evd32"
    cov = full.astype(np.float32) if single else np.triu(full)  # float64: only the upper triangle is read
    tracemalloc.start()
    base, _ = tracemalloc.get_traced_memory()
    matrix = (4 if single else 8) * p * p
    vals, vecs = exact_eigh(cov, k, driver)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    # beside the matrix itself: syevd's 2 p^2 workspace then the (p, k) result; syevr's p^2 eigenvectors
    assert peak - base <= exact_peak_bytes(p, k, driver) - matrix + (256 << 10)
    assert (peak - base) / matrix < {"evd": 2.2, "evr": 1.2, "evd32": 4.2}[driver]
    if single:  # float32: the spectrum to float32 rounding of its largest eigenvalue, the vectors nearly orthonormal
        np.testing.assert_allclose(vals, want_vals[::-1][:k], rtol=1e-4, atol=1e-6 * want_vals[-1])
        np.testing.assert_allclose(vecs.T @ vecs, np.eye(k), atol=1e-5)
        top = 50  # the well separated leading components agree with float64's
        np.testing.assert_allclose(np.abs(np.sum(vecs[:, :top] * want_vecs[:, ::-1][:, :top], axis=0)), 1.0, atol=1e-4)
    else:
        np.testing.assert_allclose(vals, want_vals[::-1][:k], rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(vecs, fix_signs(want_vecs[:, ::-1][:, :k]), atol=1e-8)
    assert vecs.flags.c_contiguous and vecs.shape == (p, k) and vecs.dtype == np.float64


def test_solver_is_chosen_within_the_task_budget():
    p, bound, rows = 16384, 16131, 1024
    evd = task_bytes(p, bound, rows, Solver("exact", bound, "evd"))
    evr = task_bytes(p, bound, rows, Solver("exact", bound, "evr"))
    evd32 = task_bytes(p, bound, rows, Solver("exact", bound, "evd32"))
    assert evr < evd32 < evd and 6.4e9 < evd < 8.5e9 < 1.2 * evd  # syevd at p = 16384: the matrix and 2 p^2 of workspace
    assert choose(p, bound, evd32, rows) == Solver("exact", bound, "evd32")  # float32 syevd when it fits
    assert choose(p, bound, evd32 - 1, rows) == Solver("exact", bound, "evr")  # only syevr's smaller peak fits
    assert choose(p, bound, evr - 1, rows).method == "subspace"
    assert choose(32768, 1000, 1 << 50).method == "subspace"  # few components: subspace whatever fits
    assert choose(2048, 2000, 0) == Solver("exact", 2000)  # small p: always exact
    assert widen(32768, 2048, 32000, 1 << 50) == Solver("exact", 32000, "evd32")
    assert widen(32768, 2048, 32000, 0) == Solver("subspace", 4096)
    # cuSOLVER's syevd before CUDA 13 stops near n = 25K: larger groups solve on the CPU
    assert choose(16384, bound, 1 << 50, gpu=GpuSolve(80 * GIB, 12)).device == "cuda"
    assert choose(32768, 32000, 1 << 50, gpu=GpuSolve(140 * GIB, 12)).device == "cpu"
    assert choose(32768, 32000, 1 << 50, gpu=GpuSolve(140 * GIB, 13)).device == "cuda"
    assert choose(32768, 32000, 1 << 50, gpu=GpuSolve(16 * GIB, 13)).device == "cpu"  # does not fit the GPU


def test_tasks_run_side_by_side_only_while_their_sum_fits():
    peaks = [8 * GIB, 8 * GIB, 8 * GIB, 8 * GIB, 1 * GIB, 1 * GIB]
    assert schedule(peaks, 12 * GIB, 2) == [[0], [1], [2], [3, 4], [5]]
    assert schedule(peaks, 17 * GIB, 2) == [[0, 1], [2, 3], [4, 5]]
    assert schedule(peaks, 17 * GIB, 1) == [[i] for i in range(6)]
    assert schedule(peaks, 12 * GIB, 4) == [[0], [1], [2], [3, 4, 5]]
    assert not rp.admit([8 * GIB], 8 * GIB, 12 * GIB, 4) and rp.admit([], 99 * GIB, 12 * GIB, 1)


def test_a_group_that_cannot_fit_alone_is_refused_naming_it_and_the_memory():
    plans = [Planned(0, "keys group 0", 32768, Solver("exact", 32000, "evr"), 18 * GIB),
             Planned(1, "values group 0", 32768, Solver("exact", 32000, "evr"), 18 * GIB)]
    with pytest.raises(ValueError, match=r"keys group 0, values group 0 need up to 18\.0 GiB.*p = 32768.*"
                                         r"--groups layers:K"):
        rp.refuse_unless_fits(plans, 12 * GIB, 24 * GIB, 8 * GIB)
    rp.refuse_unless_fits(plans, 18 * GIB, 24 * GIB, 1 * GIB)


def test_the_budget_is_the_memory_monitors_line_less_what_the_node_uses(monkeypatch):
    monkeypatch.delenv("RAY_memory_usage_threshold", raising=False)
    assert rp.node_budget(100 * GIB, 10 * GIB) == pytest.approx((0.95 - rp.MARGIN) * 100 * GIB - 10 * GIB, abs=2)
    monkeypatch.setenv("RAY_memory_usage_threshold", "0.8")
    assert rp.node_budget(100 * GIB, 10 * GIB) == pytest.approx((0.8 - rp.MARGIN) * 100 * GIB - 10 * GIB, abs=2)


def test_the_plan_refuses_a_geometry_whose_reduce_cannot_fit_before_any_model_work(tmp_path, monkeypatch):
    import psutil

    from kvtc.pipeline.job import calibrate
    from kvtc.pipeline.settings import JobSettings

    class Small:  # a 12 GiB node with 1 GiB in use: the fold's one accumulator fits, the reduce's p = 32768 does not
        total, available = 12 * GIB, 11 * GIB

    monkeypatch.setattr(psutil, "virtual_memory", lambda: Small)
    cfg = JobSettings.of(model="tiny:llama@32x8x128x32", corpus="pydoc", eval_corpus=None, tokens=4096, seq_len=512,
                         seqs_per_shard=4, ratios=(8.0,), accumulators=1, registry=str(tmp_path / "reg"), store=str(tmp_path / "store"),
                         name="big")
    with pytest.raises(ValueError, match=r"GiB for the reduce .*--groups layers:\d+"):
        calibrate.plan_job(cfg, in_process=True)


def test_a_group_task_resumes_after_its_checkpointed_solve(tmp_path, monkeypatch):
    from kvtc.pipeline.fit.heldout_rows import GroupRows
    from kvtc.pipeline.fit.allocator import AllocatorSettings
    from kvtc.pipeline.job import basis_solver, group_task
    from kvtc.pipeline.job.group_task import GroupTask, load_solved
    from kvtc.pipeline.job.reduce_tasks import clear, result_name, rows_name, run_stored
    from kvtc.pipeline.job.store import ShardStore
    from kvtc.workers.capture import CaptureSettings
    from kvtc.workers.stats import CalibrationStats
    import torch

    p, store = 48, ShardStore(str(tmp_path), "m", "c")
    fp = {"num_layers": 1, "num_kv_heads": 1, "head_dim": p}
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((600, p)) * np.linspace(3, 0.2, p)).astype(np.float32)
    stats = CalibrationStats.new(fp, CaptureSettings(sinks=0, window=0), shard_ids=("s0",))
    from kvtc.workers.stats import _upper_gram_update

    for stream in ("keys", "values"):
        m = stats._get(stream, 0, torch.device("cpu"))
        m.n = 400
        m.sum += torch.from_numpy(x[:400]).double().sum(0)
        _upper_gram_update(m.gram, torch.from_numpy(x[:400]))
    store.put_acc("acc0", stats)
    task = GroupTask(index=0, stream="keys", group=0, p=p, accumulators=("acc0",), ratios=(4.0,),
                     allocator=AllocatorSettings(), sinks=0, window=0, threads=1)
    rows = GroupRows(x[400:], np.arange(200) % 100, 100)
    store.put_basis(rows_name(task), rows.arrays(), {"seq_len": 100})

    calls = {"solve": 0}
    real_solve, real_fit = basis_solver.solve, group_task.fit_group

    def counting_solve(*a, **kw):
        calls["solve"] += 1
        return real_solve(*a, **kw)

    def killed(*a, **kw):  # the node kills the task after its solve
        raise MemoryError("killed")

    monkeypatch.setattr(group_task, "solve", counting_solve)
    monkeypatch.setattr(group_task, "fit_group", killed)
    with pytest.raises(MemoryError):
        run_stored(task, store)
    assert calls["solve"] == 1 and load_solved(store, task) is not None
    monkeypatch.setattr(group_task, "fit_group", real_fit)
    name = run_stored(task, store)  # the retry: no second solve
    assert calls["solve"] == 1 and name == result_name(task)
    assert load_solved(store, task) is None  # the result replaces the checkpoint
    arrays, meta = store.get_basis(name)
    assert meta["solves"][0]["resumed"] is True
    assert run_stored(task, store) == name and calls["solve"] == 1  # a stopped job resumes at its results
    fresh = group_task.run_group(task, store, rows)  # solved from scratch: the same basis bit for bit
    np.testing.assert_array_equal(fresh.basis[2], arrays["components"])
    clear([task], store)
    assert not store.has_basis(name) and not store.has_basis(rows_name(task))


class _FakeRay:
    """Just enough of Ray for the reduce's scheduler: tasks finish in submission order; `kills` says how many
    times the node kills each task index for memory."""

    def __init__(self, kills: dict[int, int]) -> None:
        self.kills, self.refs, self.running, self.together = dict(kills), {}, [], []
        self.exceptions = type("exceptions", (), {"OutOfMemoryError": type("OutOfMemoryError", (Exception,), {})})

    def nodes(self):
        return [{"Alive": True, "Resources": {"memory": float(1 << 50)}}]

    def remote(self, **_):
        fake = self

        class Submit:
            def remote(self, *args):
                ref = object()
                fake.refs[ref] = args[-1]["index"]
                fake.running.append(ref)
                fake.together.append(sorted(fake.refs[r] for r in fake.running))
                return ref

        class Remote:
            def options(self, **_):
                return Submit()

        return lambda fn: Remote()

    def wait(self, refs, num_returns=1):
        return [refs[0]], refs[1:]

    def get(self, ref):
        i = self.refs[ref]
        self.running.remove(ref)
        if self.kills.get(i, 0):
            self.kills[i] -= 1
            raise self.exceptions.OutOfMemoryError(f"task {i} killed")
        return {"ok": f"result-{i}"}

    def cancel(self, ref, force=False):
        pass


def _schedule_on(fake, monkeypatch, peaks, budget, workers=2):
    import sys

    from kvtc.pipeline.fit.allocator import AllocatorSettings
    from kvtc.pipeline.job import reduce_tasks
    from kvtc.pipeline.job.group_task import GroupTask
    from kvtc.pipeline.job.progress import ReduceProgress

    monkeypatch.setitem(sys.modules, "ray", fake)
    monkeypatch.setitem(sys.modules, "ray.exceptions", fake.exceptions)
    tasks = [GroupTask(index=i, stream="keys", group=i, p=8, accumulators=("a",), ratios=(8.0,),
                       allocator=AllocatorSettings(), sinks=0, window=0, threads=1) for i in range(len(peaks))]
    store = type("Store", (), {"root": "r", "model_id": "m", "capture_key": "c"})()
    progress = ReduceProgress([f"keys group {i}" for i in range(len(peaks))], [8] * len(peaks), bar=False)
    reduce_tasks._on_ray(tasks, list(range(len(peaks))), store, reduce_tasks.Placement(workers, 1), peaks, budget, progress)
    return progress


def test_the_reduce_admits_tasks_only_while_their_planned_peaks_fit(monkeypatch):
    fake = _FakeRay({})
    progress = _schedule_on(fake, monkeypatch, [8 * GIB, 8 * GIB, 1 * GIB, 1 * GIB], 12 * GIB)
    assert max(len(t) for t in fake.together) == 2 and progress.kills == 0
    assert all(sum([8, 8, 1, 1][i] for i in t) <= 12 for t in fake.together)  # the two large ones never together


def test_a_task_the_node_kills_runs_again_alone_and_twice_alone_stops_the_job(monkeypatch, capsys):
    fake = _FakeRay({0: 1})
    progress = _schedule_on(fake, monkeypatch, [2 * GIB] * 3, 12 * GIB)
    assert progress.kills == 1 and [0] in fake.together[2:]  # the rerun of task 0 had nothing beside it
    assert "the node killed keys group 0 for memory" in capsys.readouterr().err
    with pytest.raises(MemoryError, match=r"keys group 1 for memory twice.*checkpointed"):
        _schedule_on(_FakeRay({1: 2}), monkeypatch, [2 * GIB] * 3, 12 * GIB)


def test_a_float32_exact_solve_from_the_store_matches_the_float64_one(tmp_path):
    from kvtc.pipeline.job.basis_solver import solve
    from kvtc.pipeline.job.store import ShardStore
    from kvtc.workers.capture import CaptureSettings
    from kvtc.workers.stats import CalibrationStats, _upper_gram_update
    import torch

    p, store = 64, ShardStore(str(tmp_path), "m", "c")
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((900, p)) * np.linspace(3, 0.2, p) + 1.5).astype(np.float32)
    stats = CalibrationStats.new({"num_layers": 1, "num_kv_heads": 1, "head_dim": p}, CaptureSettings(sinks=0, window=0),
                                 shard_ids=("s0",))
    for stream in ("keys", "values"):
        m = stats._get(stream, 0, torch.device("cpu"))
        m.n = 900
        m.sum += torch.from_numpy(x).double().sum(0)
        _upper_gram_update(m.gram, torch.from_numpy(x))
    store.put_acc("acc0", stats)
    f64 = solve(store, ["acc0"], "keys", 0, p, method="exact", driver="evd").basis
    f32 = solve(store, ["acc0"], "keys", 0, p, method="exact", driver="evd32")
    assert f32.driver == "evd32" and f32.basis.components.dtype == np.float64
    np.testing.assert_allclose(f32.basis.eigenvalues, f64.eigenvalues, rtol=1e-4, atol=1e-6 * f64.eigenvalues[0])
    np.testing.assert_allclose(np.abs(np.sum(f32.basis.components * f64.components, axis=0))[:32], 1.0, atol=1e-4)
    np.testing.assert_allclose(f32.basis.mean, f64.mean)
    assert f32.basis.total_variance == pytest.approx(f64.total_variance)
