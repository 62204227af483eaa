"""Production geometry on a CPU: geometry presets, layer groups through calibration, codec and
charts; the accumulator planner; the memory estimate. (Store-size, bit-identity, resume and
corruption checks of the whole job are in test_calibrate.py.)"""
from pathlib import Path

import pytest
import torch

from kvtc import artifacts
from kvtc.pipeline.job.accumulators import AccumulatorPlan, FoldPlanner
from kvtc.pipeline.job.memory_plan import GIB, check_fits, estimate
from kvtc.pipeline.job.store import ShardStore
from kvtc.workers.capture import CaptureSettings
from kvtc.workers.models import load_model, load_spec
from kvtc.workers.stats import CalibrationStats
from kvtc.workers.tiny import Geometry, parse_tiny


def test_geometry_preset_has_the_kv_geometry_and_loads_without_weights():
    spec = load_spec("tiny:llama@80x8x128")
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.features) == (80, 8, 128, 81920)
    assert spec.config.hidden_size == 64 and spec.fingerprint["architecture"] == "LlamaForCausalLM"
    lm = load_model("tiny:llama@3x2x32", device="cpu")
    assert lm.fingerprint == load_spec("tiny:llama@3x2x32").fingerprint
    assert lm.fingerprint != load_spec("tiny:llama").fingerprint
    k = lm.model.model.layers[0].self_attn.k_proj
    assert k.out_features == 2 * 32 and len(lm.model.model.layers) == 3
    with pytest.raises(ValueError, match="LAYERSxKV_HEADSxHEAD_DIM"):
        parse_tiny("tiny:llama@32x8")
    with pytest.raises(ValueError, match="takes no geometry"):
        parse_tiny("tiny:qwen2@2x2x16")
    with pytest.raises(ValueError, match="even"):
        Geometry(2, 2, 15)


def test_layer_groups_through_calibration_codec_and_charts(tmp_path):
    from kvtc.kernels import KVTCCodec
    from kvtc.pipeline.settings import JobSettings
    from kvtc.pipeline.job.calibrate import calibrate_local

    cfg = JobSettings.of(model="tiny:llama@4x2x32", corpus="pydoc", eval_corpus=None, seq_len=128, window=16,
                          tokens=2048, seqs_per_shard=2, heldout_rows=1024, ratios=(4.0, 8.0), groups="layers:2",
                          accumulators=2, name="geo", registry=str(tmp_path / "reg"), store=str(tmp_path / "store"),
                          served_sequences=0)
    summary, _ = calibrate_local(cfg)
    art = artifacts.pull("geo@latest", registry=summary["registry"])
    assert art.manifest["calibration"]["groups"] == [[0, 2], [2, 4]]
    for g in (0, 1):
        mean, evals, comps = art.basis("keys", group=g)
        assert mean.shape == (128,) and comps.shape[0] == 128
    for rel in ("charts/error_by_tokens.png", "charts/error_by_position.png", "charts/allocation.png"):
        assert (Path(art.path) / rel).stat().st_size > 0
    lm = load_model("tiny:llama@4x2x32", device="cpu")
    ids = torch.randint(3, 2000, (1, 96), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        out = lm.base(input_ids=ids, use_cache=True)
    cache = out.cache if "cache" in out else out.past_key_values
    keys = torch.stack([layer.keys[0] for layer in cache.layers])  # (L, H, T, D), RoPE applied
    values = torch.stack([layer.values[0] for layer in cache.layers])
    codec = KVTCCodec.from_registry("geo@latest", 4.0, registry=summary["registry"])
    k2, v2 = codec.decode(codec.encode(keys, values))
    assert k2.shape == keys.shape == (4, 2, 96, 32)
    assert float((k2 - keys).norm() / keys.norm()) < 0.5 and float((v2 - values).norm() / values.norm()) < 0.8


def _stats(ids, fingerprint, settings, seed):
    s = CalibrationStats.new(fingerprint, settings, shard_ids=tuple(ids))
    for stream in ("keys", "values"):
        m = s._get(stream, 0, torch.device("cpu"))
        m.n = 1
        m.sum += seed
    return s


def test_planner_resumes_extends_and_restarts_an_accumulator_that_is_not_a_prefix(tmp_path):
    fp = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 4}
    settings = CaptureSettings(sinks=0, window=0, objective="mse")
    store = ShardStore(str(tmp_path), "m", "c")
    plan = AccumulatorPlan(2)
    store.put_acc(plan.name(0, "s0"), _stats(["s0", "s2", "s4"], fp, settings, 1))
    store.put_acc(plan.name(1, "s1"), _stats(["s1"], fp, settings, 2))
    planner = FoldPlanner(plan, store)
    tasks = []
    for i in range(4):  # a shorter run for accumulator 0 (s0, s2), a longer one for 1 (s1, s3)
        tasks += planner.add(i, f"s{i}", {"shard": i})
    assert [(t["acc_index"], t["shard"], t["after"]) for t in tasks] == [(1, 3, "s1")]
    tasks = planner.finish()  # accumulator 0 holds s4, which this run lacks: set aside, rerun into a fresh total
    assert [(t["acc_index"], t["shard"], t["after"]) for t in tasks] == [(0, 0, None), (0, 2, "s0")]
    assert store.acc_shards(plan.name(0, "s0")) is None
    assert list(tmp_path.rglob("*.stats.stale"))
    assert planner.accumulators() == [(plan.name(0, "s0"), ["s0", "s2"]), (plan.name(1, "s1"), ["s1", "s3"])]
    assert store.acc_shards(plan.name(1, "s1")) == ["s1"] and store.acc_shards("absent") is None
    assert FoldPlanner(plan, store).finish() == []
    assert store.get_acc(plan.name(1, "s1")).packed("keys", 0)[1][0] == 2.0


def test_memory_estimate_and_the_layer_group_hint():
    p = 80 * 8 * 128
    est = estimate([p], accumulators=2, workers=2, rows_per_batch=512, heldout_rows=1024, kept_max=p)
    assert est.reduce > 3 * 8 * p * p / 2 and est.peak == max(est.reduce, est.worker * est.workers)

    def grouped(k):
        return estimate([k * 1024] * (80 // k), accumulators=2, workers=2, rows_per_batch=512, heldout_rows=1024, kept_max=k * 1024)

    with pytest.raises(ValueError, match=r"needs about \d+\.\d GiB .*--groups layers:(\d+)") as err:
        check_fits(est, 12 * GIB, 80, 1024, "model", grouped)
    k = int(str(err.value).split("--groups layers:")[1].split()[0])
    assert grouped(k).peak <= 12 * GIB < grouped(k + 1).peak
    check_fits(grouped(k), 12 * GIB, 80, 1024, f"layers:{k}", grouped)
