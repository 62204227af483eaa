"""One stream and group of the reduce: solve -> fit -> measure, the unit a reduce worker runs.

`run_group` is the one path, in the driver (in-process jobs) or in a Ray task (`reduce_tasks`): it
solves the basis from the stored accumulators (`basis_solver`), fits the DP allocations and ECSQ
tables (`fit.group_fit`) and measures both modes (`evaluation.measure`), each a typed result with
its own seconds. A subspace solve whose components the allocation fills is followed by an exact
solve (or a wider subspace where that does not fit), before anything is measured.

Results cross processes through the shard store as one checksummed object (arrays + JSON, no
pickle): `GroupResult.arrays_and_meta` / `GroupResult.from_stored`; JSON round-trips floats
exactly, so a result read back equals the one written.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import sys

from dataclasses import asdict, dataclass, field, fields

import numpy as np

from kvtc.pipeline.evaluation.diagnostics import PrefixSolver, group_prefix_partials
from kvtc.pipeline.evaluation.measure import CURVES, GroupMeasure, measure_group
from kvtc.pipeline.fit.allocator import AllocatorSettings
from kvtc.pipeline.fit.group_fit import GroupFit, fit_group
from kvtc.pipeline.fit.heldout_rows import GroupRows
from kvtc.pipeline.fit.metric import AttentionMetric, Whitening
from kvtc.pipeline.fit.pca import Basis, cpu_threads
from kvtc.pipeline.job.basis_solver import Moments, metric_whitening, prefix_moments, solve
from kvtc.pipeline.job.reduce_plan import Solver, choose, widen
from kvtc.pipeline.job.store import ShardStore

KEEP_MARGIN = 0.8  # a truncated basis stands when every allocation keeps fewer than this share of it


@dataclass(frozen=True)
class TokensCurve:
    """The error-by-tokens points one group measures: `points`, prefix lengths in accumulators (the last one
    all of them), at `ratio`, each prefix's basis of `k` components."""

    points: tuple[int, ...]
    ratio: float
    k: int

    def to_json(self) -> dict:
        return {"points": list(self.points), "ratio": self.ratio, "k": self.k}

    @classmethod
    def from_json(cls, d: dict) -> "TokensCurve":
        return cls(tuple(int(c) for c in d["points"]), float(d["ratio"]), int(d["k"]))


@dataclass(frozen=True, kw_only=True)
class GroupTask:
    """What one stream and group's reduce needs besides its rows: the accumulators to sum (in order),
    the ratios and allocator settings, sinks and window, the device of the solve, the CPU threads it
    may use (fixed per job, so the result does not depend on how many workers ran), the bytes it may
    hold (`budget`) and the solver the reduce plan chose within them (None: `reduce_plan.choose` in the task).
    metric: the attention objective's metric (None: the cache's own squared error). curve: the error-by-tokens
    points this group measures (None: no curve). budgets: bits per token per ratio (a joint split's shares,
    `fit.joint_budget`); None: each ratio's floor(16 p / CR). solve_only: solve and checkpoint the basis and its
    spectrum, nothing more (the joint split's first pass; the task with budgets then resumes from that
    checkpoint). Typed inside; `to_json` / `from_json` are its JSON edge (across processes, and what its
    checkpoints are named by and bound to: `key`, `bound`)."""

    index: int
    stream: str
    group: int
    p: int
    accumulators: tuple[str, ...]
    ratios: tuple[float, ...]
    allocator: AllocatorSettings
    sinks: int
    window: int
    threads: int
    device: str = "cpu"
    budget: int = 0
    metric: AttentionMetric | None = None
    solver: Solver | None = None
    curve: TokensCurve | None = None
    budgets: tuple[int, ...] | None = None
    solve_only: bool = False

    @property
    def checkpoints(self) -> tuple[int, ...]:
        """The error-by-tokens prefixes, in accumulators (the last one may be all of them)."""
        return self.curve.points if self.curve is not None else ()

    @property
    def prefixes(self) -> tuple[int, ...]:
        """The prefixes short of every accumulator: running sums the solve copies (the last point, when it is
        every accumulator, is the solve's own basis)."""
        return tuple(c for c in self.checkpoints if c < len(self.accumulators))

    @property
    def prefixes_held(self) -> int:
        """Running sums the solve copies for the curve."""
        return len(self.prefixes)

    @property
    def curve_k(self) -> int:
        """Components of each prefix basis (0 without a curve)."""
        return min(self.curve.k, self.p) if self.curve is not None else 0

    PLACEMENT = ("budget", "solver", "device")  # where and how it runs, not what it computes
    PASS = ("budgets", "solve_only")  # which pass: both share the solve's checkpoint (results name the budgets)

    def __post_init__(self) -> None:
        if self.stream not in ("keys", "values") or self.p < 1 or self.threads < 1 or not self.accumulators:
            raise ValueError(f"GroupTask: bad stream {self.stream!r}, p {self.p}, threads {self.threads} "
                             f"or no accumulators")

    def to_json(self) -> dict:
        """Every field in order, its typed ones as the dicts they were before they were typed (the names and
        bindings of checkpoints written by earlier releases stand)."""
        return {**{f.name: getattr(self, f.name) for f in fields(self)}, "allocator": self.allocator.to_dict(),
                "metric": None if self.metric is None else self.metric.to_json(),
                "solver": None if self.solver is None else asdict(self.solver),
                "curve": None if self.curve is None else self.curve.to_json()}

    @classmethod
    def from_json(cls, d: dict) -> "GroupTask":
        metric, solver, curve, budgets = (d.get(k) for k in ("metric", "solver", "curve", "budgets"))
        return cls(**{**d, "accumulators": tuple(d["accumulators"]), "ratios": tuple(float(r) for r in d["ratios"]),
                      "allocator": AllocatorSettings.from_dict(d["allocator"]),
                      "metric": None if metric is None else AttentionMetric(**metric),
                      "solver": None if solver is None else Solver(**solver),
                      "curve": None if curve is None else TokensCurve.from_json(curve),
                      "budgets": None if budgets is None else tuple(int(b) for b in budgets)})

    def settings(self) -> dict:
        """What the task computes (not its memory budget, solver choice or pass): its checkpoints' identity."""
        return {k: v for k, v in self.to_json().items() if k not in self.PLACEMENT + self.PASS}

    def key(self) -> str:
        """`settings` hashed, for its checkpoints' names."""
        digest = hashlib.sha256(json.dumps(self.settings(), sort_keys=True).encode()).hexdigest()[:16]
        return f"{self.stream}-g{self.group}-{digest}"

    def bound(self, kind: str) -> dict:
        """What a stored object of this task (`kind`: solved, spectrum, result) is bound to inside its authenticated
        footer (`ShardStore.put_basis`): the kind, stream, group and settings, and a result its pass's budgets.
        An object copied from another task, stream, pass or job then fails its check and is recomputed."""
        out = {"kind": kind, "stream": self.stream, "group": self.group, "settings": self.settings()}
        if kind == "result":
            out["budgets"] = None if self.budgets is None else list(self.budgets)
        return out

    def pass_key(self) -> str:
        """`key` and the pass: what a result is stored under."""
        if self.solve_only:
            return f"{self.key()}-solve"
        if self.budgets is None:
            return self.key()
        return f"{self.key()}-{hashlib.sha256(json.dumps(list(self.budgets)).encode()).hexdigest()[:12]}"


@dataclass(frozen=True)
class Solved:
    """One solve of a group's basis: method, components solved, where, and its seconds."""

    method: str
    k: int
    device: str
    sum_s: float
    eig_s: float
    driver: str = ""
    resumed: bool = False  # read back from the task's checkpoint (a retried task), not solved again


@dataclass
class GroupResult:
    """Everything one stream and group contributes to the artifact: its basis (mean (p,), eigenvalues
    (kept,), components (p, kept), float32), the DP allocations and ECSQ tables per (ratio, stream,
    group), the measurement, warnings, the rows that built the basis, and each stage's seconds.
    decoder (p, kept) float32: the attention objective's decode matrix (basis[2] is then the encoder)."""

    stream: str
    group: int
    basis: tuple[np.ndarray, np.ndarray, np.ndarray]
    allocations: dict
    ecsq: dict
    measure: GroupMeasure
    notes: list[str]
    train_rows: int
    solves: list[Solved] = field(default_factory=list)
    fit_s: float = 0.0
    decoder: np.ndarray | None = None
    metric_root: np.ndarray | None = None  # the attention metric's S blocks (blocks, d, d) float32
    by_tokens: list[dict] = field(default_factory=list)  # error-by-tokens partials {tokens, split, err, norm}

    @property
    def solve_s(self) -> float:
        return sum(s.sum_s + s.eig_s for s in self.solves)

    def arrays_and_meta(self) -> tuple[dict[str, np.ndarray], dict]:
        arrays = {"mean": self.basis[0], "eigenvalues": self.basis[1], "components": self.basis[2]}
        if self.decoder is not None:
            arrays["decoder"] = self.decoder
        if self.metric_root is not None:
            arrays["metric_root"] = self.metric_root
        tables = []
        for i, ((ratio, _, _), t) in enumerate(self.ecsq.items()):
            arrays.update({f"ecsq{i}.scales": t["scales"], f"ecsq{i}.model": t["model"], f"ecsq{i}.offsets": t["offsets"]})
            arrays.update({f"ecsq{i}.counts{j}": counts for j, (_, counts) in enumerate(t["models"])})
            tables.append({"ratio": ratio, "radii": [int(r) for r, _ in t["models"]],
                           **{k: t[k] for k in ("budget_bits", "step", "kept", "bits_per_token", "heldout_rows")}})
        m = self.measure
        meta = {"stream": self.stream, "group": self.group, "notes": self.notes, "train_rows": self.train_rows,
                "allocations": [[list(key), value] for key, value in self.allocations.items()], "ecsq": tables,
                "metrics": m.metrics, "curves": m.curves, "measure_s": m.seconds, "fit_s": self.fit_s,
                "partials": [[list(k), v] for k, v in m.partials.items()],
                "ecsq_partials": [[list(k), v] for k, v in m.ecsq_partials.items()],
                "solves": [asdict(s) for s in self.solves], "by_tokens": self.by_tokens}
        return arrays, meta

    @classmethod
    def from_stored(cls, arrays: dict[str, np.ndarray], meta: dict) -> "GroupResult":
        stream, group = meta["stream"], int(meta["group"])
        ecsq = {}
        for i, t in enumerate(meta["ecsq"]):
            ecsq[(float(t["ratio"]), stream, group)] = {
                **{k: t[k] for k in ("budget_bits", "step", "kept", "bits_per_token", "heldout_rows")},
                "scales": arrays[f"ecsq{i}.scales"], "model": arrays[f"ecsq{i}.model"],
                "offsets": arrays[f"ecsq{i}.offsets"],
                "models": [(int(r), arrays[f"ecsq{i}.counts{j}"]) for j, r in enumerate(t["radii"])]}
        allocations = {(float(k[0]), k[1], int(k[2])): {**v, "blocks": [tuple(b) for b in v["blocks"]]}
                       for k, v in meta["allocations"]}
        measure = GroupMeasure(metrics=meta["metrics"], curves={name: meta["curves"].get(name, []) for name in CURVES},
                               partials={tuple(k): v for k, v in meta["partials"]},
                               ecsq_partials={tuple(k): v for k, v in meta["ecsq_partials"]}, seconds=meta["measure_s"])
        return cls(stream, group, (arrays["mean"], arrays["eigenvalues"], arrays["components"]), allocations, ecsq,
                   measure, list(meta["notes"]), int(meta["train_rows"]), [Solved(**s) for s in meta["solves"]],
                   float(meta["fit_s"]), arrays.get("decoder"), arrays.get("metric_root"), list(meta.get("by_tokens", [])))


def whitened_rows(rows: GroupRows, whitening: Whitening) -> GroupRows:
    """The held-out rows in the metric's space (x S), where the fit and the measurement run unchanged."""
    def w(x: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(whitening.apply(x), dtype=np.float32)

    return GroupRows(w(rows.rows), rows.positions, rows.seq_len, None if rows.evals is None else w(rows.evals))


def solved_name(task: GroupTask) -> str:
    return f"solved-{task.key()}"


def save_solved(store: ShardStore, task: GroupTask, basis: Basis, solved: Solved,
                by_tokens: list[dict] | None = None) -> None:
    """The solve's basis, float64, checkpointed before the fit (with the curve's partials measured during it):
    a retried task, or the joint split's second pass, resumes after it."""
    store.put_basis(solved_name(task), {"mean": basis.mean, "eigenvalues": basis.eigenvalues,
                                         "components": basis.components},
                    {"solved": asdict(solved), "total_variance": basis.total_variance, "n": basis.n,
                     "by_tokens": by_tokens}, task.bound("solved"))


def load_solved(store: ShardStore, task: GroupTask) -> tuple[Basis, Solved, list[dict] | None] | None:
    """The checkpointed solve of this task (basis, how, the curve's partials or None), or None (absent; a
    corrupt one is set aside by the store)."""
    name = solved_name(task)
    if not store.has_basis(name):
        return None
    try:
        arrays, meta = store.get_basis(name, task.bound("solved"))
    except ValueError as exc:  # CorruptStats (unreadable, or another task's): moved aside, solve again
        print(f"kvtc: {exc}; solving it again", file=sys.stderr)
        return None
    basis = Basis(arrays["mean"], arrays["eigenvalues"], arrays["components"], float(meta["total_variance"]),
                  int(meta["n"]))
    return basis, Solved(**{**meta["solved"], "resumed": True}), meta.get("by_tokens")


def drop_solved(store: ShardStore, task: GroupTask) -> None:
    store.drop_basis(solved_name(task))


def prefix_partials(task: GroupTask, prefixes: list[Moments], rows: GroupRows, solved: Basis | None = None) -> list[dict]:
    """This group's error-by-tokens partials {tokens, split, err, norm}: each prefix's top-k basis in order
    (`PrefixSolver`), measured on the group's held-out rows, one basis held at a time. `solved`: the group's
    own basis, whose leading components stand for the last point when it is every accumulator (the solve
    already has that prefix's eigenvectors: no subspace iteration repeats them)."""
    solver, out = PrefixSolver(task.curve_k), []
    bases = (solver(n, s, packed) for n, s, packed in prefixes)
    if solved is not None and len(task.accumulators) in task.checkpoints:
        bases = itertools.chain(bases, [truncated(solved, task.curve_k)])
    for b in bases:
        for split, (err, norm) in group_prefix_partials(b, rows, task.curve.ratio, task.sinks,
                                                        task.window).items():
            out.append({"tokens": int(b.n), "split": split, "err": err, "norm": norm})
    return out


def truncated(basis: Basis, k: int) -> Basis:
    """The leading min(k, basis.k) components of `basis` (mean, total variance and rows kept)."""
    k = min(k, basis.k)
    return Basis(basis.mean, basis.eigenvalues[:k], np.ascontiguousarray(basis.components[:, :k]),
                 basis.total_variance, basis.n)


def spectrum_name(task: GroupTask) -> str:
    return f"spectrum-{task.key()}"


def run_group(task: GroupTask, store: ShardStore, rows: GroupRows) -> GroupResult | None:
    """solve -> fit -> measure of one stream and group, on `task.threads` CPU threads; each solve is
    checkpointed in the store, and a checkpoint left by an earlier attempt (or by the joint split's first
    pass) is resumed from. `task.solve_only`: the first solve only, its spectrum stored (`spectrum_name`)."""
    with cpu_threads(task.threads):
        whitening = None
        if task.metric is not None:
            whitening = metric_whitening(store, list(task.accumulators), task.stream, task.group, task.metric)
            rows = whitened_rows(rows, whitening)
        solved = solve_and_fit(task, store, rows, whitening)
        if solved is None:
            return None
        basis, fitted, solves, by_tokens = solved
        if task.curve is not None and by_tokens is None:  # a resumed solve: the running sums are summed again
            by_tokens = prefix_partials(task, prefix_moments(store, list(task.accumulators), task.stream, task.group,
                                                             task.prefixes, whitening), rows, basis)
        measured = measure_group(fitted, task.sinks, task.window)
    return group_result(task, basis, fitted, measured, whitening, solves, by_tokens or [])


def solve_and_fit(task: GroupTask, store: ShardStore, rows: GroupRows, whitening: Whitening | None
                  ) -> tuple[Basis, GroupFit, list[Solved], list[dict] | None] | None:
    """The basis (resumed from the task's checkpoint, else solved and checkpointed) and its fit; a subspace the
    allocation fills is solved again (exact, or wider) until the basis stands. -> (basis, fit, the solves, the
    curve's partials or None), or None for `task.solve_only` (its spectrum stored after the first solve)."""
    bound = task.allocator.kept_bound(task.p, task.ratios, task.budgets)
    n_rows = rows.rows.shape[0] + (0 if rows.evals is None else rows.evals.shape[0])
    solver = first_solver(task, bound, n_rows)
    resumed = load_solved(store, task)
    by_tokens: list[dict] | None = None if resumed is None else resumed[2]
    solves: list[Solved] = []
    while True:
        if resumed is not None:
            (basis, solved, _), resumed = resumed, None
        else:
            basis, solved, by_tokens = solve_once(task, store, rows, whitening, solver, by_tokens)
        solves.append(solved)
        if task.solve_only:
            store.put_basis(spectrum_name(task), {"eigenvalues": basis.eigenvalues},
                            {"k": basis.k, "exact": solved.method == "exact", "n": basis.n}, task.bound("spectrum"))
            return None
        fitted = fit_group(task.stream, task.group, basis, task.ratios, task.allocator, rows, task.sinks, task.window,
                           task.budgets)
        if solved.method == "exact" or basis.k >= bound or fitted.kept < KEEP_MARGIN * basis.k:
            return basis, fitted, solves, by_tokens
        k = basis.k
        del basis, fitted
        solver = widen(task.p, k, bound, task.budget or (1 << 62), n_rows)


def first_solver(task: GroupTask, bound: int, n_rows: int) -> Solver:
    """The task's solver (the reduce plan's, else chosen within its budget), on the task's device."""
    solver = task.solver or choose(task.p, bound, task.budget or (1 << 62), n_rows)
    if task.device.startswith("cuda") != solver.device.startswith("cuda"):
        solver = Solver(solver.method, solver.k, solver.driver, task.device if task.device.startswith("cuda") else "cpu")
    return solver


def solve_once(task: GroupTask, store: ShardStore, rows: GroupRows, whitening: Whitening | None, solver: Solver,
               by_tokens: list[dict] | None) -> tuple[Basis, Solved, list[dict] | None]:
    """One solve with `solver`, checkpointed (`save_solved`); the curve's partials (`by_tokens`, unless already
    measured) measured during it: the prefixes' before the eigensolver (only their sums stay), the last point's on
    the basis. -> (basis, how, the partials)."""
    curve = task.curve is not None and by_tokens is None
    early: list[dict] = []

    def measure_prefixes(prefixes: list[Moments]) -> None:  # before the eigensolver; only the sums stay
        early.extend(prefix_partials(task, prefixes, rows))

    sol = solve(store, list(task.accumulators), task.stream, task.group, solver.k, solver.device, solver.method,
                whitening, solver.driver, task.prefixes if curve else (),
                measure_prefixes if curve and task.prefixes else None)
    basis = sol.basis
    solved = Solved(sol.method, basis.k, solver.device, sol.sum_s, sol.eig_s, sol.driver)
    del sol
    if curve:
        by_tokens = early + prefix_partials(task, [], rows, basis)
    save_solved(store, task, basis, solved, by_tokens)
    return basis, solved, by_tokens


def group_result(task: GroupTask, basis: Basis, fitted: GroupFit, measured: GroupMeasure, whitening: Whitening | None,
                 solves: list[Solved], by_tokens: list[dict]) -> GroupResult:
    """The group's result: its basis cut to what the allocations keep (back from the metric's space), the
    allocations and ECSQ tables per ratio, the measurement, warnings and seconds."""
    kept = fitted.kept
    mean, encoder, decoder = basis.mean, basis.components[:, :kept], None
    if whitening is not None:  # back from the metric's space: x_hat = mean + z_hat D^T with z = (x - mean) E
        mean = whitening.apply(basis.mean[None, :], inverse=True)[0]
        encoder, decoder = whitening.columns(encoder), whitening.columns(encoder, inverse=True).astype(np.float32)
    allocations = {(a.ratio, task.stream, task.group): {
        "budget_bits": a.budget_bits, "cost_bits": a.cost_bits, "kept": a.kept,
        "blocks": [(b.start, b.size, b.qtype, b.bits, b.scale_bits) for b in a.blocks],
        "expected_error": a.expected_error, "heldout_rows": a.heldout_rows} for a in fitted.allocs}
    return GroupResult(
        task.stream, task.group,
        (mean.astype(np.float32), basis.eigenvalues[:kept].astype(np.float32), encoder.astype(np.float32)),
        allocations, {(f.ratio, task.stream, task.group): f.to_table() for f in fitted.fits}, measured,
        list(dict.fromkeys(w for a in fitted.allocs for w in a.warnings)), basis.n, solves, fitted.seconds, decoder,
        None if whitening is None else whitening.root.astype(np.float32), by_tokens)
