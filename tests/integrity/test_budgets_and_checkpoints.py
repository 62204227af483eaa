"""The calibration side's stored objects, forged (issue 49): the joint budget a manifest records,
checked wherever it is read; reduce checkpoints bound to their task; sensitivity sums checked like the metric
sums. The families come from bench/hostile.py, so the bench and the tests try the same cases."""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import os
from pathlib import Path

import numpy as np
import pytest

from kvtc.artifacts import Registry, publish, pull
from kvtc.artifacts.bit_split import check_bit_split
from kvtc.artifacts.errors import CorruptArtifactError
from kvtc.pipeline import cli
from kvtc.pipeline.job.store import ShardStore
from kvtc.workers.stats_file import CorruptStats, DegenerateStats

from helpers import reduce_checkpoints as rc
from helpers.joint_artifacts import RECORD_FORGERIES, TABLE_FORGERIES, joint_content
from helpers.toy_artifacts import forge_version

REPO = Path(__file__).resolve().parents[2]


def _clean(ended, families: set[str]) -> None:
    bad = [f"{e.family}: {e.label}: {e.how}" for e in ended if not e.clean]
    assert not bad, "\n".join(bad)
    assert {e.family for e in ended} == families


# ---- 1. the joint budget, checked wherever it is read ----


def test_every_forged_joint_budget_is_an_integrity_error_for_every_reader(hostile, tmp):
    ended = hostile.joint_budget_records(tmp)
    _clean(ended, {"joint budget record"})
    readers = {"show", "verify", "report", "export", "codec load"}
    for label in RECORD_FORGERIES:  # exit 6 in one line (or IntegrityError) from each reader, never exit 1
        assert {e.label.split(": ")[-1] for e in ended if e.label.startswith(label + ":")} == readers
    for label in TABLE_FORGERIES:
        assert {e.label.split(": ")[-1] for e in ended if e.label.startswith(label + ":")} == {"verify", "codec load"}
    assert any(e.how.startswith("correct") for e in ended)  # the untampered artifact reads, each share served


@pytest.mark.parametrize("label", ["a share of 1e400 (inf)", "a share that is a string", "a share of 0 (the other "
                                   "takes it)", "a ratio missing", "shares one bit over the total"])
def test_report_names_the_record_and_exits_6_not_1(tmp, capsys, label):
    reg = Registry(str(tmp / "reg"))
    version = publish(joint_content(), reg).version
    forge_version(reg, "joint", version, RECORD_FORGERIES[label])
    assert cli.main(["report", f"joint@{version}", "--out", str(tmp / "out"), "--registry", reg.uri]) == 6
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "calibration.bit_split" in err and "republish" in err
    assert not (tmp / "out").exists()  # nothing written


def test_a_budget_of_zero_is_never_read_as_unset():
    content = joint_content(joint=False)
    tables = {k: dict(v) for k, v in content.ecsq.items()}
    own = int(tables[(8.0, "keys", 0)]["budget_bits"])
    tables[(8.0, "keys", 0)]["budget_bits"], tables[(8.0, "values", 0)]["budget_bits"] = 0, 2 * own  # adds up
    with pytest.raises(CorruptArtifactError, match=r"budget 0 bits is outside \[1, 16 p"):
        dataclasses.replace(content, ecsq=tables)


def test_a_record_a_calibration_could_not_write_is_refused_when_published():
    content = joint_content()
    for label, edit in RECORD_FORGERIES.items():
        manifest = {"calibration": copy.deepcopy(content.calibration)}
        edit(manifest)
        with pytest.raises(ValueError, match="bit_split"):
            dataclasses.replace(content, calibration=manifest["calibration"])


def test_the_record_is_checked_against_the_manifest_alone():
    content = joint_content()
    manifest = {"calibration": copy.deepcopy(content.calibration), "model": content.model,
                "bases": {"entries": [{"stream": s, "group": 0} for s in ("keys", "values")]}}
    check_bit_split(manifest, "m")  # as a calibration writes it
    del manifest["calibration"]["bit_split"]
    check_bit_split(manifest, "m")  # an even split records nothing
    manifest["calibration"]["bit_split"] = {"split": "joint", "bits": []}
    with pytest.raises(CorruptArtifactError, match="has no share for CR 4"):
        check_bit_split(manifest, "m")


def test_an_untampered_joint_artifact_serves_each_share(tmp):
    from kvtc.kernels import KVTCCodec

    content = joint_content()
    reg = Registry(str(tmp / "reg"))
    version = publish(content, reg).version
    art = pull(f"joint@{version}", registry=reg)
    assert art.ecsq(8.0, "keys")["budget_bits"] == art.ecsq(8.0, "values")["budget_bits"] + 16
    codec = KVTCCodec.from_registry(f"joint@{version}", 8.0, registry=reg)
    assert [codec.spec.ecsq[s][0].budget_bits for s in ("keys", "values")] == [72, 56]
    assert cli.main(["verify", f"joint@{version}", "--registry", reg.uri]) == 0


# ---- 2. reduce checkpoints bound to their task ----


def test_swapped_or_copied_checkpoints_are_recomputed_named_once_and_the_result_is_untampered(hostile, tmp):
    ended = hostile.reduce_checkpoints(tmp)
    _clean(ended, {"reduce checkpoints"})
    assert len(ended) == 6 and all(e.how.startswith("recomputed") for e in ended)


def test_a_swapped_solve_checkpoint_is_named_with_what_it_was_written_as(tmp):
    tasks = rc.make_tasks()
    with contextlib.redirect_stderr(io.StringIO()):
        baseline = rc.reduce_once(rc.make_store(tmp / "base"), tasks)
    store = rc.make_store(tmp / "store")
    with contextlib.redirect_stderr(io.StringIO()):
        rc.reduce_once(store, tasks, solve_only=True)
    rc.swap(store, rc.solved_name(tasks[0]), rc.solved_name(tasks[1]))
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        got = rc.reduce_once(store, tasks)
    lines = [line for line in err.getvalue().splitlines() if line.startswith("kvtc:")]
    assert len(lines) == 2 and all("recomputing it" in line and "copied or swapped" in line for line in lines)
    assert f"written as '{rc.solved_name(tasks[1])}'" in lines[0]
    assert rc.same_results(got, baseline)
    assert os.path.exists(f"{rc.object_path(store, rc.solved_name(tasks[0]))}.corrupt")  # kept for inspection


def test_an_object_of_another_job_fails_its_binding_even_with_the_right_name(tmp):
    store = ShardStore(str(tmp / "store"), "m", "c")
    store.put_basis("x", {"a": np.zeros(2)}, {"k": 1}, {"task": 1})
    store.check_basis("x", {"task": 1})
    assert store.get_basis("x")[1]["k"] == 1  # a caller naming no task checks the name and scope
    with pytest.raises(CorruptStats, match="for another task .*differing: task"):
        store.check_basis("x", {"task": 2})
    assert not store.has_basis("x")  # moved aside
    other = ShardStore(str(tmp / "store"), "m2", "c")
    other.put_basis("x", {"a": np.zeros(2)}, {}, {"task": 1})
    os.makedirs(os.path.dirname(store._basis_path("x")), exist_ok=True)
    os.replace(other._basis_path("x"), store._basis_path("x"))
    with pytest.raises(CorruptStats, match="for another job .*model_id"):
        store.get_basis("x", {"task": 1})


# ---- 3. sensitivity sums checked like the metric sums ----


@pytest.mark.parametrize("tensor", ["sensitivity_keys", "sensitivity_values"])
@pytest.mark.parametrize("factor, problem", [(1e300, "beyond any sum of 3 squared float32 gradients"),
                                             (1e-300, "below the square of float32's smallest gradient")])
def test_sensitivity_sums_out_of_range_are_named_and_moved_aside(hostile, tmp, tensor, factor, problem):
    store = ShardStore(str(tmp / "store"), "m", "c")
    store.put_acc("a0", hostile._sensitivity_stats(tensor, factor))
    with pytest.raises(DegenerateStats, match=f"a0.stats is degenerate: tensor metric/{tensor} holds .*{problem}"):
        store.get_acc("a0", keys=[])
    assert os.path.exists(store._acc_path("a0") + ".corrupt") and store.acc_shards("a0") is None
    store.put_acc("a0", hostile._sensitivity_stats())  # the rerun's sums, in range
    assert store.get_acc("a0", keys=[]).metric_tokens == 3


def test_every_out_of_range_accumulator_is_moved_aside_at_once(hostile, tmp):
    from kvtc.pipeline.job.basis_solver import metric_sums

    store = ShardStore(str(tmp / "store"), "m", "c")
    for name in ("a0", "a1", "a2"):
        store.put_acc(name, hostile._sensitivity_stats("sensitivity_values", 1e300 if name != "a1" else 1.0))
    with pytest.raises(DegenerateStats, match=r"a0.stats .*\(1 more statistics object\(s\) moved aside with it\)"):
        metric_sums(store, ["a0", "a1", "a2"])
    assert [store.acc_shards(n) is None for n in ("a0", "a1", "a2")] == [True, False, True]


def test_forged_sensitivity_sums_between_two_calibrations_are_recomputed_end_to_end(hostile, tmp):
    """tiny:llama, attention objective, sensitivity balance: sums forged x1e300 (re-signed with the store's key)
    refuse the rerun naming them, instead of "math domain error"; the next rerun publishes the untampered bases."""
    how, ok = hostile._sensitivity_end_to_end(tmp)
    assert ok, how
