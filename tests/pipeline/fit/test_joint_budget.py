"""One bit budget across streams and groups: the split, its exchange rate, and an artifact whose split does
not add up, refused when published and when read."""
import dataclasses

import numpy as np
import pytest

from kvtc.artifacts.blocks import budget_bits, check_budget_split
from kvtc.artifacts.groups import FeatureGroup
from kvtc.pipeline.fit.allocator_settings import AllocatorSettings, BitSplit
from kvtc.pipeline.fit.joint_budget import BasisSpectrum, gaussian_bits, split_budget
from kvtc.pipeline.fit.metric import AttentionMetric
from kvtc.pipeline.fit.joint_budget import attention_weights


def _spectrum(scale: float, p: int = 64, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.sort(rng.gamma(1.0, 1.0, p))[::-1] * np.exp(-np.arange(p) / 12) * scale


def test_gaussian_bits_meet_the_high_rate_law_and_vanish_below_the_drop_line():
    s = np.array([0.1, 0.5, 4.0, 100.0, 1000.0])
    bits = gaussian_bits(s)
    assert bits[0] == 0 and 1.1 < bits[1] < 1.3  # N(0, 1/4): P(0) = 0.68, each neighbour 0.16
    np.testing.assert_allclose(bits[3:], np.log2(s[3:] * np.sqrt(2 * np.pi * np.e)), rtol=1e-6)
    assert np.all(np.diff(gaussian_bits(np.geomspace(0.3, 200, 50))) > 0)


@pytest.mark.parametrize("ratio", [4.0, 8.0, 16.0, 32.0])
def test_split_adds_up_exactly_and_moves_bits_to_the_basis_the_model_feels_more(ratio):
    e = _spectrum(1.0)
    even = [BasisSpectrum("keys", 0, 64, e, 64, 1.0, ("r",)), BasisSpectrum("values", 0, 64, e, 64, 1.0, ("r",))]
    shares = split_budget(even, ratio)
    total = 2 * budget_bits(64, ratio)
    assert sum(shares) == total and abs(shares[0] - shares[1]) <= 1  # alike: shared alike
    heavy = [dataclasses.replace(even[0], weight=0.05), even[1]]
    shares = split_budget(heavy, ratio)
    assert sum(shares) == total and shares[1] > shares[0] >= budget_bits(64, ratio) / 4  # bounded shift
    # a larger spectrum at the same weight needs more bits for the same error
    wide = [dataclasses.replace(even[0], eigenvalues=e * 100), even[1]]
    assert split_budget(wide, ratio)[0] > split_budget(even, ratio)[0]


def test_pools_keep_their_own_totals():
    e = _spectrum(1.0)
    bases = [BasisSpectrum("keys", g, 64, e * (1 + 9 * g), 64, 1.0, (h,)) for h in ((0, 1), (1, 2)) for g in (0, 1)]
    shares = split_budget(bases, 8.0)
    assert shares[0] + shares[1] == shares[2] + shares[3] == 2 * budget_bits(64, 8.0)
    alone = [BasisSpectrum("keys", 0, 64, e, 64, 0.01, ("a",)), BasisSpectrum("values", 0, 64, e, 64, 1.0, ("b",))]
    assert split_budget(alone, 8.0) == [budget_bits(64, 8.0)] * 2  # one basis per pool: its own share


def test_attention_weights_follow_the_keys_reach_through_the_output_projection():
    layers, heads, d = 2, 2, 4
    groups = [FeatureGroup((0, 1))]
    sums = {"keys": np.full((layers, heads, d), 2.0) * 10, "values": np.tile(np.eye(d), (layers, heads, 1, 1)) * 10,
            "concentration": np.full((layers, heads), 0.5) * 10, "reach": np.full((layers, heads), 3.0) * 10}
    w = attention_weights(AttentionMetric("layer"), sums, 10, groups, heads, query_heads=1)
    # keys: c Q = 1 per dim (n_k 1), values: c G = 0.5 (n_v 0.5); a key unit is R / (n_q c) = 6 output units
    assert w[("values", 0)] == 1.0 and w[("keys", 0)] == pytest.approx(1 * 3 / (1 * 0.5) / 0.5)
    assert attention_weights(AttentionMetric("layer"), sums, 10, groups, heads, query_heads=3)[("keys", 0)] == \
        pytest.approx(w[("keys", 0)] / 3)
    assert attention_weights(AttentionMetric("layer"), {k: v for k, v in sums.items() if k != "reach"}, 10, groups, heads,
                             1) is None  # statistics of an earlier release: no exchange rate


def test_the_keys_reach_is_the_values_spread_around_each_output_through_w_o():
    """Captured beside the concentration, positive, and quadratic in the values: values scaled by s about
    their outputs (v_j - o_t scales by s) give s^2 the reach; the same values shifted by a constant give the same."""
    import torch

    from kvtc.workers.capture import _forward_cache, metric_capture
    from kvtc.workers.models import load_model

    lm = load_model("tiny:llama")
    ids = torch.randint(0, 1000, (1, 48), generator=torch.Generator().manual_seed(0))

    def reach(transform) -> torch.Tensor:
        metric = metric_capture(lm)
        keys, values = _forward_cache(lm, ids, metric)
        metric.attend(keys, 2, [transform(v) for v in values])
        return metric.sums()["reach"]

    base = reach(lambda v: v)
    assert bool((base > 0).all()) and bool(torch.isfinite(base).all())
    torch.testing.assert_close(reach(lambda v: 3 * v), 9 * base, rtol=1e-3, atol=0)
    torch.testing.assert_close(reach(lambda v: v + 5.0), base, rtol=2e-2, atol=1e-6)


def test_a_split_that_does_not_add_up_is_refused():
    dims = {("keys", 0): 32, ("values", 0): 32}
    good = {(8.0, "keys", 0): 40, (8.0, "values", 0): 88}
    check_budget_split(good, dims, {0: None}, "allocation")
    with pytest.raises(ValueError, match="add up to 129 bits per token, not the ratio's 128"):
        check_budget_split({**good, (8.0, "values", 0): 89}, dims, {0: None}, "allocation")
    with pytest.raises(ValueError, match="outside"):
        check_budget_split({(8.0, "keys", 0): -8, (8.0, "values", 0): 136}, dims, {0: None}, "allocation")


def test_an_artifact_whose_split_does_not_add_up_is_refused_when_published_and_when_read(tmp_path, monkeypatch):
    from kvtc import artifacts
    from kvtc.artifacts import tables
    from kvtc.artifacts.errors import CorruptArtifactError
    from helpers.whitened import whitened_content

    content = whitened_content(name="split", ecsq=False)
    key = next(iter(content.allocations))
    skewed = {**content.allocations, key: {**content.allocations[key],
                                           "budget_bits": content.allocations[key]["budget_bits"] + 8}}
    with pytest.raises(ValueError, match="add up to"):
        dataclasses.replace(content, allocations=skewed)
    ref = artifacts.publish(content, registry=str(tmp_path / "reg"))
    art = artifacts.Artifact(ref.path)
    real = tables.decode_allocations
    monkeypatch.setattr(tables, "decode_allocations", lambda *a: {**real(*a), key: skewed[key]})
    with pytest.raises(CorruptArtifactError, match="add up to"):
        art.allocations()


def test_a_joint_calibration_shares_each_ratios_total_in_the_models_kl_and_its_tables_keep_their_shares(tmp_path):
    """End to end on a tiny model (attention objective, sensitivity balance): the reduce solves every basis, sets
    the shares, fits each table within its own; the manifest records them; reading checks them."""
    from kvtc import artifacts
    from kvtc.pipeline.job.calibrate import run
    from kvtc.pipeline.settings import JobSettings

    ratios = (4.0, 8.0)
    cfg = JobSettings.of(model="tiny:llama", corpus="pydoc", eval_corpus=None, seq_len=64, window=8, sinks=2,
                         tokens=1024, seqs_per_shard=4, heldout_rows=512, ratios=ratios, tokens_curve_points=0,
                         served_sequences=0, bit_split="joint", registry=str(tmp_path / "reg"),
                         store=str(tmp_path / "store"), name="joint")
    summary = run(cfg, in_process=True)
    art = artifacts.pull(f"joint@{summary['version']}", registry=str(tmp_path / "reg"))
    split = art.manifest["calibration"]["bit_split"]
    assert split["split"] == "joint" and "KL" in split["unit"]  # the sensitivity balance: one unit, weights 1
    assert all(w == 1.0 for _, _, w in split["weights"])
    p = art.manifest["model"]["num_kv_heads"] * art.manifest["model"]["head_dim"] * art.manifest["model"]["num_layers"]
    for r in ratios:
        shares = {row["stream"]: row["bits"] for row in split["bits"] if row["ratio"] == r}
        assert sum(shares.values()) == 2 * budget_bits(p, r)  # the ratio's total, exactly
        for stream, bits in shares.items():
            table = art.ecsq(r, stream)
            assert table["budget_bits"] == bits and 0 < table["bits_per_token"] <= bits
            assert art.allocation_info(r, stream)["budget_bits"] == budget_bits(p, r)  # the fixed mode: its own


def test_the_bit_split_is_read_into_its_switch_and_recorded_as_its_word():
    assert BitSplit.words() == ("joint", "even") and AllocatorSettings().bit_split is BitSplit.JOINT
    even = AllocatorSettings(bit_split="even")
    assert even.bit_split is BitSplit.EVEN and not even.bit_split.shares_total and BitSplit.JOINT.shares_total
    assert even.to_dict()["bit_split"] == "even" and type(even.to_dict()["bit_split"]) is str
    with pytest.raises(ValueError, match=r"--bit-split must be one of \('joint', 'even'\), got 'half'"):
        AllocatorSettings(bit_split="half")
