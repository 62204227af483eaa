"""The rate-distortion curve reuses the held-out errors `split_metrics` measured for the fitted ratios: the same
rows, the same fits, so the same numbers, one reconstruction of every row fewer per ratio."""
import numpy as np
import torch

from kvtc.pipeline.evaluation import rate_distortion
from kvtc.pipeline.fit.ecsq import fit_ratios
from kvtc.pipeline.fit.pca import pca_from_moments


def test_curve_rows_given_the_measured_errors_equal_the_ones_it_measures_itself():
    rng = np.random.default_rng(3)
    p, n = 37, 613  # odd sizes
    x = (rng.standard_normal((n, p)) * np.linspace(3.0, 0.1, p)).astype(np.float32)
    basis = pca_from_moments(n, x.sum(0, dtype=np.float64), x.astype(np.float64).T @ x, k=29)
    z = basis.project(torch.from_numpy(x))
    fits = fit_ratios((4.0, 8.0), z, p)
    totals: dict = {}
    rate_distortion.split_metrics(fits, basis, x, z, "heldout", "keys", 0, totals)
    measured = {f.ratio: totals[(f.ratio, "keys", "heldout")][0] for f in fits}
    fixed = [(100.0, 0.2)]
    assert rate_distortion.curve_rows(basis, x, z, "keys", 0, fits, fixed, measured=measured) == \
        rate_distortion.curve_rows(basis, x, z, "keys", 0, fits, fixed)
    # a ratio it was not given is measured as before
    partial = {4.0: measured[4.0]}
    assert rate_distortion.curve_rows(basis, x, z, "keys", 0, fits, fixed, measured=partial) == \
        rate_distortion.curve_rows(basis, x, z, "keys", 0, fits, fixed)
