"""The main job end to end on a tiny model: Ray pool, shard store, reduce, publish."""
import os
from pathlib import Path

import numpy as np
import pytest
import ray

from kvtc import artifacts
from kvtc.pipeline.settings import JobSettings
from kvtc.pipeline.job.calibrate import run
from kvtc.pipeline.cli import main as cli_main

TINY = dict(model="tiny:llama", corpus="pydoc", eval_corpus="stdlib", seq_len=128, window=16, tokens=2048,
            eval_tokens=256, seqs_per_shard=2, heldout_rows=1024, ratios=(4.0, 8.0),
            served_sequences=0)  # the job's served check: tests/pipeline/evaluation/test_evaluate.py


@pytest.fixture(scope="module", autouse=True)
def ray_local():
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    root = tmp_path_factory.mktemp("base")
    cfg = JobSettings.of(**TINY, workers=1, registry=str(root / "reg"), store=str(root / "store"), name="tiny")
    return cfg, run(cfg)


def _arrays(summary):
    art = artifacts.pull(summary["name"], summary["version"], registry=summary["registry"])
    out = {}
    for stream in ("keys", "values"):
        out[stream] = art.basis(stream)
        for r in (4.0, 8.0):
            out[(stream, r)] = art.allocation(r, stream)
    return art, out


def test_publishes_artifact_with_allocations_within_budget(baseline):
    cfg, summary = baseline
    art, arrays = _arrays(summary)
    assert art.manifest["model"]["num_layers"] == 3
    layers = art.manifest["calibration"]["layers"]  # the per-layer schema, uniform models included
    assert len(layers) == 3 and all(l["kind"] == "full" and l["kv_heads"] > 0 and l["head_dim"] > 0 for l in layers)
    folder = Path(art.path)
    for rel in ("report.md", "charts/error_by_tokens.png", "charts/error_by_position.png", "charts/allocation.png"):
        assert (folder / rel).stat().st_size > 0, rel
    assert {r["split"] for r in art.curve("error_by_tokens")} == {"heldout", "eval"}
    p = 3 * 2 * 16
    for stream in ("keys", "values"):
        mean, evals, comps = arrays[stream]
        assert mean.shape == (p,) and comps.shape[0] == p and comps.shape[1] == evals.shape[0] > 0
        assert np.all(np.diff(evals) <= 1e-6)
        for r in (4.0, 8.0):
            blocks = arrays[(stream, r)]
            cost = sum(b[1] * b[3] + (0 if b[2] == "none" else 16 if b[2] == "fp8" else 32) for b in blocks)
            assert cost <= art.allocation_info(r, stream)["budget_bits"]  # its share of the ratio's total
    for r in (4.0, 8.0):  # the joint split: the streams' shares add up to the ratio's total, exactly
        assert all(art.allocation_info(r, s)["budget_bits"] == int(16 * p // r) for s in ("keys", "values"))  # fixed
        assert sum(art.ecsq(r, s)["budget_bits"] for s in ("keys", "values")) == 2 * int(16 * p // r)
    rows = {(r["ratio"]): r for r in summary["ratios"]}
    assert rows[4.0]["keys"]["rel_error"] < rows[8.0]["keys"]["rel_error"] < 1.0
    assert "eval_rel_error" in rows[4.0]["values"]
    # the codec's default mode first (ECSQ: its tables exist), fixed-rate beside it (each basis's own share), ECSQ
    # no worse wherever the joint split gave it at least that share (the other stream pays in the cache's own error
    # what it saves in the model's)
    def at_least_own(r: float, stream: str) -> bool:
        return art.ecsq(r, stream)["budget_bits"] >= int(16 * p // r)

    for r, row in rows.items():
        assert row["mode"] == "ecsq"
        assert any(at_least_own(r, s) for s in ("keys", "values"))
        for stream in ("keys", "values"):
            entry = row[stream]
            assert entry["rel_error"] == entry["ecsq"]["rel_error"]
            assert entry["kept"] == entry["ecsq"]["kept"] and entry["fixed"]["kept"] > 0
            if at_least_own(r, stream):
                assert entry["ecsq"]["rel_error"] <= entry["fixed"]["rel_error"]
                assert entry["bound_rel_error"] < entry["fixed"]["rel_error"]
    run_info = summary["run"]
    assert run_info["shards_run"] > 0 and run_info["shards_cached"] == 0 and run_info["checkpoint_bytes_per_shard"] > 0 and run_info["stats_bytes"] > 0
    # ECSQ mode: tables beside the allocations, within budget, better than fixed-rate, and its chart
    assert art.ecsq_ratios() == [4.0, 8.0] and (folder / "charts/rate_distortion.png").stat().st_size > 0
    for stream in ("keys", "values"):
        for r in (4.0, 8.0):
            table = art.ecsq(r, stream)
            assert 0 < table["bits_per_token"] <= table["budget_bits"]
            assert table["kept"] <= arrays[stream][2].shape[1]
        if at_least_own(8.0, stream):
            assert rows[8.0][stream]["ecsq"]["rel_error"] < rows[8.0][stream]["fixed"]["rel_error"]
        assert rows[8.0][stream]["bound_rel_error"] <= rows[8.0][stream]["ecsq"]["rel_error"]
    assert {r["mode"] for r in art.curve("rate_distortion")} == {"fixed", "ecsq", "bound_heldout", "bound_calibration"}
    assert {r["cap"] for r in art.curve("basis_size")} == {6, 12, 24, 48, 0}
    assert (folder / "charts/basis_size.png").stat().st_size > 0


def test_basis_budget_caps_both_allocators(baseline, tmp_path):
    cfg, _ = baseline
    summary = run(cfg.replace(registry=str(tmp_path / "reg"), max_components=8))  # cached shards: only the reduce
    art = artifacts.pull(summary["name"], summary["version"], registry=summary["registry"])
    assert art.manifest["calibration"]["allocator"]["max_components"] == 8
    for stream in ("keys", "values"):
        assert art.basis(stream)[2].shape[1] <= 8
        for r in (4.0, 8.0):
            assert art.ecsq(r, stream)["kept"] <= 8
            assert max(b[0] + b[1] for b in art.allocation(r, stream) if b[3]) <= 8


def test_bit_identical_with_two_workers_and_a_killed_worker(baseline, tmp_path):
    cfg, summary = baseline
    marker = tmp_path / "killed"
    os.environ["KVTC_TEST_KILL_ON_SHARD"] = f"6:{marker}"  # accumulator 2's second shard: resumes from its checkpoint
    try:
        other = run(JobSettings.of(**TINY, workers=2, registry=str(tmp_path / "reg"), store=str(tmp_path / "store"), name="tiny"))
    finally:
        del os.environ["KVTC_TEST_KILL_ON_SHARD"]
    assert marker.exists(), "the test hook did not kill a worker"
    _, a = _arrays(summary)
    _, b = _arrays(other)
    for key in a:
        if isinstance(a[key], tuple):
            for x, y in zip(a[key], b[key]):
                assert np.array_equal(x, y), key
        else:
            assert a[key] == b[key], key


def _assert_same_artifact(x, y):
    _, a = _arrays(x)
    _, b = _arrays(y)
    for key in a:
        if isinstance(a[key], tuple):
            for u, v in zip(a[key], b[key]):
                assert np.array_equal(u, v), key
        else:
            assert a[key] == b[key], key


def test_rerun_reuses_cached_shards_and_extension_runs_only_new_ones(baseline, tmp_path):
    import shutil

    cfg, summary = baseline
    again = run(cfg)
    assert again["run"]["shards_run"] == 0 and again["run"]["shards_cached"] > 0
    doubled = {**TINY, "tokens": 2 * TINY["tokens"]}
    shutil.copytree(cfg.runtime.store, tmp_path / "extended")  # the baseline's store stays as it is for other tests
    longer = run(JobSettings.of(**doubled, workers=1, registry=cfg.runtime.registry, store=str(tmp_path / "extended"), name="tiny"))
    assert 0 < longer["run"]["shards_run"] <= longer["run"]["shards_cached"] + 2
    assert longer["run"]["tokens_run"] <= TINY["tokens"]
    # doubling the tokens adds no statistics bytes: one running total per accumulator (ids list aside)
    assert longer["run"]["stats_bytes"] == pytest.approx(summary["run"]["stats_bytes"], rel=0.05)
    # and the extended totals are exactly those of a fresh run on the doubled corpus
    fresh = run(JobSettings.of(**doubled, workers=1, registry=str(tmp_path / "reg"), store=str(tmp_path / "store"), name="tiny"))
    _assert_same_artifact(longer, fresh)


def test_corrupt_statistics_object_is_named_and_recomputed(baseline, tmp_path):
    import shutil

    cfg, summary = baseline
    store = tmp_path / "store"
    shutil.copytree(cfg.runtime.store, store)
    (victim,) = [p for p in store.rglob("acc/4-1-*.stats")]
    data = bytearray(victim.read_bytes())
    data[200] ^= 0x01  # one bit of a Gram entry
    victim.write_bytes(bytes(data))
    other = dict(TINY, workers=1, registry=str(tmp_path / "reg"), store=str(store), name="tiny")
    with pytest.raises(ValueError, match=rf"{victim.name} is corrupt \(checksum mismatch .*rerun"):
        run(JobSettings.of(**other))
    assert not victim.exists() and victim.with_name(victim.name + ".corrupt").exists()
    again = run(JobSettings.of(**other))
    assert 0 < again["run"]["shards_run"] < summary["run"]["shards_run"]
    _assert_same_artifact(summary, again)


def test_corpus_running_out_warns_and_records(tmp_path):
    corpus = tmp_path / "small.txt"
    corpus.write_text("A short document about key value caches. " * 120)  # ~1,080 tokens: 4 shards, then it runs out
    with pytest.warns(UserWarning, match="ran out"):
        summary = run(JobSettings.of(**{**TINY, "corpus": str(corpus), "eval_corpus": None, "tokens": 100_000},
                                      workers=1, registry=str(tmp_path / "reg"), store=str(tmp_path / "store"), name="small"))
    art = artifacts.pull("small", summary["version"], registry=summary["registry"])
    assert any("ran out" in n for n in art.manifest["calibration"]["notes"])


@pytest.mark.parametrize("argv, message", [
    (["--ratios", "1"], "must be > 1"),
    (["--ratios", "0.5,8"], "must be > 1"),
    (["--ratios", "5000"], "cheapest quantized block"),
    (["--corpus", "nosuchcorpus:xyz"], "accepted"),
    (["--basis-budget", "200%"], "--basis-budget"),
    (["--max-components", "-3"], "--max-components"),
])
def test_bad_input_fails_before_model_work(argv, message, tmp_path, capsys):
    code = cli_main(["calibrate", "--model", "tiny:llama", "--seq-len", "128", "--window", "16",
                     "--registry", str(tmp_path / "reg"), "--store", str(tmp_path / "store"), *argv])
    assert code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "store").exists()


def test_geometry_that_cannot_fit_fails_before_model_work(tmp_path, capsys):
    code = cli_main(["calibrate", "--model", "tiny:llama@80x8x128", "--seq-len", "256", "--window", "16",
                     "--registry", str(tmp_path / "reg"), "--store", str(tmp_path / "store")])
    assert code == 2
    err = capsys.readouterr().err
    assert "GiB" in err and "--groups layers:" in err and "p=81920" in err
    assert not (tmp_path / "store").exists()


def test_unwritable_registry_fails_before_model_work(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    code = cli_main(["calibrate", "--model", "tiny:llama", "--registry", str(blocker / "reg"), "--store", str(tmp_path / "store")])
    assert code == 2
    assert "registry" in capsys.readouterr().err.lower()
    assert not (tmp_path / "store").exists()
