"""DP allocator: optimality against brute force, budgets, trimming, error models, bad input."""
import math

import numpy as np
import pytest
import torch

from kvtc.artifacts.blocks import block_cost_bits
from kvtc.kernels.codec.reference import quantize_dequantize
from kvtc.pipeline.fit.allocator import (AllocatorSettings, allocate, allocate_from_tables, budget_bits, error_tables,
                                solve_budget, validate_ratios)
from kvtc.pipeline.fit.pca import Basis


def _basis(lam: np.ndarray) -> Basis:
    p = lam.shape[0]
    return Basis(np.zeros(p), lam.astype(np.float64), np.eye(p), float(lam.sum()), 1000)


def _gaussian(lam: np.ndarray, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, lam.shape[0], generator=g, dtype=torch.float64).mul(torch.from_numpy(lam).sqrt()).float()


def _brute_force(tables, settings, budget):
    """Minimum error over every aligned tiling of [0, k) (each block any allowed type, the
    tail after the last block free to be dropped, nothing dropped before a coded block) with cost <= budget."""
    k, best = tables.k, math.inf
    mids = settings.quantized_types

    def rec(i, cost, err):
        nonlocal best
        best = min(best, err + float(tables.variance[i:].sum()))
        for s in settings.block_sizes:
            if i % s or i + s > k:
                continue
            for t in mids:
                c = block_cost_bits(t, s)
                if cost + c <= budget:
                    rec(i + s, cost + c, err + tables.error(s, t, i // s))

    rec(0, 0, 0.0)
    return best + tables.beyond


@pytest.mark.parametrize("types", [("none", "int2", "int4", "fp8"), ("int1", "int3", "fp8")])
def test_dp_matches_brute_force(types):
    lam = np.array([9.0, 5.0, 3.0, 2.0, 1.0, 0.7, 0.4, 0.2])
    settings = AllocatorSettings(block_sizes=(1, 2, 4), types=types)
    basis = _basis(np.append(lam, [0.05, 0.01]))
    tables, _ = error_tables(basis, settings=settings, k=8, projections=_gaussian(basis.eigenvalues, 1024))
    for budget in (24, 35, 60, 100, 150):
        blocks, err, unit = solve_budget(tables, settings, budget)
        assert unit == math.gcd(*[block_cost_bits(t, s) for s in (1, 2, 4) for t in types if t != "none"])
        assert sum(b.cost_bits for b in blocks) <= budget
        assert err + tables.beyond == pytest.approx(_brute_force(tables, settings, budget), rel=1e-12)
        assert not blocks or blocks[-1].qtype != "none"


def test_coarse_cost_unit_stays_within_budget_and_near_optimal():
    lam = (np.arange(1, 513) ** -1.3).astype(np.float64)
    basis = _basis(lam)
    exact = AllocatorSettings(error_model="analytic")
    coarse = AllocatorSettings(error_model="analytic", cost_unit=16)
    tables, _ = error_tables(basis, settings=exact)
    for ratio in (4, 8, 16, 32):
        a, c = allocate_from_tables(ratio, tables, exact), allocate_from_tables(ratio, tables, coarse)
        assert c.cost_unit == 16 and c.cost_bits <= c.budget_bits
        assert a.expected_error <= c.expected_error <= 1.05 * a.expected_error


def test_cost_fits_budget_and_trimming_on_many_spectra():
    rng = np.random.default_rng(3)
    for trial in range(6):
        p = int(rng.integers(40, 400))
        lam = np.sort(rng.exponential(size=p) * np.arange(1, p + 1) ** -rng.uniform(0.5, 2.0))[::-1]
        lam[int(p * 0.6):] = 0.0
        settings = AllocatorSettings(error_model="analytic", max_dp_states=20_000 if trial % 2 else 150_000_000)
        allocs = allocate([2.5, 8, 16, 40], _basis(lam), settings=settings)
        for a in allocs:
            assert a.cost_bits == sum(b.cost_bits for b in a.blocks) <= a.budget_bits == budget_bits(p, a.ratio)
            assert [b.start for b in a.blocks] == [0] + [b.end for b in a.blocks[:-1]]
            assert a.kept == a.blocks[-1].end and a.blocks[-1].qtype != "none"
            assert a.blocks[-1].start < int(p * 0.6)
            assert all(b.start % b.size == 0 for b in a.blocks)
            assert a.bits_per_component().shape == (a.kept,)
        errs = [a.expected_error for a in allocs]
        assert errs == sorted(errs)
        assert [a.kept for a in allocs] == sorted((a.kept for a in allocs), reverse=True)


def test_measured_tables_match_reference_quantizer():
    lam = np.linspace(4.0, 0.1, 64)
    z = _gaussian(lam, 1100, seed=5)
    tables, _ = error_tables(_basis(lam), settings=AllocatorSettings(), projections=z)
    blk = z[:, 16:32]
    direct = float((blk - quantize_dequantize(blk, "int4")).double().square().sum() / 1100)
    assert tables.error(16, "int4", 1) == pytest.approx(direct, rel=1e-5)
    assert tables.error(64, "none", 0) == pytest.approx(float(z.double().square().sum() / 1100), rel=1e-9)


def test_analytic_model_agrees_with_measured_errors():
    lam = (np.arange(1, 513) ** -1.0).astype(np.float64)
    basis = _basis(lam)
    z = _gaussian(lam, 1024, seed=7)
    measured, _ = error_tables(basis, settings=AllocatorSettings(), projections=z)
    analytic, _ = error_tables(basis, settings=AllocatorSettings(error_model="analytic"))
    for s in (16, 64, 256):
        for t in ("int2", "int4", "fp8"):
            ratio = measured.errors[(s, t)][1:] / analytic.errors[(s, t)][1:]
            assert 0.5 < np.median(ratio) < 2.0, (s, t, np.median(ratio))
    for r in (8, 16, 32):
        em = allocate_from_tables(r, measured, AllocatorSettings()).expected_error
        ea = allocate_from_tables(r, analytic, AllocatorSettings(error_model="analytic")).expected_error
        assert abs(em - ea) / em < 0.15


def test_bad_ratios_fail_before_any_work():
    for bad in ([1], [0.5], [-4], [float("nan")], [float("inf")], [8, 8], [], [16 * 64 / 20]):
        with pytest.raises(ValueError, match="ratio"):
            validate_ratios(bad, 64)
    assert validate_ratios([8, 16.0], 64) == (8.0, 16.0)
    with pytest.raises(ValueError, match="compression ratio 1 "):
        allocate([8, 1], _basis(np.ones(64)), heldout=None)


def test_heldout_rows_minimum_and_warning():
    lam = np.linspace(2.0, 0.1, 64)
    basis = _basis(lam)
    with pytest.raises(ValueError, match="held-out rows"):
        allocate([8], basis, projections=_gaussian(lam, 10))
    with pytest.raises(ValueError, match="held-out rows"):
        allocate([8], basis)
    with pytest.warns(UserWarning, match="100 held-out rows"):
        (a,) = allocate([8], basis, heldout=_gaussian(lam, 100).numpy())
    assert a.heldout_rows == 100 and "100 held-out rows" in a.warnings[0]


def test_settings_validation():
    with pytest.raises(ValueError, match="block_sizes"):
        AllocatorSettings(block_sizes=(0, 16))
    with pytest.raises(ValueError, match="unknown block type"):
        AllocatorSettings(types=("none", "int9"))
    with pytest.raises(ValueError, match="quantized type"):
        AllocatorSettings(types=("none",))
    with pytest.raises(ValueError, match="error_model"):
        AllocatorSettings(error_model="guess")
    assert AllocatorSettings(block_sizes=(64, 1)).block_sizes == (1, 64)
    assert AllocatorSettings().to_dict()["aligned_starts"] is True
    custom = AllocatorSettings(block_sizes=(1, 32), types=("none", "int3"), error_model="analytic")
    assert AllocatorSettings.from_dict(custom.to_dict()) == custom
    with pytest.raises(ValueError, match="unknown allocator settings"):
        AllocatorSettings.from_dict({"blocks": [1]})


def test_never_drops_a_component_and_codes_a_weaker_one():
    """Held-out noise can make a later component look stronger than earlier ones (the CR 32 anomaly:
    components dropped, then one coded alone); the DP must code a prefix and drop only the tail."""
    lam = (np.arange(1, 97) ** -1.5).astype(np.float64)
    z = _gaussian(lam, 512, seed=5)
    z[:, 40] *= 12.0  # one late component with a large held-out variance
    settings = AllocatorSettings(block_sizes=(1, 16), types=("none", "int2", "int4", "fp8"))
    for a in allocate([8, 16, 32, 48], _basis(lam), settings=settings, projections=z):
        assert all(b.qtype != "none" for b in a.blocks)
        assert [b.start for b in a.blocks] == [0] + [b.end for b in a.blocks[:-1]]


def test_analytic_tables_use_heldout_variances_when_given_projections():
    lam = (np.arange(1, 65) ** -1.0).astype(np.float64)
    z = _gaussian(lam * 2.0, 2048, seed=2)  # held-out rows carry twice the calibration variance
    settings = AllocatorSettings(error_model="analytic")
    tables, _ = error_tables(_basis(lam), settings=settings, projections=z)
    assert tables.variance.sum() == pytest.approx(2.0 * lam.sum(), rel=0.1)
    assert np.all(np.diff(tables.variance) <= 1e-12)


def test_every_entry_point_applies_the_one_ratio_rule():
    from kvtc.artifacts.blocks import check_ratios
    from kvtc.pipeline.checks.words import parse_ratios
    from kvtc.pipeline.evaluation.model_quality import EvalSettings
    from kvtc.pipeline.settings import JobSettings

    entries = (check_ratios, lambda r: parse_ratios(",".join(map(str, r))), lambda r: EvalSettings(ratios=r),
               lambda r: JobSettings.of(ratios=r), lambda r: validate_ratios(r, 64))
    for enter in entries:
        with pytest.raises(ValueError, match="compression ratio 1 is refused: compression ratios must be > 1"):
            enter((8.0, 1.0))
        with pytest.raises(ValueError, match="lists a ratio twice"):
            enter((8.0, 8.0))
    assert check_ratios([8, "16"]) == (8.0, 16.0)
