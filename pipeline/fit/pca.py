"""PCA of one stream and group from merged moments (count, sum, Gram), in float64.

mu = sum / n, C = Gram / n - mu mu^T, C = U diag(lambda) U^T. Eigenvalues are clipped at 0 and
sorted descending; each component's sign is fixed so that its largest-magnitude entry is
positive (the first such entry on ties), which makes bases reproducible across runs and
LAPACK builds. The eigendecomposition is float64 LAPACK through scipy: at p = 5760 on 2 cores
`syevr` (MRRR, all pairs) took 26 s against 118 s for numpy's `eigh` and 146 s for torch's.

`pca_from_packed` is the reducer's form, from the packed upper triangle. Its exact CPU solve picks
the LAPACK driver from k / p: `syevr` with an index range only for few components (k <= p /
SUBSET_SHARE: for an index range it runs bisection and inverse iteration, whose
reorthogonalisation grows with k^2 p: 219 s for 5,671 of 5,760 components), else one `syevd`
(divide and conquer, every pair: 17 s at p = 5760) cut to k. On CUDA, torch's `eigh` (syevd).
`cpu_threads(n)` sets the solve's BLAS, OpenMP and torch threads (`every_core()`: every core of the process).
"""
from __future__ import annotations

import os
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import scipy.linalg
import torch
from threadpoolctl import threadpool_limits

from kvtc.workers.triangle import diagonal, row_offset, unpack_upper


@dataclass(frozen=True)
class Basis:
    """mean (p,) f64; eigenvalues (k,) f64 descending, >= 0; components (p, k) f64, orthonormal
    columns; total_variance = trace(C) over all p dimensions (kept when truncating); n rows."""

    mean: np.ndarray
    eigenvalues: np.ndarray
    components: np.ndarray
    total_variance: float
    n: int

    def __post_init__(self) -> None:
        p = self.mean.shape[0]
        k = self.eigenvalues.shape[0]
        if self.mean.ndim != 1 or self.eigenvalues.ndim != 1:
            raise ValueError("Basis: mean and eigenvalues must be 1-D arrays")
        if self.components.shape != (p, k):
            raise ValueError(f"Basis: components has shape {self.components.shape}, expected ({p}, {k})")
        if k > p:
            raise ValueError(f"Basis: {k} components for {p} dimensions")

    @property
    def dim(self) -> int:
        """p, the number of features."""
        return int(self.mean.shape[0])

    @property
    def k(self) -> int:
        """Number of components kept."""
        return int(self.eigenvalues.shape[0])

    def truncate(self, k: int) -> "Basis":
        """The first k components (k <= self.k); total_variance is unchanged."""
        if not 0 <= k <= self.k:
            raise ValueError(f"truncate({k}): the basis has {self.k} components; pick 0 <= k <= {self.k}")
        return Basis(self.mean, self.eigenvalues[:k].copy(), self.components[:, :k].copy(),
                     self.total_variance, self.n)

    def explained_variance(self, k: int) -> float:
        """Fraction of the calibration variance carried by the first k components."""
        if self.total_variance <= 0:
            return 1.0
        return float(self.eigenvalues[:k].sum() / self.total_variance)

    def project(self, x: np.ndarray | torch.Tensor, k: int | None = None) -> torch.Tensor:
        """Raw rows x (N, p) -> centered projections z (N, k) float32 (torch)."""
        k = self.k if k is None else k
        xt = torch.as_tensor(x, dtype=torch.float32)
        if xt.ndim != 2 or xt.shape[1] != self.dim:
            raise ValueError(f"project: rows have shape {tuple(xt.shape)}, expected (N, {self.dim})")
        mu = torch.from_numpy(self.mean).float()
        u = torch.from_numpy(np.ascontiguousarray(self.components[:, :k])).float()
        return (xt - mu) @ u


def fix_signs(components: np.ndarray) -> np.ndarray:
    """components (p, k) -> same columns with the largest-|.| entry of each made positive."""
    if components.size == 0:
        return components
    idx = np.abs(components).argmax(axis=0)
    signs = np.sign(components[idx, np.arange(components.shape[1])])
    signs[signs == 0] = 1.0
    return components * signs


def _f64(a: np.ndarray | torch.Tensor) -> np.ndarray:
    return a.detach().double().cpu().numpy() if isinstance(a, torch.Tensor) else np.asarray(a, dtype=np.float64)


def pca_from_moments(n: int, sum_: np.ndarray | torch.Tensor, gram: np.ndarray | torch.Tensor,
                     k: int | None = None) -> Basis:
    """Merged statistics -> Basis. n rows; sum_ (p,) f64; gram (p, p) f64 (sum of x x^T).

    k: keep only the leading k components (default all p)."""
    s, g = _f64(sum_), _f64(gram)
    if int(n) < 2:
        raise ValueError(f"PCA needs at least 2 rows of statistics, got n={n}; calibrate on more tokens")
    if s.ndim != 1 or g.shape != (s.shape[0], s.shape[0]):
        raise ValueError(f"PCA: sum has shape {s.shape} and Gram {g.shape}; expected (p,) and (p, p)")
    if not (np.isfinite(s).all() and np.isfinite(g).all()):
        raise ValueError("PCA: statistics contain NaN or inf; check the captured activations")
    p = s.shape[0]
    k = p if k is None else int(k)
    if not 0 < k <= p:
        raise ValueError(f"PCA: k={k} must be in 1..{p}")
    mu = s / n
    cov = g / n
    cov -= np.outer(mu, mu)
    cov += cov.T
    cov *= 0.5
    total = float(max(np.trace(cov), 0.0))
    evals, evecs = scipy.linalg.eigh(cov, driver="evr", overwrite_a=True, check_finite=False)
    evals = evals[::-1][:k]
    evecs = evecs[:, ::-1][:, :k]
    return Basis(mean=mu, eigenvalues=np.clip(evals, 0.0, None).copy(),
                 components=np.ascontiguousarray(fix_signs(evecs)), total_variance=total, n=int(n))


EXACT_MAX_P = 4096  # up to this p a CPU always solves exactly; above it only when most components are needed
SUBSET_SHARE = 16  # syevr with an index range only for k <= p / SUBSET_SHARE; syevd otherwise


def cores() -> int:
    """CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@contextmanager
def cpu_threads(n: int) -> Iterator[None]:
    """BLAS, OpenMP and torch threads set to `n` while the block runs (whatever a Ray worker's
    OMP_NUM_THREADS=1 or a worker's torch.set_num_threads left behind)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        with threadpool_limits(limits=n):
            yield
    finally:
        torch.set_num_threads(before)


def every_core() -> AbstractContextManager[None]:
    """`cpu_threads` on every core of the process."""
    return cpu_threads(cores())


EXACT_DRIVERS = ("evd", "evr", "evd32")  # LAPACK syevd, syevr (float64); syevd in float32 (ssyevd)


def fix_signs_inplace(components: np.ndarray, chunk: int = 64) -> None:
    """`fix_signs` in place, a column chunk at a time (no second (p, k) array)."""
    for a in range(0, components.shape[1], chunk):
        block = components[:, a:a + chunk]
        idx = np.abs(block).argmax(axis=0)
        signs = np.sign(block[idx, np.arange(block.shape[1])])
        signs[signs == 0] = 1.0
        block *= signs


def exact_eigh(cov: np.ndarray, k: int, driver: str = "evd") -> tuple[np.ndarray, np.ndarray]:
    """Leading k eigenpairs of a symmetric (p, p) float64 C-ordered matrix (upper triangle read;
    overwritten, its memory reused) -> (eigenvalues (k,) descending, eigenvectors (p, k), signs fixed).

    LAPACK works in place on the matrix's Fortran-ordered view (no copy), so the peak is the matrix
    plus the driver's workspace: syevd 2 p^2 doubles, then the (p, k) result beside the matrix;
    syevr (every pair, "evr") p^2 for its eigenvectors, the result then written into the matrix's own
    memory. For k <= p / SUBSET_SHARE an index range with syevr whatever `driver`.
    "evd32": a float32 matrix (`covariance_f32`), syevd in float32 (about twice as fast, half the
    memory: the matrix and 2 p^2 floats of workspace), the result (p, k) float64."""
    if driver not in EXACT_DRIVERS:
        raise ValueError(f"exact_eigh: driver {driver!r} must be one of {EXACT_DRIVERS}")
    p = cov.shape[0]
    if driver == "evd32":
        if not (cov.flags.c_contiguous and cov.dtype == np.float32):
            cov = np.array(cov, dtype=np.float32, order="C")
        evals, evecs = scipy.linalg.eigh(cov.T, lower=True, driver="evd", overwrite_a=True, check_finite=False)
        out = np.ascontiguousarray(evecs[:, p - k:][:, ::-1], dtype=np.float64)
        del evecs
        fix_signs_inplace(out)
        return evals[p - k:][::-1].astype(np.float64), out
    if not (cov.flags.c_contiguous and cov.flags.owndata and cov.dtype == np.float64):
        cov = np.array(cov, dtype=np.float64, order="C")
    lapack_view = cov.T  # Fortran order: the C array's upper triangle is its lower one
    if k * SUBSET_SHARE <= p:
        evals, evecs = scipy.linalg.eigh(lapack_view, lower=True, driver="evr", subset_by_index=[p - k, p - 1],
                                         overwrite_a=True, check_finite=False)
        out = np.ascontiguousarray(evecs[:, ::-1])
    elif driver == "evd":
        evals, evecs = scipy.linalg.eigh(lapack_view, lower=True, driver="evd", overwrite_a=True, check_finite=False)
        evals = evals[p - k:]
        out = np.ascontiguousarray(evecs[:, p - k:][:, ::-1])  # evecs is the matrix's memory
    else:
        evals, evecs = scipy.linalg.eigh(lapack_view, lower=True, driver="evr", overwrite_a=True, check_finite=False)
        evals = evals[p - k:]
        out = np.ndarray((p, k), dtype=np.float64, buffer=cov)  # the matrix is spent: its memory holds the result
        np.copyto(out, evecs[:, p - k:][:, ::-1])
        del evecs
    fix_signs_inplace(out)
    return evals[::-1].copy(), out


def exact_peak_bytes(p: int, k: int, driver: str = "evd") -> int:
    """Peak bytes of `exact_eigh` on a (p, p) float64 matrix (the matrix included)."""
    if driver == "evd32":
        return 4 * 3 * p * p + 8 * p * k + 64 * p
    if k * SUBSET_SHARE <= p:
        return 8 * (p * p + 2 * p * k + 32 * p)
    if driver == "evd":
        return 8 * (3 * p * p + 8 * p)
    return 8 * (2 * p * p + 32 * p)


def covariance_upper(n: int, mu: np.ndarray, packed: np.ndarray) -> np.ndarray:
    """(p, p) float64 whose upper triangle is Gram / n - mu mu^T, from the packed Gram (the lower part zeros)."""
    p = mu.shape[0]
    cov = unpack_upper(packed, p)
    step = 1024
    for a in range(0, p, step):  # in row blocks
        b = min(a + step, p)
        cov[a:b, a:] /= n
        cov[a:b, a:] -= np.outer(mu[a:b], mu[a:])
    return cov


def covariance_f32(n: int, mu: np.ndarray, packed: np.ndarray) -> torch.Tensor:
    """Full symmetric covariance (p, p) float32 from a packed Gram, each row block computed in float64
    (Gram / n - mu mu^T, no cancellation in float32) before the cast: one p x p float32 matrix."""
    p = mu.shape[0]
    cov = torch.empty(p, p, dtype=torch.float32)
    step = 512
    for a in range(0, p, step):
        b = min(a + step, p)
        block = unpack_rows(packed, p, a, b)  # (b - a, p) float64, upper rows a..b-1
        block /= n
        block -= np.outer(mu[a:b], mu)
        cov[a:b] = torch.from_numpy(block)
    upper = torch.triu(torch.ones(step, step, dtype=torch.bool))
    for a in range(0, p, step):  # mirror the upper triangle into the lower one
        b = min(a + step, p)
        cov[b:, a:b] = cov[a:b, b:].T
        tile = cov[a:b, a:b]
        m = upper[: b - a, : b - a]
        tile.copy_(torch.where(m, tile, tile.T))
    return cov


def unpack_rows(packed: np.ndarray, p: int, a: int, b: int) -> np.ndarray:
    """Rows a..b-1 of the symmetric matrix, entries (i, j >= i) from the packed triangle, j < i zero."""
    out = np.zeros((b - a, p), dtype=np.float64)
    for i in range(a, b):
        o = row_offset(p, i)
        out[i - a, i:] = packed[o : o + p - i]
    return out


def subspace_eigh(cov: torch.Tensor, k: int, tol: float = 1e-5, max_iters: int = 12, seed: int = 0
                  ) -> tuple[np.ndarray, np.ndarray, int]:
    """Leading k eigenpairs of a symmetric (p, p) float32 matrix by subspace iteration with
    Rayleigh-Ritz (float32 GEMMs, float64 Ritz step), oversampled by max(32, k/4) columns; stops when
    the leading k Ritz values change by less than `tol` (relative to the largest). -> (eigenvalues
    (k,) descending, eigenvectors (p, k) float64, iterations)."""
    p = cov.shape[0]
    width = min(p, k + max(32, k // 4))
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(cov @ torch.randn(p, width, generator=g))
    previous = None
    for it in range(1, max_iters + 1):
        z = cov @ q
        b = (q.T @ z).double()
        evals, vecs = torch.linalg.eigh((b + b.T) / 2)
        evals, vecs = evals.flip(0)[:k], vecs.flip(1)[:, :k]
        done = previous is not None and float((evals - previous).abs().max()) <= tol * float(evals[0].abs())
        if done or it == max_iters:
            comps = (q.double() @ vecs).numpy()
            return evals.numpy(), comps, it
        previous = evals
        q, _ = torch.linalg.qr(z)
    raise AssertionError("unreachable")


def pca_from_packed(n: int, sum_: np.ndarray, packed: np.ndarray, k: int | None = None,
                    device: str | torch.device = "cpu", method: str = "auto", driver: str = "evd") -> Basis:
    """Merged statistics with the Gram as its packed upper triangle (p(p+1)/2,) f64 -> Basis of the
    leading k components (default all). method: "exact" (`exact_eigh` on CPU, torch eigh on CUDA; the
    packed Gram plus one (p, p) float64 matrix and, for syevd, twice that in workspace), "subspace"
    (`subspace_eigh` on one (p, p) float32 matrix) or "auto" (exact on CUDA or when p <= EXACT_MAX_P)."""
    s = np.asarray(sum_, dtype=np.float64)
    p = s.shape[0]
    if int(n) < 2:
        raise ValueError(f"PCA needs at least 2 rows of statistics, got n={n}; calibrate on more tokens")
    if packed.shape != (p * (p + 1) // 2,):
        raise ValueError(f"PCA: packed Gram has {packed.shape} entries; expected ({p * (p + 1) // 2},) for p={p}")
    k = p if k is None else int(k)
    if not 0 < k <= p:
        raise ValueError(f"PCA: k={k} must be in 1..{p}")
    if method not in ("auto", "exact", "subspace"):
        raise ValueError(f"PCA: method {method!r} must be auto, exact or subspace")
    if not (np.isfinite(s).all() and np.isfinite(packed).all()):
        raise ValueError("PCA: statistics contain NaN or inf; check the captured activations")
    mu = s / n
    total = float(max((diagonal(packed, p) / n - mu * mu).sum(), 0.0))
    dev = torch.device(device)
    if method == "auto":
        method = "exact" if dev.type == "cuda" or p <= EXACT_MAX_P or k == p else "subspace"
    if method == "subspace":
        evals, evecs, _ = subspace_eigh(covariance_f32(n, mu, packed), k)
        return Basis(mean=mu, eigenvalues=np.clip(evals, 0.0, None).copy(),
                     components=np.ascontiguousarray(fix_signs(evecs)), total_variance=total, n=int(n))
    cov = covariance_upper(n, mu, packed)
    return basis_from_covariance(cov, mu, total, int(n), k, dev, driver)


def basis_from_covariance(cov: np.ndarray, mu: np.ndarray, total: float, n: int, k: int,
                          device: str | torch.device = "cpu", driver: str = "evd") -> Basis:
    """Basis of the leading k components of `covariance_upper`'s matrix (consumed: pass the last reference
    to keep the peak at `exact_peak_bytes`)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        evals_t, evecs_t = torch.linalg.eigh(torch.from_numpy(cov).to(dev), UPLO="U")
        del cov
        evals = evals_t.flip(0)[:k].cpu().numpy()
        evecs = np.ascontiguousarray(fix_signs(evecs_t.flip(1)[:, :k].cpu().numpy()))
        del evals_t, evecs_t
    else:
        evals, evecs = exact_eigh(cov, k, driver)
        del cov
    return Basis(mean=mu, eigenvalues=np.clip(evals, 0.0, None), components=evecs, total_variance=total, n=int(n))
