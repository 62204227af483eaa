"""The calibration side's inputs (issue 49): malformed GGUF files refused naming them and
the conversion cache verified against its record; environment variables checked before Ray starts; `kvtc list`
of a registry that does not exist; bad command lines refused before any model or tokenizer loads. The families
come from bench/hostile.py."""
from __future__ import annotations

import contextlib
import io
import struct
import sys
from pathlib import Path

import pytest

from kvtc.pipeline import cli
from kvtc.pipeline.checks.environment import check_environment
from kvtc.workers import models
from kvtc.workers.model_limits import embedded_gguf, gguf_context_length, model_facts, read_gguf_header

REPO = Path(__file__).resolve().parents[2]


def _clean(ended, family: str) -> None:
    bad = [f"{e.label}: {e.how}" for e in ended if not e.clean]
    assert not bad, "\n".join(bad)
    assert {e.family for e in ended} == {family}


def _run(capsys, *argv: str) -> tuple[int, str]:
    rc = cli.main(list(argv))
    return rc, capsys.readouterr().err.strip()


# ---- 4. GGUF inputs ----


def test_the_embedded_header_reads_whole_and_tells_the_geometry():
    header = read_gguf_header(embedded_gguf())
    assert (header.arch, header.context_length, header.tensors, header.parameters) == ("llama", 8192, 272, 134515008)
    assert header.data_start == 1785664  # what gguf's own reader finds
    facts = model_facts("smollm2-135m")
    assert (facts.layers, facts.kv_heads, facts.attention_heads, facts.head_dim, facts.features) == (30, 3, 9, 64, 5760)
    assert gguf_context_length(embedded_gguf()) == 8192


def test_malformed_gguf_files_are_refused_naming_them_from_the_command_line_and_load_spec(hostile, tmp):
    ended = hostile.gguf_files(tmp)
    _clean(ended, "GGUF files")
    assert len(ended) == 2 * 9
    assert max(e.seconds for e in ended if "calibrate" in e.label) < 2


@pytest.mark.parametrize("data, problem", [
    (b"GGUF" + struct.pack("<I", 3), "ends inside its header"),
    (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"k" + struct.pack("<IIQ", 9, 0, 1 << 40),
     "declares 1099511627776 bytes past the end"),
    (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1 << 62), "declares 4611686018427387904 bytes"),
    (b"GGUF" + struct.pack("<IQQ", 3, 1, 0) + struct.pack("<Q", 1) + b"t" + struct.pack("<IQIQ", 1, 32, 0, 0),
     "lies past the end of the file"),
    (b"GGUF" + struct.pack("<IQQ", 3, 1, 0) + struct.pack("<Q", 1) + b"t" + struct.pack("<IQIQ", 5, 32, 0, 0),
     "declares 5 dimensions"),
    (b"GGUF" + struct.pack("<IQQ", 3, 0, 2) + (struct.pack("<Q", 1) + b"k" + struct.pack("<II", 4, 7)) * 2,
     "appears twice"),
])
def test_a_header_cut_or_forged_anywhere_is_a_value_error_naming_the_file(tmp, data, problem):
    path = tmp / "bad.gguf"
    path.write_bytes(data)
    with pytest.raises(ValueError, match=f"model file .*bad.gguf is not a valid GGUF file .*{problem}"):
        read_gguf_header(path)


def test_the_conversion_cache_is_verified_and_rebuilt_named_once(hostile, tmp):
    ended = hostile.gguf_conversion_cache(tmp)
    _clean(ended, "GGUF conversion cache")
    assert [e.how for e in ended][1:] == ["rebuilt, named once"] * 5


def test_a_changed_weight_in_the_cache_is_never_loaded(tmp, monkeypatch):
    import numpy as np
    from safetensors.numpy import load_file, save_file

    source = embedded_gguf()
    digest = models.sha256_file(source)

    def convert(path, folder, digest):
        save_file({"w": np.ones(8, np.float32)}, str(folder / "model.safetensors"))
        (folder / "config.json").write_text("{}")
        models.write_conversion_record(folder, digest)

    monkeypatch.setattr(models, "_convert", convert)
    folder = models.convert_gguf(source, tmp / "cache", digest)
    save_file({"w": np.full(8, 7.0, np.float32)}, str(folder / "model.safetensors"))  # same size, another weight
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert models.convert_gguf(source, tmp / "cache", digest) == folder
    assert "is not the one converted" in err.getvalue() and len(err.getvalue().strip().splitlines()) == 1
    assert load_file(str(folder / "model.safetensors"))["w"].tolist() == [1.0] * 8
    assert models.conversion_problem(folder, digest) is None
    assert not [p for p in (tmp / "cache").iterdir() if p.name != folder.name]  # the bad copy is gone, nothing half-made


# ---- 5. environment variables ----


def test_environment_variables_ray_or_kvtc_cannot_use_are_refused_naming_them(hostile, tmp):
    _clean(hostile.environment_variables(tmp), "environment variables")


@pytest.mark.parametrize("value", ["abc", "nan", "-1", "0.0001", "inf"])
def test_a_bad_memory_threshold_is_refused_before_ray_starts(tmp, capsys, monkeypatch, value):
    monkeypatch.setenv("RAY_memory_usage_threshold", value)
    rc, err = _run(capsys, "calibrate", "--registry", str(tmp / "reg"))
    assert rc == 2 and err.startswith("kvtc calibrate: error: environment variable RAY_memory_usage_threshold")
    assert len(err.splitlines()) == 1
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()


def test_sound_values_pass_and_commands_without_ray_ignore_its_variables():
    check_environment(True, {"RAY_memory_usage_threshold": "0.9", "RAY_task_oom_retries": "0", "KVTC_REQUIRE_SIGNATURE":
                             "1", "RAY_USAGE_STATS_ENABLED": "0", "KVTC_TEST_KILL_ON_SHARD": "3:/tmp/m", "RAY_ADDRESS":
                             "auto", "KVTC_REQUIRE_KERNELS": ""})
    check_environment(False, {"RAY_memory_usage_threshold": "abc"})
    with pytest.raises(ValueError, match="environment variable RAY_task_oom_retries must be an integer"):
        check_environment(True, {"RAY_task_oom_retries": "1.5"})


# ---- 6. the small things ----


def test_listing_a_registry_that_does_not_exist_exits_2_and_an_empty_one_0(tmp, capsys):
    rc, err = _run(capsys, "list", "--registry", str(tmp / "nowhere"))
    assert rc == 2 and "nowhere does not exist" in err and len(err.splitlines()) == 1
    (tmp / "empty").mkdir()
    assert cli.main(["list", "--registry", str(tmp / "empty")]) == 0
    assert "(no artifacts" in capsys.readouterr().out
    assert cli.main(["list", "toy", "--registry", str(tmp / "nowhere")]) == 2


def test_bad_command_lines_refuse_before_any_model_or_tokenizer_loads(hostile, tmp):
    ended = hostile.command_lines(tmp)
    _clean(ended, "command lines")
    cold = [e for e in ended if "cold" in e.how]
    assert len(cold) == len(hostile._SLOW_REFUSALS) and max(e.seconds for e in cold) < 2.0
    assert max(e.peak_bytes for e in cold) < 64 << 20  # nothing loaded beyond a plain refusal


def test_the_early_checks_pass_the_defaults_and_refuse_what_the_plan_stage_would(tmp):
    from kvtc.pipeline.checks.header import check_calibration
    from kvtc.pipeline.settings import JobSettings

    assert check_calibration(JobSettings.of()).features == 5760
    assert check_calibration(JobSettings.of(model="tiny:llama@4x2x16", tp=2)).kv_heads == 2
    with pytest.raises(ValueError, match="--tp 7 does not shard 3 KV heads"):
        check_calibration(JobSettings.of(tp=7))
    with pytest.raises(ValueError, match="compression ratio 20000 leaves 4 bits per token for p=5760"):
        check_calibration(JobSettings.of(ratios=(20000.0,)))
    with pytest.raises(ValueError, match="seq_len 9000 exceeds the model's limit of 8192"):
        check_calibration(JobSettings.of(seq_len=9000))
    with pytest.raises(ValueError, match="corpus .* has no usable document"):
        check_calibration(JobSettings.of(corpus=str(tmp / "missing.txt")))
    check_calibration(JobSettings.of(corpus=f"pydoc,{tmp / 'missing.txt'}"))  # a mixture with a source: left to it
