"""Model loading: tiny architectures, the embedded SmolLM2 (cached conversion), fingerprints, bad specs."""
import json
import time

import pytest
import torch

from kvtc.artifacts.fingerprint import model_id as fingerprint_id
from kvtc.workers.models import ACCEPTED_FORMS, default_cache_dir, embedded_gguf_path, load_model, sha256_file
from kvtc.workers.tiny import UNIFORM_ARCHS

FP_KEYS = {"spec", "source", "weights_sha256", "revision", "architecture", "model_type", "num_layers",
           "num_kv_heads", "head_dim", "max_positions", "rope", "key_norm"}


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2-135m", device="cpu")


@pytest.mark.parametrize("arch", UNIFORM_ARCHS)
def test_tiny_loads_with_fingerprint_and_tokenizer(arch):
    lm = load_model(f"tiny:{arch}")
    on_gpu = torch.cuda.is_available()
    assert lm.device.type == ("cuda" if on_gpu else "cpu")
    assert lm.dtype == (torch.bfloat16 if on_gpu else torch.float32)
    assert next(lm.model.parameters()).dtype == lm.dtype
    assert set(lm.fingerprint) == FP_KEYS
    assert json.loads(json.dumps(lm.fingerprint)) == lm.fingerprint
    assert lm.fingerprint["num_kv_heads"] == (1 if arch == "mistral" else 2)
    assert lm.fingerprint["key_norm"] == (arch == "qwen3")
    assert lm.rope.rotary_dim == (lm.head_dim // 2 if arch == "phi" else lm.head_dim)
    ids = lm.tokenizer("def f(x): return x")["input_ids"]
    assert ids and max(ids) < lm.config.vocab_size and lm.tokenizer.eos_token_id is not None
    # seeded: a second build is bit-identical
    assert load_model(f"tiny:{arch}").fingerprint == lm.fingerprint


def test_tiny_rope_types_cover_scalings():
    types = {arch: load_model(f"tiny:{arch}").rope for arch in ("llama", "qwen2", "mistral")}
    assert types["llama"].rope_type == "llama3"
    assert types["qwen2"].rope_type == "yarn" and types["qwen2"].attention_scaling > 1.0
    assert types["mistral"].rope_type == "linear"


def test_fingerprint_id_is_stable_and_sensitive():
    fp = load_model("tiny:llama").fingerprint
    assert fingerprint_id(fp) == fingerprint_id(json.loads(json.dumps(fp)))
    assert fingerprint_id(fp) != fingerprint_id({**fp, "num_layers": 99})
    assert len(fingerprint_id(fp)) == 16


@pytest.mark.parametrize("spec", ["nonsense", "tiny:gpt2", "./no/such/dir.bin"])
def test_unknown_spec_lists_accepted_forms(spec):
    with pytest.raises(ValueError, match="accepted") as err:
        load_model(spec)
    assert "tiny:qwen3" in str(err.value) and "smollm2-135m" in str(err.value) and "tiny:qwen3" in ACCEPTED_FORMS


def test_missing_gguf_and_bad_dtype():
    with pytest.raises(FileNotFoundError):
        load_model("/no/such/model.gguf")
    with pytest.raises(ValueError, match="dtype"):
        load_model("tiny:llama", dtype="float8")


def test_uncached_hub_id_is_a_clear_error():
    with pytest.raises(ValueError, match="local Hugging Face cache"):
        load_model("kvtc-no-such-org/no-such-model")


def test_smollm2_config_and_fingerprint(smollm2):
    fp = smollm2.fingerprint
    assert (smollm2.num_layers, smollm2.num_kv_heads, smollm2.head_dim) == (30, 3, 64)
    assert fp["rope"]["theta"] == 100000.0 and fp["rope"]["rope_type"] == "default"
    assert fp["weights_sha256"] == sha256_file(embedded_gguf_path())
    assert fp["source"] == "gguf:SmolLM2-135M-Instruct.Q4_1.gguf"
    assert smollm2.max_positions >= 2048
    assert smollm2.tokenizer.eos_token_id is not None


def test_smollm2_second_load_hits_cache(smollm2):
    cached = default_cache_dir() / f"gguf-{smollm2.fingerprint['weights_sha256'][:24]}"
    assert (cached / "config.json").exists() and list(cached.glob("*.safetensors"))
    t0 = time.perf_counter()
    again = load_model("smollm2-135m", device="cpu")
    assert time.perf_counter() - t0 < 15.0
    assert again.fingerprint == smollm2.fingerprint
    w0 = smollm2.model.model.layers[3].self_attn.k_proj.weight
    assert torch.equal(w0, again.model.model.layers[3].self_attn.k_proj.weight)


def test_directory_spec_loads_saved_tiny(tmp_path):
    lm = load_model("tiny:qwen3")
    lm.model.save_pretrained(tmp_path / "m")
    lm.tokenizer.save_pretrained(tmp_path / "m")
    again = load_model(str(tmp_path / "m"))
    assert again.fingerprint["source"] == "dir:m" and again.fingerprint["weights_sha256"]
    assert again.fingerprint["rope"] == lm.fingerprint["rope"] and again.fingerprint["key_norm"]


def test_atomic_cache_write_keeps_first_copy(tmp_path):
    from kvtc.workers.models import _atomic_save

    def writer(text):
        return lambda d: (d / "config.json").write_text(text)

    _atomic_save(tmp_path / "entry", writer("first"))
    _atomic_save(tmp_path / "entry", writer("second"))  # a concurrent loser: its copy is discarded
    assert (tmp_path / "entry" / "config.json").read_text() == "first"
    assert [p.name for p in tmp_path.iterdir()] == ["entry"]

    def failing(d):
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        _atomic_save(tmp_path / "other", failing)
    assert [p.name for p in tmp_path.iterdir()] == ["entry"]
