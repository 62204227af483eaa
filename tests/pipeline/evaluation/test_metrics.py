"""Metrics on a synthetic Gaussian with a decaying spectrum: errors, bound, positions, PCA-only."""
import numpy as np
import pytest
import torch

from kvtc.kernels.codec.reference import quantize_dequantize
from kvtc.pipeline.fit.allocator import AllocatorSettings, allocate
from kvtc.pipeline.evaluation.metrics import (default_edges, evaluate, pca_rel_error, quantize_projections,
                              waterfilling_distortion)
from kvtc.pipeline.fit.pca import pca_from_moments

P = 96


@pytest.fixture(scope="module")
def setup():
    rng = np.random.default_rng(0)
    lam = np.arange(1, P + 1, dtype=np.float64) ** -1.5
    q, _ = np.linalg.qr(rng.standard_normal((P, P)))
    mean = rng.standard_normal(P) * 0.3

    def rows(n):
        return ((rng.standard_normal((n, P)) * np.sqrt(lam)) @ q.T + mean).astype(np.float32)

    cal, held = rows(6000).astype(np.float64), rows(1500)
    basis = pca_from_moments(cal.shape[0], cal.sum(0), cal.T @ cal)
    allocs = allocate([8, 16, 32], basis, held, AllocatorSettings(block_sizes=(1, 16, 32)))
    return basis, allocs, held


def test_error_ordering_bound_and_expected(setup):
    basis, allocs, held = setup
    evs = evaluate(basis, allocs, held)
    errs = [e.rel_error for e in evs]
    assert errs[0] < errs[1] < errs[2]
    norm = float((held.astype(np.float64) ** 2).sum(1).mean())
    for a, e in zip(allocs, evs):
        assert e.bound_rel_error < e.rel_error
        assert e.pca_rel_error <= e.rel_error
        assert e.bits_per_token == a.cost_bits <= a.budget_bits and e.kept == a.kept and e.rows == held.shape[0]
        assert 0 < e.explained_variance <= 1
        assert e.rel_error == pytest.approx(np.sqrt(a.expected_error / norm), rel=0.1)
    assert evs[0].to_dict()["ratio"] == 8.0


def test_explicit_reconstruction_matches_manual(setup):
    basis, allocs, held = setup
    a = allocs[1]
    u = torch.from_numpy(basis.components[:, :a.kept]).float()
    mu = torch.from_numpy(basis.mean).float()
    z = (torch.from_numpy(held) - mu) @ u
    zq = torch.zeros_like(z)
    for b in a.blocks:
        if b.qtype != "none":
            zq[:, b.start:b.end] = quantize_dequantize(z[:, b.start:b.end], b.qtype)
    torch.testing.assert_close(quantize_projections(z, a), zq)
    x_hat = mu + zq @ u.T
    rel = float(torch.linalg.norm(torch.from_numpy(held) - x_hat) / torch.linalg.norm(torch.from_numpy(held)))
    assert evaluate(basis, [a], held, explicit=True)[0].rel_error == pytest.approx(rel, rel=1e-4)
    assert evaluate(basis, [a], held)[0].rel_error == pytest.approx(rel, rel=1e-4)
    assert evaluate(basis, [a], held, projections=z)[0].rel_error == pytest.approx(rel, rel=1e-4)


def test_pca_only_error(setup):
    basis, _, held = setup
    errs = pca_rel_error(basis, held, [0, 4, 16, 64, P])
    assert np.all(np.diff(errs) < 0) and errs[-1] < 1e-3
    u = basis.components[:, :16]
    xd = held - basis.mean
    direct = np.linalg.norm(xd - xd @ u @ u.T) / np.linalg.norm(held)
    assert errs[2] == pytest.approx(direct, rel=1e-4)


def test_error_by_position(setup):
    basis, allocs, held = setup
    pos = np.arange(held.shape[0]) % 300
    spiked = held.copy()
    spiked[pos == 0] += 5.0 * np.abs(held).max()
    (e,) = evaluate(basis, allocs[:1], spiked, positions=pos)
    assert [b.lo for b in e.by_position] == default_edges(299)[:-1]
    assert sum(b.rows for b in e.by_position) == held.shape[0]
    assert e.by_position[0].rel_error > 2 * e.by_position[-1].rel_error
    with pytest.raises(ValueError, match="positions"):
        evaluate(basis, allocs[:1], held, positions=pos[:-1])


def test_waterfilling():
    lam = np.ones(10)
    assert waterfilling_distortion(lam, 10) == pytest.approx(10 * 4.0 ** -1)
    assert waterfilling_distortion(lam, 0) == pytest.approx(10)
    lam = np.array([16.0, 1.0])
    assert waterfilling_distortion(lam, 1) == pytest.approx(4.0 + 1.0)
    decay = np.arange(1, 200, dtype=np.float64) ** -1.2
    d = [waterfilling_distortion(decay, b) for b in (10, 50, 200, 800)]
    assert d == sorted(d, reverse=True) and d[-1] > 0
    assert waterfilling_distortion(decay, 10, tail_variance=0.5) == pytest.approx(d[0] + 0.5)
