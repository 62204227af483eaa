"""Models whose layers differ, on tiny random models built from real transformers configs: Gemma 3
(sliding + global, two RoPE bases, linear scaling), gpt-oss (alternating sliding/full, YaRN), SmolLM3
(NoPE layers), Qwen3-Next (linear-attention layers without a KV cache), Cohere 2 (interleaved RoPE on
sliding layers, NoPE global layers), Llama 4 (chunked attention). Schema, RoPE per layer against the
model's own rotary code, calibration, both codec modes, KVTCCache.generate, charts and `kvtc eval`."""
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from kvtc import artifacts
from kvtc.artifacts.groups import FeatureGroup
from kvtc.kernels import CodecSpec, CodedBlock, GroupCode, KVTCCache, KVTCCodec
from kvtc.kernels.integrations.kvtc_cache import cache_layers, compress_cache, restore_cache
from kvtc.kernels.codec.layers import cached_layers, layers_of
from kvtc.workers.capture import CaptureSettings
from kvtc.workers.layers import layer_schema
from kvtc.workers.models import load_model, load_spec
from kvtc.workers.rope_check import rope_round_trip
from kvtc.workers.tiny import MIXED_ARCHS, tiny_config

CALIBRATED = ("gemma3", "gpt_oss", "smollm3", "qwen3_next", "cohere2")


def _ids(t: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 2000, (1, t), generator=torch.Generator().manual_seed(seed))


def test_schema_of_real_configs():
    gemma = layer_schema(tiny_config("gemma3"))
    assert [l.kind for l in gemma] == ["sliding", "sliding", "full", "sliding"] and gemma[0].span == 12
    local, glob = gemma[0].rope, gemma[2].rope
    assert (local.theta, local.rope_type) == (1e4, "default") and (glob.theta, glob.rope_type) == (1e6, "linear")
    assert glob.inv_freq[0] == pytest.approx(1 / 8)  # linear scaling by 8 on the global layers only
    smol = layer_schema(tiny_config("smollm3"))
    assert [l.rope is None for l in smol] == [False, False, False, True]
    nxt = layer_schema(tiny_config("qwen3_next"))
    assert [l.kind for l in nxt] == ["none"] * 3 + ["full"] and nxt[3].rope.rotary_dim == 4  # 0.25 of 16
    cohere = layer_schema(tiny_config("cohere2"))
    assert cohere[0].rope.layout == "interleaved" and cohere[3].rope is None
    llama4 = layer_schema(tiny_config("llama4"))
    assert [(l.kind, l.span) for l in llama4[:2]] == [("chunked", 8)] * 2 and llama4[3].rope is None
    oss = layer_schema(tiny_config("gpt_oss"))
    assert oss[0].rope == oss[1].rope and oss[0].rope.rope_type == "yarn" and oss[0].rope.attention_scaling > 1


def test_gemma3_config_as_gguf_gives_it():
    """A Gemma 3 GGUF yields rope_theta, sliding_window and no layer_types: both layer types get RoPE
    (the global base from the file, the local 10000), where earlier releases refused the config."""
    import transformers as tf

    cfg = tf.Gemma3TextConfig(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=6,
                              num_attention_heads=4, num_key_value_heads=1, head_dim=16, rope_theta=1e6,
                              sliding_window=512)
    schema = layer_schema(cfg)
    assert [l.kind for l in schema] == ["sliding"] * 5 + ["full"]
    assert {l.rope.theta for l in schema} == {1e4, 1e6}


def test_layer_kinds_the_service_cannot_code_are_named():
    import transformers as tf

    mixed = tf.DeepseekV3Config(num_hidden_layers=2, sliding_window=64)
    mixed.layer_types = ["full_attention", "sliding_attention"]
    with pytest.raises(ValueError, match=r"layer 1 of 'deepseek_v3' is 'sliding_attention' in a multi-head latent"):
        layer_schema(mixed)
    with pytest.raises(ValueError, match=r"layer 0 of 'falcon_h1' is 'hybrid'"):
        layer_schema(tf.FalconH1Config(num_hidden_layers=2))


@pytest.mark.parametrize("arch", MIXED_ARCHS)
def test_rope_round_trip_per_layer_matches_the_model(arch):
    lm = load_model(f"tiny:{arch}", device="cpu")
    errors = rope_round_trip(lm, _ids(96))
    assert set(errors) == set(cached_layers(lm.layers))
    assert max(errors.values()) < 1e-6, errors


def test_groups_auto_by_kind_and_layers_k_within_kind():
    schema = layer_schema(tiny_config("gemma3"))
    assert CaptureSettings(groups="auto").group_layers(schema) == [FeatureGroup((0, 1, 3)), FeatureGroup((2,))]
    assert CaptureSettings(groups="layers:2").group_layers(schema) == [
        FeatureGroup((0, 1)), FeatureGroup((2,)), FeatureGroup((3,))]
    with pytest.raises(ValueError, match="auto"):
        CaptureSettings(groups="model").group_layers(schema)
    nxt = layer_schema(tiny_config("qwen3_next"))
    assert CaptureSettings(groups="layer").group_layers(nxt) == [FeatureGroup((3,))]


def _near_lossless(lm) -> CodecSpec:
    """Full orthonormal bases per auto group, int8 blocks: decode error ~1e-3 (plumbing checks)."""
    H, D = lm.num_kv_heads, lm.head_dim
    g = torch.Generator().manual_seed(0)
    streams = {}
    for stream in ("keys", "values"):
        codes = []
        for group in CaptureSettings(groups="auto").group_layers(lm.layers):
            p = group.dim(H, D)
            q, _ = torch.linalg.qr(torch.randn(p, p, generator=g))
            blocks = tuple(CodedBlock(s, min(16, p - s), "int8", 8) for s in range(0, p, 16))
            codes.append(GroupCode(group, torch.randn(p, generator=g) * 0.1, q.contiguous(), blocks))
        streams[stream] = tuple(codes)
    return CodecSpec("tiny", "v0", 2.0, "tiny", lm.num_layers, H, D, 2, 3, lm.fingerprint["rope"], streams,
                     layers=layers_of(lm.fingerprint))


@pytest.mark.parametrize("arch", MIXED_ARCHS)
def test_kvtc_cache_matches_dynamic_cache_layer_for_layer(arch):
    lm = load_model(f"tiny:{arch}", device="cpu")
    codec = KVTCCodec(_near_lossless(lm))
    ids = _ids(30, seed=1)
    ref, got = DynamicCache(config=lm.model.config), KVTCCache(codec, config=lm.model.config, chunk=4)
    with torch.no_grad():
        a = lm.model(ids, past_key_values=ref, use_cache=True).logits
        lm.model(ids, past_key_values=got, use_cache=True)
        for step in range(6):  # decode steps past the window: full layers' tokens get coded
            nxt = a[:, -1:].argmax(-1)
            a = lm.model(nxt, past_key_values=ref, use_cache=True).logits
            b2 = lm.model(nxt, past_key_values=got, use_cache=True).logits
            torch.testing.assert_close(b2, a, atol=5e-2, rtol=0)
    for i, (r, k) in enumerate(zip(ref.layers, got.layers)):
        if not isinstance(getattr(r, "keys", None), torch.Tensor):
            continue
        if lm.layers[i].kind != "full":
            assert k.keys.shape == r.keys.shape  # sliding / chunked layers: transformers' own, bounded
            continue
        keys, values = k.update(r.keys[:, :, :0], r.values[:, :, :0])  # sinks + decoded coded tokens + recent
        for x, want in ((keys, r.keys), (values, r.values)):  # each layer's own RoPE (NoPE layers: none)
            assert x.shape == want.shape and float((x - want).norm() / want.norm()) < 2e-2
    assert got.coded_tokens > 0 or all(l.kind != "full" for l in lm.layers)
    assert got.get_seq_length() == ref.get_seq_length() == 36


@pytest.fixture(scope="module", params=CALIBRATED)
def calibrated(request, tmp_path_factory):
    from kvtc.pipeline.job.calibrate import calibrate_local
    from kvtc.pipeline.settings import JobSettings

    arch = request.param
    root = tmp_path_factory.mktemp(arch)
    cfg = JobSettings.of(model=f"tiny:{arch}", corpus="pydoc", eval_corpus=None, seq_len=64, window=8, sinks=2,
                         tokens=768, seqs_per_shard=2, heldout_rows=512, ratios=(4.0, 16.0), accumulators=2,
                         tokens_curve_points=1, name=arch.replace("_", "-"), registry=str(root / "reg"),
                         store=str(root / "store"), served_sequences=0)  # the test runs `kvtc eval`'s paths itself
    summary, _ = calibrate_local(cfg)
    return arch, summary


def test_calibration_codec_cache_charts_and_eval(calibrated):
    from kvtc.pipeline.evaluation.eval_settings import BASELINES
    from kvtc.pipeline.operations import quality

    arch, summary = calibrated
    art = artifacts.pull(f"{summary['name']}@latest", registry=summary["registry"])
    lm = load_model(f"tiny:{arch}", device="cpu")
    model = art.manifest["model"]
    assert [l["kind"] for l in model["layers"]] == [l.kind for l in lm.layers]
    assert all(("rope" in l) == (l["kind"] != "none") for l in model["layers"])
    groups = art.groups()
    assert sorted(l for g in groups for l in g.layers) == cached_layers(lm.layers)
    assert all(len({lm.layers[l].kind for l in g.layers}) == 1 for g in groups)  # one kind per basis
    for rel in ("charts/error_by_tokens.png", "charts/error_by_position.png", "charts/allocation.png", "report.md"):
        assert (Path(art.path) / rel).stat().st_size > 0
    ids = _ids(40, seed=3)
    cache = DynamicCache(config=lm.model.config)
    with torch.no_grad():
        lm.model(ids, past_key_values=cache, use_cache=True)
    keys, _ = cache_layers(cache)
    for mode in ("fixed", "ecsq"):
        codec = KVTCCodec(art, 4.0, mode=mode)
        restored = restore_cache(codec, compress_cache(codec, cache), config=lm.model.config)
        k2, _ = cache_layers(restored)
        assert [None if k is None else tuple(k.shape) for k in k2] == [None if k is None else tuple(k.shape) for k in keys]
        err = max(float((a - b).norm() / a.norm()) for a, b in zip(keys, k2) if a is not None)
        assert err < 1.0, err  # ECSQ's joint split gives the keys of a random model's diffuse heads few bits
        assert [l.get_seq_length() for l, k in zip(restored.layers, k2) if k is not None] == \
            [l.get_seq_length() for l, k in zip(cache.layers, keys) if k is not None]
        kv = KVTCCache(codec, config=lm.model.config, window=4, sinks=2, chunk=4)
        out = lm.model.generate(ids, past_key_values=kv, max_new_tokens=8, do_sample=False, min_new_tokens=8)
        assert out.shape == (1, 48)
    result = quality.run(summary["name"], summary["registry"],
                         quality.EvalSettings(ratios=(4.0,), continuation=4, sequences=1,
                                              baselines=tuple(b for b in BASELINES if b != "pca_uniform")))
    rows = {r["method"]: r for r in result["rows"]}
    assert rows["uncompressed"]["ppl_ratio"] == 1.0 and rows["uncompressed"]["kl"] == 0.0
    assert 0 < rows["kvtc-4x"]["key_rel_error"] < 1 and rows["kvtc-4x"]["ppl_ratio"] > 0


def test_driver_reads_the_schema_without_weights():
    info = load_spec("tiny:gemma3")
    assert "layers" in info.fingerprint and info.features == 4 * 2 * 16
    uniform = load_spec("tiny:llama")
    assert "layers" not in uniform.fingerprint  # uniform models keep earlier fingerprints (and shard stores)


def test_gguf_rope_scaling_reaches_the_global_layers():
    """A Gemma 3 GGUF stores its global layers' linear x8 scaling as gemma3.rope.scaling.*, which transformers'
    GGUF reader leaves out; the loader carries it into the config (and the embedded GGUF has none)."""
    import transformers as tf

    from kvtc.workers.models import embedded_gguf_path, gguf_fields, with_gguf_rope_scaling

    cfg = tf.Gemma3TextConfig(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=6,
                              num_attention_heads=4, num_key_value_heads=1, head_dim=16, rope_theta=1e6,
                              sliding_window=512)
    fields = {"general.architecture": "gemma3", "gemma3.rope.scaling.type": "linear", "gemma3.rope.scaling.factor": 8.0}
    schema = layer_schema(with_gguf_rope_scaling(cfg, fields))
    assert schema[5].rope.rope_type == "linear" and schema[5].rope.inv_freq[0] == pytest.approx(1 / 8)
    assert schema[0].rope.rope_type == "default" and schema[0].rope.inv_freq[0] == 1.0
    embedded = gguf_fields(embedded_gguf_path())
    assert embedded["general.architecture"] == "llama" and not any("scaling" in k for k in embedded)


def test_calibrate_refuses_an_uncodable_layer_kind_before_model_work(tmp_path, capsys, monkeypatch):
    """`kvtc calibrate` on a model mixing multi-head latent attention with sliding-window layers: one line
    naming the kind and the layer."""
    import transformers as tf

    from kvtc.pipeline import cli
    from kvtc.workers.models import embedded_tokenizer

    model = tmp_path / "mla"
    config = tf.DeepseekV3Config(num_hidden_layers=2, vocab_size=49152, sliding_window=64)
    config.layer_types = ["full_attention", "sliding_attention"]
    config.save_pretrained(model)
    embedded_tokenizer().save_pretrained(model)
    monkeypatch.setenv("KVTC_CACHE", str(tmp_path / "cache"))
    rc = cli.main(["calibrate", "--model", str(model), "--tokens", "2048", "--seqs-per-shard", "1",
                   "--registry", str(tmp_path / "reg")])
    err = capsys.readouterr().err
    assert rc != 0 and "multi-head latent attention" in err and "layer 1" in err and "Traceback" not in err
    assert not (tmp_path / "reg").exists() or not any((tmp_path / "reg").rglob("manifest.json"))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_cache_coder_and_blob_codec_remove_each_layers_own_rope(backend):
    """A group whose layers rotate differently (RoPE bases 1e4 / 1e6, a NoPE layer): KVTCCache's coder
    decodes exactly what the blob codec decodes for the same tokens."""
    import dataclasses

    from kvtc.kernels.codec.coefficients import CoefficientCoder
    from kvtc.kernels.codec.layers import LayerSpec
    from kvtc.kernels.codec.rope import RopeSpec
    from helpers.synthetic import synthetic_cache, synthetic_spec

    def rope(theta: float) -> RopeSpec:
        return RopeSpec("default", theta, 8, 8, tuple(theta ** (-i / 8) for i in range(0, 8, 2)))

    base = synthetic_spec(3, 2, 8, 4.0, groups=[(0, 3)], sinks=0, window=0, seed=5, rope_theta=None)
    layers = (LayerSpec("full", 2, 8, rope(1e4)), LayerSpec("full", 2, 8, rope(1e6)), LayerSpec("full", 2, 8, None))
    spec = dataclasses.replace(base, rope=rope(1e4).to_dict(), layers=layers)
    keys, values = synthetic_cache(base, 13, dtype=torch.float32, start=40)
    keys = torch.stack([k if l.rope is None else l.rope.apply(k, torch.arange(40, 53)) for k, l in zip(keys, layers)])
    codec = KVTCCodec(spec, backend=backend)
    want_k, _ = codec.decode(codec.encode(keys, values, start=40))
    assert float((want_k - keys).norm() / keys.norm()) < 0.5
    coder = CoefficientCoder(spec, backend)
    coded = coder.encode(keys[:, None], values[:, None], 40)
    z = coder.coefficients(coded, "keys", 0)
    for layer in range(3):
        got = coder.decode_layer(coded, z, "keys", layer, torch.float32)
        torch.testing.assert_close(got[0], want_k[layer], rtol=1e-4, atol=1e-4)
