"""Operations on a tiny model: drift checks, recalibration (promote / keep unaliased / up to date),
model mismatch, a fault during publish, and the scheduler firing a recalibration twice."""
import json
import os
import random
import shutil
import sys

import pytest
import ray

from kvtc import artifacts
from kvtc.pipeline import cli as kvtc_cli
from kvtc.pipeline.settings import JobSettings
from kvtc.pipeline.job.calibrate import run
from kvtc.pipeline.operations.schedule import Schedule, Scheduler, command_job, parse_command

TINY = dict(model="tiny:llama", corpus="pydoc", eval_corpus=None, seq_len=128, window=16, tokens=2048,
            seqs_per_shard=2, heldout_rows=512, ratios=(4.0, 8.0), objective="mse",  # drift in the cache's own error
            served_sequences=0)
OPS_MODULES = ("kvtc.pipeline.commands.drift", "kvtc.pipeline.commands.recalibrate", "kvtc.pipeline.commands.schedule")


@pytest.fixture(scope="module", autouse=True)
def ray_and_cli():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kvtc_cli, "COMMAND_MODULES", tuple(dict.fromkeys((*kvtc_cli.COMMAND_MODULES, *OPS_MODULES))))
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
        yield
        ray.shutdown()


@pytest.fixture(scope="module")
def parent(tmp_path_factory):
    """A calibrated artifact `tiny` (registry, store, version), published once for the module."""
    root = tmp_path_factory.mktemp("ops")
    cfg = JobSettings.of(**TINY, workers=1, registry=str(root / "reg"), store=str(root / "store"), name="tiny")
    summary = run(cfg)
    return root, summary["version"]


@pytest.fixture
def reg(parent, tmp_path):
    """A private copy of the parent's registry (the shard store is shared: it is content-addressed)."""
    root, _ = parent
    shutil.copytree(root / "reg", tmp_path / "reg")
    return str(tmp_path / "reg")


def kvtc(*argv: str) -> int:
    return kvtc_cli.main([str(a) for a in argv])


def state(registry: str) -> tuple[list[str], dict]:
    r = artifacts.Registry(registry)
    return r.versions("tiny"), r.aliases("tiny")


def store_files(parent) -> set[str]:
    return {os.path.relpath(os.path.join(d, f), parent[0]) for d, _, fs in os.walk(parent[0] / "store") for f in fs}


def test_drift_same_corpus_within_threshold(parent, reg, capsys):
    assert kvtc("drift", "tiny", "--registry", reg, "--corpus", "pydoc", "--tokens", 1024, "--json") == 0
    report = json.loads(capsys.readouterr().out)
    assert report["drifted"] is False and report["rows"] == 8 * (128 - 4 - 16)
    assert {(c["ratio"], c["stream"]) for c in report["comparisons"]} == {(r, s) for r in (4.0, 8.0) for s in ("keys", "values")}
    for c in report["comparisons"]:
        assert 0 < c["measured"] < 1 and abs(c["change"]) < 0.10 and 0.5 < c["explained_variance"] <= 1.0


def test_drift_detects_changed_traffic(parent, reg, tmp_path, capsys):
    rng = random.Random(0)
    text = "\n\n".join(" ".join(f"{rng.randrange(16**6):06x}" for _ in range(200)) for _ in range(30))
    (tmp_path / "hex.txt").write_text(text)
    assert kvtc("drift", "tiny", "--registry", reg, "--corpus", tmp_path / "hex.txt", "--tokens", 1024) == 3
    out = capsys.readouterr().out
    assert "DRIFTED" in out and "DRIFT" in out.split("\n", 1)[1]


def test_other_model_is_refused(parent, reg, capsys):
    before = state(reg)
    assert kvtc("drift", "tiny", "--registry", reg, "--model", "tiny:qwen3") == 4
    assert kvtc("recalibrate", "tiny", "--registry", reg, "--store", parent[0] / "store", "--model", "tiny:qwen3") == 4
    err = capsys.readouterr().err
    assert err.count("is not the model tiny@") == 2 and "model_type" in err
    assert state(reg) == before


def test_bad_threshold_and_unknown_artifact(parent, reg, capsys):
    assert kvtc("drift", "tiny", "--registry", reg, "--threshold", "-1") == 2
    assert kvtc("drift", "nope", "--registry", reg) == 2
    err = capsys.readouterr().err
    assert "--threshold must be >= 0" in err and "no artifact named 'nope'" in err


def test_worse_version_kept_unaliased_and_fault_leaves_registry_as_it_was(parent, reg, monkeypatch, capsys):
    store = parent[0] / "store"
    versions, aliases = state(reg)
    publish_mod = sys.modules["kvtc.artifacts.publish"]  # the package re-exports the function under that name

    def fail(point):
        if point == "before_commit":
            raise OSError("injected fault while publishing")  # a disk or network failure

    with monkeypatch.context() as mp:
        mp.setattr(publish_mod, "_pause", fail)
        assert kvtc("recalibrate", "tiny", "--registry", reg, "--store", store, "--ratios", "4") == 2
    assert "injected fault" in capsys.readouterr().err
    assert state(reg) == (versions, aliases)
    assert not [p for p in os.listdir(os.path.join(reg, "tiny", ".staging"))]

    # dropping a ratio the parent serves makes the new version worse: published, not aliased
    assert kvtc("recalibrate", "tiny", "--registry", reg, "--store", store, "--ratios", "4") == 5
    assert "CR 8 is missing from the new version" in capsys.readouterr().out
    after, after_aliases = state(reg)
    assert len(after) == len(versions) + 1 and after_aliases == aliases
    child = artifacts.Registry(reg).read_manifest("tiny", after[-1])
    assert child["parent"] == parent[1]

    # the same request again: that recalibration exists already, nothing new
    assert kvtc("recalibrate", "tiny", "--registry", reg, "--store", store, "--ratios", "4") == 0
    assert f"already recalibrated as tiny@{after[-1]}" in capsys.readouterr().out
    assert state(reg) == (after, aliases)


def test_scheduler_fires_twice_second_run_reuses_everything(parent, reg, capsys):
    command = parse_command(["--", "recalibrate", "tiny", "--registry", reg, "--store", str(parent[0] / "store"),
                             "--tokens", "3072", "--tolerance", "1", "--alias", "prod"], kvtc_cli.build_parser())
    seen = []

    def snapshot(record):
        seen.append((record, state(reg), store_files(parent), capsys.readouterr().out))

    runs = Scheduler(Schedule(every=1.0), command_job(command, main=kvtc_cli.main), max_runs=2, report=snapshot).run()
    assert [r["rc"] for r in runs] == [0, 0]
    assert runs[1]["fired_at"] - runs[0]["fired_at"] >= 1.0 and runs[1]["started"] >= runs[1]["fired_at"]
    (_, (v1, a1), files1, out1), (_, (v2, a2), files2, out2) = seen
    assert "published tiny@" in out1 and len(v1) == 2 and a1["latest"] == a1["prod"] == v1[-1]
    assert artifacts.Registry(reg).read_manifest("tiny", v1[-1])["parent"] == parent[1]
    assert "is up to date" in out2 and "nothing to publish" in out2
    assert (v2, a2) == (v1, a1) and files2 == files1


def test_schedule_cli_validates_and_runs(parent, reg, capsys):
    assert kvtc("schedule", "--every", "0.5", "--max-runs", "2", "--in-process", "--", "list", "--registry", reg) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith('{"run"')]
    assert [x["run"] for x in lines] == [1, 2] and all(x["rc"] == 0 for x in lines)
    assert kvtc("schedule", "--cron", "61 * * * *", "--", "list") == 2
    assert kvtc("schedule", "--every", "1", "--", "recalibrate") == 2
    err = capsys.readouterr().err
    assert "is not a cron expression" in err and "does not parse" in err


def test_if_drift_skips_a_run_when_the_new_data_has_not_drifted(parent, reg, capsys):
    before = state(reg)
    assert kvtc("recalibrate", "tiny", "--registry", reg, "--store", parent[0] / "store", "--tokens", 3072,
                "--if-drift", 0.5, "--drift-tokens", 512, "--json") == 0
    result = json.loads(capsys.readouterr().out)
    assert result["status"] == "no_drift" and result["drift"]["drifted"] is False and result["version"] is None
    assert state(reg) == before


def test_drift_samples_as_many_tokens_whatever_the_calibrations_sequence_length():
    from kvtc.pipeline.operations.drift_settings import default_tokens

    assert default_tokens(1024) == default_tokens(4096) == 16384  # 16 sequences of 1,024, or 4 of 4,096
    assert default_tokens(8192) == 4 * 8192  # at least 4 of the artifact's sequences
