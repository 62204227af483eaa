"""The reduce's memory plan: what each stream and group's task holds at its peak, by solver, and how
many run at once on a node so that their sum stays under the node's kill line.

A group task's peak (`task_bytes`) is its process (`TASK_BASE`: Python, torch, numpy, a Ray worker)
plus the largest of its phases:
- sum: the running packed Gram and the accumulator being added (2 packed);
- solve, by solver: exact on CPU (`pca.covariance_upper` beside the packed Gram, then the packed Gram
  released: LAPACK in place on the p x p float64 matrix, syevd's 2 p^2 workspace or syevr's p^2
  eigenvectors; float32 syevd on `pca.covariance_f32`'s matrix: `pca.exact_peak_bytes`); subspace iteration (the packed Gram, a float32 p x p
  covariance and its iterates); on CUDA the matrix travels to the device and the host keeps one copy;
- fit and measure: the float64 basis (p, k), its float32 copies, and the held-out rows with their
  projections.

The node's budget (`node_budget`) is what Ray's memory monitor allows (`RAY_memory_usage_threshold`
of the node's memory, 0.95 by default) minus what the node already uses (the driver, Ray's own
processes, anything else) and a margin. `admit` starts tasks while their sum fits, so large groups
run one at a time and small ones side by side; a group that cannot fit alone is refused, before any
model work when `kvtc calibrate` plans (`memory_plan.check_fits`, the largest group at `least_bytes`).

cuSOLVER's `syevd` before CUDA 13 queries its workspace in 32 bits and fails above about n = 25K
(`CUSOLVER_SYEVD_MAX_P`): such groups, and groups whose solve does not fit the GPU, solve on the CPU.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from kvtc.artifacts.env_values import ray_float
from kvtc.pipeline.fit.pca import EXACT_DRIVERS, EXACT_MAX_P, exact_peak_bytes

GIB = 1 << 30
TASK_BASE = 700 << 20  # a Ray worker with torch, numpy and scipy imported, measured ~0.55 GiB
MARGIN = 0.04  # of the node's memory, kept free beside the kill line
FEW_SHARE = 8  # subspace iteration pays when the allocation keeps at most p / FEW_SHARE components
SUBSPACE_START = 512  # first subspace width: max(SUBSPACE_START, p / 16)
CUSOLVER_SYEVD_MAX_P = 24576  # largest n cuSOLVER's syevd takes before CUDA 13 (32-bit workspace query)
GPU_USABLE = 0.90
LARGE_DRIVERS = ("evd32", "evr")  # exact CPU solves above EXACT_MAX_P, by preference


def packed(p: int) -> int:
    return 8 * (p * (p + 1) // 2)


def sum_bytes(p: int) -> int:
    return 2 * packed(p) + 32 * p


def solve_bytes(p: int, k: int, method: str, driver: str = "evd", device: str = "cpu") -> int:
    """Host bytes of one solve of k components (the sum phase included)."""
    if device.startswith("cuda"):
        return max(sum_bytes(p), packed(p) + 8 * p * p, 8 * p * p + 8 * p * k)
    if method == "exact":
        matrix = 4 * p * p + 8 * 512 * p if driver == "evd32" else 8 * p * p
        return max(sum_bytes(p), packed(p) + matrix, exact_peak_bytes(p, k, driver))
    width = min(p, k + max(32, k // 4))
    return max(sum_bytes(p), packed(p) + 4 * p * p + 3 * 4 * p * width + 8 * p * k)


def fit_bytes(p: int, k: int, rows: int) -> int:
    """Bytes of the fit and measure stages: the float64 basis, two float32 copies, the rows and projections."""
    return 8 * p * k + 2 * 4 * p * k + 3 * 4 * rows * (p + k)


@dataclass(frozen=True)
class Solver:
    """How one group solves: `method` exact | subspace, LAPACK `driver` evd | evr | evd32 (syevd in float32),
    `k` components first, on `device`."""

    method: str
    k: int
    driver: str = "evd"
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.method not in ("exact", "subspace") or self.driver not in EXACT_DRIVERS or self.k < 1:
            raise ValueError(f"solver: bad method {self.method!r}, driver {self.driver!r} or k {self.k}")


def choose(p: int, bound: int, budget: int, rows: int = 0, gpu: "GpuSolve | None" = None) -> Solver:
    """The solver for a group of p features whose allocations keep at most `bound` components, within
    `budget` bytes for the whole task: exact when most components may be kept or p is small (float64 syevd
    up to EXACT_MAX_P; above it float32 syevd, twice as fast and its peak lower, else float64 syevr when only
    its peak fits); subspace iteration for few components or when no exact solve fits."""
    if gpu is not None and gpu.takes(p):
        return Solver("exact", bound, "evd", "cuda")
    if p <= EXACT_MAX_P:
        return Solver("exact", bound)
    if bound * FEW_SHARE <= p:
        return Solver("subspace", bound)
    for driver in LARGE_DRIVERS:
        if task_bytes(p, bound, rows, Solver("exact", bound, driver)) <= budget:
            return Solver("exact", bound, driver)
    return Solver("subspace", min(bound, max(SUBSPACE_START, p // 16)))


def widen(p: int, k: int, bound: int, budget: int, rows: int = 0) -> Solver:
    """The solve after a subspace of k components that the allocation filled: exact if it fits, else twice as wide."""
    for driver in LARGE_DRIVERS:
        if task_bytes(p, bound, rows, Solver("exact", bound, driver)) <= budget:
            return Solver("exact", bound, driver)
    return Solver("subspace", min(bound, 2 * k))


def curve_bytes(p: int, prefixes: int, k: int) -> int:
    """Bytes of the error-by-tokens phase, between the sum and the eigensolver (0 without a curve): the
    running sum and `prefixes` copies of it (packed Grams), one float32 covariance, the subspace and its QR
    (float32, p x (k + 32)) and one prefix basis (float64)."""
    if k <= 0:
        return 0
    width = min(p, k + 32)
    return packed(p) * (1 + prefixes) + 4 * p * p + 3 * 4 * p * width + 8 * p * width


def task_bytes(p: int, bound: int, rows: int, solver: Solver, prefixes: int = 0, curve_k: int = 0) -> int:
    """Peak bytes of one group task with this solver (a subspace may widen up to `bound`); with the
    error-by-tokens curve, `prefixes` running sums held and bases of `curve_k` components (`curve_bytes`)."""
    k = bound if solver.method == "exact" else min(bound, 2 * solver.k)
    return TASK_BASE + max(solve_bytes(p, k, solver.method, solver.driver, solver.device), fit_bytes(p, bound, rows),
                           curve_bytes(p, prefixes, curve_k))


def least_bytes(p: int, bound: int, rows: int, prefixes: int = 0, curve_k: int = 0) -> int:
    """The smallest peak any CPU solver gives the group (what must fit for it to run at all)."""
    if p <= EXACT_MAX_P or bound * FEW_SHARE <= p:
        return task_bytes(p, bound, rows, choose(p, bound, 0, rows), prefixes, curve_k)
    return min(task_bytes(p, bound, rows, Solver("exact", bound, "evr"), prefixes, curve_k),
               task_bytes(p, bound, rows, Solver("subspace", min(bound, max(SUBSPACE_START, p // 16))), prefixes,
                          curve_k))


@dataclass(frozen=True)
class GpuSolve:
    """A GPU's exact solve: its memory and whether its cuSOLVER has the 32-bit workspace limit."""

    gpu_bytes: int
    cuda_major: int

    def takes(self, p: int) -> bool:
        if self.cuda_major < 13 and p > CUSOLVER_SYEVD_MAX_P:
            return False
        return 8 * 3 * p * p <= GPU_USABLE * self.gpu_bytes  # matrix, eigenvectors, syevd workspace


def kill_threshold() -> float:
    """Share of a node's memory above which Ray's memory monitor kills tasks."""
    try:  # the parser the command line's check used (kvtc.artifacts.env_values): it accepts what Ray reads
        return min(1.0, max(0.1, ray_float(os.environ.get("RAY_memory_usage_threshold", "0.95"))))
    except ValueError:
        return 0.95


def node_budget(total: int, used: int) -> int:
    """Bytes group tasks may hold together on a node of `total` bytes that already uses `used`."""
    return int(kill_threshold() * total - used - MARGIN * total)


@dataclass(frozen=True)
class Planned:
    """One group's plan: its task index, name (for messages), p, solver and peak bytes."""

    index: int
    name: str
    p: int
    solver: Solver
    bytes: int


def admit(running: list[int], peak: int, budget: int, slots: int) -> bool:
    """Whether a task of `peak` bytes starts beside tasks holding `running`: one always runs alone; more
    while their sum fits `budget` and fewer than `slots` run."""
    return not running or (len(running) < slots and sum(running) + peak <= budget)


def schedule(peaks: list[int], budget: int, slots: int) -> list[list[int]]:
    """Waves of task indices, in task order, as `admit` lets them start when every task of a wave ends
    together (a planning view: the reduce admits each task as soon as others end)."""
    waves: list[list[int]] = [[]]
    for i, b in enumerate(peaks):
        if not admit([peaks[j] for j in waves[-1]], b, budget, slots):
            waves.append([])
        waves[-1].append(i)
    return [w for w in waves if w]


def refuse_unless_fits(plans: list[Planned], budget: int, total: int, used: int) -> None:
    """ValueError naming the groups that cannot run even alone, and the memory they need."""
    over = [p for p in plans if p.bytes > budget]
    if not over:
        return
    worst = max(over, key=lambda p: p.bytes)
    names = ", ".join(p.name for p in over[:6]) + (f" and {len(over) - 6} more" if len(over) > 6 else "")
    raise ValueError(
        f"the reduce cannot fit this node: {names} need{'s' if len(over) == 1 else ''} up to {worst.bytes / GIB:.1f} "
        f"GiB, one task at a time ({worst.name}: p = {worst.p}, {worst.solver.method} solve), and "
        f"group tasks may hold {max(budget, 0) / GIB:.1f} GiB here ({kill_threshold():.0%} of {total / GIB:.1f} GiB "
        f"less {used / GIB:.1f} GiB in use and a {MARGIN:.0%} margin); split the features into smaller layer groups "
        "(--groups layers:K), or run the reduce on a node with more memory")
