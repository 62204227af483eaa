"""Hostile ECSQ blobs (issue 21): inflation bombs, truncated and dry ANS streams, fuzzing; finite
reconstructions near the dtype's limit; a bad device is bad input."""
import dataclasses
import random
import struct
import zlib

import pytest
import torch

from kvtc.kernels.codec import rans
from kvtc.kernels import BlobError, KVTCCodec, read_blob
from kvtc.kernels.codec.blob import TAG_ECSQ, TAG_ESCAPES, Section, write_blob
from kvtc.kernels.codec.ecsq import decode_group, encode_symbols
from kvtc.kernels.codec.entropy import PLAIN, ZLIB
from helpers.synthetic import synthetic_cache, synthetic_spec
from helpers.ecsq_synthetic import synthetic_ecsq_spec


@pytest.fixture(scope="module", params=["constriction", "rans"])
def ecsq(request):
    spec = synthetic_ecsq_spec(2, 1, 8, 4.0)
    codec = KVTCCodec(spec, backend="torch", ecsq_format=request.param)
    keys, values = synthetic_cache(spec, 12, torch.float16, start=1, seed=9)
    assert codec.mode == "ecsq"
    return codec, codec.encode(keys, values, start=1), keys


def _replace(sections, key_tag, fn):
    return [fn(s) if s.key.tag == key_tag else s for s in sections]


def test_escapes_inflation_bomb_is_refused_before_inflating(ecsq):
    codec, blob, _ = ecsq
    header, sections = read_blob(blob)
    bomb = zlib.compress(b"\0" * (64 << 20), 9)  # 64 MiB of escapes in about 64 KB
    forged = _replace(sections, TAG_ESCAPES, lambda s: Section(s.key, ZLIB, 64 << 20, bomb))
    with pytest.raises(BlobError, match=r"declares 67108864 raw bytes; its header allows at most \d+"):
        codec.decode(write_blob(header, forged))
    # the words section is the ANS stream itself: stored plain, never inflated
    packed = _replace(sections, TAG_ECSQ, lambda s: Section(s.key, ZLIB, s.raw_len, zlib.compress(bytes(s.stored))))
    with pytest.raises(BlobError, match="must be stored plain"):
        codec.decode(write_blob(header, packed))
    # a long declared token count lifts the bound only as far as the symbols it declares
    big = dataclasses.replace(header, tokens=131072)
    bounds = {b.key: b.max_raw for b in codec.section_bounds(big, sections)}
    assert all(n <= 4 * 131072 * 16 + 64 for (tag, *_), n in bounds.items() if tag == TAG_ESCAPES)


def test_escapes_are_bounded_by_what_the_words_can_name(ecsq):
    codec, blob, _ = ecsq
    header, sections = read_blob(blob)
    bounds = {b.key: b.max_raw for b in codec.section_bounds(header, sections)}
    for s in sections:
        if s.key.tag == TAG_ESCAPES:
            words = next(w for w in sections if w.key == s.key._replace(tag=TAG_ECSQ))
            assert s.raw_len <= bounds[s.key] <= 4 * (8 * words.raw_len // 1 + 1)


def test_every_truncated_or_extended_ans_stream_is_refused(ecsq):
    codec, blob, _ = ecsq
    header, sections = read_blob(blob)
    words = next(s for s in sections if s.key.tag == TAG_ECSQ)
    body = bytes(words.stored)
    variants = [body[:n] for n in range(4, len(body), 4)]                     # cut at the end (the state)
    variants += [body[:4] + body[4 + n:] for n in range(4, len(body) - 4, 4)]  # cut at the bottom of the stack
    variants += [body + b"\1\0\0\0", body[:4] + b"\1\0\0\0" + body[4:]]        # leftover words
    for v in variants:  # checksums recomputed: only the stream's own end can tell
        forged = _replace(sections, TAG_ECSQ, lambda s: Section(s.key, PLAIN, len(v), v) if s.key == words.key else s)
        with pytest.raises(BlobError):
            codec.decode(write_blob(header, forged))


def test_a_tiny_blob_declaring_many_tokens_runs_dry(ecsq):
    codec, blob, _ = ecsq
    header, sections = read_blob(blob)
    long = dataclasses.replace(header, tokens=131072, head_raw=1, tail_raw=3)
    tail = [s for s in sections if s.key.tag == 2]
    forged = [Section(s.key, s.coding, s.raw_len, s.stored) for s in sections]
    assert tail  # raw sections keep their sizes: the tail is 3 tokens whatever the count
    with pytest.raises(BlobError, match="cannot hold|ran dry|does not end|lanes for"):
        codec.decode(write_blob(long, forged), max_tokens=131072)


def test_streams_from_before_end_of_stream_states_are_named(ecsq):
    codec, blob, _ = ecsq
    header, sections = read_blob(blob)
    old = _replace(sections, TAG_ECSQ, lambda s: Section(s.key, PLAIN, s.raw_len,
                                                         struct.pack("<i", 0) + bytes(s.stored)[4:]))
    with pytest.raises(BlobError, match="older release"):
        codec.decode(write_blob(header, old))


def _self_consistent(codec: KVTCCodec, data: bytes) -> bool:
    """Every ECSQ stream of the blob is exactly the encoding of the symbols it decodes to."""
    header, sections = read_blob(data)
    table = {s.key: bytes(s.stored) for s in sections}
    _, mid, _ = codec.split(header.tokens, header.start)
    for si, stream in enumerate(("keys", "values")):
        for gi, g in enumerate(codec.spec.ecsq[stream]):
            words, escapes = table[(TAG_ECSQ, si, gi, 0)], table[(TAG_ESCAPES, si, gi, 0)]
            q, _ = decode_group(words, escapes, mid, g, header.ecsq_format)
            if header.ecsq_format == "rans":
                tables = rans.group_tables(g)
                again = rans.encode(q, tables, rans.Layout(words[4:], mid, g.kept).lanes)
            else:
                again = encode_symbols(q, g)
            if again != (words[4:], escapes):
                return False
    return True


def test_fuzzed_ecsq_blobs_end_in_blob_error_or_a_consistent_decode(ecsq):
    codec, blob, keys = ecsq
    header, sections = read_blob(blob)
    coded = [s for s in sections if s.key.tag in (TAG_ECSQ, TAG_ESCAPES) and s.stored]
    rng = random.Random(21)
    outcomes = {"BlobError": 0, "decoded": 0}
    for i in range(300):
        kind = i % 3
        if kind == 0:
            data = blob[:rng.randrange(len(blob))]
        elif kind == 1:  # flipped bits in an ECSQ stream, checksums recomputed
            s = rng.choice(coded)
            b = bytearray(s.stored)
            for _ in range(rng.choice([1, 2, 8])):
                b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
            data = write_blob(header, [Section(x.key, x.coding, x.raw_len, bytes(b)) if x is s else x for x in sections])
        else:  # a hostile declared raw length, checksums recomputed
            s = rng.choice(sections)
            n = rng.choice([0, 1, max(0, s.raw_len - 1), s.raw_len + 4, 1 << 30, (1 << 63) - 1])
            data = write_blob(header, [Section(x.key, x.coding, n, x.stored) if x is s else x for x in sections])
        try:
            k, v = codec.decode(data)
        except BlobError:
            outcomes["BlobError"] += 1
            continue
        middle = slice(header.head_raw, header.tokens - header.tail_raw)
        assert k.shape == keys.shape and bool(torch.isfinite(k[:, :, middle]).all() and torch.isfinite(v[:, :, middle]).all())
        assert _self_consistent(codec, data)  # e.g. a flipped step exponent: another valid step
        outcomes["decoded"] += 1
    assert outcomes["BlobError"] >= 270, outcomes


@pytest.mark.parametrize("mode", ["ecsq", "fixed"])
@pytest.mark.parametrize("peak", [30000.0, 65504.0])
def test_fp16_near_its_limit_decodes_finite(mode, peak):
    """Values in [0.9, 1] x peak: a reconstruction a little above 65504 was cast to inf (ECSQ at a
    coarse rate-controlled step: thousands of them); both modes clamp to the dtype's finite range."""
    spec = synthetic_ecsq_spec(2, 1, 8, 16.0) if mode == "ecsq" else synthetic_spec(2, 1, 8, 4.0, sinks=2, window=3)
    codec = KVTCCodec(spec, backend="torch", mode=mode)
    g = torch.Generator().manual_seed(0)
    keys, values = (((torch.rand(2, 1, 200, 8, generator=g) * 0.1 + 0.9) * peak).half() for _ in range(2))
    assert bool(torch.isfinite(keys).all() and torch.isfinite(values).all())
    k, v = codec.decode(codec.encode(keys, values))
    assert int((~torch.isfinite(k)).sum() + (~torch.isfinite(v)).sum()) == 0


def test_a_bad_device_is_bad_input(ecsq):
    codec, blob, _ = ecsq
    with pytest.raises(ValueError, match="device='gpu0' is not a torch device") as info:
        codec.decode(blob, device="gpu0")
    assert not isinstance(info.value, (RuntimeError, BlobError))
    for unusable in ("meta", f"cuda:{torch.cuda.device_count() if torch.cuda.is_available() else 0}"):
        with pytest.raises(ValueError, match="is not available here") as info:
            codec.decode(blob, device=unusable)
        assert not isinstance(info.value, BlobError)
