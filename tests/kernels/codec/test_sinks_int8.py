"""Raw sinks as int8 (kernels/codec/sinks_int8.py) and their place in the blob (the int8-sinks option)."""
import pytest
import torch

from kvtc.kernels.codec.blob import FLAGS_BY_NAME, BlobError, read_blob
from kvtc.kernels.codec.kvtc_codec import KVTCCodec
from kvtc.kernels.codec.sinks_int8 import int8_bytes, sinks_from_int8, sinks_to_int8


@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (3, 2, 5, 7), (2, 3, 4, 64)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 0.006), (torch.bfloat16, 0.01), (torch.float16, 0.006)])
def test_int8_sinks_round_trip_within_a_per_vector_step_on_odd_shapes(shape, dtype, tol):
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * torch.logspace(-2, 2, shape[-1])).to(dtype)
    x[..., 0, :] = 0  # a zero vector: scale 0, decoded exactly
    data = sinks_to_int8(x)
    assert len(data) == int8_bytes(*shape)
    y = sinks_from_int8(data, shape, dtype)
    assert y.dtype == dtype and y.shape == x.shape and not y[..., 0, :].any()
    step = x.float().abs().amax(-1, keepdim=True) / 127
    assert ((y.float() - x.float()).abs() <= step / 2 + x.float().abs() * tol).all()


def test_corrupt_int8_sinks_are_blob_errors():
    shape = (2, 1, 3, 4)
    data = bytearray(sinks_to_int8(torch.randn(shape)))
    for bad in (float("nan"), float("inf"), -1.0):
        forged = bytearray(data)
        forged[-4:] = torch.tensor([bad], dtype=torch.float32).numpy().tobytes()
        with pytest.raises(BlobError, match="int8 sink section"):
            sinks_from_int8(bytes(forged), shape, torch.float32)
    forged = bytearray(data)
    forged[0] = 0x80  # -128
    with pytest.raises(BlobError, match="int8 sink section"):
        sinks_from_int8(bytes(forged), shape, torch.float32)
    huge = bytearray(data)
    huge[-4:] = torch.tensor([1e38], dtype=torch.float32).numpy().tobytes()
    with pytest.raises(BlobError, match="beyond"):
        sinks_from_int8(bytes(huge), shape, torch.float16)


def test_the_codec_writes_int8_sinks_only_where_it_keeps_sinks_and_decode_follows_the_blob():
    from helpers.ecsq_synthetic import synthetic_ecsq_spec

    spec = synthetic_ecsq_spec(2, 2, 8, 4.0, sinks=2, window=3)
    keys, values = torch.randn(2, 2, 2, 20, 8).unbind(0)
    int8, cache = KVTCCodec(spec, sink_format="int8"), KVTCCodec(spec)
    blob = int8.encode(keys, values, start=0)
    header = read_blob(blob)[0]
    assert header.sink_format == "int8" and blob[7] & FLAGS_BY_NAME["int8-sinks"].v2
    assert len(blob) < len(cache.encode(keys, values, start=0))
    for codec in (int8, cache):  # either codec decodes it: the format is the blob's
        k, v = codec.decode(blob)
        assert (k[:, :, :2] - keys[:, :, :2]).norm() / keys[:, :, :2].norm() < 0.01
        assert torch.equal(k[:, :, -3:], keys[:, :, -3:])  # the window stays in the cache's dtype
    later = int8.encode(keys, values, start=8)  # no sinks in it: byte for byte the blob of before
    assert later == cache.encode(keys, values, start=8)
    with pytest.raises(ValueError, match="sink_format"):
        KVTCCodec(spec, sink_format="fp4")
