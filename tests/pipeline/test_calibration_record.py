"""The typed record of a calibration (manifest round trip, older manifests, bad input), the settings
a recalibration derives from it, and the one shard plan every path uses."""
import dataclasses

import pytest

from kvtc.artifacts import CalibrationRecord
from kvtc.pipeline.cli import build_parser
from kvtc.pipeline.job.shards import shard_plan
from kvtc.pipeline.job.shards import DEFAULT_EVAL_SEQS, plan_shards
from kvtc.pipeline.operations.recalibrate_plan import build_configs
from kvtc.pipeline.settings import COMPUTATIONAL, JobSettings, group_options, settings_from_manifest
from kvtc.pipeline.settings_args import settings_options

ALLOCATOR = {"block_sizes": [1, 16], "types": ["none", "int4"], "error_model": "analytic"}


def _record(**kw) -> CalibrationRecord:
    base = dict(sinks=4, window=16, seq_len=128, seed=3, ratios=(4.0, 8.0), groups=((0, 2), (2, 3)), allocator=ALLOCATOR,
                group_spec="layers:2", sample=0.5, tokens_requested=2048, seqs_per_shard=2, holdout_fraction=0.25,
                heldout_rows_cap=512, text_column="text", dtype="float32", tokens=2048, train_rows=1000,
                heldout_rows=200, notes=("a note",))
    return CalibrationRecord(**{**base, **kw})


def _manifest(record: CalibrationRecord) -> dict:
    return {"name": "tiny", "version": "v1", "model": {"spec": "tiny:llama"}, "calibration": record.to_manifest(),
            "corpus": {"spec": "pydoc", "eval_spec": "stdlib", "train_shards": ["a", "b"], "heldout_shards": ["c"],
                       "eval_shards": ["d"], "tokens": {"a": 256, "b": 256, "c": 256, "d": 384}}}


def test_record_round_trips_through_the_manifest():
    rec = _record()
    section = rec.to_manifest()
    assert section["groups"] == [[0, 2], [2, 3]] and section["ratios"] == [4.0, 8.0] and "relative_error" in section
    assert CalibrationRecord.from_manifest(_manifest(rec)) == dataclasses.replace(rec, eval_tokens=384)
    assert rec.capture() == {"sinks": 4, "window": 16, "groups": "layers:2", "sample": 0.5, "seed": 3,
                             "objective": "mse"}  # explicit: CaptureSettings defaults to auto


def test_older_manifests_infer_what_they_did_not_record():
    manifest = _manifest(_record())
    for key in ("seqs_per_shard", "eval_tokens", "tokens_requested", "holdout_fraction", "heldout_rows_cap"):
        manifest["calibration"].pop(key)
    rec = CalibrationRecord.from_manifest(manifest)
    assert rec.seqs_per_shard == 2 and rec.eval_tokens == 384 and rec.tokens_requested == 2048
    assert rec.holdout_fraction is None and rec.heldout_rows_cap is None
    cfg = settings_from_manifest(manifest)
    assert cfg.plan.holdout_fraction == JobSettings().plan.holdout_fraction
    assert cfg.reduce.heldout_rows == JobSettings().reduce.heldout_rows


def test_bad_records_are_refused_with_the_field_named():
    with pytest.raises(ValueError, match="ratios must be > 1"):
        _record(ratios=(1.0,))
    with pytest.raises(ValueError, match="groups"):
        _record(groups=((2, 2),))
    with pytest.raises(ValueError, match="holdout_fraction"):
        _record(holdout_fraction=1.5)
    manifest = _manifest(_record())
    del manifest["calibration"]["allocator"]
    with pytest.raises(ValueError, match="lacks allocator"):
        CalibrationRecord.from_manifest(manifest)


def test_recalibration_replaces_only_the_options_given():
    manifest = _manifest(_record())
    run_cfg, repeat = build_configs(manifest, {"ratios": "4,16", "eval_corpus": "none", "registry": "r"}, "v1")
    assert repeat == settings_from_manifest(manifest).with_runtime(name="tiny", parent="v1")
    assert repeat.reduce.ratios == (4.0, 8.0) and repeat.plan.eval_corpus == "stdlib" and repeat.capture.sample == 0.5
    assert repeat.allocator.block_sizes == (1, 16) and repeat.allocator.types == ("none", "int4")
    assert repeat.allocator.error_model == "analytic"
    assert run_cfg == repeat.replace(ratios=(4.0, 16.0), eval_corpus=None, registry="r")
    with pytest.raises(ValueError, match="parent's name"):
        build_configs(manifest, {"name": "other"}, "v1")


def test_one_shard_plan_with_one_eval_default():
    from kvtc.workers.models import embedded_tokenizer

    cfg = JobSettings.of(corpus="pydoc", eval_corpus="stdlib", seq_len=64, seqs_per_shard=2, tokens=64 * 12)
    plan = shard_plan(cfg, cfg.plan.tokens)
    assert plan.eval_budget == DEFAULT_EVAL_SEQS * 64
    roles = list(plan_shards(plan, embedded_tokenizer()))
    order = [r for r, _ in roles]
    assert order == sorted(order, key=lambda r: r == "eval") and {"train", "heldout", "eval"} == set(order)
    assert sum(s.input_ids.shape[0] for r, s in roles if r == "eval") == DEFAULT_EVAL_SEQS
    assert len({s.id for _, s in roles}) == len(roles)
    duplicates: list[str] = []
    same = list(plan_shards(dataclasses.replace(plan, eval_corpus="pydoc", eval_tokens=64 * 2), embedded_tokenizer(),
                            duplicates=duplicates))
    assert duplicates and all(r != "eval" or s.id not in {t.id for q, t in roles if q != "eval"} for r, s in same)


def test_rope_kept_keys_travel_through_the_record():
    rec = _record(keys="rope-kept")
    assert rec.capture()["keys"] == "rope-kept" and "with RoPE" in rec.to_manifest()["relative_error"]
    assert CalibrationRecord.from_manifest(_manifest(rec)).keys == "rope-kept"
    with pytest.raises(ValueError, match="keys"):
        _record(keys="rope")


PARENT_FLAGS = ["--model", "tiny:qwen2", "--corpus", "stdlib", "--eval-corpus", "none", "--ratios", "4,12",
                "--tokens", "4096", "--eval-tokens", "512", "--seq-len", "256", "--seqs-per-shard", "3",
                "--holdout-fraction", "0.3", "--text-column", "body", "--dtype", "bfloat16", "--sinks", "2",
                "--window", "32", "--groups", "layers:2", "--sample", "0.5", "--seed", "7", "--keys", "rope-kept",
                "--block-sizes", "1,32", "--types", "none,int4", "--error-model", "analytic", "--heldout-rows", "999",
                "--tokens-curve-points", "0", "--accumulators", "2", "--served-sequences", "2", "--tp", "2",
                "--basis-budget", "3%", "--max-components", "24", "--objective", "attention",
                "--attention-balance", "head", "--attention-floor", "0.2", "--attention-weighting", "none", "--sensitivity", "2",
                "--bit-split", "even", "--copy-probe", "1000", "--attention-copy-weight", "2",
                "--copy-probe-form", "passage-twice"]


def _parsed(command: str, flags: list[str]) -> dict:
    target = ["tiny"] if command == "recalibrate" else []
    return settings_options(build_parser().parse_args([command, *target, *flags]))


def test_every_setting_of_a_parent_survives_recalibration():
    """Each computational option of `kvtc calibrate`, set away from its default, is recorded verbatim
    and comes back when `kvtc recalibrate` derives its settings from the parent."""
    parent = JobSettings.of(**_parsed("calibrate", PARENT_FLAGS))
    default = JobSettings()
    changed = [k for k, v in parent.flat().items() if v != default.flat()[k]]
    given = {name for name in _parsed("calibrate", PARENT_FLAGS)}
    assert set(changed) == given  # every flag took effect, so the check below covers it
    rec = _record(settings=parent.computational())
    manifest = _manifest(rec)
    manifest["calibration"] = __import__("json").loads(__import__("json").dumps(manifest["calibration"]))  # as stored
    run_cfg, repeat = build_configs(manifest, _parsed("recalibrate", []), "v1")
    assert run_cfg.computational() == repeat.computational() == parent.computational()
    assert run_cfg.reduce.accumulators == 2 and run_cfg.reduce.tokens_curve_points == 0
    # and every computational flag is a recalibrate option defaulting to the parent's
    flags = {f for f in PARENT_FLAGS if f.startswith("--")}
    assert len(flags) == sum(len(parent.computational()[g]) for g in COMPUTATIONAL) - len(_internal())
    changed_again, _ = build_configs(manifest, _parsed("recalibrate", ["--accumulators", "3"]), "v1")
    assert changed_again.reduce.accumulators == 3 and changed_again.plan == parent.plan


def test_a_parent_recorded_before_the_kl_sensitivity_recalibrates_as_it_ran():
    """Its capture recorded no --sensitivity (none was measured) and its reduce the per-layer balance."""
    import json

    parent = JobSettings.of(**_parsed("calibrate", ["--objective", "attention", "--attention-balance", "layer"]))
    recorded = json.loads(json.dumps(parent.computational()))
    del recorded["capture"]["sensitivity"], recorded["capture"]["copy_probe"]  # neither was recorded then
    manifest = _manifest(_record(settings=recorded))
    again = settings_from_manifest(manifest)
    assert again.capture.sensitivity == 0 and again.reduce.attention_balance == "layer"
    assert again.capture.copy_probe == 0  # nor a copy probe
    del recorded["reduce"]["attention_balance"]
    again = settings_from_manifest(_manifest(_record(settings=recorded)))
    assert again.capture.sensitivity == 0 and again.reduce.attention_balance == "layer"
    fresh = settings_from_manifest(_manifest(_record(settings=JobSettings().computational())))
    assert fresh.capture.sensitivity == 1 and fresh.reduce.attention_balance == "sensitivity"


def test_a_parent_recorded_with_the_first_copy_probe_recalibrates_with_it_and_finds_its_held_out_rows():
    """Stop 70's probe (a passage twice, weight 3 over every coded position) recorded no form; recalibrating its
    artifact repeats that probe, and the parent's held-out rows are read from the scope its capture settings
    wrote, not today's defaults'."""
    import json

    from kvtc.pipeline.job.store import capture_key
    from kvtc.pipeline.operations.recalibrate import heldout_store

    parent = JobSettings.of(**_parsed("calibrate", ["--objective", "attention", "--copy-probe", "8192",
                                                    "--attention-copy-weight", "3"]))
    recorded = json.loads(json.dumps(parent.computational()))
    del recorded["capture"]["copy_probe_form"]  # not recorded then
    manifest = _manifest(_record(settings=recorded))
    again = settings_from_manifest(manifest)
    assert again.capture.copy_probe == 8192 and again.capture.copy_probe_form == "passage-twice"
    assert again.reduce.attention_copy_weight == 3.0
    scope = heldout_store(manifest, "mem://s").capture_key
    assert scope == capture_key(again.capture.to_dict(), "float32")
    assert scope != capture_key(JobSettings.of(objective="attention").capture.to_dict(), "float32")
    for flags in (["--sensitivity", "0"], ["--copy-probe", "0"], []):  # whatever it measured, its own scope
        cfg = JobSettings.of(**_parsed("calibrate", ["--objective", "attention", *flags]))
        manifest = _manifest(_record(settings=json.loads(json.dumps(cfg.computational()))))
        assert heldout_store(manifest, "mem://s").capture_key == capture_key(cfg.capture.to_dict(), "float32")


def _internal() -> set[str]:
    """Allocator and capture fields that are not options (set in code only)."""
    from kvtc.pipeline.fit.allocator import AllocatorSettings
    from kvtc.workers.capture import CaptureSettings

    return ({f.name for f in dataclasses.fields(AllocatorSettings)} - set(group_options("allocator"))) | \
        ({f.name for f in dataclasses.fields(CaptureSettings)} - set(group_options("capture")))


def test_every_group_declares_its_options_on_its_own_fields():
    """Each option is a field of its group, its metadata the Option; the capture and allocator groups
    too (declared in their light modules, so `kvtc` start-up imports neither torch nor the capture)."""
    import subprocess
    import sys

    from kvtc.pipeline.fit.allocator import AllocatorSettings
    from kvtc.workers.capture import CaptureSettings

    assert set(group_options("capture")) == {f.name for f in dataclasses.fields(CaptureSettings)}
    assert set(group_options("allocator")) == {"block_sizes", "types", "error_model", "max_components", "basis_budget",
                                                "bit_split"}
    assert AllocatorSettings.__dataclass_fields__["types"].metadata["option"].value("none,int4") == ("none", "int4")
    code = "import sys, kvtc.pipeline.settings; print(sorted(m for m in ('torch', 'triton') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_bad_settings_are_refused_with_the_option_named():
    with pytest.raises(ValueError, match="--accumulators"):
        JobSettings.of(accumulators=0)
    with pytest.raises(ValueError, match="--tokens-curve-points"):
        JobSettings.of(tokens_curve_points=-1)
    assert JobSettings.of(tokens_curve_points=0).reduce.tokens_curve_points == 0
    with pytest.raises(ValueError, match="ratios"):
        JobSettings.of(ratios="8,8")
    with pytest.raises(TypeError, match="unknown calibration setting"):
        JobSettings.of(colour="blue")
