"""The KL sensitivity (Fisher information of the cached keys and values): what it measures, how it is stored,
and the metric balance built on it."""
import numpy as np
import pytest
import torch

from kvtc.artifacts.groups import FeatureGroup
from kvtc.pipeline.fit.joint_budget import attention_weights
from kvtc.pipeline.fit.metric import SENSITIVITY_FLOOR, AttentionMetric
from kvtc.workers.capture import CaptureSettings, capture_kv
from kvtc.workers.models import load_model
from kvtc.workers.sensitivity import kl_sensitivity
from kvtc.workers.stats import CalibrationStats
from kvtc.workers.stats_file import CorruptStats, DegenerateStats

ATTN = CaptureSettings(sinks=2, window=4, objective="attention")


@pytest.fixture(scope="module")
def llama():
    return load_model("tiny:llama")


def _ids(t: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 1000, (1, t), generator=torch.Generator().manual_seed(seed))


def _logprobs(lm, ids: torch.Tensor, clean: dict, layer: int, noise: torch.Tensor | None, lo: int, hi: int
              ) -> torch.Tensor:
    """Next-token log-probabilities when every layer attends to the `clean` cache ({layer: (k, v)}, recorded
    when None is passed) with `noise` (kv_heads, hi - lo, d) added to layer `layer`'s values at positions
    [lo, hi): a served cache, whose entries are stored, not recomputed from the queries' perturbed states."""
    from transformers import DynamicCache

    class Served(DynamicCache):
        def update(self, k, v, layer_idx, *args, **kwargs):
            if layer_idx not in clean:
                clean[layer_idx] = (k.clone(), v.clone())
            k, v = clean[layer_idx]
            if noise is not None and layer_idx == layer:
                v = v.clone()
                v[0, :, lo:hi] += noise.to(v.dtype)
            return super().update(k, v, layer_idx, *args, **kwargs)

    with torch.inference_mode():
        out = lm.model(input_ids=ids, past_key_values=Served(config=lm.model.config), use_cache=True)
    return torch.log_softmax(out.logits[0].double(), -1)


def test_the_fisher_information_predicts_the_kl_a_value_error_costs(llama):
    t, sinks, window = 48, 2, 4
    ids = _ids(t)
    f = kl_sensitivity(llama, ids, sinks, window)
    values = f["sensitivity_values"]  # (layers, kv_heads, d, d)
    assert values.shape == (llama.num_layers, llama.num_kv_heads, llama.head_dim, llama.head_dim)
    torch.testing.assert_close(values, values.transpose(-1, -2))
    assert float(torch.linalg.eigvalsh(values).min()) > -1e-9  # a sum of g g^T
    clean: dict = {}
    base = _logprobs(llama, ids, clean, 0, None, sinks, t - window)
    gen = torch.Generator().manual_seed(1)
    for layer in range(llama.num_layers):
        sigma, kls = 0.02, []
        for _ in range(6):
            e = sigma * torch.randn(llama.num_kv_heads, t - window - sinks, llama.head_dim, generator=gen)
            pert = _logprobs(llama, ids, clean, layer, e, sinks, t - window)
            kls.append(float((base.exp() * (base - pert)).sum()))
        predicted = 0.5 * sigma ** 2 * float(torch.einsum("hii->", values[layer]))  # E[e^T F e] = sigma^2 tr F
        assert 0.4 < np.mean(kls) / predicted < 2.5, (layer, np.mean(kls), predicted)


def test_keys_are_pair_averaged_and_uncoded_positions_count_nothing(llama):
    f = kl_sensitivity(llama, _ids(40), 2, 4)
    keys, d = f["sensitivity_keys"], llama.head_dim
    assert keys.shape == (llama.num_layers, llama.num_kv_heads, d) and float(keys.min()) >= 0 and float(keys.sum()) > 0
    torch.testing.assert_close(keys[..., : d // 2], keys[..., d // 2:])  # RoPE half layout: j pairs with j + d/2
    empty = kl_sensitivity(llama, _ids(6), 2, 4)  # every position is a sink or in the window
    assert all(float(t.abs().sum()) == 0 for t in empty.values())
    with pytest.raises(ValueError, match="one sequence"):
        kl_sensitivity(llama, torch.zeros(2, 8, dtype=torch.long), 2, 4)


def test_capture_adds_the_sensitivity_of_the_first_sequences_and_stats_store_it(llama):
    ids = torch.cat([_ids(24, 0), _ids(24, 1)])
    plain = capture_kv(llama, ids, ATTN)
    assert "sensitivity_values" not in plain.metric
    one = capture_kv(llama, ids, ATTN, sensitivity=1)
    torch.testing.assert_close(one.metric["sensitivity_values"], kl_sensitivity(llama, ids[:1], 2, 4)["sensitivity_values"])
    stats = CalibrationStats.new(llama.fingerprint, ATTN, ("a",))
    stats.update(one)
    back = CalibrationStats.from_bytes(stats.to_bytes())
    assert torch.equal(back.metric["sensitivity_keys"], stats.metric["sensitivity_keys"])
    bad = CalibrationStats.from_bytes(stats.to_bytes())
    del bad.metric["sensitivity_keys"]
    with pytest.raises(CorruptStats, match="without the other"):
        CalibrationStats.from_bytes(bad.to_bytes())
    bad = CalibrationStats.from_bytes(stats.to_bytes())
    bad.metric["sensitivity_values"] = -bad.metric["sensitivity_values"]
    with pytest.raises(DegenerateStats, match="negative Fisher"):
        CalibrationStats.from_bytes(bad.to_bytes())
    with pytest.raises(ValueError, match="--sensitivity must be"):
        CaptureSettings(sensitivity=-1)


def test_capture_measures_the_first_sensitivity_tokens_of_a_longer_sequence(llama, monkeypatch):
    from kvtc.workers import sensitivity

    ids = torch.cat([_ids(40, 0), _ids(40, 1)])
    monkeypatch.setattr(sensitivity, "SENSITIVITY_TOKENS", 24)
    got = capture_kv(llama, ids, ATTN, sensitivity=1).metric
    want = kl_sensitivity(llama, ids[:1, :24], 2, 4)
    for name in ("sensitivity_keys", "sensitivity_values"):
        torch.testing.assert_close(got[name], want[name])
    assert not torch.equal(want["sensitivity_values"], kl_sensitivity(llama, ids[:1], 2, 4)["sensitivity_values"])


def _sums(rng, layers=3, heads=2, d=4):
    keys = rng.uniform(0.5, 2.0, size=(layers, heads, d)) * 10
    values = rng.normal(size=(layers, heads, d, d))
    values = values @ values.transpose(0, 1, 3, 2) * 10 + np.eye(d)
    fv = np.tile(np.eye(d), (layers, heads, 1, 1)).astype(np.float64)
    return {"keys": keys, "values": values, "concentration": np.full((layers, heads), 5.0),
            "sensitivity_keys": np.ones((layers, heads, d)), "sensitivity_values": fv}


def test_the_sensitivity_balance_scales_each_block_by_the_kl_of_one_whitened_unit():
    sums, groups = _sums(np.random.default_rng(0)), [FeatureGroup((0, 1, 2))]
    sums["sensitivity_values"][1, 0] *= 4.0  # layer 1, head 0: the model feels its values four times more
    head = AttentionMetric("head").blocks(sums, 10, "values", groups[0], groups, 2).reshape(3, 2, 4, 4)
    sens = AttentionMetric("sensitivity").blocks(sums, 10, "values", groups[0], groups, 2).reshape(3, 2, 4, 4)
    for layer in range(3):
        for h in range(2):
            f = sums["sensitivity_values"][layer, h]
            want = np.trace(np.linalg.inv(head[layer, h]) @ f) / 4  # the model's mean Fisher diagonal is the unit
            ref = np.einsum("lhii->", sums["sensitivity_values"]) / 24
            np.testing.assert_allclose(sens[layer, h], head[layer, h] * want / ref, rtol=1e-10)
    # so one whitened unit in every direction costs the same KL in every block: tr(M^-1 F) = d x the unit
    costs = [np.trace(np.linalg.inv(sens[layer, h]) @ sums["sensitivity_values"][layer, h]) for layer in range(3)
             for h in range(2)]
    np.testing.assert_allclose(costs, 4 * np.einsum("lhii->", sums["sensitivity_values"]) / 24, rtol=1e-10)
    sums["sensitivity_keys"][2] = 0.0  # a layer the model does not feel: floored, never free
    keys = AttentionMetric("sensitivity").blocks(sums, 10, "keys", groups[0], groups, 2).reshape(3, 2, 4, 4)
    plain = AttentionMetric("head").blocks(sums, 10, "keys", groups[0], groups, 2).reshape(3, 2, 4, 4)
    scale = np.einsum("lhii->lh", keys) / np.einsum("lhii->lh", plain)
    np.testing.assert_allclose(scale[2], SENSITIVITY_FLOOR * scale.max(), rtol=1e-10)
    w = attention_weights(AttentionMetric("sensitivity"), sums, 10, groups, 2, query_heads=1)
    assert w == {("keys", 0): 1.0, ("values", 0): 1.0}  # one unit already: the model's KL


def test_the_sensitivity_balance_refuses_statistics_without_it_or_a_model_that_feels_nothing():
    sums, groups = _sums(np.random.default_rng(1)), [FeatureGroup((0, 1, 2))]
    old = {k: v for k, v in sums.items() if not k.startswith("sensitivity_")}
    with pytest.raises(ValueError, match="--attention-balance layer"):
        AttentionMetric("sensitivity").blocks(old, 10, "keys", groups[0], groups, 2)
    sums["sensitivity_values"] = np.zeros_like(sums["sensitivity_values"])
    with pytest.raises(ValueError, match="zero or not finite"):
        AttentionMetric("sensitivity").blocks(sums, 10, "values", groups[0], groups, 2)


def test_calibrate_refuses_the_sensitivity_balance_without_its_capture_before_model_work(tmp_path):
    from kvtc.pipeline.job.calibrate import run
    from kvtc.pipeline.settings import JobSettings

    cfg = JobSettings.of(model="tiny:llama", corpus="pydoc", seq_len=64, window=8, tokens=512, sensitivity=0,
                         seqs_per_shard=2,
                         registry=str(tmp_path / "reg"), store=str(tmp_path / "store"), name="x")
    with pytest.raises(ValueError, match="--sensitivity 0"):
        run(cfg, in_process=True)
    assert not (tmp_path / "store").exists()
