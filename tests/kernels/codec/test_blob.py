"""Blob format: self-description, refusals with clear errors, and fuzzing (flips, truncations)."""
import dataclasses
import random
import struct
import zlib

import pytest
import torch

from kvtc.kernels import FORMAT_VERSION, BlobError, KVTCCodec, read_blob
from kvtc.kernels.codec.blob import write_blob
from helpers.synthetic import synthetic_cache, synthetic_spec


@pytest.fixture(scope="module")
def small():
    spec = synthetic_spec(2, 1, 8, 4.0, sinks=2, window=3, kept=12, seed=8)
    keys, values = synthetic_cache(spec, 12, torch.float16, start=1, seed=9)
    codec = KVTCCodec(spec)
    return codec, codec.encode(keys, values, start=1), keys, values


def test_header_describes_the_blob(small):
    codec, blob, keys, _ = small
    header, sections = read_blob(blob)
    assert blob[:4] == b"KVTC" and struct.unpack_from("<H", blob, 4)[0] == FORMAT_VERSION
    assert (header.name, header.version, header.ratio, header.model_id) == ("synthetic", "v0", 4.0, "synthetic-8")
    assert (header.layers, header.kv_heads, header.tokens, header.head_dim) == tuple(keys.shape)
    assert (header.dtype, header.start, header.sinks, header.window) == ("float16", 1, 2, 3)
    assert (header.head_raw, header.tail_raw) == (1, 3)
    assert [(s.key, s.raw_len) for s in sections] == codec.expected_sections(header)
    assert issubclass(BlobError, ValueError)


def _codec_like(codec: KVTCCodec, **changes) -> KVTCCodec:
    return KVTCCodec(dataclasses.replace(codec.spec, **changes))


def test_refuses_other_artifact_model_and_format(small):
    codec, blob, _, _ = small
    with pytest.raises(BlobError, match="artifact synthetic@v0 at ratio 4"):
        _codec_like(codec, version="v1").decode(blob)
    with pytest.raises(BlobError, match="ratio"):
        _codec_like(codec, ratio=8.0).decode(blob)
    with pytest.raises(BlobError, match="model"):
        _codec_like(codec, model_id="other").decode(blob)
    newer = blob[:4] + struct.pack("<H", FORMAT_VERSION + 1) + blob[6:]
    with pytest.raises(BlobError, match=f"format version {FORMAT_VERSION + 1} is not supported"):
        codec.decode(newer)
    with pytest.raises(BlobError, match="not a KVTC blob"):
        codec.decode(b"PK\x03\x04" + blob[4:])
    with pytest.raises(BlobError, match="checksum"):
        codec.decode(blob[:-1] + bytes([blob[-1] ^ 1]))
    with pytest.raises(BlobError, match="trailing"):
        codec.decode(blob + b"\x00")
    with pytest.raises(BlobError, match="bytes"):
        codec.decode("not bytes")


def _decodes_cleanly(codec: KVTCCodec, data: bytes, shape) -> None:
    try:
        keys, values = codec.decode(data)
    except BlobError:
        return
    assert keys.shape == values.shape == shape


def test_fuzz_flips_and_truncations(small):
    codec, blob, keys, _ = small
    rng = random.Random(0)
    for i in range(3000):
        data = bytearray(blob)
        if i % 3 == 0:
            data = data[: rng.randrange(len(blob))]
        else:
            for _ in range(rng.choice([1, 1, 2, 8])):
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        _decodes_cleanly(codec, bytes(data), keys.shape)


def test_fuzz_with_valid_checksums_reaches_semantic_checks(small):
    codec, blob, keys, _ = small
    header, sections = read_blob(blob)
    rng = random.Random(1)
    fields = ["tokens", "start", "head_raw", "tail_raw", "layers", "dtype", "sinks", "window", "head_dim"]
    for _ in range(600):
        h, secs = header, [dataclasses.replace(s, stored=bytes(s.stored)) for s in sections]
        what = rng.randrange(4)
        if what == 0:
            name = rng.choice(fields)
            value = rng.choice(["float32", "bfloat16"]) if name == "dtype" else rng.choice([0, 1, 2, 5, 13, 2**31, 2**63 + 5])
            h = dataclasses.replace(h, **{name: value})
        elif what == 1 and secs:
            j = rng.randrange(len(secs))
            stored = bytearray(secs[j].stored)
            stored[rng.randrange(len(stored))] ^= 1 << rng.randrange(8)
            secs[j] = dataclasses.replace(secs[j], stored=bytes(stored))
        elif what == 2 and secs:
            j = rng.randrange(len(secs))
            secs[j] = dataclasses.replace(secs[j], coding=rng.randrange(4), raw_len=secs[j].raw_len + rng.choice([-1, 0, 1]))
        elif secs:
            secs.pop(rng.randrange(len(secs)))
        try:
            data = write_blob(h, secs)
        except (struct.error, ValueError):
            continue
        _decodes_cleanly(codec, data, keys.shape)


def test_zip_bomb_is_refused_without_inflating(small):
    codec, blob, _, _ = small
    header, sections = read_blob(blob)
    j = next(i for i, s in enumerate(sections) if s.raw_len > 8)
    bomb = zlib.compress(bytes(50_000_000), 9)
    sections[j] = dataclasses.replace(sections[j], coding=1, stored=bomb)
    with pytest.raises(BlobError, match="does not inflate"):
        codec.decode(write_blob(header, sections))


def _with_meta(blob: bytes, meta: bytes) -> bytes:
    """Replace a blob's metadata and recompute the prefix's length and CRC (payloads unchanged)."""
    magic, fmt, flags, meta_len, _ = struct.unpack_from("<4sHHII", blob)
    return struct.pack("<4sHHII", magic, fmt, flags, len(meta), zlib.crc32(meta)) + meta + blob[16 + meta_len:]


def test_fuzz_header_bytes_with_recomputed_crc(small):
    codec, blob, keys, _ = small
    meta_len = struct.unpack_from("<I", blob, 8)[0]
    meta = blob[16:16 + meta_len]
    rng = random.Random(2)
    outcomes = {"decoded": 0, "BlobError": 0}
    for i in range(2000):
        m = bytearray(meta)
        if i % 5 == 0:
            m = m[: rng.randrange(len(m))] if i % 10 else m + bytes(rng.randrange(1, 40))
        else:
            for _ in range(rng.choice([1, 1, 2, 4])):
                j = rng.randrange(len(m))
                m[j] = rng.randrange(256) if rng.random() < 0.5 else m[j] ^ (1 << rng.randrange(8))
        try:
            k, v = codec.decode(_with_meta(blob, bytes(m)))
        except BlobError:
            outcomes["BlobError"] += 1
            continue
        assert k.ndim == 4 and k.shape[:2] == keys.shape[:2] and k.shape[3] == keys.shape[3]
        outcomes["decoded"] += 1
    assert outcomes["BlobError"] > 1500


def test_declared_size_over_max_tokens_is_refused_before_allocating(small):
    codec, blob, _, _ = small
    header, _ = read_blob(blob)
    huge = write_blob(dataclasses.replace(header, tokens=200_000, head_raw=1, tail_raw=3), [])
    with pytest.raises(BlobError, match="200000 tokens, over this decoder's limit of 131072"):
        codec.decode(huge)
    with pytest.raises(BlobError, match="limit of 10"):
        codec.decode(blob, max_tokens=10)
    assert codec.decode(blob, max_tokens=12)[0].shape[2] == 12
    with pytest.raises(ValueError, match="max_tokens"):
        KVTCCodec(codec.spec, max_tokens=-1)


def test_only_the_blob_makes_a_blob_error(small, monkeypatch):
    """A failure the blob's bytes did not cause (a kernel, the device, a bug) is not reported as a bad blob."""
    codec, blob, _, _ = small

    def boom(*_args, **_kwargs):
        raise RuntimeError("kernel failed")

    monkeypatch.setattr("kvtc.kernels.codec.fixed_mode.params_from_bytes", boom)
    with pytest.raises(RuntimeError, match="kernel failed") as caught:
        codec.decode(blob)
    assert not isinstance(caught.value, BlobError)
