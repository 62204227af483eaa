"""The attention objective: its statistics (queries' second moments, W_O Grams), the whitened PCA, the
option and its bad inputs, and a calibration end to end whose artifact decodes through its decoder."""
import numpy as np
import pytest
import torch

from kvtc import artifacts
from kvtc.artifacts.calibration import CalibrationRecord
from kvtc.artifacts.groups import FeatureGroup
from kvtc.pipeline.fit.metric import AttentionMetric, Whitening
from kvtc.pipeline.fit.pca import pca_from_packed
from kvtc.workers.attention_metric import attention_modules, check_readable
from kvtc.workers.capture import CaptureSettings, capture_kv
from kvtc.workers.models import load_model
from kvtc.workers.stats import CalibrationStats
from kvtc.workers.stats_file import CorruptStats
from kvtc.workers.triangle import symmetric
from kvtc.workers.objective import ATTENTION, AUTO, MSE

ATTN = CaptureSettings(sinks=2, window=4, objective="attention")


def _dense(blocks: np.ndarray) -> np.ndarray:
    nb, d, _ = blocks.shape
    out = np.zeros((nb * d, nb * d))
    for b in range(nb):
        out[b * d:(b + 1) * d, b * d:(b + 1) * d] = blocks[b]
    return out


def test_whitening_of_packed_statistics_is_s_gram_s():
    rng = np.random.default_rng(0)
    nb, d = 5, 3
    a = rng.normal(size=(nb, d, d))
    w = Whitening.of(a @ a.transpose(0, 2, 1) + 0.1 * np.eye(d))
    x = rng.normal(size=(40, nb * d))
    gram, total = x.T @ x, x.sum(0)
    packed = gram[np.triu_indices(nb * d)].copy()
    w.whiten_packed(total, packed)
    s = _dense(w.root)
    np.testing.assert_allclose(symmetric(packed, nb * d), s @ gram @ s, atol=1e-10)
    np.testing.assert_allclose(total, s @ x.sum(0), atol=1e-10)
    np.testing.assert_allclose(_dense(w.inverse) @ s, np.eye(nb * d), atol=1e-10)
    np.testing.assert_allclose(w.apply(w.apply(x), inverse=True), x, atol=1e-10)


def test_whitened_pca_has_less_error_in_the_metric_than_plain_pca():
    rng = np.random.default_rng(1)
    nb, d, k = 4, 8, 6
    x = rng.normal(size=(4000, nb * d)) * rng.uniform(0.3, 3.0, size=nb * d)
    weights = np.exp(rng.normal(scale=1.5, size=(nb, d)))  # a strongly uneven diagonal metric
    w = Whitening.of(weights[..., None] * np.eye(d))
    m = _dense(w.root) @ _dense(w.root)

    def metric_error(enc: np.ndarray, dec: np.ndarray, mean: np.ndarray) -> float:
        e = (x - mean) - ((x - mean) @ enc) @ dec.T
        return float(np.einsum("ni,ij,nj->", e, m, e))

    gram, total = x.T @ x, x.sum(0)
    plain = pca_from_packed(len(x), total.copy(), gram[np.triu_indices(nb * d)].copy(), k=k)
    packed, wtotal = gram[np.triu_indices(nb * d)].copy(), total.copy()
    w.whiten_packed(wtotal, packed)
    white = pca_from_packed(len(x), wtotal, packed, k=k)
    enc, dec = w.columns(white.components), w.columns(white.components, inverse=True)
    np.testing.assert_allclose(enc.T @ dec, np.eye(k), atol=1e-10)  # decode undoes encode on the kept subspace
    mean = w.apply(white.mean[None], inverse=True)[0]
    np.testing.assert_allclose(mean, x.mean(0), atol=1e-10)
    assert metric_error(enc, dec, mean) < 0.8 * metric_error(plain.components, plain.components, plain.mean)


def test_metric_blocks_balance_and_floor():
    rng = np.random.default_rng(2)
    keys = rng.uniform(0.1, 5.0, size=(3, 2, 4)) * 10
    values = rng.normal(size=(3, 2, 4, 4))
    values = values @ values.transpose(0, 1, 3, 2) * 10
    sums, group = {"keys": keys, "values": values}, FeatureGroup((0, 2))
    blocks = AttentionMetric("layer", 0.05, "none").blocks(sums, 10, "keys", group, [FeatureGroup((0, 1, 2))], 2)
    assert blocks.shape == (4, 4, 4)  # layers 0 and 2, 2 heads each
    diag = np.einsum("bii->bi", blocks).reshape(2, 2, 4)
    np.testing.assert_allclose(diag.mean(axis=(1, 2)), 1.05)  # mean 1 per layer, plus the floor
    np.testing.assert_allclose(blocks[0] - np.diag(np.diag(blocks[0])), 0)  # keys: diagonal
    model = AttentionMetric("model", 0.05, "none").blocks(sums, 10, "values", group, [FeatureGroup((0, 1, 2))], 2)
    np.testing.assert_allclose(model[2], values[2, 0] / 10 + 0.05 * np.trace(values[2, 0] / 10) / 4 * np.eye(4))
    with pytest.raises(ValueError, match="concentration"):
        AttentionMetric().blocks(sums, 10, "keys", group, [FeatureGroup((0, 1, 2))], 2)
    sums["concentration"] = np.array([[10.0, 30.0], [5.0, 5.0], [20.0, 10.0]])  # layer 0: head 1 three times sharper
    weighted = AttentionMetric("layer", 0.05).blocks(sums, 10, "values", group, [FeatureGroup((0, 1, 2))], 2)
    plain = AttentionMetric("layer", 0.05, "none").blocks(sums, 10, "values", group, [FeatureGroup((0, 1, 2))], 2)
    ratio = (np.trace(weighted[1]) / np.trace(weighted[0])) / (np.trace(plain[1]) / np.trace(plain[0]))
    assert ratio == pytest.approx(3.0, rel=0.05)  # the floor is a share of each block's own mean
    with pytest.raises(ValueError, match="balance"):
        AttentionMetric("tokens")
    with pytest.raises(ValueError, match="weighting"):
        AttentionMetric(weighting="max")
    with pytest.raises(ValueError, match="floor"):
        AttentionMetric(floor=0.0)


@pytest.fixture(scope="module")
def llama():
    return load_model("tiny:llama")


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])  # plain, query norm, query norm after the heads move
def test_query_moments_match_the_queries_the_attention_computes(arch):
    lm = load_model(f"tiny:{arch}")
    ids = torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(0))
    cap = capture_kv(lm, ids, ATTN)
    assert cap.metric_tokens == 48
    with torch.inference_mode():
        hidden = lm.base(input_ids=ids, output_hidden_states=True).hidden_states
    d, kv = lm.head_dim, lm.num_kv_heads
    for i, layer in enumerate(lm.base.layers):
        attn = layer.self_attn
        heads = attn.o_proj.in_features // d
        with torch.inference_mode():
            q = attn.q_proj(layer.input_layernorm(hidden[i])).reshape(2, 24, heads, d)
            if hasattr(attn, "q_norm"):
                q = attn.q_norm(q)
        q = q.reshape(-1, heads, d).double()
        energy = q.square().sum(0).reshape(kv, -1, d).sum(1) * attn.scaling ** 2
        paired = (energy[:, : d // 2] + energy[:, d // 2:]) / 2  # RoPE half layout: dim j pairs with j + d/2
        torch.testing.assert_close(cap.metric["keys"][i], torch.cat([paired, paired], 1), rtol=1e-4, atol=1e-6)
        w = attn.o_proj.weight.double().reshape(-1, heads, d)
        gram = torch.einsum("ohi,ohj->hij", w, w).reshape(kv, -1, d, d).sum(1)
        torch.testing.assert_close(cap.metric["values"][i], gram * 48)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])  # gemma3: sliding-window layers
def test_attention_concentration_matches_the_models_own_attention_weights(arch):
    lm = load_model(f"tiny:{arch}")
    ids = torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(0))
    cap = capture_kv(lm, ids, ATTN)
    lm.model.config._attn_implementation = "eager"
    for layer in lm.base.layers:
        layer.self_attn.config._attn_implementation = "eager"
    weights = {}
    hooks = [layer.self_attn.register_forward_hook(lambda m, a, out, i=i: weights.__setitem__(i, out[1]))
             for i, layer in enumerate(lm.base.layers)]
    with torch.inference_mode():
        lm.base(input_ids=ids)
    for h in hooks:
        h.remove()
    assert len(weights) == len(lm.base.layers)
    for i, a in weights.items():  # (B, heads, T, T)
        per_head = a[..., ATTN.sinks:].double().square().sum((0, 2, 3))
        expected = per_head.reshape(lm.num_kv_heads, -1).sum(1)
        torch.testing.assert_close(cap.metric["concentration"][i], expected, rtol=1e-4, atol=1e-6)


def test_metric_statistics_add_round_trip_and_refuse_corruption(llama):
    ids = torch.randint(0, 1000, (1, 20), generator=torch.Generator().manual_seed(1))
    a = CalibrationStats.new(llama.fingerprint, ATTN, ("a",))
    b = CalibrationStats.new(llama.fingerprint, ATTN, ("b",))
    a.update(capture_kv(llama, ids, ATTN))
    b.update(capture_kv(llama, ids, ATTN))
    both = a.merge(b)
    assert both.metric_tokens == 40
    torch.testing.assert_close(both.metric["keys"], 2 * a.metric["keys"])
    back = CalibrationStats.from_bytes(both.to_bytes())
    assert back.metric_tokens == 40 and torch.equal(back.metric["values"], both.metric["values"])
    bad = CalibrationStats.from_bytes(both.to_bytes())
    bad.metric["keys"] = bad.metric["keys"][:1]
    with pytest.raises(CorruptStats, match="attention-metric keys"):
        CalibrationStats.from_bytes(bad.to_bytes())
    bad.metric["keys"] = torch.full_like(both.metric["keys"], float("nan"))
    with pytest.raises(CorruptStats, match="finite"):
        CalibrationStats.from_bytes(bad.to_bytes())
    plain = CalibrationStats.new(llama.fingerprint, CaptureSettings(sinks=2, window=4, objective="mse"))
    plain.update(capture_kv(llama, ids, CaptureSettings(sinks=2, window=4, objective="mse")))
    assert not plain.metric and "metric" not in plain.metadata()  # mse statistics are stored as before


def test_bad_objective_and_unreadable_models_fail_before_model_work(llama):
    with pytest.raises(ValueError, match="--objective must be one of"):
        CaptureSettings(objective="logits")
    mla = load_model("tiny:deepseek_v3")
    with pytest.raises(ValueError, match="multi-head latent attention"):
        check_readable(mla.config, mla.layers)
    lm = load_model("tiny:llama")
    del lm.base.layers[1].self_attn.q_proj
    with pytest.raises(ValueError, match="layer 1 .*query projection"):
        attention_modules(lm.base, lm.layers)
    check_readable(llama.config, llama.layers)  # a meta-device model: no weights loaded


def test_auto_objective_is_attention_where_its_metric_can_be_built_else_mse_with_the_reason(llama):
    from kvtc.workers.attention_metric import choose_objective
    from kvtc.workers.models import load_spec

    assert CaptureSettings().objective == AUTO
    assert choose_objective("auto", llama.config, llama.layers) == (
        ATTENTION, "auto: every coded layer's query and output projections were read")
    assert choose_objective("mse", llama.config, llama.layers)[0] == MSE
    mla = load_spec("tiny:deepseek_v3")
    used, why = choose_objective("auto", mla.config, mla.layers)
    assert used == MSE and "multi-head latent attention" in why and why.startswith("auto: ")
    with pytest.raises(ValueError, match="multi-head latent attention"):
        choose_objective("attention", mla.config, mla.layers)  # asked for explicitly: refused, never replaced
    with pytest.raises(ValueError, match="resolved against the model"):
        capture_kv(llama, torch.zeros(1, 16, dtype=torch.long), CaptureSettings(sinks=2, window=4))


def test_a_recalibration_repeats_the_objective_its_parent_ran():
    from kvtc.pipeline.settings import JobSettings, settings_from_manifest

    rec = CalibrationRecord(sinks=4, window=8, seq_len=64, seed=0, ratios=(8.0,), groups=(FeatureGroup((0, 1)),),
                            allocator={"block_sizes": [1], "types": ["int4"], "error_model": "measured"}, tokens_requested=2048)
    settings = JobSettings.of(objective="mse").computational()
    del settings["capture"]["objective"]  # a parent recorded before the option existed
    old = {"model": {"spec": "tiny:llama"}, "calibration": {**rec.to_manifest(), "settings": settings}}
    assert settings_from_manifest(old).capture.objective == MSE
    unrecorded = {"model": {"spec": "tiny:llama"}, "calibration": rec.to_manifest()}
    assert settings_from_manifest(unrecorded).capture.objective == MSE
    assert rec.capture()["objective"] == "mse"  # the parent's statistics scope names it


def test_cli_refuses_an_unknown_objective(capsys):
    from kvtc.pipeline.cli import main

    with pytest.raises(SystemExit):
        main(["calibrate", "--objective", "logits"])
    assert "--objective" in capsys.readouterr().err


def test_record_repeats_the_objective():
    rec = CalibrationRecord(sinks=4, window=8, seq_len=64, seed=0, ratios=(8.0,), groups=(FeatureGroup((0, 1)),),
                            allocator={}, objective="attention", attention_metric=AttentionMetric().to_json())
    back = CalibrationRecord.from_manifest({"calibration": rec.to_manifest()})
    assert back.capture()["objective"] == "attention" and back.attention_metric == {
        "balance": "sensitivity", "floor": 0.05, "weighting": "concentration", "copy_weight": 1.5}
    plain = CalibrationRecord(sinks=4, window=8, seq_len=64, seed=0, ratios=(8.0,), groups=(FeatureGroup((0, 1)),),
                              allocator={}).to_manifest()
    assert "objective" not in plain and "attention_metric" not in plain
    with pytest.raises(ValueError, match="objective"):
        CalibrationRecord(sinks=4, window=8, seq_len=64, seed=0, ratios=(8.0,), groups=(FeatureGroup((0, 1)),),
                          allocator={}, objective="attention")


def test_calibration_end_to_end_with_the_attention_objective(tmp_path):
    from kvtc.kernels.codec.kvtc_codec import KVTCCodec
    from kvtc.pipeline.job.calibrate import run
    from kvtc.pipeline.operations import quality
    from kvtc.pipeline.settings import JobSettings
    from kvtc.workers.capture import raw_cache

    cfg = JobSettings.of(model="tiny:qwen3", corpus="pydoc", eval_corpus="stdlib", seq_len=96, window=16, tokens=2048,
                         eval_tokens=192, seqs_per_shard=2, heldout_rows=512, ratios=(4.0, 8.0),  # objective: auto
                         registry=str(tmp_path / "reg"), store=str(tmp_path / "store"), name="att",
                         tokens_curve_points=0, served_sequences=0)
    run(cfg, in_process=True)
    art = artifacts.pull("att@latest", registry=str(tmp_path / "reg"))
    cal = art.manifest["calibration"]
    assert cal["objective_reason"].startswith("auto: ") and cal["settings"]["capture"]["objective"] == "attention"
    assert cal["objective"] == "attention" and cal["attention_metric"] == {
        "balance": "sensitivity", "floor": 0.05, "weighting": "concentration", "copy_weight": 1.5}
    assert cal["settings"]["capture"]["copy_probe"] == 4096  # the job's first shard measured the probe
    assert "attention" in cal["relative_error"]
    for stream in ("keys", "values"):
        _, _, enc = art.basis(stream)
        dec = art.decoder(stream)
        assert dec is not None and dec.shape == enc.shape
        np.testing.assert_allclose(enc.T @ dec, np.eye(enc.shape[1]), atol=2e-3)
    lm = load_model("tiny:qwen3")
    keys, values = raw_cache(lm, torch.randint(0, 1000, (1, 80), generator=torch.Generator().manual_seed(3)))
    codec = KVTCCodec(art, 4.0)
    k2, v2 = codec.decode(codec.encode(keys, values))
    assert float((k2 - keys).norm() / keys.norm()) < 0.5 and float((v2 - values).norm() / values.norm()) < 0.5
    result = quality.run("att@latest", str(tmp_path / "reg"),
                         quality.EvalSettings(ratios=(4.0,), baselines=(), sequences=1, continuation=8), "stdlib")
    row = next(r for r in result["rows"] if r["ratio"] == 4.0)
    assert 0 < row["key_attn_error"] < 1 and 0 < row["value_attn_error"] < 1
    # drift measures in the artifact's own metric (its whitening is stored beside the bases)
    from kvtc.pipeline.operations.drift_meter import measure_rows, metric_whitenings

    assert set(metric_whitenings(art)) == {("keys", 0), ("values", 0)}
    cap = capture_kv(lm, torch.randint(0, 1000, (2, 96), generator=torch.Generator().manual_seed(4)), ATTN)
    drift = measure_rows(art, cap.keys.numpy(), cap.values.numpy())
    recorded = {m["stream"]: m["value"] for m in art.metrics()
                if m["ratio"] == 4.0 and m["group"] is None and m["split"] == "heldout" and m["metric"] == "rel_error"}
    for stream in ("keys", "values"):
        assert 0.3 * recorded[stream] < drift[(4.0, stream)] < 3 * recorded[stream]
