"""Calibration options serving consumers need, end to end on a tiny model: no window, no sinks, keys
calibrated with RoPE kept; the artifact drives the codec, KVTCCache and the Dynamo export."""
import json

import numpy as np
import pytest
import torch

from kvtc import artifacts
from kvtc.kernels import KVTCCache, KVTCCodec
from kvtc.pipeline.settings import JobSettings
from kvtc.pipeline.job.calibrate import run
from kvtc.workers.capture import raw_cache
from kvtc.workers.models import load_model

TINY = dict(model="tiny:llama", corpus="pydoc", eval_corpus=None, seq_len=64, tokens=1024, seqs_per_shard=4,
            heldout_rows=512, ratios=(4.0,), tokens_curve_points=0, sinks=0, window=0, keys="rope-kept")


@pytest.fixture(scope="module")
def rope_kept(tmp_path_factory):
    root = tmp_path_factory.mktemp("consumer")
    # in-process (the options are the job's, not its Ray pool's: tests/pipeline/test_calibrate.py runs the pool)
    summary = run(JobSettings.of(**TINY, served_sequences=0, registry=str(root / "reg"), store=str(root / "store"),
                                 name="tiny-kept"), in_process=True)
    return artifacts.pull("tiny-kept", summary["version"], registry=summary["registry"]), summary


def test_rope_kept_artifact_without_window_or_sinks_codes_the_whole_cache(rope_kept):
    art, summary = rope_kept
    cal = art.manifest["calibration"]
    assert (cal["sinks"], cal["window"], cal["keys"]) == (0, 0, "rope-kept")
    codec = KVTCCodec(art, 4)
    assert codec.rope is None
    lm = load_model("tiny:llama", device="cpu")
    ids = lm.tokenizer("Keys and values of every layer are cached by the model while it reads. " * 4,
                       return_tensors="pt").input_ids[:, :48]
    keys, values = raw_cache(lm, ids)
    assert codec.split(48, 0) == (0, 48, 0)
    k, v = codec.decode(codec.encode(keys, values))
    rel_k = float((k - keys).norm() / keys.norm())
    assert 0 < rel_k < 0.5 and float((v - values).norm() / values.norm()) < 0.8
    reported = summary["ratios"][0]["keys"]["rel_error"]
    assert reported < 0.5


def test_rope_kept_artifact_runs_in_kvtc_cache(rope_kept):
    art, _ = rope_kept
    lm = load_model("tiny:llama", device="cpu")
    ids = torch.randint(3, 2000, (1, 12), generator=torch.Generator().manual_seed(0))
    cache = KVTCCache(KVTCCodec(art, 4), config=lm.model.config, chunk=4)
    out = lm.model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=6,
                            do_sample=False, pad_token_id=0)
    assert out.shape == (1, 18) and cache.coded_tokens >= 12 and cache.layers[0].keys.shape[-2] < 4


def test_rope_kept_artifact_exports_to_dynamo_without_override(rope_kept, tmp_path):
    from kvtc.artifacts.export import DynamoExportOptions, ExportError, export_dynamo

    art, _ = rope_kept
    with pytest.raises(ExportError, match="--groups layer"):  # one cross-layer group: not a paged row
        export_dynamo(art, 4, tmp_path)
    path = export_dynamo(art, 4, tmp_path, DynamoExportOptions(layout="token-major"))
    doc = json.loads(path.read_text())
    assert doc["keys"] == "rope-kept" and all(not c["rope_removed"] for c in doc["configs"])
    assert np.fromfile(tmp_path / "keys-g0.mean.f32", dtype="<f4").shape == (3 * 2 * 16,)
