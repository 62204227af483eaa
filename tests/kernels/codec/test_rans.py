"""Interleaved rANS (kernels/codec/rans.py, kernels/codec/rans_numba.py, kernels/codec/rans_triton.py): tables, bit
identity of the numpy reference, the compiled host path and the Triton kernels (interpreter) on odd shapes, escapes,
codec blobs in both ECSQ formats, hostile sections, the work bound (words that cannot hold the declared symbols)."""
import dataclasses
import random
import struct
import time
import tracemalloc

import numpy as np
import pytest
import torch

from kvtc.artifacts.groups import FeatureGroup
from kvtc.kernels import BlobError, KVTCCodec, read_blob
from kvtc.kernels.codec import ecsq, rans
from kvtc.kernels.codec.blob import TAG_ECSQ, TAG_ESCAPES, Section, write_blob
from kvtc.kernels.codec.ecsq import EcsqGroup, SymbolModel
from kvtc.kernels.codec.rans_triton import decode_device, encode_device
from helpers.synthetic import synthetic_cache, synthetic_ecsq, synthetic_spec

CPU = torch.device("cpu")


def _gaussian_model(std: float, radius: int) -> SymbolModel:
    s = np.arange(-radius, radius + 1)
    p = np.exp(-0.5 * (s / std) ** 2)
    counts = np.maximum(np.round(p / p.sum() * (1 << 20)), 1).astype(np.int64)
    return SymbolModel(radius, np.append(counts, 3))


def _models() -> tuple[SymbolModel, ...]:
    return (_gaussian_model(0.3, 2), _gaussian_model(2.0, 12), _gaussian_model(40.0, 240), SymbolModel(0, np.array([5, 1])))


def _tables(kept: int, seed: int) -> tuple[rans.RansTables, np.ndarray]:
    rng = np.random.default_rng(seed)
    models = _models()
    model = rng.integers(0, len(models), size=kept)
    return rans.RansTables(models, model), np.array([0.3, 2.0, 40.0, 0.0])[model]


def _symbols(tokens: int, kept: int, seed: int, std: np.ndarray, escapes: int = 3) -> np.ndarray:
    rng = np.random.default_rng(seed)
    q = np.round(rng.standard_normal((tokens, kept)) * std).astype(np.int32)
    for _ in range(escapes if q.size else 0):
        q[rng.integers(tokens), rng.integers(kept)] = int(rng.choice([-1, 1]) * rng.integers(300, 1 << 30))
    return q


def test_quantized_frequencies_sum_to_the_total_and_keep_every_symbol():
    for counts in ([1, 1], [1 << 20, 1, 1, 1], list(range(1, 3000)), [7] * 9000):
        f = rans.quantize_counts(np.array(counts))
        assert f.sum() == rans.PROB_TOTAL and f.min() >= 1
    r, f = rans.model_frequencies(6000, np.ones(12002, dtype=np.int64))  # wider than MAX_RADIUS: tails escape
    assert r == rans.MAX_RADIUS and f.size == 2 * r + 2 and f.sum() == rans.PROB_TOTAL


@pytest.mark.parametrize("tokens,kept,lanes", [(1, 1, 1), (3, 5, None), (3, 5, 15), (129, 7, 5), (4097, 3, 64),
                                               (0, 4, None)])
def test_reference_and_triton_are_bit_identical(tokens, kept, lanes):
    tables, std = _tables(kept, tokens)
    q = _symbols(tokens, kept, tokens + kept, std)
    section, escapes = rans.encode(q, tables, lanes, reference=True)
    assert rans.compiled() is not None, "numba is a dependency: the compiled host path must import"
    assert rans.encode(q, tables, lanes) == (section, escapes)
    assert encode_device(torch.from_numpy(q), tables, lanes) == (section, escapes)
    np.testing.assert_array_equal(rans.decode(section, escapes, tokens, tables, reference=True), q)
    np.testing.assert_array_equal(rans.decode(section, escapes, tokens, tables), q)
    np.testing.assert_array_equal(decode_device(section, escapes, tokens, tables, CPU).numpy(), q)


def test_lane_count_follows_the_estimated_bits():
    tables, std = _tables(40, 1)
    assert rans.choose_lanes(0, tables) == 0 and rans.choose_lanes(1, tables) == 1
    est = 5000 * tables.bits.sum()
    assert rans.choose_lanes(5000, tables) == round(est / rans.LANE_BITS)
    q = _symbols(600, 40, 2, std)
    section, escapes = rans.encode(q, tables)
    np.testing.assert_array_equal(rans.decode(section, escapes, 600, tables), q)
    assert rans.Layout(section, 600, 40).lanes == rans.choose_lanes(600, tables)


def _mutations(section: bytes, rng: random.Random) -> list[bytes]:
    out = []
    for _ in range(60):
        b = bytearray(section)
        kind = rng.randrange(4)
        if kind == 0:
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        elif kind == 1:
            b = b[:rng.randrange(len(b))]
        elif kind == 2:
            i = rng.randrange(len(b) - 3)
            b[i:i + 4] = struct.pack("<I", rng.choice([0, 1, 0xFFFF, 0x10000, 0xFFFFFFFF, rng.getrandbits(32)]))
        else:
            b += bytes(rng.randrange(1, 6))
        out.append(bytes(b))
    return out


def test_hostile_sections_end_in_blob_error_or_a_consistent_decode():
    tables, std = _tables(6, 3)
    q = _symbols(40, 6, 4, std)
    section, escapes = rans.encode(q, tables, 6)
    rng = random.Random(0)
    outcomes = {"error": 0, "decoded": 0}
    for i, bad in enumerate(_mutations(section, rng)):
        for esc in (escapes, escapes[:-4] if escapes else b"\0\0\0\0"):
            try:
                ref = rans.decode(bad, esc, 40, tables, reference=True)
            except BlobError:
                ref = None
            try:
                fast = rans.decode(bad, esc, 40, tables)
            except BlobError:
                fast = None
            assert (ref is None) == (fast is None) and (ref is None or (ref == fast).all())
            if i % 6 == 0:  # a share through the Triton interpreter: same verdict, same symbols
                try:
                    dev = decode_device(bad, esc, 40, tables, CPU).numpy()
                except BlobError:
                    dev = None
                assert (ref is None) == (dev is None) and (ref is None or (ref == dev).all())
            outcomes["error" if ref is None else "decoded"] += 1
            if ref is not None:
                assert ref.shape == (40, 6) and rans.encode(ref, tables, 6)[1] == esc
    assert outcomes["error"] > 0


@pytest.fixture(scope="module")
def ecsq_codec_spec():
    return synthetic_ecsq(synthetic_spec(2, 2, 16, 4.0, kept=20, sinks=2, window=3))


def test_codec_writes_rans_blobs_and_still_reads_constriction_blobs(ecsq_codec_spec):
    keys, values = synthetic_cache(ecsq_codec_spec, 21, torch.float32)
    new = KVTCCodec(ecsq_codec_spec, mode="ecsq", rate_control=False)
    old = KVTCCodec(ecsq_codec_spec, mode="ecsq", rate_control=False, ecsq_format="constriction")
    blob_new, blob_old = new.encode(keys, values), old.encode(keys, values)
    assert read_blob(blob_new)[0].ecsq_format == "rans" and read_blob(blob_old)[0].ecsq_format == "constriction"
    k1, v1 = new.decode(blob_new)
    k2, v2 = new.decode(blob_old)  # decode follows the blob's format
    assert torch.equal(k1, k2) and torch.equal(v1, v2)
    tri = KVTCCodec(ecsq_codec_spec, mode="ecsq", rate_control=False, backend="triton")
    tri.device_entropy = True  # the device path, through the interpreter
    assert tri.encode(keys, values) == blob_new
    k3, v3 = tri.decode(blob_new)
    assert torch.allclose(k3, k1, atol=1e-5) and torch.allclose(v3, v1, atol=1e-5)


def test_codec_refuses_an_unknown_format_and_a_rans_flag_without_ecsq(ecsq_codec_spec):
    with pytest.raises(ValueError, match="ecsq_format"):
        KVTCCodec(ecsq_codec_spec, mode="ecsq", ecsq_format="lz4")
    keys, values = synthetic_cache(ecsq_codec_spec, 9, torch.float32)
    blob = bytearray(KVTCCodec(ecsq_codec_spec, mode="fixed", blob_version=1).encode(keys, values))
    blob[6:8] = struct.pack("<H", 4)  # version 1: the rANS flag without the ECSQ flag
    with pytest.raises(BlobError, match="unknown flags"):
        read_blob(bytes(blob))
    blob = bytearray(KVTCCodec(ecsq_codec_spec, mode="fixed").encode(keys, values))
    blob[6] = 4  # version 2: a format code past the table's
    with pytest.raises(BlobError, match="unknown flags .format code 4"):
        read_blob(bytes(blob))


def test_codec_fuzz_with_recomputed_checksums(ecsq_codec_spec):
    """Mutated rANS sections re-checksummed so they pass the CRCs: BlobError or a decode of the declared shape."""
    keys, values = synthetic_cache(ecsq_codec_spec, 30, torch.float32)
    codec = KVTCCodec(ecsq_codec_spec, mode="ecsq", rate_control=False)
    header, sections = read_blob(codec.encode(keys, values))
    rng = random.Random(1)
    idx = [i for i, s in enumerate(sections) if s.key.tag == TAG_ECSQ]
    errors = 0
    for _ in range(150):
        i = rng.choice(idx)
        stored = bytes(sections[i].stored)
        bad = stored[:4] + _mutations(stored[4:], rng)[0]  # keep the step exponent
        new = list(sections)
        new[i] = type(sections[i])(sections[i].key, sections[i].coding, len(bad), bad)
        try:
            k, v = codec.decode(write_blob(header, new))
            assert k.shape == keys.shape and v.shape == values.shape
        except BlobError:
            errors += 1
    assert errors > 100


def test_the_work_bound_holds_for_the_cheapest_streams():
    """Streams of each model's likeliest symbol cost the fewest bits: the words bound must still let them through."""
    models = (_gaussian_model(0.3, 2), _gaussian_model(0.05, 1), SymbolModel(0, np.array([1 << 20, 1])))
    for model in ([0], [1], [2], [0, 1, 2, 2]):
        tables = rans.RansTables(models, np.array(model))
        q = np.zeros((20000, len(model)), dtype=np.int32)
        for lanes in (-(-q.size // rans.MAX_LANE_SYMBOLS), 7, 1000):
            section, escapes = rans.encode(q, tables, lanes)
            layout = rans.Layout(section, q.shape[0], tables.kept, tables)
            assert 17 * int(layout.counts.sum()) + 16 * lanes >= q.shape[0] * tables.min_bits.sum()
            np.testing.assert_array_equal(rans.decode(section, escapes, q.shape[0], tables), q)


def _lane_table(lanes: int) -> bytes:
    """A section of `lanes` lanes, each at the encoder's initial state, and no words."""
    return struct.pack("<I", lanes) + struct.pack(f"<{lanes}I", *[rans.STATE_LOW] * lanes) + bytes(2 * lanes)


def test_a_small_section_declaring_many_symbols_is_refused_before_allocating():
    """Issue 28 item 5: a 27 KB lane table with no words, declaring 131,072 tokens at the embedded model's
    geometry (p = 5760, ~250 kept components), is refused in well under 2 s and 64 MB."""
    tables, _ = _tables(250, 5)
    group = EcsqGroup(FeatureGroup.span(0, 30), torch.zeros(5760), torch.zeros(5760, 250), 0.1,
                      tables.comp_model, torch.zeros(250, 1), _models())
    section = _lane_table(4500)
    assert 26_000 < len(section) < 28_000
    words = struct.pack("<i", ecsq.STREAM_FORMAT << 16) + section
    for decode in (lambda: ecsq.decode_group(words, b"", 131072, group, "rans"),
                   lambda: decode_device(section, b"", 131072, rans.group_tables(group), CPU)):
        tracemalloc.start()
        t0 = time.perf_counter()
        with pytest.raises(BlobError, match="words|cannot hold"):  # the container's capacity check, or the rANS bound
            decode()
        elapsed = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert elapsed < 1.0 and peak < 16 << 20, (elapsed, peak)


def test_codec_refuses_a_blob_whose_words_cannot_hold_its_tokens(ecsq_codec_spec):
    spec = dataclasses.replace(ecsq_codec_spec, sinks=0, window=0)
    codec = KVTCCodec(spec, mode="ecsq", rate_control=False)
    keys, values = synthetic_cache(spec, 8, torch.float32)
    header, sections = read_blob(codec.encode(keys, values))
    big = dataclasses.replace(header, tokens=131072)
    fake = []
    for s in sections:
        raw = struct.pack("<i", ecsq.STREAM_FORMAT << 16) + _lane_table(600) if s.key.tag == TAG_ECSQ else b""
        assert s.key.tag in (TAG_ECSQ, TAG_ESCAPES)
        fake.append(Section(s.key, 0, len(raw), raw))
    t0 = time.perf_counter()
    with pytest.raises(BlobError, match="words|cannot hold"):  # the container's capacity check, or the rANS bound
        codec.decode(write_blob(big, fake))
    assert time.perf_counter() - t0 < 1.0
