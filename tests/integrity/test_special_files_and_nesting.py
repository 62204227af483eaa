"""Issue 28's hostile families, each ending in a clean refusal or a correct result: special files in the
statistics store, held-out rows, store key, pull cache and every output folder; nested per-layer
containers; short inputs declaring long caches; hostile manifest settings; and the small things
(rank=True, a listed file deleted, a negative option value). The families come from bench/hostile.py,
so the bench and the tests exercise the same cases."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvtc.artifacts import Registry, publish
from helpers.toy_artifacts import forge_version, toy_content
from kvtc.pipeline import cli

REPO = Path(__file__).resolve().parents[2]


def _all_clean(ended) -> None:
    bad = [f"{e.family}: {e.label}: {e.how}" for e in ended if not e.clean]
    assert not bad, "\n".join(bad)
    assert max(e.seconds for e in ended) < 5, "a refusal must not wait"


def test_special_files_in_the_statistics_store_rows_and_key_are_named_and_moved_aside(hostile, tmp):
    ended = hostile.store_special_files(tmp)
    _all_clean(ended)
    assert {e.family for e in ended} == {"statistics store: special files", "held-out rows: special and oversized files",
                                         "store key: special files and modes"}
    appended = next(e for e in ended if "2 GiB appended" in e.label)
    assert appended.peak_bytes < 64 << 20  # refused from its header, never read


def test_planted_files_in_output_folders_are_replaced_or_refused_never_written_through(hostile, tmp, monkeypatch):
    from kvtc.pipeline.evaluation import report

    monkeypatch.setattr(report, "build_from_artifact", report.build_from_artifact)  # the family stubs it; restored
    ended = hostile.output_special_files(tmp)
    _all_clean(ended)
    assert {e.how.split(",")[0] for e in ended} == {"replaced", "refused"}
    assert len(ended) == 27


def test_special_files_in_the_pull_cache_are_fetched_again(hostile, tmp):
    _all_clean(hostile.cache_special_files(tmp))


def test_nested_containers_end_in_a_blob_error_without_recursion(hostile):
    ended = hostile.nested_containers()
    _all_clean(ended)
    assert all(e.how == "BlobError" for e in ended)  # the message names the nesting
    codec, blob = hostile._layered(0)  # a container that does not nest still decodes
    keys, values = codec.decode(blob)
    assert [tuple(k.shape) for k in keys] == [(1, 6, 8), (1, 4, 8)]


def test_short_inputs_declaring_long_caches_are_refused_before_they_cost_memory(hostile, monkeypatch):
    from kvtc.kernels.codec import rans

    def never(*_a, **_k):
        raise AssertionError("rans.decode reached: the section was not checked against its tokens first")

    monkeypatch.setattr(rans, "decode", never)
    ended = hostile.amplification((4, 2, 32))
    _all_clean(ended)
    refused = [e for e in ended if not e.how.startswith("DECODED")]
    assert all("BlobError" in e.how for e in refused)
    assert all(e.how == "BlobError before decoding" for e in refused if e.label.startswith(("rans", "constriction")))
    assert max(e.peak_bytes for e in refused) < 64 << 20


@pytest.mark.parametrize("group, field, value", [
    ("plan", "holdout_fraction", "x"), ("reduce", "ratios", [[8]]), ("model", "model", {}),
    ("capture", "tp", True), ("allocator", "max_dp_states", 10 ** 18), ("plan", "seq_len", -4),
    ("allocator", "types", "int4"),
])
def test_recalibrate_from_hostile_manifest_settings_exits_2_naming_the_field(tmp, capsys, group, field, value):
    reg = Registry(str(tmp / "registry"))
    ref = publish(toy_content(), reg)

    def mutate(manifest):
        settings = manifest["calibration"].setdefault("settings", {})
        settings.setdefault(group, {})[field] = value
    forge_version(reg, "toy", ref.version, mutate)
    rc = cli.main(["recalibrate", f"toy@{ref.version}", "--registry", reg.uri])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert f"calibration.settings.{group}" in err and (field in err or group == "plan"), err


def test_rank_true_is_refused():
    from kvtc.kernels import KVTCCodec
    from helpers.synthetic import synthetic_spec

    spec = synthetic_spec(2, 2, 8, 4.0, kept=4)
    for rank in (True, False, -1, 1.0):
        with pytest.raises(ValueError, match="rank"):
            KVTCCodec(spec, rank=rank)


def test_verify_names_a_deleted_listed_file_in_one_line(tmp, capsys):
    reg = Registry(str(tmp / "registry"))
    ref = publish(toy_content(), reg)
    os.unlink(os.path.join(ref.path, "metrics.parquet"))
    rc = cli.main(["verify", "toy", "--registry", reg.uri])
    err = capsys.readouterr().err
    assert rc == 6 and "metrics.parquet" in err and "missing" in err and "Errno" not in err, err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv", [["calibrate", "--basis-budget", "-3%"], ["calibrate", "--basis-budget"],
                                  ["calibrate", "--no-such-flag"]])
def test_option_errors_are_one_line(capsys, argv):
    with pytest.raises(SystemExit) as exit_:
        rc = cli.main(argv)
        raise SystemExit(rc)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert "--basis-budget" in err or "no-such-flag" in err


def test_a_store_key_others_can_read_is_refused_and_a_group_may_share_it(tmp):
    from kvtc.pipeline.job import store as store_module
    from kvtc.pipeline.job.store import KEY_FILE, ShardStore

    store = ShardStore(str(tmp / "store"), "m", "c")
    key = store.hmac_key
    path = tmp / "store" / KEY_FILE
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    os.chmod(path, 0o640)
    store_module._KEYS.clear()
    assert ShardStore(str(tmp / "store"), "m", "c").hmac_key == key
    os.chmod(path, 0o644)
    store_module._KEYS.clear()
    with pytest.raises(ValueError, match=r"0o644.*chmod 600"):
        ShardStore(str(tmp / "store"), "m", "c").hmac_key


def test_a_multi_file_output_is_whole_or_absent(tmp):
    from kvtc.artifacts.errors import IntegrityError
    from kvtc.artifacts.local_files import write_outputs

    out = tmp / "out"
    out.mkdir()
    os.mkfifo(out / "b.json")
    with pytest.raises(IntegrityError, match="FIFO"):
        write_outputs(out, {"a.pt": b"1", "b.json": b"2"})
    assert sorted(p.name for p in out.iterdir()) == ["b.json"]  # no a.pt, no temp file
    victim = tmp / "victim"
    victim.write_bytes(b"precious")
    os.unlink(out / "b.json")
    os.link(victim, out / "b.json")
    write_outputs(out, {"a.pt": b"1", "b.json": b"2"})
    assert victim.read_bytes() == b"precious" and (out / "b.json").read_bytes() == b"2"
    with pytest.raises(FileExistsError):
        write_outputs(out, {"c.pem": b"3", "a.pt": b"4"}, overwrite=False)
    assert not (out / "c.pem").exists() and (out / "a.pt").read_bytes() == b"1"
    assert json.dumps(sorted(p.name for p in out.iterdir())) == '["a.pt", "b.json"]'
