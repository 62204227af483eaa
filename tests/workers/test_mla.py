"""Multi-head latent attention (DeepSeek V2/V3, MiniCPM3) on tiny random models built from real transformers
configs: the cache holds the latent c_KV (keys slot) and the shared RoPE key (values slot), coded as two streams
of their own widths. Schema, RoPE against the model's own rotary functions (interleaved weights included),
calibration (one basis for every tensor-parallel rank), both codec modes, fp8 caches, KVTCCache.generate,
charts, `kvtc eval` with the error after up-projection, bad input, and the GPU plan of DeepSeek V3 671B and
V2 Lite 16B on the meta device."""
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from kvtc import artifacts
from kvtc.kernels import CodecSpec, CodedBlock, GroupCode, KVTCCache, KVTCCodec
from kvtc.kernels.integrations.kvtc_cache import cache_layers, cache_tensors, compress_cache, restore_cache
from kvtc.kernels.codec.layers import cached_layers, layers_of
from kvtc.workers.capture import CaptureSettings
from kvtc.workers.layers import layer_schema
from kvtc.workers.models import load_model, load_spec
from kvtc.workers.rope_check import rope_round_trip
from kvtc.workers.tiny import MLA_ARCHS, tiny_config


def _ids(t: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 2000, (1, t), generator=torch.Generator().manual_seed(seed))


def _v2_lite():
    import transformers as tf

    return tf.DeepseekV2Config(vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
                               num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, n_shared_experts=2,
                               n_routed_experts=64, num_experts_per_tok=6, first_k_dense_replace=1, kv_lora_rank=512,
                               q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                               max_position_embeddings=163840, n_group=1, topk_group=1)


def test_schema_of_real_mla_configs():
    import transformers as tf

    for config, layers in ((tf.DeepseekV3Config(), 61), (_v2_lite(), 27)):
        schema = layer_schema(config)
        assert len(schema) == layers and {(l.kind, l.kv_heads, l.head_dim, l.value_dim) for l in schema} == {("mla", 1, 512, 64)}
        assert schema[0].rope.rotary_dim == 64 and schema[0].rope.layout == "half"  # the cache holds halves
    info = load_spec("tiny:deepseek_v3")
    assert info.fingerprint["value_dim"] == 8 and info.fingerprint["head_dim"] == 32
    assert [l["kind"] for l in info.fingerprint["layers"]] == ["mla"] * 3
    assert layers_of(info.fingerprint)[0].value_dim == 8  # the manifest's schema round-trips the widths


def test_mla_mixed_with_other_attention_kinds_is_refused_naming_layer_and_widths():
    import transformers as tf

    config = tf.DeepseekV3Config(num_hidden_layers=3)
    config.layer_types = ["full_attention", "sliding_attention", "full_attention"]
    config.sliding_window = 128
    with pytest.raises(ValueError, match=r"layer 1 of 'deepseek_v3' is 'sliding_attention'.*latent width 512, rope width 64"):
        layer_schema(config)


@pytest.mark.parametrize("arch", MLA_ARCHS)
def test_rope_key_round_trip_matches_the_models_rotary_function(arch):
    lm = load_model(f"tiny:{arch}", device="cpu")
    errors = rope_round_trip(lm, _ids(48))
    assert set(errors) == set(cached_layers(lm.layers)) and max(errors.values()) < 1e-6, errors


def _near_lossless(lm) -> CodecSpec:
    """Full orthonormal bases per stream at its own width, int8 blocks: decode error ~1e-3 (plumbing)."""
    g = torch.Generator().manual_seed(0)
    fp = lm.fingerprint
    streams = {}
    for stream, dim in (("keys", fp["head_dim"]), ("values", fp["value_dim"])):
        codes = []
        for group in CaptureSettings(groups="layer").group_layers(lm.layers):
            p = group.dim(1, dim)
            q, _ = torch.linalg.qr(torch.randn(p, p, generator=g))
            blocks = tuple(CodedBlock(s, min(16, p - s), "int8", 8) for s in range(0, p, 16))
            codes.append(GroupCode(group, torch.randn(p, generator=g) * 0.1, q.contiguous(), blocks))
        streams[stream] = tuple(codes)
    return CodecSpec("tiny", "v0", 2.0, "tiny", lm.num_layers, 1, fp["head_dim"], 2, 3, fp["rope"], streams,
                     layers=layers_of(fp), value_dim=fp["value_dim"])


def test_kvtc_cache_codes_the_latent_and_rope_key_like_dynamic_cache():
    lm = load_model("tiny:deepseek_v3", device="cpu")
    codec = KVTCCodec(_near_lossless(lm))
    ids = _ids(30, seed=1)
    ref, got = DynamicCache(config=lm.model.config), KVTCCache(codec, config=lm.model.config, chunk=4)
    with torch.no_grad():
        a = lm.model(ids, past_key_values=ref, use_cache=True).logits
        lm.model(ids, past_key_values=got, use_cache=True)
        for _ in range(6):
            nxt = a[:, -1:].argmax(-1)
            a = lm.model(nxt, past_key_values=ref, use_cache=True).logits
            torch.testing.assert_close(lm.model(nxt, past_key_values=got, use_cache=True).logits, a, atol=5e-2, rtol=0)
    assert got.coded_tokens > 0 and got.get_seq_length() == 36
    for r, k in zip(ref.layers, got.layers):
        latent, rope = k.update(r.keys[:, :, :0], r.values[:, :, :0])
        assert latent.shape == r.keys.shape == (1, 1, 36, 32) and rope.shape == r.values.shape == (1, 1, 36, 8)
        assert float((latent - r.keys).norm() / r.keys.norm()) < 2e-2
        assert float((rope - r.values).norm() / r.values.norm()) < 2e-2


def test_fp8_latent_cache_in_and_out_and_widths_checked_before_decoding():
    lm = load_model("tiny:deepseek_v3_plain", device="cpu")
    codec = KVTCCodec(_near_lossless(lm))
    cache = DynamicCache(config=lm.model.config)
    with torch.no_grad():
        lm.model(_ids(24, seed=2), past_key_values=cache, use_cache=True)
    latent, rope = (x.to(torch.float8_e4m3fn) for x in cache_tensors(cache))
    k, v = codec.decode(codec.encode(latent, rope, start=0))
    assert (k.dtype, v.dtype, k.shape, v.shape) == (torch.float8_e4m3fn,) * 2 + (latent.shape, rope.shape)
    assert torch.equal(k[:, :, :2].float(), latent[:, :, :2].float())  # raw sinks: the same fp8 bytes
    for x, y in ((latent, k), (rope, v)):
        assert float((x.float() - y.float()).norm() / x.float().norm()) < 0.08  # fp8's own step dominates
    with pytest.raises(ValueError, match=r"values \(rope key\) must be shaped .*latent width 32, rope width 8"):
        codec.encode(latent, torch.zeros(3, 1, 24, 16, dtype=torch.float8_e4m3fn))
    per_layer_k, per_layer_v = list(latent), list(rope)
    per_layer_v[2] = torch.zeros(1, 24, 4)
    with pytest.raises(ValueError, match=r"layer 2: .*\(1, tokens, 32\) and \(1, tokens, 8\).*got \(1, 24, 32\) and \(1, 24, 4\)"):
        codec.encode(per_layer_k, per_layer_v)
    with pytest.raises(ValueError, match=r"latent width 32, rope width 8; this model has 3 layers, latent width 64"):
        KVTCCache(codec, config=tiny_config("deepseek_v3_plain", _geometry("3x64x8")))
    with pytest.raises(ValueError, match="no latent"):
        KVTCCache(codec, config=tiny_config("llama"))


def test_triton_kernels_and_cache_coder_code_the_rope_key_like_the_torch_codec():
    """The fused kernels (interpreter on CPU) remove and restore RoPE on the values slot of an MLA cache, and
    KVTCCache's coefficient coder decodes each layer's latent and RoPE key as the blob codec does."""
    from kvtc.kernels.codec.coefficients import CoefficientCoder

    lm = load_model("tiny:deepseek_v3", device="cpu")
    spec = _near_lossless(lm)
    cache = DynamicCache(config=lm.model.config)
    with torch.no_grad():
        lm.model(_ids(21, seed=4), past_key_values=cache, use_cache=True)
    latent, rope = (x[:, :, 5:] for x in cache_tensors(cache))  # 16 tokens from position 5
    want_k, want_v = KVTCCodec(spec, backend="torch").decode(KVTCCodec(spec, backend="torch").encode(latent, rope, start=5))
    got_k, got_v = KVTCCodec(spec, backend="triton").decode(KVTCCodec(spec, backend="triton").encode(latent, rope, start=5))
    torch.testing.assert_close(got_k, want_k, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_v, want_v, rtol=1e-4, atol=1e-4)
    assert float((want_v - rope).norm() / rope.norm()) < 2e-2
    coder = CoefficientCoder(spec, "triton")
    coded = coder.encode(latent[:, None, :, 2:13], rope[:, None, :, 2:13], 7)  # the codec's coded middle
    for layer in range(3):
        for stream, want in (("keys", want_k), ("values", want_v)):
            got = coder.decode_layer(coded, coder.coefficients(coded, stream, layer), stream, layer, torch.float32)
            torch.testing.assert_close(got[0], want[layer][:, 2:13], rtol=1e-3, atol=1e-3)


def _geometry(text: str):
    from kvtc.workers.tiny import Geometry

    return Geometry.parse(text)


def test_chunk_serde_refuses_the_single_plane_latent_layout():
    from kvtc.kernels.codec.chunk_serde import ChunkTransform

    lm = load_model("tiny:minicpm3", device="cpu")
    with pytest.raises(ValueError, match="multi-head latent attention.*kv_size 1"):
        ChunkTransform(KVTCCodec(_near_lossless(lm)))


@pytest.fixture(scope="module", params=[("deepseek_v3", 1), ("minicpm3", 2)], ids=["deepseek_v3", "minicpm3-tp2"])
def calibrated(request, tmp_path_factory):
    from kvtc.pipeline.job.calibrate import calibrate_local
    from kvtc.pipeline.settings import JobSettings

    arch, tp = request.param
    root = tmp_path_factory.mktemp(arch)
    cfg = JobSettings.of(model=f"tiny:{arch}", corpus="pydoc", eval_corpus=None, seq_len=64, window=8, sinks=2,
                         tokens=512, seqs_per_shard=2, heldout_rows=256, ratios=(4.0,), accumulators=1,
                         tokens_curve_points=1, name=arch.replace("_", "-"), registry=str(root / "reg"),
                         store=str(root / "store"), tp=tp, served_sequences=0)  # the test evaluates it itself
    summary, _ = calibrate_local(cfg)
    return arch, tp, summary


def test_calibration_codec_cache_charts_and_eval(calibrated):
    from kvtc.pipeline.operations import quality

    arch, tp, summary = calibrated
    art = artifacts.pull(f"{summary['name']}@latest", registry=summary["registry"])
    lm = load_model(f"tiny:{arch}", device="cpu")
    assert [l["kind"] for l in art.manifest["model"]["layers"]] == ["mla"] * 3
    assert art.basis("keys", 0)[0].shape == (96,) and art.basis("values", 0)[0].shape == (24,)  # 3 x 32, 3 x 8
    for rel in ("charts/error_by_tokens.png", "charts/error_by_position.png", "charts/allocation.png", "report.md"):
        assert (Path(art.path) / rel).stat().st_size > 0
    if tp > 1:  # servers replicate the latent on every rank: each rank's codec holds the one basis
        ranks = [CodecSpec.from_artifact(art, 4.0, rank=r) for r in range(tp)]
        assert all(torch.equal(r.streams["keys"][0].components, ranks[0].streams["keys"][0].components) for r in ranks)
        assert {r.heads for r in ranks} == {(0, 1)}
    ids = _ids(40, seed=3)
    cache = DynamicCache(config=lm.model.config)
    with torch.no_grad():
        lm.model(ids, past_key_values=cache, use_cache=True)
    latent, rope = cache_layers(cache)
    for mode in ("fixed", "ecsq"):
        codec = KVTCCodec(art, 4.0, mode=mode, rank=0 if tp > 1 else None)
        k2, v2 = cache_layers(restore_cache(codec, compress_cache(codec, cache), config=lm.model.config))
        for x, y in ((latent, k2), (rope, v2)):
            assert [tuple(a.shape) for a in x] == [tuple(b.shape) for b in y]
            assert max(float((a - b).norm() / a.norm()) for a, b in zip(x, y)) < 0.6
        kv = KVTCCache(codec, config=lm.model.config, window=4, sinks=2, chunk=4)
        out = lm.model.generate(ids, past_key_values=kv, max_new_tokens=8, do_sample=False, min_new_tokens=8)
        assert out.shape == (1, 48) and kv.coded_tokens > 0
    result = quality.run(summary["name"], summary["registry"],
                         quality.EvalSettings(ratios=(4.0,), continuation=4, sequences=1, baselines=("fp8",)))
    rows = {r["method"]: r for r in result["rows"]}
    assert rows["uncompressed"]["key_up_error"] == 0.0 and rows["uncompressed"]["bytes_per_token"] == 2 * 3 * (32 + 8)  # bf16 bytes of a latent and a rope key per layer
    kvtc = rows["kvtc-4x"]
    assert 0 < kvtc["key_rel_error"] < 1 and 0 < kvtc["key_up_error"] < 1 and 0 < kvtc["value_up_error"] < 1
    assert 0.5 < kvtc["ppl_ratio"] < 2


def test_upprojected_error_is_what_the_models_expand_kv_reads():
    from kvtc.workers.mla import up_projections, upprojected_error

    lm = load_model("tiny:deepseek_v3", device="cpu")
    cache = DynamicCache(config=lm.model.config)
    with torch.no_grad():
        lm.model(_ids(20), past_key_values=cache, use_cache=True)
    latent, rope = cache_tensors(cache)
    g = torch.Generator().manual_seed(1)
    latent_hat, rope_hat = latent + 0.05 * torch.randn(latent.shape, generator=g), rope + 0.1 * torch.randn(rope.shape, generator=g)
    got = upprojected_error(up_projections(lm.model, lm.layers), [0, 1, 2], latent, latent_hat, rope, rope_hat)
    sums = torch.zeros(4, dtype=torch.float64)
    with torch.no_grad():
        for j, layer in enumerate(lm.model.model.layers):
            k, v = layer.self_attn.expand_kv(latent[j:j + 1], rope[j:j + 1])
            kh, vh = layer.self_attn.expand_kv(latent_hat[j:j + 1], rope_hat[j:j + 1])
            sums += torch.tensor([(kh - k).square().sum(), k.square().sum(), (vh - v).square().sum(), v.square().sum()],
                                 dtype=torch.float64)
    assert got["keys"] == pytest.approx(float((sums[0] / sums[1]).sqrt()), rel=1e-4)
    assert got["values"] == pytest.approx(float((sums[2] / sums[3]).sqrt()), rel=1e-4)


def test_gpu_plan_of_deepseek_v3_671b_and_v2_lite_16b_on_the_meta_device():
    import transformers as tf

    from kvtc.pipeline.job.memory_plan import estimate, plan_gpus
    from kvtc.workers.model_size import model_size

    def first_gpu(layers: int, groups: str):
        dims = [g.dim(1, 512) for g in CaptureSettings(groups=groups).group_layers(layers)]  # the latent stream
        return lambda workers: estimate(dims, accumulators=4, workers=workers, rows_per_batch=1024,
                                        heldout_rows=8192, kept_max=4096).worker

    h200 = 150_754_820_096  # what torch reports for an H200 (140.4 GiB)
    lite = model_size(_v2_lite(), torch.bfloat16, 1024)
    assert 15.6e9 < lite.parameters < 15.8e9  # DeepSeek V2 Lite: 15.7B
    assert plan_gpus(lite, h200, 8, 8, first_gpu(27, "model"), None).gpus == 1  # p = 27 x 512 = 13,824 per stream
    v3 = model_size(tf.DeepseekV3Config(), torch.bfloat16, 1024)
    assert 671.0e9 < v3.parameters < 671.3e9  # DeepSeek V3 without its MTP module: 671B
    # 1250 GiB of bf16 weights: more than a node of 8 H200s holds (servers run it in fp8)
    with pytest.raises(ValueError, match="needs 12 GPUs per worker on one node .* largest node has 8"):
        plan_gpus(v3, h200, 16, 8, first_gpu(61, "layers:16"), None)
    plan = plan_gpus(v3, h200, 16, 16, first_gpu(61, "layers:16"), None)
    assert plan.gpus == 12 and sum(plan.max_memory().values()) >= plan.weights
