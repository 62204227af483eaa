"""Bases that are not orthonormal: an artifact may carry a decoder D beside its components E (a whitened
pair E = S U, D = S^-1 U with S symmetric positive definite, so D.T E = I). Encode z = (x - mean) @ E,
decode mean + z @ D.T, through storage, the registry, the codec (both modes, both backends), the
coefficient coder under KVTCCache, the chunk serde, and the exports; artifacts without decoders decode
as before."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from kvtc.artifacts import IntegrityError, publish, pull
from kvtc.artifacts import tables
from kvtc.artifacts.export import FORMAT, FORMAT_DECODER, DynamoExportOptions, export_dynamo
from kvtc.artifacts.manifest import build_files
from kvtc.artifacts.schema import STREAMS
from kvtc.kernels import KVTCCodec
from kvtc.kernels.codec.chunk_serde import ChunkTransform
from kvtc.kernels.codec.coefficients import CoefficientCoder
from kvtc.kernels.codec.spec import GroupCode
from helpers.toy_artifacts import forge_version, toy_content
from helpers.whitened import D, FULL, H, L, P, PARTIAL, WHITENED, features, whitened_content


def _cache(tokens: int, seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys, values) (L, H, T, D) float32 whose layer l rows are features' group l."""
    f = features(tokens, seed)
    return tuple(torch.stack([torch.from_numpy(f[s][l]).reshape(tokens, H, D).permute(1, 0, 2) for l in range(L)])
                 for s in STREAMS)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.fixture(scope="module")
def pulled(tmp_path_factory):
    """(artifact with decoders, the same bases with the decoders dropped, the content), pulled from a registry."""
    root = tmp_path_factory.mktemp("decoder") / "reg"
    content = whitened_content()
    art = pull(publish(content, root).name, registry=str(root))
    plain = pull(publish(dataclasses.replace(content, name="nodecoder", decoders={}), root).name, registry=str(root))
    return art, plain, content


# ---------------------------------------------------------------- storage and registry

def test_decoder_round_trips_through_publish_and_pull_trimmed_like_its_components(pulled):
    art, plain, content = pulled
    for key in WHITENED:
        entry = next(e for e in art.manifest["bases"]["entries"] if (e["stream"], e["group"]) == key)
        assert entry["decoder"] == f"bases/{key[0]}-g{key[1]}.decoder.parquet" and entry["decoder"] in art.manifest["files"]
        dec = art.decoder(*key)
        assert dec.dtype == np.float32 and dec.shape == art.basis(*key)[2].shape == (P, P)
        np.testing.assert_array_equal(dec, content.decoders[key])
        # D.T E = I: the pair reconstructs at full rank
        np.testing.assert_allclose(dec.T @ art.basis(*key)[2], np.eye(P), atol=1e-4)
    assert art.decoder("values", 1) is None
    assert all(plain.decoder(*key) is None for key in content.bases)
    assert not any("decoder" in rel for rel in plain.manifest["files"])


def test_decoder_is_trimmed_with_its_components():
    content = whitened_content(ecsq=False)
    partial = dataclasses.replace(content, allocations={k: v for k, v in content.allocations.items() if k[0] == PARTIAL},
                                  calibration={**content.calibration, "ratios": [PARTIAL]})
    files, parts = build_files(partial)
    entry = next(e for e in parts["bases"]["entries"] if (e["stream"], e["group"]) == ("keys", 0))
    k = entry["k"]
    assert k < P
    dec = tables.decode_decoder(files[entry["decoder"]], (P, k))
    np.testing.assert_array_equal(dec, content.decoders[("keys", 0)][:, :k])


def test_a_float16_artifact_stores_its_decoder_in_float16_and_reads_it_as_float32():
    content = dataclasses.replace(whitened_content(ecsq=False), bases_dtype="float16")
    files, parts = build_files(content)
    entry = next(e for e in parts["bases"]["entries"] if (e["stream"], e["group"]) == ("values", 0))
    dec = tables.decode_decoder(files[entry["decoder"]], (P, entry["k"]))
    want = content.decoders[("values", 0)][:, :entry["k"]]
    assert dec.dtype == np.float32
    np.testing.assert_array_equal(dec, want.astype(np.float16).astype(np.float32))


def test_a_float16_artifact_refuses_a_decoder_beyond_float16s_range():
    content = whitened_content(ecsq=False)
    big = {**content.decoders, ("keys", 0): content.decoders[("keys", 0)] * 1e5}
    with pytest.raises(ValueError, match="float16"):
        dataclasses.replace(content, bases_dtype="float16", decoders=big)
    dataclasses.replace(content, decoders=big)  # float32 holds it


def test_an_artifact_without_decoders_has_the_same_files_as_before():
    content = toy_content()
    assert content.decoders == {}
    files, parts = build_files(content)
    assert not any("decoder" in rel for rel in files)
    assert not any("decoder" in e for e in parts["bases"]["entries"])


@pytest.mark.parametrize("bad, message", [
    ({("keys", 0): np.zeros((P, 3), np.float32)}, "shape"),
    ({("keys", 0): np.full((P, P), np.nan, np.float32)}, "finite"),
    ({("keys", 7): np.zeros((P, P), np.float32)}, "no basis"),
])
def test_content_refuses_a_decoder_of_the_wrong_shape_values_or_basis(bad, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(whitened_content(ecsq=False), decoders=bad)


@pytest.mark.parametrize("payload, message", [
    (lambda: tables.encode_decoder(np.zeros((P, 3), np.float32), "float32"), "shape"),
    (lambda: tables.encode_decoder(np.full((P, P), np.inf, np.float32), "float32"), "non-finite"),
    (lambda: tables.encode_basis(np.zeros(P), np.zeros(P), np.eye(P), "float32")[1], "not what the manifest declares"),
])
def test_a_hostile_decoder_file_is_a_clear_error(tmp_path, monkeypatch, payload, message):
    from kvtc.artifacts import Registry

    monkeypatch.setenv("KVTC_CACHE", str(tmp_path / "cache"))
    reg = Registry(str(tmp_path / "reg"))
    ref = publish(whitened_content(ecsq=False), reg)
    rel = "bases/keys-g0.decoder.parquet"
    forge_version(reg, ref.name, ref.version, lambda m: None, files={rel: payload()})
    art = pull(ref.name, ref.version, registry=reg)
    with pytest.raises(ValueError, match=f"decoder file {rel} of basis \\(keys, 0\\) is unusable: .*{message}"):
        art.decoder("keys", 0)
    with pytest.raises(ValueError, match="unusable"):
        KVTCCodec(art, FULL)


def test_a_missing_decoder_file_is_refused_naming_it(pulled, tmp_path):
    import shutil

    from kvtc.artifacts import Artifact

    art, _, _ = pulled
    copy = tmp_path / "copy"
    shutil.copytree(art.path, copy)
    (copy / "bases/keys-g1.decoder.parquet").unlink()
    with pytest.raises(IntegrityError, match="bases/keys-g1.decoder.parquet is missing"):
        Artifact(copy)


def test_a_manifest_naming_an_unlisted_decoder_is_refused(tmp_path, monkeypatch):
    from kvtc.artifacts import Registry

    monkeypatch.setenv("KVTC_CACHE", str(tmp_path / "cache"))
    reg = Registry(str(tmp_path / "reg"))
    ref = publish(whitened_content(ecsq=False), reg)

    def unlist(m: dict) -> None:
        del m["files"]["bases/keys-g0.decoder.parquet"]

    forge_version(reg, ref.name, ref.version, unlist)
    with pytest.raises(IntegrityError, match="decoder"):
        pull(ref.name, ref.version, registry=reg)


def test_runtime_groups_refuse_a_decoder_of_another_shape():
    from kvtc.artifacts.groups import FeatureGroup

    with pytest.raises(ValueError, match="decoder"):
        GroupCode(FeatureGroup.span(0, 1), torch.zeros(4), torch.eye(4), (), torch.zeros(4, 3))
    with pytest.raises(ValueError, match="finite"):
        GroupCode(FeatureGroup.span(0, 1), torch.zeros(4), torch.eye(4), (), torch.full((4, 4), float("nan")))


# ---------------------------------------------------------------- runtime

def test_spec_carries_the_kept_decoder_through_for_rank_and_restrict(pulled):
    from kvtc.kernels.codec.layered import restrict

    art, _, _ = pulled
    codec = KVTCCodec(art, PARTIAL)
    g = codec.spec.streams["keys"][0]
    assert g.decoder is not None and g.decoder.shape == g.components.shape == (P, g.kept)
    torch.testing.assert_close(g.decoding, torch.from_numpy(art.decoder("keys", 0)[:, :g.kept]))
    assert codec.spec.streams["values"][1].decoder is None
    assert codec.spec.streams["values"][1].decoding is codec.spec.streams["values"][1].components
    assert restrict(codec.spec, [1]).streams["keys"][0].decoder is codec.spec.streams["keys"][1].decoder
    e = KVTCCodec(art, FULL).spec.ecsq["keys"][0]
    assert e.decoder is not None and e.decoding is e.decoder


def _middle_reference(codec: KVTCCodec, keys: torch.Tensor, values: torch.Tensor, mode: str, backend: str
                      ) -> list[torch.Tensor]:
    """The coded middle reconstructed by hand: the coefficient coder's dequantized z of the same middle
    (same quantizer, same budget), then mean + z @ D.T per group -> (L, H, mid, D) per stream."""
    head, mid, _ = codec.split(keys.shape[2], 0)
    coder = CoefficientCoder(codec.spec, backend, mode)
    middle = [x[:, :, head:head + mid].unsqueeze(1) for x in (keys, values)]  # (L, B=1, H, mid, D)
    coded = coder.encode(*middle, head)
    out = []
    for stream in STREAMS:
        codes = codec.spec.ecsq[stream] if mode == "ecsq" else codec.spec.streams[stream]
        layers = []
        for gi, g in enumerate(codes):
            z = coder.coefficients(coded, stream, gi)
            x = g.mean + z @ g.decoding[:, :z.shape[1]].T
            layers.append(x.reshape(mid, H, D).permute(1, 0, 2))
        out.append(torch.stack(layers))
    return out


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("mode", ["fixed", "ecsq"])
def test_codec_decodes_with_the_decoder(pulled, mode, backend):
    art, plain, _ = pulled
    keys, values = _cache(40)
    codec = KVTCCodec(art, FULL, mode=mode, backend=backend, outlier_factor=None)  # the resident coder keeps none
    got = codec.decode(codec.encode(keys, values))
    head, mid, _ = codec.split(40, 0)
    want = _middle_reference(codec, keys, values, mode, backend)
    for x, y, w in zip((keys, values), got, want):
        torch.testing.assert_close(y[:, :, :head], x[:, :, :head])
        torch.testing.assert_close(y[:, :, head:head + mid], w, rtol=1e-4, atol=1e-4)
        # full rank: D.T E = I, so only quantization separates the decode from the input
        assert _rel(y, x) < (0.02 if mode == "fixed" else 0.1)
    # the same coefficients decoded with the encoder (as if orthonormal) are far off
    wrong = KVTCCodec(plain, FULL, mode=mode, backend=backend)
    wrong.spec = dataclasses.replace(codec.spec, name=plain.name, version=plain.version,
                                     streams={s: tuple(dataclasses.replace(g, decoder=None) for g in gs)
                                              for s, gs in codec.spec.streams.items()},
                                     ecsq=None if codec.spec.ecsq is None else
                                     {s: tuple(dataclasses.replace(g, decoder=None) for g in gs)
                                      for s, gs in codec.spec.ecsq.items()})
    bad = wrong.decode(wrong.encode(keys, values))
    assert _rel(bad[0], keys) > 0.2


def test_codec_at_partial_rank_matches_the_reference(pulled):
    art, _, _ = pulled
    keys, values = _cache(40)
    codec = KVTCCodec(art, PARTIAL, mode="fixed", backend="torch")
    got = codec.decode(codec.encode(keys, values))
    head, mid, _ = codec.split(40, 0)
    want = _middle_reference(codec, keys, values, "fixed", "torch")
    for y, w in zip(got, want):
        torch.testing.assert_close(y[:, :, head:head + mid], w, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", ["fixed", "ecsq"])
def test_coefficient_decode_is_mean_plus_z_decoder_transposed(pulled, mode):
    """KVTCCache's path: a layer decoded from exact coefficients z = (x - mean) @ E is mean + z @ D.T = x."""
    art, _, _ = pulled
    keys, values = _cache(12)
    codec = KVTCCodec(art, FULL, mode=mode)
    coder = CoefficientCoder(codec.spec, "torch", mode)
    coded = coder.encode(keys.unsqueeze(1), values.unsqueeze(1), 0)
    for stream, x in zip(STREAMS, (keys, values)):
        codes = codec.spec.ecsq[stream] if mode == "ecsq" else codec.spec.streams[stream]
        for layer, g in enumerate(codes):
            f = x[layer].permute(1, 0, 2).reshape(12, P)
            z = (f - g.mean) @ g.components
            out = coder.decode_layer(coded, z, stream, layer, torch.float32)  # (B, H, n, D)
            ref = (g.mean + z @ g.decoding.T).reshape(12, H, D).permute(1, 0, 2)
            torch.testing.assert_close(out[0], ref, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(out[0], x[layer], rtol=1e-4, atol=1e-4)


def test_kvtc_cache_decodes_with_the_decoder(pulled):
    """KVTCCache's store round trip (CoefficientCoder encode -> coefficients -> decode_layer)."""
    art, _, _ = pulled
    keys, values = _cache(12)
    codec = KVTCCodec(art, FULL, mode="fixed")
    coder = CoefficientCoder(codec.spec, "torch", "fixed")
    coded = coder.encode(keys.unsqueeze(1), values.unsqueeze(1), 0)
    for stream, x in zip(STREAMS, (keys, values)):
        for layer in range(L):
            z = coder.coefficients(coded, stream, layer)
            out = coder.decode_layer(coded, z, stream, layer, torch.float32)[0]
            assert _rel(out, x[layer]) < 0.02


def test_chunk_serde_decodes_with_the_decoder(pulled):
    """The chunk path the LMCache server and the vLLM offload use: (2, L, T, H * D) chunks."""
    art, _, _ = pulled
    keys, values = _cache(24)
    kv = torch.stack([x.permute(0, 2, 1, 3).reshape(L, 24, H * D) for x in (keys, values)])
    for mode in ("fixed", "ecsq"):
        transform = ChunkTransform(KVTCCodec(art, FULL), mode=mode)
        assert transform.spec.streams["keys"][0].decoder is not None
        out = torch.empty_like(kv)
        transform.deserialize(memoryview(transform.serialize(kv)), out)
        assert _rel(out, kv) < (0.02 if mode == "fixed" else 0.1), mode


# ---------------------------------------------------------------- exports

def test_dynamo_export_carries_the_decoder(pulled, tmp_path):
    art, plain, _ = pulled
    options = DynamoExportOptions(layout="token", allow_rope_removed=True)
    doc = json.loads(export_dynamo(art, FULL, tmp_path / "d", options).read_text())
    assert doc["format"] == FORMAT_DECODER
    keys, values = _cache(16)
    for config in doc["configs"]:
        p, k = config["features"], config["pca_components"]
        mean = np.fromfile(tmp_path / "d" / config["mean"]["file"], dtype="<f4")
        proj = np.fromfile(tmp_path / "d" / config["projection"]["file"], dtype="<f4").reshape(p, k)
        key = (config["stream"], config["group"])
        if key not in WHITENED:
            assert "decoder" not in config
            continue
        dec = np.fromfile(tmp_path / "d" / config["decoder"]["file"], dtype="<f4").reshape(p, k)
        assert config["decoder"]["shape"] == [p, k]
        x = (keys if key[0] == "keys" else values)[key[1]].permute(1, 0, 2).reshape(16, P).numpy()
        np.testing.assert_allclose(((x - mean) @ proj) @ dec.T + mean, x, rtol=1e-3, atol=1e-3)
    doc = json.loads(export_dynamo(plain, FULL, tmp_path / "p", options).read_text())
    assert doc["format"] == FORMAT and not any("decoder" in c for c in doc["configs"])


def test_sglang_export_carries_the_decoder(tmp_path):
    from kvtc.artifacts.export_sglang import export_sglang

    content = whitened_content(name="wsg", ecsq=False)
    # one group over both layers: what an SGLang worker of TP 1, PP 1 loads
    p = 2 * P
    rng = np.random.default_rng(0)
    u, _ = np.linalg.qr(rng.standard_normal((p, p)))
    s = np.diag(rng.uniform(0.5, 2.0, p))
    bases = {(st, 0): (np.zeros(p, np.float32), np.ones(p, np.float32), (s @ u).astype(np.float32)) for st in STREAMS}
    allocs = {(r, st, 0): {"budget_bits": 8 * p, "blocks": [(0, 8, "int8", 8, 32)], "cost_bits": 96, "kept": 8}
              for r in (2.0,) for st in STREAMS}
    content = dataclasses.replace(content, calibration={**content.calibration, "groups": [[0, 2]], "ratios": [2.0]},
                                  bases=bases, allocations=allocs, ecsq={},
                                  decoders={("keys", 0): (np.linalg.inv(s) @ u).astype(np.float32)})
    root = tmp_path / "reg"
    art = pull(publish(content, root).name, registry=str(root))
    path = export_sglang(art, 2.0, tmp_path / "sg")
    payload = torch.load(path, weights_only=True)
    entry = payload["keys"]["tp_0_pp_0"]
    assert entry["decoder"].shape == entry["basis"].shape == (p, 8)
    np.testing.assert_allclose(entry["decoder"].numpy(), art.decoder("keys", 0)[:, :8])
    assert "decoder" not in payload["values"]["tp_0_pp_0"]
    doc = json.loads(path.with_suffix(".json").read_text())
    assert [r.get("decoder") for r in doc["streams"]] == [True, None]


def test_without_decoders_decode_uses_the_very_tensors_encode_does(pulled):
    """An orthonormal artifact decodes as before: the decode path gets the encode path's tensors, not copies."""
    _, plain, _ = pulled
    for mode in ("fixed", "ecsq"):
        codec = KVTCCodec(plain, FULL, mode=mode)
        for stream in STREAMS:
            assert codec._params(stream, torch.device("cpu"), codec.coding, decode=True) is \
                codec._params(stream, torch.device("cpu"), codec.coding)
        coder = CoefficientCoder(codec.spec, "torch", mode)
        assert coder._decoding("keys", 0, torch.device("cpu"), torch.float32) is \
            coder._group("keys", 0, torch.device("cpu"), torch.float32)[1]
    whitened = KVTCCodec(pulled[0], FULL, mode="fixed")
    whitened.encode(*_cache(12))
    held = whitened.basis_bytes()
    whitened.decode(whitened.encode(*_cache(12)))
    # decoding adds only the decoders: three whitened bases of P x P float32 (values g1 shares its components)
    assert whitened.basis_bytes() - held == 3 * P * P * 4


def test_kvtc_cache_update_returns_the_decoded_cache(pulled):
    """KVTCCache itself (a transformers Cache): tokens past the window come back decoded with the decoder."""
    transformers = pytest.importorskip("transformers")
    from kvtc.kernels import KVTCCache

    config = transformers.LlamaConfig(num_hidden_layers=L, num_attention_heads=H, num_key_value_heads=H,
                                      hidden_size=H * D, head_dim=D, intermediate_size=32, vocab_size=64)
    art, _, _ = pulled
    keys, values = _cache(60)  # a long coded span: ECSQ's rate control coarsens the step of short ones
    for mode in ("fixed", "ecsq"):
        cache = KVTCCache(KVTCCodec(art, FULL, mode=mode), config=config, chunk=4)
        for layer in range(L):
            cache.update(keys[layer].unsqueeze(0), values[layer].unsqueeze(0), layer)  # prefill: returned as given
        assert cache.coded_tokens > 0
        out = [cache.update(keys[l, :, :0].unsqueeze(0), values[l, :, :0].unsqueeze(0), l) for l in range(L)]
        for layer, (k, v) in enumerate(out):
            assert _rel(k[0], keys[layer]) < (0.02 if mode == "fixed" else 0.1), mode
            assert _rel(v[0], values[layer]) < (0.02 if mode == "fixed" else 0.1), mode
