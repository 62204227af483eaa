"""Charts and report.md from a tiny in-process calibration; the error-by-tokens curve."""
import argparse
import contextlib
import io

import pytest

from kvtc import artifacts
from kvtc.pipeline.evaluation import diagnostics
from kvtc.pipeline.evaluation import report
from kvtc.pipeline.commands import report as report_command
from kvtc.pipeline.fit.allocator import AllocatorSettings
from kvtc.pipeline.job.error_by_tokens import error_by_tokens
from kvtc.pipeline.settings import JobSettings
from kvtc.pipeline.job.calibrate import calibrate_local
from kvtc.pipeline.job.heldout_store import load_rows

PNG = b"\x89PNG\r\n\x1a\n"
TINY = dict(model="tiny:llama", corpus="pydoc", eval_corpus="stdlib", seq_len=128, window=16, tokens=2048,
            eval_tokens=256, seqs_per_shard=2, heldout_rows=1024, ratios=(4.0, 8.0), name="tiny",
            objective="mse",  # the refold measures the cache's own error
            served_sequences=0)  # the served check's report rows: test_evaluate.py


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    root = tmp_path_factory.mktemp("report")
    cfg = JobSettings.of(**TINY, registry=str(root / "reg"), store=str(root / "store"))
    summary, ctx = calibrate_local(cfg)
    art = artifacts.pull("tiny@latest", registry=summary["registry"])
    return summary, ctx, art


def _curve(ctx, art, settings=None):
    corpus = art.manifest["corpus"]
    held = load_rows(ctx["store"], corpus["heldout_shards"], 1024)
    evals = load_rows(ctx["store"], corpus["eval_shards"], 1024)
    return error_by_tokens(ctx["store"], corpus["accumulators"], held, evals, 8.0, 4, 16, settings=settings)


def test_error_by_tokens_grows_prefixes_and_ends_at_the_calibration(calibrated):
    summary, ctx, art = calibrated
    rows = _curve(ctx, art, AllocatorSettings())  # measured, like the reduce
    tokens = sorted({r["tokens"] for r in rows})
    assert len(tokens) == 3 and tokens[-1] == art.manifest["calibration"]["train_rows"]
    assert {(r["stream"], r["split"]) for r in rows} == {(s, p) for s in ("keys", "values") for p in ("heldout", "eval")}
    final = {row["ratio"]: row for row in summary["ratios"]}[8.0]
    for stream in ("keys", "values"):
        last = next(r for r in rows if r["tokens"] == tokens[-1] and r["stream"] == stream and r["split"] == "heldout")
        assert last["rel_error"] == pytest.approx(final[stream]["fixed"]["rel_error"], rel=1e-3)
        first = next(r for r in rows if r["tokens"] == tokens[0] and r["stream"] == stream and r["split"] == "heldout")
        assert first["rel_error"] > last["rel_error"]


def test_build_makes_three_charts_and_the_tables(calibrated):
    _, ctx, art = calibrated
    curves = {name: art.curve(name) for name in art.curves()}
    curves["error_by_tokens"] = _curve(ctx, art)
    quality = {"artifact": "tiny@x", "corpus": "pydoc", "settings": {},
               "rows": [{"method": "kvtc-8x", "bytes_per_token": 50.0, "cr": 7.7, "key_rel_error": 0.3,
                         "value_rel_error": 0.4, "ppl_ratio": 1.01, "kl": 0.002}]}
    files = report.build(art.metrics(), curves, art.allocations(), art.manifest["calibration"], art.manifest["model"],
                         quality=quality)
    charts = ("charts/error_by_tokens.png", "charts/error_by_position.png", "charts/allocation.png")
    for rel in charts:
        assert files[rel].startswith(PNG) and len(files[rel]) > 5000, rel
    md = files["report.md"].decode()
    for rel in charts:
        assert f"]({rel})" in md
    assert "| CR | stream | default mode | held-out |" in md and "| 8 | values |" in md and "gap (dB)" in md
    assert "| kvtc-8x | 50 | 7.70 | 30.00% | 40.00% | 1.0100 | 0.0020 |" in md
    # every calibration stores the error_by_tokens curve, so the artifact's own report has all three charts
    stored = report.build_from_artifact(art)
    assert all(rel in stored for rel in charts)
    # a calibration run with --tokens-curve-points 0 has no such curve: the report says so instead of failing
    curves.pop("error_by_tokens")
    plain = report.build(art.metrics(), curves, art.allocations(), art.manifest["calibration"], art.manifest["model"])
    assert "charts/error_by_tokens.png" not in plain and "no data stored" in plain["report.md"].decode()


def test_bits_per_component_amortises_scales():
    bits = report.bits_per_component([(0, 16, "int4", 4, 32), (16, 64, "int2", 2, 32), (80, 16, "none", 0, 0)])
    assert bits[:16] == [6.0] * 16 and bits[16:80] == [2.5] * 64 and len(bits) == 80


def test_allocation_chart_drops_to_zero_bits_after_the_kept_components():
    bits = report.bits_per_component([(0, 16, "int4", 4, 32), (16, 64, "int2", 2, 32)])
    xs, ys = report.allocation_steps(bits, features=96)
    assert xs[:2] == [1, 2] and ys[:80] == bits and ys[80:] == [0.0, 0.0] and xs[80] == 81 and xs[-1] == 160
    assert report.allocation_steps(bits, features=400)[0][-1] == 400


def test_cli_writes_report_folder(calibrated, tmp_path):
    summary, _, _ = calibrated
    parser = argparse.ArgumentParser()
    report_command.register(parser.add_subparsers())
    args = parser.parse_args(["report", "tiny", "--registry", summary["registry"], "--out", str(tmp_path / "r")])
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert args.func(args) == 0
    assert (tmp_path / "r" / "report.md").is_file()
    assert (tmp_path / "r" / "charts" / "allocation.png").read_bytes().startswith(PNG)


def test_pca_error_by_position_is_below_the_quantized_error():
    import numpy as np

    from kvtc.pipeline.fit.allocator import allocate
    from kvtc.pipeline.evaluation.metrics import evaluate
    from kvtc.pipeline.fit.pca import pca_from_moments

    rng = np.random.default_rng(0)
    x = (rng.standard_normal((600, 32)) * np.linspace(3, 0.1, 32)).astype(np.float32)
    basis = pca_from_moments(len(x), x.sum(0, dtype=np.float64), x.T.astype(np.float64) @ x)
    allocs = allocate([4.0, 8.0], basis, x, AllocatorSettings(error_model="analytic"))
    positions = np.arange(600) % 100
    rows = diagnostics.pca_error_by_position(basis, allocs, x, positions)
    quantized = {(b.lo, ev.ratio): b.rel_error for ev in evaluate(basis, allocs, x, positions=positions) for b in ev.by_position}
    assert {(r["lo"], r["ratio"]) for r in rows} == set(quantized)
    for r in rows:
        assert 0 <= r["rel_error"] <= quantized[(r["lo"], r["ratio"])] + 1e-6


def test_group_task_reruns_the_published_group_and_survives_the_store(calibrated):
    """One stream and group's reduce unit, rerun from the store on one thread, gives the published
    basis and allocations; its result read back from the store (arrays + JSON, no pickle) equals it."""
    import numpy as np

    from kvtc.pipeline.job.group_task import GroupResult, GroupTask, run_group

    summary, ctx, art = calibrated
    cal, corpus = art.manifest["calibration"], art.manifest["corpus"]
    held = load_rows(ctx["store"], corpus["heldout_shards"], 1024)
    evals = load_rows(ctx["store"], corpus["eval_shards"], 1024)
    p = art.basis("values")[0].shape[0]
    task = GroupTask(index=0, stream="values", group=0, p=p, accumulators=tuple(corpus["accumulators"]),
                     ratios=(4.0, 8.0), allocator=AllocatorSettings.from_dict(cal["allocator"]), sinks=cal["sinks"],
                     window=cal["window"], threads=1)
    result = run_group(task, ctx["store"], held.group("values", slice(0, p), evals, cal["sinks"], cal["window"]))
    mean, eigenvalues, components = art.basis("values")
    np.testing.assert_allclose(result.basis[0], mean, rtol=0, atol=1e-6)
    np.testing.assert_allclose(np.abs(result.basis[2]), np.abs(components), rtol=0, atol=1e-4)
    assert [s.method for s in result.solves] and result.fit_s > 0 and result.measure.seconds > 0
    for ratio in (4.0, 8.0):
        assert [tuple(b[:4]) for b in result.allocations[(ratio, "values", 0)]["blocks"]] == \
               [tuple(b) for b in art.allocation(ratio, "values")]
    ctx["store"].put_basis("result-test", *result.arrays_and_meta())
    back = GroupResult.from_stored(*ctx["store"].get_basis("result-test"))
    ctx["store"].drop_basis("result-test")
    assert back.allocations == result.allocations and back.notes == result.notes and back.solves == result.solves
    assert back.measure.metrics == result.measure.metrics and back.measure.curves == result.measure.curves
    assert back.measure.partials == result.measure.partials and back.measure.ecsq_partials == result.measure.ecsq_partials
    for a, b in zip(back.basis, result.basis):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    for key, table in result.ecsq.items():
        other = back.ecsq[key]
        assert {k: v for k, v in other.items() if not isinstance(v, (np.ndarray, list))} == \
               {k: v for k, v in table.items() if not isinstance(v, (np.ndarray, list))}
        assert all(np.array_equal(other[k], table[k]) for k in ("scales", "model", "offsets"))
        assert [(r, c.tolist()) for r, c in other["models"]] == [(r, c.tolist()) for r, c in table["models"]]
    with pytest.raises(ValueError, match="bad stream"):
        GroupTask(index=0, stream="queries", group=0, p=p, accumulators=("a",), ratios=(4.0,), allocator={}, sinks=4,
                  window=16, threads=1)


def test_the_jobs_own_error_by_tokens_curve_agrees_with_a_refold(calibrated):
    """The reduce measures the curve in its group tasks, from the running sums of each group's own solve;
    a refold of the stored accumulators gives the same curve."""
    summary, ctx, art = calibrated
    stored = art.curve("error_by_tokens")
    tokens = sorted({r["tokens"] for r in stored})
    assert len(tokens) >= 2 and tokens[-1] == art.manifest["calibration"]["train_rows"]
    refold = {(r["tokens"], r["stream"], r["split"]): r["rel_error"] for r in _curve(ctx, art)}
    for r in stored:
        assert r["rel_error"] == pytest.approx(refold[(r["tokens"], r["stream"], r["split"])], rel=1e-4)
    for stream in ("keys", "values"):
        by = {r["tokens"]: r["rel_error"] for r in stored if r["stream"] == stream and r["split"] == "heldout"}
        assert by[tokens[0]] > by[tokens[-1]]
