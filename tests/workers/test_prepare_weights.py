"""The embedded GGUF is converted once per node, by the driver, before the workers start (not by every
worker at once on a cold cache); a job with nothing to run converts nothing."""
from kvtc.pipeline.job.calibrate import _after_first
from kvtc.workers.models import convert_gguf, embedded_gguf_path, load_model, prepare_weights


def test_prepare_weights_converts_once_and_workers_reuse_it(tmp_path, capfd):
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    bar = gguf_utils.tqdm
    prepare_weights("smollm2-135m", tmp_path)
    (folder,) = tmp_path.glob("gguf-*")
    # a first run says in one line what converts; transformers' three bars stay off, and its bar is put back
    err = capfd.readouterr().err
    assert err.count("kvtc: converting SmolLM2-135M-Instruct.Q4_1.gguf once into") == 1, err
    assert not any(b in err for b in ("de-quantizing", "Loading weights", "Writing model shards")), err
    assert gguf_utils.tqdm is bar
    stamp = (folder / "config.json").stat().st_mtime_ns
    assert convert_gguf(embedded_gguf_path(), tmp_path) == folder
    lm = load_model("smollm2-135m", cache_dir=tmp_path)
    assert lm.num_layers == 30 and (folder / "config.json").stat().st_mtime_ns == stamp
    prepare_weights("tiny:llama", tmp_path)  # nothing to convert
    assert list(tmp_path.glob("gguf-*")) == [folder]


def test_after_first_runs_its_step_only_when_there_is_work():
    calls = []
    assert list(_after_first(iter([]), lambda: calls.append(1))) == [] and calls == []
    seen = []
    for item in _after_first(iter([{"a": 1}, {"b": 2}]), lambda: calls.append(len(seen))):
        seen.append(item)
    assert seen == [{"a": 1}, {"b": 2}] and calls == [0]


def test_a_conversion_without_room_is_refused_before_it_writes(tmp_path, monkeypatch):
    import shutil

    import pytest

    from kvtc.workers import models

    models.check_room(tmp_path, 1 << 20, "converting m.gguf")  # room: nothing said
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(models.shutil, "disk_usage", lambda p: usage._replace(free=300 << 20))
    with pytest.raises(OSError, match=r"converting m.gguf writes about 0.50 GiB into .*0.29 GiB free; .*KVTC_CACHE"):
        models.check_room(tmp_path / "stage", 512 << 20, "converting m.gguf")
    assert list(tmp_path.iterdir()) == []
