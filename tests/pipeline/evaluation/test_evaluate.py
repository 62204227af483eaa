"""`kvtc eval` on a tiny model calibrated in-process: finite numbers, an exact uncompressed path,
the codec at its budget, and baselines at their real bytes."""
import argparse
import contextlib
import io
import json
import math

import pytest

from kvtc import artifacts
from kvtc.pipeline.operations import quality
from kvtc.pipeline.commands import eval as eval_command
from kvtc.pipeline.settings import JobSettings
from kvtc.pipeline.job.calibrate import calibrate_local

TINY = dict(model="tiny:llama", corpus="pydoc", eval_corpus="stdlib", seq_len=128, window=16, tokens=2048,
            eval_tokens=256, seqs_per_shard=2, heldout_rows=1024, ratios=(4.0, 8.0), name="tiny")


@pytest.fixture(scope="module")
def calibrated_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    cfg = JobSettings.of(**TINY, registry=str(root / "reg"), store=str(root / "store"))
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        summary, _ = calibrate_local(cfg)
    return summary, err.getvalue()


@pytest.fixture(scope="module")
def calibrated(calibrated_run):
    return calibrated_run[0]


@pytest.fixture(scope="module")
def result(calibrated):
    settings = quality.EvalSettings(ratios=(4.0, 8.0), continuation=12, sequences=2)
    return quality.run("tiny", calibrated["registry"], settings)


def test_every_number_is_finite_and_uncompressed_is_exact(result):
    rows = {r["method"]: r for r in result["rows"]}
    assert {"uncompressed", "kvtc-4x", "kvtc-8x", "pca-uniform-8x", "evict-8x", "kivi-int2-g32", "kivi-int4-g128",
            "fp8-e4m3", "deflate-fp16"} <= set(rows)
    for r in rows.values():
        assert all(math.isfinite(r[k]) for k in ("bytes_per_token", "cr", "key_rel_error", "value_rel_error",
                                                 "ppl_ratio", "kl")), r
        assert r["kl"] >= -1e-12 and r["tokens"] == 24 and r["sequences"] == 2
    base = rows["uncompressed"]
    assert base["ppl_ratio"] == 1.0 and base["kl"] == 0.0 and base["key_rel_error"] == 0.0 and base["cr"] == 1.0
    assert rows["deflate-fp16"]["key_rel_error"] < 1e-3 and rows["deflate-fp16"]["cr"] > 1.0


def test_codec_spends_its_budget_and_errors_grow_with_ratio(result):
    rows = {r["method"]: r for r in result["rows"]}
    p = 3 * 2 * 16
    for ratio in (4.0, 8.0):
        r = rows[f"kvtc-{ratio:g}x"]
        budget_bytes = 2 * (16 * p // ratio) / 8  # both streams; header and section tables come on top
        assert r["bytes_per_token"] <= 1.25 * budget_bytes and r["cr"] > 0.75 * ratio
        assert rows[f"evict-{ratio:g}x"]["cr"] >= ratio
        assert r["kl"] > 0
    assert rows["kvtc-4x"]["key_rel_error"] < rows["kvtc-8x"]["key_rel_error"] < 1
    assert rows["kvtc-4x"]["value_rel_error"] < rows["kvtc-8x"]["value_rel_error"] < 1


def test_limit_rows_compare_with_the_gaussian_bound(result, calibrated):
    limit = {(r["ratio"], r["stream"]): r for r in result["limit"]}
    assert set(limit) == {(4.0, "keys"), (4.0, "values"), (8.0, "keys"), (8.0, "values")}
    summary = {row["ratio"]: row for row in calibrated["ratios"]}
    for (ratio, stream), r in limit.items():
        assert r["rel_error"] == pytest.approx(summary[ratio][stream]["fixed"]["rel_error"])
        assert r["bound_rel_error"] < r["rel_error"]
        assert r["gap_db"] == pytest.approx(20 * math.log10(r["rel_error"] / r["bound_rel_error"]))


def test_heldout_sequences_are_the_calibration_heldout_shards(calibrated):
    from kvtc.workers.models import embedded_tokenizer

    art = artifacts.pull("tiny@latest", registry=calibrated["registry"])
    seqs = quality.heldout_sequences(art, embedded_tokenizer(), None, 3)
    assert len(seqs) == 3 and all(len(s) == 128 for s in seqs)
    other = quality.heldout_sequences(art, embedded_tokenizer(), "stdlib", 2)
    assert len(other) == 2 and not any((a == b).all() for a in seqs for b in other)


def test_cli_prints_json_and_rejects_bad_input(calibrated):
    parser = argparse.ArgumentParser()
    eval_command.register(parser.add_subparsers())
    args = parser.parse_args(["eval", "tiny", "--registry", calibrated["registry"], "--ratios", "8", "--sequences", "1",
                              "--continuation", "4", "--baselines", "fp8", "--json"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert args.func(args) == 0
    data = json.loads(out.getvalue())
    assert [r["method"] for r in data["rows"]] == ["uncompressed", "kvtc-8x", "kvtc-chunk-8x", "fp8-e4m3"]
    with pytest.raises(ValueError, match="unknown baselines"):
        quality.EvalSettings(baselines=("gzip",))
    with pytest.raises(ValueError, match="ratios must be > 1"):
        quality.EvalSettings(ratios=(1.0,))
    with pytest.raises(ValueError, match=r"offline_ratios \[16.0\] must be among the ratios \[4.0, 8.0\]"):
        quality.EvalSettings(ratios=(4.0, 8.0), offline_ratios=(16.0,))
    with pytest.raises(ValueError, match="offline_ratios must be a tuple of ratios, got 8.0"):
        quality.EvalSettings(ratios=(4.0, 8.0), offline_ratios=8.0)
    assert quality.EvalSettings(ratios=(4.0, 8.0), offline_ratios=(8.0, 8.0)).offline_ratios == (8.0,)


def test_the_chunk_path_is_scored_beside_the_codec_and_the_job_publishes_what_serving_costs(result, calibrated,
                                                                                             calibrated_run):
    # the check runs for minutes on a CPU after the reduce's last line: it says what it scores as it starts
    lines = [line for line in calibrated_run[1].splitlines() if line.startswith("served check: ")]
    assert len(lines) == 2 and "through the offline codec and the chunk path at CR 4/8" in lines[0]
    assert "held-out window of" in lines[1] and "offline codec at CR 8" in lines[1]
    rows = {r["method"]: r for r in result["rows"]}
    for ratio in (4.0, 8.0):
        served = rows[f"kvtc-chunk-{ratio:g}x"]
        assert math.isfinite(served["ppl_ratio"]) and served["kl"] >= 0
        assert 0.5 * ratio < served["cr"] <= 1.01 * ratio  # every stored byte counted, the raw sinks included
    # the job scored its own held-out sequences through both paths before publishing: summary, metrics, report
    by_ratio = {row["ratio"]: row for row in calibrated["ratios"]}
    for ratio in (4.0, 8.0):
        served = by_ratio[ratio]["served"]
        # the long window through the offline codec at the middle ratio only (the chart's), the chunk path at each
        assert set(served) == {"chunk", "offline", "chunk-long"} | ({"offline-long"} if ratio == 8.0 else set())
        assert served["chunk"]["ppl_ratio"] > 0 and served["chunk"]["kl"] >= 0
        # one more held-out window at the longest context the text allows (the held-out sequences joined)
        assert served["chunk-long"]["prefix"] > 128 and served["chunk-long"]["kl"] >= 0
        # each figure with its 95% interval; the window's needles asked through the raw cache and the chunk path
        for path in ("chunk", "chunk-long", "offline"):
            assert served[path]["kl_ci_low"] <= served[path]["kl"] <= served[path]["kl_ci_high"]
            assert served[path]["ppl_ratio_ci_low"] <= served[path]["ppl_ratio"] <= served[path]["ppl_ratio_ci_high"]
        long = served["chunk-long"]
        assert long["needles_samples"] >= 2 and 0 <= long["needles"] <= 1 and 0 <= long["needles_raw"] <= 1
        assert long["needles_ci_low"] <= long["needles"] <= long["needles_ci_high"]
    art = artifacts.pull("tiny@latest", registry=calibrated["registry"])
    splits = {(m["split"], m["metric"]) for m in art.metrics() if m["split"].startswith("served")}
    assert {("served-chunk", "ppl_ratio"), ("served-chunk", "kl"), ("served-offline", "ppl_ratio"),
            ("served-chunk-long", "kl"), ("served-chunk-long", "prefix")} <= splits
    report = art.file("report.md").read_text()
    assert "kvtc-chunk-8x" in report and "Model quality with compressed caches" in report
    assert "At the longest context scored" in report and "Needles in that window" in report
    # the codec's error by position over that window: the chart spans it, past the calibration's --seq-len
    long = art.curve("error_by_position_long")
    prefix = served["chunk-long"]["prefix"]
    assert max(r["hi"] for r in long) == prefix and {r["stream"] for r in long} == {"keys", "values"}
    assert {float(r["ratio"]) for r in long} == {8.0}  # the middle ratio, the chart's bold line
    middle = [r for r in long if r["lo"] >= 4 and r["hi"] <= prefix - 16]
    assert middle and all(0 < r["rel_error"] < 1.5 for r in middle)


def test_a_served_check_that_cannot_run_is_a_note_and_the_artifact_is_still_published():
    from helpers.toy_artifacts import toy_content
    from kvtc.pipeline.job.served_check import served_quality

    quality_result, note = served_quality(toy_content(), "tiny:no-such-architecture", None, 2, 8)
    assert quality_result is None and "served quality not measured in the job" in note and "kvtc eval" in note


def test_a_served_check_that_cannot_fit_the_drivers_memory_is_a_note(monkeypatch):
    from helpers.toy_artifacts import toy_content
    from kvtc.pipeline.job import served_check

    content = toy_content()
    need = served_check.served_bytes(content)
    assert need == served_check.SERVED_COPIES * sum(4 * b[2].size for b in content.bases.values()) > 0
    monkeypatch.setattr(served_check, "_free_bytes", lambda: need - 1)
    quality_result, note = served_check.served_quality(content, "tiny:llama", None, 2, 8)
    assert quality_result is None and "GiB" in note and "kvtc eval" in note


def test_eval_scores_after_a_prefix_longer_than_the_calibrations_and_refuses_one_beyond_the_model_or_the_text(
        calibrated):
    from kvtc.workers.models import load_model

    settings = quality.EvalSettings(ratios=(4.0,), continuation=8, sequences=1, baselines=(), prefix=200,
                                    attention_errors=False)
    out = quality.run("tiny", calibrated["registry"], settings)  # calibrated at --seq-len 128
    assert out["settings"]["prefix"] == 200 and out["settings"]["sequences"] == 1
    rows = {r["method"]: r for r in out["rows"]}
    assert rows["uncompressed"]["kl"] == 0.0 and math.isfinite(rows["kvtc-chunk-4x"]["kl"])
    art = artifacts.pull("tiny@latest", registry=calibrated["registry"])
    tok = load_model("tiny:llama").tokenizer
    windows = quality.heldout_sequences(art, tok, None, 2, None, 209)
    joined = [int(t) for s in quality.heldout_sequences(art, tok, None, 64) for t in s]
    assert [int(t) for t in windows[0]] == joined[:209]  # the held-out sequences joined in plan order
    limit = load_model("tiny:llama").max_positions
    with pytest.raises(ValueError, match=f"needs {limit + 9} positions, beyond model .*limit of {limit}"):
        quality.run("tiny", calibrated["registry"], quality.EvalSettings(ratios=(4.0,), continuation=8, baselines=(),
                                                                       prefix=limit))
    with pytest.raises(ValueError, match=f"holds {len(joined)} tokens, fewer than one window of {limit}"):
        quality.run("tiny", calibrated["registry"], quality.EvalSettings(ratios=(4.0,), continuation=8, baselines=(),
                                                                       prefix=limit - 9))
    with pytest.raises(ValueError, match="prefix must be a token count"):
        quality.EvalSettings(prefix=0)


def test_a_prefix_whose_scoring_would_not_fit_the_nodes_memory_is_refused_before_scoring(calibrated, monkeypatch):
    from kvtc.pipeline.evaluation.long_context import long_bytes
    from kvtc.pipeline.job import fold_plan
    from kvtc.workers.models import load_model

    lm = load_model("tiny:llama")
    need = long_bytes(lm, 200 + 8 + 1)
    monkeypatch.setattr(fold_plan, "node_now", lambda reserve=0: (need // 3, 1 << 34, 0))
    settings = quality.EvalSettings(ratios=(4.0,), continuation=8, sequences=1, baselines=(), prefix=200)
    with pytest.raises(ValueError, match=r"--prefix 200: scoring one sequence of 209 tokens needs about .* GiB .*"
                                         r"lower --prefix to at most \d+"):
        quality.run("tiny", calibrated["registry"], settings)
    monkeypatch.setattr(fold_plan, "node_now", lambda reserve=0: (0, 1 << 34, 1 << 34))
    with pytest.raises(ValueError, match="no --prefix fits here"):
        quality.run("tiny", calibrated["registry"], settings)


def test_ratios_coded_side_by_side_restore_what_each_restores_alone(calibrated, monkeypatch):
    import torch

    from kvtc.kernels.codec import basis_product
    from kvtc.pipeline.evaluation.model_quality import Codecs
    from kvtc.pipeline.evaluation.served import chunk_paths, restore_through

    codecs = Codecs(artifacts.pull("tiny@latest", registry=calibrated["registry"]), None)
    transforms = {r: codecs.chunk(r) for r in (8.0, 4.0)}  # the wider one second: coded first all the same
    spec = transforms[4.0].codec.spec
    g = torch.Generator().manual_seed(3)
    shape = (spec.num_layers, spec.kv_heads, 600, spec.head_dim)  # 256 + 256 + 88 tokens: a ragged last chunk
    keys, values = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    widths = []
    project = basis_product._project
    monkeypatch.setattr(basis_product, "_project", lambda x, b: widths.append(b.shape[1]) or project(x, b))
    alone = {r: restore_through(t, keys, values) for r, t in transforms.items()}
    products_alone, widths[:] = len(widths), []
    together = dict(chunk_paths(transforms, keys, values))
    assert list(together) == [8.0, 4.0]
    for r, (k, v, stored) in alone.items():
        rec = together[r]
        assert torch.equal(rec.keys, k) and torch.equal(rec.values, v) and rec.stored_bytes == stored
    # the narrower ratio's projections read from the wider's, each pairing of width and row count checked once
    assert len(widths) < products_alone


def test_the_offline_codec_at_several_ratios_scores_what_each_scores_alone(calibrated, monkeypatch):
    from kvtc.kernels.codec import basis_product
    from kvtc.pipeline.evaluation import model_quality

    calls = []
    project = basis_product._project
    monkeypatch.setattr(basis_product, "_project", lambda x, b: calls.append(b.shape[1]) or project(x, b))
    settings = quality.EvalSettings(ratios=(4.0, 8.0), continuation=12, sequences=2, baselines=(), served=False)
    shared = {r["method"]: r for r in quality.run("tiny", calibrated["registry"], settings)["rows"]}
    shared_calls, calls[:] = len(calls), []
    monkeypatch.setattr(model_quality, "SHARED_ROWS_BYTES", 0)  # nothing kept: each ratio projects its own
    alone = {r["method"]: r for r in quality.run("tiny", calibrated["registry"], settings)["rows"]}
    assert shared_calls < len(calls)
    for method in ("kvtc-4x", "kvtc-8x"):
        assert shared[method] == alone[method]
