"""The copy probe: the KL sensitivity of the model copying from far back, measured once per job and weighed beside
fresh text's in the sensitivity balance."""
import numpy as np
import pytest
import torch

from kvtc.artifacts.groups import FeatureGroup
from kvtc.pipeline.fit.metric import AttentionMetric, fisher
from kvtc.pipeline.job.accumulators import AccumulatorPlan, FoldPlanner
from kvtc.workers.capture import CaptureSettings, capture_kv
from kvtc.workers.models import load_model
from kvtc.workers.sensitivity import copy_probe, kl_sensitivity
from kvtc.workers.stats import CalibrationStats
from kvtc.workers.stats_file import CorruptStats

ATTN = CaptureSettings(sinks=2, window=4, objective="attention", copy_probe=20)


@pytest.fixture(scope="module")
def llama():
    return load_model("tiny:llama")


def _ids(b: int, t: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 1000, (b, t), generator=torch.Generator().manual_seed(seed))


def test_a_copy_probe_is_a_passage_the_text_after_it_and_the_passage_again():
    ids = torch.arange(100, 131)
    probe, scored_from = copy_probe(ids, 20)  # a passage of 20 // 4 = 5 tokens, 10 more, the passage again
    assert probe.tolist() == list(range(100, 115)) + list(range(100, 105)) and scored_from == 15
    assert (probe[scored_from:] == probe[:20 - scored_from]).all()  # the scored copy repeats the passage 15 back
    probe, scored_from = copy_probe(ids, 1 << 20)  # at most the sequence: 31 tokens, a passage of 7
    assert probe.tolist() == list(range(100, 124)) + list(range(100, 107)) and scored_from == 24
    probe, scored_from = copy_probe(ids, 20, "passage-twice")  # stop 70's: the first half twice, all scored
    assert probe.tolist() == list(range(100, 110)) * 2 and scored_from == 0
    with pytest.raises(ValueError, match="form"):
        copy_probe(ids, 20, "twice")
    with pytest.raises(ValueError, match="empty"):
        copy_probe(ids[:3], 8)
    with pytest.raises(ValueError, match=r"\(T,\)"):
        copy_probe(ids[None], 8)


def test_capture_measures_the_probe_beside_fresh_text_and_counts_both_positions(llama):
    ids = torch.cat([_ids(1, 40, 0), _ids(1, 40, 1)])
    got = capture_kv(llama, ids, ATTN, sensitivity=1, probe=True).metric
    probe, scored_from = copy_probe(ids[0], 20)
    want = kl_sensitivity(llama, probe[None], 2, 4, scored_from=scored_from)  # the copy's distributions only
    torch.testing.assert_close(got["probe_keys"], want["sensitivity_keys"])
    torch.testing.assert_close(got["probe_values"], want["sensitivity_values"])
    every = kl_sensitivity(llama, probe[None], 2, 4)
    assert float(got["probe_keys"].sum()) < float(every["sensitivity_keys"].sum())
    assert got["probe_positions"].tolist() == [5]  # the positions it scores
    assert got["fisher_positions"].tolist() == [40 - 2 - 4]  # one sequence's fresh pass
    torch.testing.assert_close(got["sensitivity_values"], kl_sensitivity(llama, ids[:1], 2, 4)["sensitivity_values"])
    plain = capture_kv(llama, ids, ATTN, sensitivity=1).metric  # every other shard: no probe
    assert "probe_keys" not in plain and plain["fisher_positions"].tolist() == [34]
    twice = capture_kv(llama, ids, CaptureSettings(sinks=2, window=4, objective="attention", copy_probe=20,
                                                  copy_probe_form="passage-twice"), sensitivity=1, probe=True).metric
    probe, _ = copy_probe(ids[0], 20, "passage-twice")
    torch.testing.assert_close(twice["probe_keys"], kl_sensitivity(llama, probe[None], 2, 4)["sensitivity_keys"])
    assert twice["probe_positions"].tolist() == [20 - 2 - 4]  # stop 70's count: the coded positions
    off = capture_kv(llama, ids, CaptureSettings(sinks=2, window=4, objective="attention", copy_probe=0),
                     sensitivity=1, probe=True).metric
    assert "probe_keys" not in off


def test_stats_keep_the_probe_and_refuse_half_of_it(llama):
    ids = _ids(1, 40, 2)
    with_probe = CalibrationStats.new(llama.fingerprint, ATTN, ("a",))
    with_probe.update(capture_kv(llama, ids, ATTN, sensitivity=1, probe=True))
    without = CalibrationStats.new(llama.fingerprint, ATTN, ("b",))
    without.update(capture_kv(llama, _ids(1, 40, 3), ATTN, sensitivity=1))
    back = CalibrationStats.from_bytes(with_probe.to_bytes())
    assert torch.equal(back.metric["probe_values"], with_probe.metric["probe_values"])
    merged = CalibrationStats.from_bytes(without.merge(with_probe).to_bytes())  # totals without the probe shard add
    assert merged.metric["fisher_positions"].tolist() == [68] and merged.metric["probe_positions"].tolist() == [5]
    for key in ("probe_values", "probe_positions"):
        bad = CalibrationStats.from_bytes(with_probe.to_bytes())
        del bad.metric[key]
        with pytest.raises(CorruptStats, match="without the others"):
            CalibrationStats.from_bytes(bad.to_bytes())
    bad = CalibrationStats.from_bytes(with_probe.to_bytes())
    del bad.metric["fisher_positions"]
    with pytest.raises(CorruptStats, match="count of fresh positions"):
        CalibrationStats.from_bytes(bad.to_bytes())


def _sums(layers=3, heads=2, d=4, n=10.0, n_probe=5.0):
    rng = np.random.default_rng(0)
    values = rng.normal(size=(layers, heads, d, d))
    eye = np.tile(np.eye(d), (layers, heads, 1, 1))
    return {"keys": rng.uniform(0.5, 2.0, size=(layers, heads, d)) * 10,
            "values": values @ values.transpose(0, 1, 3, 2) * 10 + np.eye(d),
            "concentration": np.full((layers, heads), 5.0),
            "sensitivity_keys": np.ones((layers, heads, d)) * n, "sensitivity_values": eye * n,
            "fisher_positions": np.array([n]),
            "probe_keys": np.ones((layers, heads, d)) * n_probe, "probe_values": eye * n_probe,
            "probe_positions": np.array([n_probe])}


def test_the_probe_weighs_per_position_beside_fresh_text():
    groups = [FeatureGroup((0, 1, 2))]
    sums = _sums()
    sums["probe_values"][1, 0] *= 9.0  # layer 1, head 0: what copying from far back needs, fresh text does not

    def scale(weight: float, s: dict = sums) -> np.ndarray:
        sens = AttentionMetric("sensitivity", copy_weight=weight).blocks(s, 10, "values", groups[0], groups, 2)
        head = AttentionMetric("head").blocks(s, 10, "values", groups[0], groups, 2)
        return (np.einsum("bii->b", sens) / np.einsum("bii->b", head)).reshape(3, 2)

    alone = {k: v for k, v in sums.items() if not k.startswith("probe_")}
    np.testing.assert_allclose(scale(0.0), scale(3.0, alone), rtol=1e-10)  # weight 0: fresh text only
    shares = [scale(w)[1, 0] / scale(w)[0, 0] for w in (0.0, 1.0, 3.0, 10.0)]
    assert shares == sorted(shares) and shares[-1] > 3 * shares[0]  # the probe's head gains with its weight
    # per position: the same Fisher over twice the probe's positions at twice the weight is the same balance
    double = {**sums, "probe_values": sums["probe_values"] * 2, "probe_keys": sums["probe_keys"] * 2,
              "probe_positions": sums["probe_positions"] * 2}
    np.testing.assert_allclose(scale(3.0, double), scale(3.0), rtol=1e-10)
    fresh, probe = fisher(sums)
    np.testing.assert_allclose(fresh["values"], sums["sensitivity_values"] / 10)
    assert fisher({**sums, "probe_positions": np.array([0.0])})[1] is None  # a probe shorter than sinks and window
    with pytest.raises(ValueError, match="copy weight"):
        AttentionMetric("sensitivity", copy_weight=-1.0)


def test_only_the_first_training_shard_measures_the_probe(tmp_path):
    from kvtc.pipeline.job.store import ShardStore

    planner = FoldPlanner(AccumulatorPlan(2), ShardStore(str(tmp_path), "m", "c"))
    tasks = [t for i in range(5) for t in planner.add(i, f"s{i}", {"shard": {"id": f"s{i}"}})]
    assert [t["probe"] for t in tasks] == [True, False, False, False, False]


def test_the_probe_is_a_capture_setting_of_the_store_key():
    from kvtc.pipeline.job.store import capture_key, settings_key

    assert "copy_probe" in ATTN.to_dict() and ATTN.to_dict()["copy_probe_form"] == "passage-text-passage"
    # the probe's form is in the key: a store of stop 70's probe (a passage twice, which wrote no form) is not read
    # as today's, and today's key is the one its stores were written under
    first = CaptureSettings(sinks=2, window=4, objective="attention", copy_probe=20, copy_probe_form="passage-twice")
    assert "copy_probe_form" not in first.to_dict() and first.to_dict() == {
        k: v for k, v in ATTN.to_dict().items() if k != "copy_probe_form"}
    assert capture_key(first.to_dict(), "float32") != capture_key(ATTN.to_dict(), "float32")
    assert capture_key(ATTN.to_dict(), "float32") == settings_key(
        {**first.to_dict(), "copy_probe_form": "passage-text-passage", "model_dtype": "float32"})
    assert CaptureSettings.from_dict(first.to_dict()) == first
    off = CaptureSettings(objective="attention", copy_probe=0).to_dict()
    assert capture_key(off, "float32") == settings_key({**off, "model_dtype": "float32"})  # stores before it match
    assert "copy_probe" not in CaptureSettings(objective="attention", copy_probe=0).to_dict()  # stores before it match
    assert "copy_probe" not in CaptureSettings(objective="attention", sensitivity=0).to_dict()
    assert CaptureSettings.from_dict(ATTN.to_dict()) == ATTN
    with pytest.raises(ValueError, match="--copy-probe"):
        CaptureSettings(copy_probe=8)
    with pytest.raises(ValueError, match="--copy-probe-form"):
        CaptureSettings(copy_probe_form="twice")
    assert "copy_probe_form" not in CaptureSettings(objective="attention", copy_probe=0).to_dict()
