"""Basis budget: caps parsed and sized, both allocators within the cap, the basis-size curve, the runtime holding only
the columns its mode uses in the requested dtype."""
import numpy as np
import pytest
import torch

from kvtc.kernels import KVTCCodec
from helpers.synthetic import synthetic_cache, synthetic_spec
from kvtc.pipeline.evaluation import basis_size
from kvtc.pipeline.fit.allocator import AllocatorSettings, allocate
from kvtc.pipeline.fit.basis_budget import BasisBudget, model_parameters
from kvtc.pipeline.fit.ecsq import EcsqSettings, fit_ecsq
from kvtc.pipeline.fit.pca import Basis


def test_budget_parses_shares_and_caps_per_group():
    assert BasisBudget.parse("3%").share == pytest.approx(0.03)
    assert BasisBudget.parse("0.05", 100).cap(10 ** 9, 5760) == 100
    assert BasisBudget.parse("0.05", 100).cap(10 ** 7, 5760) == 43
    assert BasisBudget.parse("3%").cap(8_000_000_000, 32768) == int(0.03 * 8e9 // 65536)
    assert BasisBudget().cap(None, 10) == 0 and not BasisBudget().active
    for bad in ("0%", "150%", "x", "-1"):
        with pytest.raises(ValueError, match="basis budget"):
            BasisBudget.parse(bad)
    with pytest.raises(ValueError, match="less than one component"):
        BasisBudget.parse("0.0001%").cap(1000, 5760)
    with pytest.raises(ValueError, match="max components"):
        BasisBudget(max_components=0)


def test_model_parameters_from_a_config_without_weights():
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    per_layer = 32 * 32 * 2 + 32 * 16 * 2 + 3 * 32 * 64 + 2 * 32
    assert model_parameters(cfg) == 100 * 32 + 2 * per_layer + 32


def _basis_and_rows(p: int = 96, n: int = 1024):
    g = torch.Generator().manual_seed(0)
    lam = np.exp(-np.arange(p) / 12.0) * 4 + 1e-3
    x = (torch.randn(n, p, generator=g, dtype=torch.float64) * torch.from_numpy(np.sqrt(lam))).float()
    basis = Basis(mean=np.zeros(p), eigenvalues=lam, components=np.eye(p), total_variance=float(lam.sum()), n=n)
    return basis, x


def test_allocators_stay_within_the_cap_and_pay_for_it_in_error():
    basis, x = _basis_and_rows()
    z = basis.project(x)
    free = allocate([4.0], basis, settings=AllocatorSettings(), projections=z)[0]
    capped = allocate([4.0], basis, settings=AllocatorSettings(max_components=12), projections=z)[0]
    assert free.kept > 12 >= capped.kept and capped.expected_error > free.expected_error
    assert capped.cost_bits <= capped.budget_bits
    e_free = fit_ecsq(4.0, z, basis.dim)
    e_cap = fit_ecsq(4.0, z, basis.dim, EcsqSettings(max_components=12))
    assert e_free.kept > 12 >= e_cap.kept and e_cap.bits_per_token <= e_cap.budget_bits
    assert e_cap.step < e_free.step  # the budget's bits go to the components it keeps


def test_basis_size_curve_falls_with_components():
    basis, x = _basis_and_rows()
    rows = basis_size.curve_rows(basis, x.numpy(), basis.project(x), "keys", 0, [4.0, 8.0])
    assert {r["cap"] for r in rows} == {6, 12, 24, 48, 0}
    for ratio in (4.0, 8.0):
        errs = [r["rel_error"] for r in sorted((r for r in rows if r["ratio"] == ratio), key=lambda r: r["components"])]
        assert errs[0] > errs[-1]
    assert basis_size.cost_db(rows, "keys", 4.0, 6) > basis_size.cost_db(rows, "keys", 4.0, 48) >= -0.05
    assert basis_size.chart(rows)[:4] == b"\x89PNG"


def test_codec_holds_only_its_modes_columns_in_the_basis_dtype():
    spec = synthetic_spec(2, 2, 16, 8.0, sinks=2, window=2)
    keys, values = synthetic_cache(spec, 20, torch.float32)
    full = KVTCCodec(spec, mode="fixed")
    k32, v32 = full.decode(full.encode(keys, values))
    kept = sum(g.kept * g.mean.shape[0] for st in spec.streams.values() for g in st)
    assert full.basis_bytes() == 4 * (kept + 2 * spec.features)
    half = KVTCCodec(spec, mode="fixed", basis_dtype=torch.bfloat16)
    blob = half.encode(keys, values)
    k16, v16 = half.decode(blob)
    assert half.basis_bytes() == 2 * kept + 4 * 2 * spec.features
    err = float((k16 - keys).norm() / (k32 - keys).norm())
    assert 0.9 < err < 1.2  # bf16 components cost little next to the quantization error
    with pytest.raises(ValueError, match="basis_dtype"):
        KVTCCodec(spec, mode="fixed", basis_dtype=torch.int8)
