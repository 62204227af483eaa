"""Allocator timings: error tables + DP for ratios 8, 16, 32.

p = 5760 (SmolLM2's per-stream size): decaying spectrum, measured errors on synthetic held-out
projections. p = 32768: synthetic spectrum, analytic errors (and measured on fewer rows).
Run from the repository root: python -m bench.allocator_dp [--rows 4000] [--threads 1] [--skip-large]
(`python bench/allocator_dp.py` would let bench/pipeline.py shadow the pipeline package.)
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from kvtc.pipeline.fit.allocator import AllocatorSettings, allocate_from_tables, error_tables, validate_ratios
from kvtc.pipeline.fit.pca import Basis

RATIOS = (8, 16, 32)


def spectrum(p: int) -> np.ndarray:
    """Keys-like spectrum: a few dominant components, then a power-law tail."""
    i = np.arange(p, dtype=np.float64)
    return (i + 1.0) ** -1.2 * (1.0 + 30.0 * np.exp(-i / 4.0)) + 1e-5


def eigen_basis(lam: np.ndarray) -> Basis:
    """A Basis carrying only the spectrum; components are never read by the allocator
    (np.zeros is lazily allocated, so p = 32768 does not cost 8 GiB)."""
    p = lam.shape[0]
    return Basis(np.zeros(p), lam, np.zeros((p, p)), float(lam.sum()), 10 ** 6)


def profile(a) -> str:
    """Mean amortised bits per component over log-spaced index ranges."""
    bits = a.bits_per_component()
    edges = [0, 1, 4, 16, 64, 256, 1024, 4096, 16384, 65536]
    parts = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        if lo >= a.kept:
            break
        parts.append(f"[{lo},{min(hi, a.kept)}):{bits[lo:hi].mean():.2f}")
    return " ".join(parts)


def run(p: int, model: str, rows: int) -> None:
    lam = spectrum(p)
    basis = eigen_basis(lam)
    settings = AllocatorSettings(error_model=model)
    validate_ratios(RATIOS, p, settings)
    t0 = time.perf_counter()
    z = None
    if model == "measured":
        z = torch.randn(rows, p, generator=torch.Generator().manual_seed(0)) * torch.from_numpy(lam).float().sqrt()
    tables, _ = error_tables(basis, settings=settings, projections=z)
    t1 = time.perf_counter()
    print(f"p={p} model={model} rows={rows if z is not None else 0}: error tables {t1 - t0:.2f} s")
    for r in RATIOS:
        t = time.perf_counter()
        a = allocate_from_tables(r, tables, settings)
        rel = np.sqrt(a.expected_error / a.total_variance)
        print(f"  CR {r:>2}: DP {time.perf_counter() - t:.2f} s  budget {a.budget_bits}  cost {a.cost_bits}  "
              f"unit {a.cost_unit}  kept {a.kept}  blocks {len(a.blocks)}  expected rel. error {rel:.4f}")
        print(f"         bits/component {profile(a)}")
    print(f"  total {time.perf_counter() - t0:.2f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=4000)
    ap.add_argument("--large-rows", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--skip-large", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    run(5760, "measured", args.rows)
    run(5760, "analytic", 0)
    if not args.skip_large:
        run(32768, "analytic", 0)
        run(32768, "measured", args.large_rows)


if __name__ == "__main__":
    main()
