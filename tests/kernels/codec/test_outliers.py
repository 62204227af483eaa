"""Outlier vectors (kernels/codec/outliers.py): the coded middle's worst (layer, token) vectors stored int8 inside
the budget, and their place in the blob (the outliers option, one TAG_OUTLIERS section per stream)."""
import struct

import pytest
import torch

from kvtc.kernels.codec import outliers
from kvtc.kernels.codec.blob import FLAG_LAYERED, FLAG_OUTLIERS, FLAGS_BY_NAME, TAG_OUTLIERS, BlobError, read_blob
from kvtc.kernels.codec.chunk_options import OUTLIER_FACTOR
from kvtc.kernels.codec.chunk_serde import ChunkTransform, unframe
from kvtc.kernels.codec.kvtc_codec import KVTCCodec


@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (3, 2, 7, 5), (2, 3, 4, 64)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 0.006), (torch.bfloat16, 0.01), (torch.float16, 0.006)])
def test_pack_and_unpack_put_each_vector_back_at_its_layer_and_token_on_odd_shapes(shape, dtype, tol):
    L, H, T, W = shape
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    index = torch.unique(torch.randint(0, L * T, (max(1, L * T // 2),), generator=g))
    data = outliers.pack(index, x)
    assert len(data) == len(index) * outliers.vector_bytes(H, W)
    got, vectors = outliers.unpack(data, L, H, T, W, dtype)
    assert torch.equal(got, index) and vectors.shape == (len(index), H, W) and vectors.dtype == dtype
    out = torch.zeros_like(x)
    outliers.scatter(got, vectors, out)
    layer, token = index // T, index % T
    mask = torch.zeros(L, T, dtype=torch.bool)
    mask[layer, token] = True
    assert not out.permute(0, 2, 1, 3)[~mask].any()  # nothing written elsewhere
    want, have = x[layer, :, token].float(), out[layer, :, token].float()
    step = want.abs().amax(-1, keepdim=True) / 127
    assert ((have - want).abs() <= step / 2 + want.abs() * tol).all()
    assert outliers.unpack(b"", L, H, T, W, dtype)[1].shape == (0, H, W)


def test_a_forged_outlier_section_is_a_blob_error():
    L, H, T, W = 2, 2, 5, 3
    x = torch.randn(L, H, T, W)
    good = outliers.pack(torch.tensor([1, 6]), x)
    with pytest.raises(BlobError, match="whole number"):
        outliers.unpack(good[:-1], L, H, T, W, torch.float32)
    for index in ([6, 1], [3, 3], [1, L * T]):  # not increasing, repeated, beyond the coded tokens
        forged = struct.pack("<2I", *index) + good[8:]
        with pytest.raises(BlobError, match="increasing"):
            outliers.unpack(forged, L, H, T, W, torch.float32)
    forged = bytearray(good)
    forged[-4:] = struct.pack("<f", float("nan"))
    with pytest.raises(BlobError, match="int8"):
        outliers.unpack(bytes(forged), L, H, T, W, torch.float32)


def test_select_takes_the_vectors_coded_far_worse_than_their_stream_the_worst_first_within_the_budget():
    n, L, p_layer = 50, 3, 8
    g = torch.Generator().manual_seed(3)
    mean = torch.zeros(L * p_layer)
    feat = torch.randn(n, L * p_layer, generator=g)
    feat.view(n, L, p_layer)[7, 1] *= 0.05  # a short vector, as a mid-sequence sink's value
    feat.view(n, L, p_layer)[20, 2] *= 0.1
    noisy = feat + 0.2 * torch.randn(n, L * p_layer, generator=g)  # the same noise everywhere
    blocks = [outliers.errors(feat[a:b], noisy[a:b], mean, L) for a, b in ((0, 13), (13, 50))]  # as decode's blocks
    assert blocks[0][0].shape == (13, L)
    assert outliers.select(blocks, 2.5, 1000, 10).tolist() == [1 * n + 7, 2 * n + 20]
    assert outliers.select(blocks, 2.5, 19, 10).tolist() == [1 * n + 7]  # the shorter vector is the worse coded
    assert outliers.select(blocks, 2.5, 9, 10).tolist() == []
    assert outliers.select(blocks, 1000.0, 1000, 10).tolist() == []


def _cache_with_sinks_mid_sequence(spec, tokens: int):
    from helpers.synthetic import synthetic_cache

    keys, values = synthetic_cache(spec, tokens, torch.float32, start=0)
    values = values.clone()
    values[0, :, 9] *= 0.02  # short value vectors in the middle, as the embedded model's " " and " the"
    values[1, :, 14] *= 0.02
    return keys, values


def test_the_codec_stores_the_worst_vectors_int8_inside_the_budget_and_decode_writes_them_back():
    from helpers.ecsq_synthetic import synthetic_ecsq_spec

    spec = synthetic_ecsq_spec(2, 2, 8, 4.0, sinks=2, window=3)
    keys, values = _cache_with_sinks_mid_sequence(spec, 40)
    plain, kept = KVTCCodec(spec, outlier_factor=None), KVTCCodec(spec)
    assert kept.outlier_factor == OUTLIER_FACTOR and kept.uses_outliers
    old, new = plain.encode(keys, values), kept.encode(keys, values)
    outliers_bit = FLAGS_BY_NAME["outliers"].v2
    assert not read_blob(old)[0].outliers and not old[7] & outliers_bit
    header, sections = read_blob(new)
    assert header.outliers and new[7] & outliers_bit
    table = {s.key.tag: s for s in sections if s.key.tag == TAG_OUTLIERS and s.key.stream == 1}
    index, _ = outliers.unpack(bytes(table[TAG_OUTLIERS].stored), 2, 2, 40 - 2 - 3, 8, torch.float32)
    assert {(0 * 35 + 7), (1 * 35 + 12)} <= set(index.tolist())  # tokens 9 and 14 of the coded middle
    for codec in (plain, kept):  # decode follows the blob
        _, v = codec.decode(new)
        for layer, token in ((0, 9), (1, 14)):
            assert (v[layer, :, token] - values[layer, :, token]).norm() < 0.02 * values[layer, :, token].norm()
    _, v_old = plain.decode(old)
    assert (v_old[0, :, 9] - values[0, :, 9]).norm() > 0.5 * values[0, :, 9].norm()
    # paid from the budget: the middle is re-coded at the rest, the blob within the mode's bound
    t = ChunkTransform(kept, positions=True)
    data = t.serialize(torch.stack([x.permute(0, 2, 1, 3).reshape(2, 40, 16) for x in (keys, values)]), start=16)
    assert len(data) == t.serialized_size((2, 2, 40, 16), torch.float32)
    assert read_blob(unframe(data)[1])[0].outliers


def test_a_blob_whose_flag_and_sections_disagree_is_refused_and_bad_options_are_named():
    from helpers.ecsq_synthetic import synthetic_ecsq_spec

    spec = synthetic_ecsq_spec(2, 2, 8, 4.0, sinks=2, window=3)
    keys, values = _cache_with_sinks_mid_sequence(spec, 40)
    codec = KVTCCodec(spec)
    v2 = (7, FLAGS_BY_NAME["outliers"].v2, FLAGS_BY_NAME["layered"].v2)  # the flags' byte, the two bits
    for version, (at, outliers_bit, layered_bit) in ((1, (6, FLAG_OUTLIERS, FLAG_LAYERED)), (2, v2)):
        for factor in (OUTLIER_FACTOR, None):
            blob = KVTCCodec(spec, outlier_factor=factor, blob_version=version).encode(keys, values)
            forged = bytearray(blob)
            forged[at] ^= outliers_bit
            with pytest.raises(BlobError):
                codec.decode(bytes(forged))
            forged = bytearray(blob)
            forged[at] |= outliers_bit | layered_bit
            with pytest.raises(BlobError, match="unknown flags"):
                codec.decode(bytes(forged))
    for bad in (0, -1.0, float("inf"), float("nan"), True, "2.5"):
        with pytest.raises(ValueError, match="outlier_factor"):
            KVTCCodec(spec, outlier_factor=bad)
    fixed = KVTCCodec(spec, mode="fixed")
    assert not fixed.uses_outliers and not read_blob(fixed.encode(keys, values))[0].outliers  # exact sizes


def test_the_serving_integrations_take_the_outlier_factor_and_null_turns_it_off():
    from helpers.ecsq_synthetic import synthetic_ecsq_spec

    from kvtc.kernels.integrations.lmcache_ranks import RankedChunkTransforms

    spec = synthetic_ecsq_spec(2, 2, 8, 4.0, sinks=2, window=3)
    on = RankedChunkTransforms(KVTCCodec(spec), positions=True)
    off = RankedChunkTransforms(KVTCCodec(spec), positions=True, outlier_factor=None)
    assert on.default.codec.outlier_factor == OUTLIER_FACTOR and off.default.codec.outlier_factor is None
    keys, values = _cache_with_sinks_mid_sequence(spec, 40)
    kv = torch.stack([x.permute(0, 2, 1, 3).reshape(2, 40, 16) for x in (keys, values)])
    assert read_blob(on.default.encode(kv, start=16))[0].outliers
    assert not read_blob(off.default.encode(kv, start=16))[0].outliers


@pytest.mark.parametrize("fmt", ["rans", "constriction"])
def test_the_outlier_stage_reads_the_symbols_it_wrote_as_a_reader_decodes_them(monkeypatch, fmt):
    from helpers.ecsq_synthetic import synthetic_ecsq_spec

    from kvtc.kernels.codec import ecsq

    spec = synthetic_ecsq_spec(2, 2, 8, 4.0, sinks=2, window=3)
    keys, values = _cache_with_sinks_mid_sequence(spec, 40)
    codec = KVTCCodec(spec, ecsq_format=fmt)
    decoded = []
    decode = ecsq.decode_group_to
    monkeypatch.setattr(ecsq, "decode_group_to", lambda *a, **k: decoded.append(1) or decode(*a, **k))
    held = codec.encode(keys, values)
    assert read_blob(held)[0].outliers and not decoded  # the coded middle not decoded again to find them
    encode = ecsq.encode_group
    monkeypatch.setattr(ecsq, "encode_group", lambda *a, symbols=None, **k: encode(*a, **k))  # nothing handed back
    assert codec.encode(keys, values) == held and decoded  # read back from the sections: the same blob
