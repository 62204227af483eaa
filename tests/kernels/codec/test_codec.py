"""KVTCCodec round trips against an independent reconstruction from kernels/codec/reference.py."""
import zlib

import pytest
import torch

from kvtc.kernels import BlobError, CodecSpec, KVTCCodec, read_blob
from kvtc.kernels.codec.blob import TAG_CODES
from kvtc.kernels.codec.entropy import PLAIN, RAW_DEFLATE, ZLIB, decode_section, encode_section, nvcomp_available
from kvtc.kernels.codec.reference import quantize_dequantize
from kvtc.kernels.codec.spec import STREAMS, model_id
from helpers.synthetic import synthetic_cache, synthetic_spec
from kvtc.kernels.codec.rope import RopeSpec


def reference_reconstruction(spec: CodecSpec, cache: torch.Tensor, stream: str, start: int) -> torch.Tensor:
    """Middle tokens rebuilt the slow, obvious way: (L, H, mid, D) float32."""
    L, H, T, D = cache.shape
    head = min(T, max(0, spec.sinks - start))
    mid = T - head - min(spec.window, T - head)
    pos = torch.arange(start + head, start + head + mid)
    x = cache[:, :, head:head + mid].float()
    rope = RopeSpec.from_dict(spec.rope) if spec.rope and stream == "keys" else None
    if rope:
        x = rope.remove(x, pos)
    flat = x.permute(2, 0, 1, 3).reshape(mid, -1)
    out = torch.empty_like(flat)
    for g in spec.streams[stream]:
        cols = g.group.columns(H, D)
        z = (flat[:, cols] - g.mean) @ g.components
        zhat = torch.zeros_like(z)
        for b in g.blocks:
            zhat[:, b.start:b.start + b.size] = quantize_dequantize(z[:, b.start:b.start + b.size], b.qtype)
        out[:, cols] = zhat @ g.components.T + g.mean
    x = out.reshape(mid, L, H, D).permute(1, 2, 0, 3)
    return rope.apply(x, pos) if rope else x


def test_roundtrip_equals_reference_definition_without_rope():
    spec = synthetic_spec(5, 2, 8, groups=[(0, 2), (2, 5)], sinks=3, window=4, kept=30, rope_theta=None)
    keys, values = synthetic_cache(spec, 23, torch.float32, seed=1)
    codec = KVTCCodec(spec)
    k2, v2 = codec.decode(codec.encode(keys, values))
    for orig, dec, stream in ((keys, k2, "keys"), (values, v2, "values")):
        assert dec.shape == orig.shape and dec.dtype == orig.dtype
        assert torch.equal(dec[:, :, :3], orig[:, :, :3]) and torch.equal(dec[:, :, -4:], orig[:, :, -4:])
        assert torch.equal(dec[:, :, 3:-4], reference_reconstruction(spec, orig, stream, 0))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("start", [0, 2, 11])
def test_roundtrip_with_rope_close_to_reference(dtype, start):
    spec = synthetic_spec(3, 2, 16, 4.0, sinks=4, window=5, seed=2)
    keys, values = synthetic_cache(spec, 29, dtype, start=start, seed=3)
    codec = KVTCCodec(spec)
    head, mid, tail = codec.split(29, start)
    assert (head, mid, tail) == (max(0, 4 - start), 29 - max(0, 4 - start) - 5, 5)
    k2, v2 = codec.decode(codec.encode(keys, values, start=start))
    for orig, dec, stream in ((keys, k2, "keys"), (values, v2, "values")):
        assert dec.dtype == dtype and dec.shape == orig.shape
        assert torch.equal(dec[:, :, :head], orig[:, :, :head]) and torch.equal(dec[:, :, -tail:], orig[:, :, -tail:])
        ref = reference_reconstruction(spec, orig, stream, start)
        got, x = dec[:, :, head:head + mid].float(), orig[:, :, head:head + mid].float()
        err_ref = (ref - x).norm() / x.norm()
        assert err_ref < 0.2
        assert (got - ref).norm() <= 0.05 * (ref - x).norm() + 1e-2 * x.norm()


@pytest.mark.parametrize("tokens", [0, 1, 6, 9])
def test_short_sequences_stay_raw(tokens):
    spec = synthetic_spec(2, 1, 8, sinks=4, window=5, kept=8)
    keys, values = synthetic_cache(spec, tokens, torch.float16)
    codec = KVTCCodec(spec)
    blob = codec.encode(keys, values)
    _, sections = read_blob(blob)
    assert all(s.key.tag != TAG_CODES for s in sections)
    k2, v2 = codec.decode(blob)
    assert torch.equal(k2, keys) and torch.equal(v2, values)


def test_triton_interpreter_backend_writes_the_same_blob():
    spec = synthetic_spec(2, 3, 8, groups=[(0, 1), (1, 2)], sinks=2, window=3, kept=20, seed=4)
    keys, values = synthetic_cache(spec, 17, torch.float32, seed=5)
    torch_codec, triton_codec = KVTCCodec(spec, backend="torch"), KVTCCodec(spec, backend="triton")
    blob = torch_codec.encode(keys, values, start=1)
    assert triton_codec.encode(keys, values, start=1) == blob
    for a, b in zip(torch_codec.decode(blob), triton_codec.decode(blob)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_bad_inputs_are_clear_value_errors():
    spec = synthetic_spec(2, 1, 8, kept=8)
    codec = KVTCCodec(spec)
    keys, values = synthetic_cache(spec, 10, torch.float16)
    with pytest.raises(ValueError, match="layers, kv_heads, tokens, head_dim"):
        codec.encode(keys[:1], values[:1])
    with pytest.raises(ValueError, match="dtype"):
        codec.encode(keys.double(), values.double())
    with pytest.raises(ValueError, match="same shape"):
        codec.encode(keys, values[:, :, :5])
    with pytest.raises(ValueError, match="start"):
        codec.encode(keys, values, start=-1)
    with pytest.raises(ValueError, match="ratio"):
        KVTCCodec(object())
    with pytest.raises(ValueError, match="backend"):
        KVTCCodec(spec, backend="cuda")


class FakeArtifact:
    """Implements only the Artifact interface the codec may use."""

    def __init__(self, spec: CodecSpec, fingerprint: dict):
        self.spec = spec
        self.manifest = {"name": "fake", "version": "v3", "model": fingerprint,
                         "calibration": {"sinks": spec.sinks, "window": spec.window,
                                         "groups": [g.group.to_json() for g in spec.streams["keys"]]}}

    def basis(self, stream, group=0):
        g = self.spec.streams[stream][group]
        extra = torch.zeros(g.components.shape[0], 3)
        return g.mean.numpy(), None, torch.cat([g.components, extra], 1).numpy()

    def allocation(self, ratio, stream, group=0):
        assert ratio == 16
        return [(b.start, b.size, b.qtype, b.bits) for b in self.spec.streams[stream][group].blocks]


def test_codec_from_artifact_interface():
    spec = synthetic_spec(2, 2, 8, groups=[(0, 1), (1, 2)], kept=12, seed=6)
    fp = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "rope": spec.rope, "spec": "tiny"}
    codec = KVTCCodec(FakeArtifact(spec, fp), 16)
    assert codec.spec.model_id == model_id(fp) and codec.spec.name == "fake" and codec.spec.version == "v3"
    for stream in STREAMS:
        for a, b in zip(codec.spec.streams[stream], spec.streams[stream]):
            assert a.kept == b.kept and torch.equal(a.components, b.components[:, :b.kept])
    keys, values = synthetic_cache(spec, 140, torch.float16)
    k2, v2 = codec.decode(codec.encode(keys, values))
    assert k2.shape == keys.shape


def test_entropy_sections_never_grow_and_decode_all_codings():
    noise = torch.randint(0, 256, (4096,), dtype=torch.uint8).numpy().tobytes()
    assert encode_section(noise) == (PLAIN, noise)
    coding, stored = encode_section(bytes(4096))
    assert coding == ZLIB and len(stored) < 100
    assert decode_section(coding, stored, 4096, "x") == bytes(4096)
    raw = zlib.compressobj(6, zlib.DEFLATED, -15)
    stream = raw.compress(b"abc" * 100) + raw.flush()
    assert decode_section(RAW_DEFLATE, stream, 300, "x") == b"abc" * 100
    with pytest.raises(BlobError, match="exactly 299"):
        decode_section(RAW_DEFLATE, stream, 299, "x")
    if not nvcomp_available():
        with pytest.raises(RuntimeError, match="nvcomp"):
            encode_section(b"a" * 100, coder="nvcomp")


def test_codec_from_registry_with_a_published_toy_artifact(tmp_path):
    testing = pytest.importorskip("helpers.toy_artifacts")
    from kvtc.artifacts import publish

    content = testing.toy_content(num_layers=2, num_kv_heads=2, head_dim=8, groups=[[0, 1], [1, 2]])
    inv = [10000.0 ** (-2 * i / 8) for i in range(4)]
    content.model["rope"] = {"rope_type": "default", "theta": 10000.0, "head_dim": 8, "rotary_dim": 8,
                             "inv_freq": inv, "attention_scaling": 1.0, "layout": "half"}
    publish(content, registry=str(tmp_path))
    codec = KVTCCodec.from_registry("toy@latest", 4.0, registry=str(tmp_path))
    for g in codec.spec.streams["keys"]:
        assert g.kept == g.components.shape[1] < g.mean.shape[0] and g.blocks[-1].bits > 0
    keys = torch.randn(2, 2, 140, 8, dtype=torch.float16)
    values = torch.randn(2, 2, 140, 8, dtype=torch.float16)
    blob = codec.encode(keys, values)
    header, _ = read_blob(blob)
    assert (header.name, header.ratio, header.model_id) == ("toy", 4.0, model_id(content.model))
    k2, _ = codec.decode(blob)
    assert torch.equal(k2[:, :, :4], keys[:, :, :4]) and torch.equal(k2[:, :, -128:], keys[:, :, -128:])
    other = KVTCCodec.from_registry("toy@latest", 8.0, registry=str(tmp_path))
    with pytest.raises(BlobError, match="ratio"):
        other.decode(blob)


def test_the_bundle_is_the_codec_folder():
    """The bundle is every *.py under kvtc/kernels/codec (recursively, paths relative to it): a new codec file
    joins it with no list to keep in step. kvtc/kernels holds only the two folders and its lazy __init__.py;
    the integrations, that __init__.py and kvtc.artifacts' format vocabulary (groups.py, blocks.py) are not in it."""
    from kvtc.artifacts.bundle import codec_dir, kernel_sources

    codec = codec_dir()
    assert codec is not None and (codec.parent.name, codec.name) == ("kernels", "codec")
    files = {p.relative_to(codec).as_posix() for p in codec.rglob("*.py")}
    assert set(kernel_sources()) == files
    assert {"__init__.py", "kvtc_codec.py", "spec.py", "blob.py", "chunk_serde.py", "model_config.py"} <= files
    assert {p.name for p in codec.parent.glob("*.py")} == {"__init__.py"}
    assert {p.name for p in codec.parent.iterdir() if p.is_dir() and p.name != "__pycache__"} == {"codec", "integrations"}
    assert {p.name for p in (codec.parent / "integrations").glob("*.py")} == {
        "__init__.py", "kvtc_cache.py", "lmcache_ranks.py", "lmcache_serde.py", "lmcache_server.py", "lmcache_settings.py",
        "vllm_offload.py"}
    assert not {"groups.py", "blocks.py"} & {rel.rsplit("/", 1)[-1] for rel in files}


def test_block_widths_the_codec_takes_from_artifacts_are_pinned():
    """blocks.py is outside the bundle (artifacts/bundle.py says why): the bits and side information each block
    type costs, which fixed-rate decoding reads, are pinned here instead (a group's feature columns: test_groups.py)."""
    from kvtc.artifacts.blocks import QTYPES, block_cost_bits, qtype_bits, scale_bits

    assert QTYPES == ("none", "int1", "int2", "int3", "int4", "int5", "int6", "int7", "int8", "fp8")
    assert [qtype_bits(t) for t in QTYPES] == [0, 1, 2, 3, 4, 5, 6, 7, 8, 8]
    assert [scale_bits(t) for t in QTYPES] == [0] + [32] * 8 + [16]
    # each token's codes are padded to whole bytes (kernels/codec/bitpack.py), and the allocator counts that padding
    assert block_cost_bits("int3", 10) == 64 and block_cost_bits("fp8", 4) == 48 and block_cost_bits("none", 9) == 0
    assert block_cost_bits("int2", 1) == 40 and block_cost_bits("int4", 16) == 96


def test_from_registry_checks_the_kernel_bundle_and_integrations_are_not_in_it(tmp_path, monkeypatch):
    import shutil
    import warnings

    from kvtc.artifacts import kernel_bundle_hash, publish
    from kvtc.artifacts.bundle import codec_dir
    from helpers.toy_artifacts import toy_content
    from kvtc.kernels.codec.kvtc_codec import KernelBundleWarning

    copy = tmp_path / "kernels"
    shutil.copytree(codec_dir().parent, copy, ignore=shutil.ignore_patterns("__pycache__"))
    for integration in ("lmcache_server.py", "kvtc_cache.py", "lmcache_serde.py", "vllm_offload.py", "__init__.py"):
        path = copy / "integrations" / integration
        path.write_text(path.read_text() + "\n# an integration edited\n")
    (copy / "__init__.py").write_text((copy / "__init__.py").read_text() + "\n# the lazy names edited\n")
    (copy / "integrations" / "extra_tool.py").write_text("# a file beside the codec\n")
    assert kernel_bundle_hash(copy / "codec") == kernel_bundle_hash()  # integrations are not the codec a decoder must match
    reference = (copy / "codec" / "reference.py").read_text()
    (copy / "codec" / "reference.py").write_text(reference + "\n# runtime code edited\n")
    assert kernel_bundle_hash(copy / "codec") != kernel_bundle_hash()
    (copy / "codec" / "reference.py").write_text(reference)
    assert kernel_bundle_hash(copy / "codec") == kernel_bundle_hash()
    (copy / "codec" / "formats").mkdir()
    (copy / "codec" / "formats" / "new_section.py").write_text("# a codec file no list names\n")
    assert kernel_bundle_hash(copy / "codec") != kernel_bundle_hash()  # it joins the bundle as it lands

    content = toy_content(num_layers=2, num_kv_heads=2, head_dim=8)
    content.model["rope"] = {"rope_type": "default", "theta": 10000.0, "head_dim": 8, "rotary_dim": 8,
                             "inv_freq": [10000.0 ** (-2 * i / 8) for i in range(4)], "attention_scaling": 1.0,
                             "layout": "half"}
    publish(content, registry=str(tmp_path / "reg"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", KernelBundleWarning)
        KVTCCodec.from_registry("toy@latest", 4.0, registry=str(tmp_path / "reg"))  # made for these kernels
    monkeypatch.setattr("kvtc.artifacts.Artifact.kernels_match", lambda self, directory=None: False)
    with pytest.warns(KernelBundleWarning, match="was made for kernel bundle"):
        KVTCCodec.from_registry("toy@latest", 4.0, registry=str(tmp_path / "reg"))
    with pytest.raises(ValueError, match="recalibrate"):
        KVTCCodec.from_registry("toy@latest", 4.0, registry=str(tmp_path / "reg"), require_kernels=True)


def test_roundtrip_with_layer_sets_and_head_ranges_equals_reference():
    """Groups as (ordered layer set x KV head range): non-contiguous layers, heads split across groups."""
    from kvtc.artifacts.groups import FeatureGroup

    groups = [FeatureGroup((2, 0), (0, 1)), FeatureGroup((0, 2), (1, 3)), FeatureGroup((1,))]
    spec = synthetic_spec(3, 3, 8, groups=groups, sinks=2, window=3, kept=12, rope_theta=None, seed=5)
    keys, values = synthetic_cache(spec, 17, torch.float32, seed=2)
    codec = KVTCCodec(spec)
    for mode_blob in (codec.encode(keys, values),):
        k2, v2 = codec.decode(mode_blob)
        for orig, dec, stream in ((keys, k2, "keys"), (values, v2, "values")):
            assert torch.equal(dec[:, :, :2], orig[:, :, :2]) and torch.equal(dec[:, :, -3:], orig[:, :, -3:])
            assert torch.allclose(dec[:, :, 2:-3], reference_reconstruction(spec, orig, stream, 0), atol=1e-5)


def test_groups_must_cover_every_layer_and_head_once():
    from kvtc.artifacts.groups import FeatureGroup

    with pytest.raises(ValueError, match="layer 0 head 1 is in two groups"):
        synthetic_spec(2, 2, 8, groups=[FeatureGroup((0, 1)), FeatureGroup((0,), (1, 2))], kept=4)
    with pytest.raises(ValueError, match="missing"):
        synthetic_spec(2, 2, 8, groups=[FeatureGroup((0, 1), (0, 1))], kept=4)


def test_a_fixed_rate_blob_stores_the_code_bits_its_allocation_is_charged():
    """The allocator charges a block's codes as the fixed-rate mode stores them (artifacts/blocks.code_bits), each
    token's row padded to whole bytes: a 1-component int2 block stores 8 bits, not 2 (an allocation of many such
    blocks, as a capped basis at CR 8 chooses, came out over its budget). Side information too: two fp16 params per
    token for a min/max block, the fp16 scale alone for an fp8 block (blob format fixed-grouped)."""
    for seed in (4, 22):  # odd sizes of every type; seed 22 draws fp8 blocks in both streams
        spec = synthetic_spec(2, 2, 8, 8.0, kept=29, sinks=0, window=0, seed=seed)
        _check_stored_bits(spec, 11)


def _check_stored_bits(spec, tokens):
    from kvtc.artifacts.blocks import code_bits, scale_bits
    from kvtc.kernels.codec.blob import TAG_PARAMS

    keys, values = synthetic_cache(spec, tokens, torch.float32)
    _, sections = read_blob(KVTCCodec(spec, mode="fixed", level=0).encode(keys, values))
    for si, stream in enumerate(("keys", "values")):
        blocks = [b for b in spec.streams[stream][0].blocks if b.qtype != "none"]
        codes = sum(s.raw_len for s in sections if s.key.tag == TAG_CODES and s.key.stream == si)
        params = sum(s.raw_len for s in sections if s.key.tag == TAG_PARAMS and s.key.stream == si)
        assert codes * 8 == tokens * sum(code_bits(b.qtype, b.size) for b in blocks)
        assert params * 8 == tokens * sum(scale_bits(b.qtype) for b in blocks)
