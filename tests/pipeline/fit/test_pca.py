"""PCA from merged moments: agreement with a direct covariance eigendecomposition, signs, truncation."""
import numpy as np
import pytest
import torch

from kvtc.pipeline.fit.pca import Basis, fix_signs, pca_from_moments


def _rows(n: int = 800, p: int = 24, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    lam = 2.0 ** -np.arange(p, dtype=np.float64)
    q, _ = np.linalg.qr(rng.standard_normal((p, p)))
    return (rng.standard_normal((n, p)) * np.sqrt(lam)) @ q.T + rng.standard_normal(p)


def _moments(x: np.ndarray):
    return x.shape[0], x.sum(0), x.T @ x


def test_matches_direct_covariance_eigendecomposition():
    x = _rows()
    b = pca_from_moments(*_moments(x))
    cov = np.cov(x.T, bias=True)
    w, v = np.linalg.eigh(cov)
    np.testing.assert_allclose(b.mean, x.mean(0), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(b.eigenvalues, w[::-1], rtol=1e-8, atol=1e-12)
    dots = np.abs(np.sum(b.components * v[:, ::-1], axis=0))
    np.testing.assert_allclose(dots, 1.0, atol=1e-6)
    np.testing.assert_allclose(b.components @ np.diag(b.eigenvalues) @ b.components.T, cov, atol=1e-10)
    assert b.total_variance == pytest.approx(np.trace(cov))
    assert np.all(np.diff(b.eigenvalues) <= 0)


def test_sign_convention_and_reproducibility():
    x = _rows(seed=1)
    b = pca_from_moments(*_moments(x))
    idx = np.abs(b.components).argmax(axis=0)
    assert np.all(b.components[idx, np.arange(b.k)] > 0)
    np.testing.assert_array_equal(fix_signs(-b.components), b.components)
    half = x.shape[0] // 2
    n1, s1, g1 = _moments(x[half:])
    n2, s2, g2 = _moments(x[:half])
    merged = pca_from_moments(n1 + n2, s1 + s2, g1 + g2)
    np.testing.assert_allclose(merged.components, b.components, atol=1e-8)


def test_accepts_torch_moments_and_rank_deficiency():
    x = _rows(n=10, p=24, seed=2)
    n, s, g = _moments(x)
    b = pca_from_moments(n, torch.from_numpy(s), torch.from_numpy(g))
    assert b.eigenvalues.min() >= 0.0
    assert np.count_nonzero(b.eigenvalues > 1e-9 * b.eigenvalues[0]) <= 9


def test_truncate_and_explained_variance():
    b = pca_from_moments(*_moments(_rows()))
    t = b.truncate(5)
    assert t.components.shape == (24, 5) and t.eigenvalues.shape == (5,)
    assert t.total_variance == b.total_variance
    assert t.explained_variance(5) == pytest.approx(b.eigenvalues[:5].sum() / b.total_variance)
    assert b.explained_variance(24) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="truncate"):
        b.truncate(25)
    z = b.project(_rows(n=7), 3)
    assert z.shape == (7, 3) and z.dtype == torch.float32


def test_bad_statistics():
    n, s, g = _moments(_rows())
    with pytest.raises(ValueError, match="at least 2 rows"):
        pca_from_moments(1, s, g)
    with pytest.raises(ValueError, match="expected"):
        pca_from_moments(n, s[:-1], g)
    g = g.copy()
    g[0, 0] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        pca_from_moments(n, s, g)
    with pytest.raises(ValueError, match="components"):
        Basis(np.zeros(3), np.ones(2), np.zeros((3, 3)), 2.0, 10)


def test_subset_eigensolver_from_packed_matches_the_exact_one():
    from kvtc.pipeline.fit.pca import pca_from_packed

    rng = np.random.default_rng(3)
    q, _ = np.linalg.qr(rng.standard_normal((97, 97)))
    x = (rng.standard_normal((3000, 97)) / np.sqrt(1.0 + np.arange(97))) @ q.T + 0.5  # well-separated spectrum
    n, s, g = _moments(x)
    packed = g[np.triu_indices(97)]
    exact = pca_from_moments(n, s, g)
    for k in (1, 13, 97):
        sub = pca_from_packed(n, s, packed.copy(), k=k)
        assert sub.k == k and sub.dim == 97
        np.testing.assert_allclose(sub.eigenvalues, exact.eigenvalues[:k], rtol=1e-9, atol=1e-14)
        np.testing.assert_allclose(np.abs(np.sum(sub.components * exact.components[:, :k], axis=0)), 1.0, atol=1e-6)
        assert sub.total_variance == pytest.approx(exact.total_variance, rel=1e-12)
        np.testing.assert_array_equal(sub.mean, exact.mean)
    with pytest.raises(ValueError, match="packed Gram"):
        pca_from_packed(n, s, packed[:-1], k=3)


def test_subspace_iteration_matches_the_exact_eigendecomposition_on_a_small_p():
    from kvtc.pipeline.fit.pca import pca_from_packed

    p = 301
    rng = np.random.default_rng(4)
    q, _ = np.linalg.qr(rng.standard_normal((p, p)))
    lam = 3.0 * 0.97 ** np.arange(p) + 1e-3  # decaying like a KV spectrum, no exact ties
    x = (rng.standard_normal((6000, p)) * np.sqrt(lam)) @ q.T + 2.0  # a large mean: the float64 centring matters
    n, s, g = _moments(x)
    packed = g[np.triu_indices(p)]
    exact = pca_from_packed(n, s, packed, k=64, method="exact")
    approx = pca_from_packed(n, s, packed, k=64, method="subspace")
    np.testing.assert_allclose(approx.eigenvalues, exact.eigenvalues, rtol=1e-4)
    # the components the allocator keeps (well inside k) agree to float32 accuracy
    dots = np.abs(np.sum(approx.components[:, :48] * exact.components[:, :48], axis=0))
    np.testing.assert_allclose(dots, 1.0, atol=1e-4)
    np.testing.assert_allclose(approx.components.T @ approx.components, np.eye(64), atol=1e-5)
    assert approx.total_variance == pytest.approx(exact.total_variance, rel=1e-12)


def test_exact_eigh_drivers_agree():
    from kvtc.pipeline.fit.pca import exact_eigh, fix_signs

    rng = np.random.default_rng(0)
    x = rng.standard_normal((400, 96)) * np.linspace(3, 0.1, 96)
    cov = x.T @ x / 400
    want_vals, want_vecs = np.linalg.eigh(cov)
    for k in (4, 90):  # an index range (syevr) and one syevd cut to k
        vals, vecs = exact_eigh(cov.copy(), k)
        assert np.allclose(vals, want_vals[::-1][:k]) and np.allclose(fix_signs(vecs), fix_signs(want_vecs[:, ::-1][:, :k]))

