"""One basis per artifact in a process: every ratio's and mode's components are views of the artifact's own matrix
(no copy per codec), a half-precision copy is made once per (basis, device, dtype) and shared, and coding through the
shared views gives the bytes private copies give."""
import dataclasses

import pytest
import torch

from helpers.toy_artifacts import toy_content
from kvtc.artifacts import publish, pull
from kvtc.kernels.codec.kvtc_codec import KVTCCodec


@pytest.fixture()
def art(tmp_path):
    content = toy_content(num_layers=2, num_kv_heads=2, head_dim=8, ratios=(4.0, 8.0))
    content.model["rope"] = {"rope_type": "default", "theta": 10000.0, "head_dim": 8, "rotary_dim": 8,
                             "inv_freq": [10000.0 ** (-2 * i / 8) for i in range(4)], "attention_scaling": 1.0,
                             "layout": "half"}
    publish(content, registry=str(tmp_path))
    return pull("toy@latest", registry=str(tmp_path))


def _storages(codec: KVTCCodec) -> set[int]:
    return {c.untyped_storage().data_ptr() for _, parts in codec._on_device.values() for _, c, _ in parts}


def test_every_ratio_and_mode_codes_with_views_of_one_basis(art):
    keys, values = torch.randn(2, 2, 200, 8), torch.randn(2, 2, 200, 8)
    four, eight = KVTCCodec(art, 4.0), KVTCCodec(art, 8.0)
    blobs = [c.encode(keys, values, start=0) for c in (four, eight)]
    held = _storages(four) | _storages(eight)
    assert len(held) == 2  # keys' and values' bases, each held once for both ratios
    widths = {c.shape[1] for codec in (four, eight) for _, parts in codec._on_device.values() for _, c, _ in parts}
    assert len(widths) >= 2  # each ratio its own leading columns
    # the same bytes as a codec holding private contiguous copies
    for codec, blob in zip((four, eight), blobs):
        spec = codec.spec
        private = dataclasses.replace(spec, streams={s: tuple(dataclasses.replace(g, components=g.components.clone())
                                                              for g in spec.streams[s]) for s in spec.streams})
        assert KVTCCodec(private, options=codec.options).encode(keys, values, start=0) == blob
        k, v = codec.decode(blob)
        assert k.shape == keys.shape and torch.isfinite(k).all() and torch.isfinite(v).all()


def test_a_half_precision_basis_is_converted_once_and_shared(art):
    keys, values = torch.randn(2, 2, 200, 8), torch.randn(2, 2, 200, 8)
    codecs = [KVTCCodec(art, r, basis_dtype=torch.float16, mode="fixed") for r in (4.0, 8.0)]
    for codec in codecs:
        k, _ = codec.decode(codec.encode(keys, values, start=0))
        assert torch.isfinite(k).all()
    dtypes = {c.dtype for codec in codecs for _, parts in codec._on_device.values() for _, c, _ in parts}
    assert dtypes == {torch.float16}
    assert _storages(codecs[0]) == _storages(codecs[1]) and len(_storages(codecs[0])) == 2
    assert codecs[0].basis_bytes() == codecs[1].basis_bytes()  # each counts the shared storage whole
