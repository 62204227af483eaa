"""The blob's flags (kernels/codec/blob.py's FLAGS table): every version-1 flag word reads as version 1's reader read
it, every version-2 (format code, option bits) pair as the version-1 word it stands for, and everything else is
refused as "unknown flags"; new blobs are version 2, version 1 written where asked."""
import struct
from dataclasses import fields, replace
from functools import reduce
from operator import or_

import pytest
import torch
from helpers.synthetic import synthetic_spec

from kvtc.kernels import KVTCCodec
from kvtc.kernels.codec import blob
from kvtc.kernels.codec.blob import (FLAGS, FLAGS_BY_NAME, FORMAT_VERSION, FORMATS, OPTIONS, TAG_SEGMENT, BlobError,
                                     BlobHeader, Section, SectionKey, read_blob, write_blob)

# version 2 as issue 56 gives it, beside the version-1 bits each code or bit stands for
V2_CODES = {0: 0x00, 1: 0x20, 2: 0x01, 3: 0x05}  # fixed per-block, fixed grouped, ECSQ constriction, ECSQ rANS
V2_BITS = {0x1: 0x02, 0x2: 0x08, 0x4: 0x10, 0x8: 0x40}  # container, int8 sinks, outliers, truncated

HEADER = BlobHeader("n", "v", "m", 4.0, "float16", 2, 1, 5, 8, 0, 1, 1, 1, 1)
SECTIONS = [Section(SectionKey(1, 0, 0, 0), 0, 3, b"abc")]


def _v1_reader(flags: int) -> dict | None:
    """Version 1's reader before version 2: the header fields a flag word gave, None where it was refused."""
    if flags & ~0x7F or (flags & 4 and not flags & 1) or (flags & 16 and flags & 2) or (flags & 32 and flags & 3) \
            or (flags & 64 and (flags & 2 or not flags & 1)):
        return None
    return {"mode": ("fixed", "ecsq")[flags & 1], "layered": bool(flags & 2),
            "ecsq_format": ("constriction", "rans")[(flags & 4) >> 2], "sink_format": ("cache", "int8")[(flags & 8) >> 3],
            "outliers": bool(flags & 16), "grouped": bool(flags & 32), "truncated": bool(flags & 64)}


def _flag_fields(header: BlobHeader) -> dict:
    return {k: getattr(header, k) for k in ("mode", "layered", "ecsq_format", "sink_format", "outliers", "grouped",
                                            "truncated")}


def _forged(version: int, flags: bytes) -> bytes:
    data = write_blob(HEADER, SECTIONS, version)
    return data[:6] + flags + data[8:]  # the prefix's flags are outside the metadata's checksum


def test_every_legal_version_1_flag_word_reads_as_before_and_round_trips_through_version_2():
    legal = 0
    for flags in (*range(1 << 8), *(1 << i | 1 for i in range(7, 16)), 0xFFFF):  # bits 7..15 are refused alone
        data, before = _forged(1, struct.pack("<H", flags)), _v1_reader(flags)
        if before is None:
            with pytest.raises(BlobError, match=f"unknown flags {flags:#x}"):
                read_blob(data)
            continue
        legal += 1
        header, sections = read_blob(data)
        assert _flag_fields(header) == before
        assert write_blob(header, sections, 1) == data
        new = write_blob(header, sections)
        assert new[:4] + new[8:] == data[:4] + data[8:] and read_blob(new)[0] == header
    assert legal == 6 + 4 + 10 + 10  # fixed-blocks, fixed-grouped, ECSQ constriction, ECSQ rANS, with their options


def test_every_version_2_code_and_bits_read_as_the_version_1_word_they_stand_for():
    legal = 0
    pairs = {(c, b) for c in (*range(6), 0x80, 0xFF) for b in range(256)} | {(c, 0) for c in range(256)}
    for code, bits in sorted(pairs):
        data = _forged(2, bytes([code, bits]))
        known = code in V2_CODES and not bits & ~0xF
        word = V2_CODES[code] | reduce(or_, (v1 for b, v1 in V2_BITS.items() if bits & b), 0) if known else None
        before = None if word is None else _v1_reader(word)
        if before is None:
            with pytest.raises(BlobError, match=rf"unknown flags \(format code {code}, option bits {bits:#x}\)"):
                read_blob(data)
            continue
        legal += 1
        header, sections = read_blob(data)
        assert _flag_fields(header) == before and write_blob(header, sections) == data
    assert legal == 30


def test_the_table_is_the_issues_and_the_module_docstring_lists_it():
    assert FORMAT_VERSION == 2 and blob.VERSIONS == (1, 2) and FLAGS == FORMATS + OPTIONS
    assert {f.v2: f.v1 for f in FORMATS} == V2_CODES and {o.v2: o.v1 for o in OPTIONS} == V2_BITS
    assert set(FLAGS_BY_NAME) == {f.name for f in FLAGS} and len(FLAGS_BY_NAME) == len(FLAGS)
    names = {f.name for f in fields(BlobHeader)}
    assert all(k in names for f in FLAGS for k in f.header_fields)
    format_bits = reduce(or_, (f.v1 for f in FORMATS))
    assert not format_bits & reduce(or_, (o.v1 for o in OPTIONS)) and f"bits equal its bits {format_bits:#x}" in blob.__doc__
    assert blob.flag_table() in blob.__doc__
    assert all(f"{f.name} (" in blob.flag_table() for f in FLAGS)


@pytest.mark.parametrize("version", [0, 3, 0xFFFF])
def test_an_unknown_version_is_refused_naming_it(version):
    data = write_blob(HEADER, SECTIONS)
    with pytest.raises(BlobError, match=f"format version {version} is not supported by this reader"):
        read_blob(data[:4] + struct.pack("<H", version) + data[6:])


def test_a_header_no_legal_flags_describe_and_an_unknown_version_are_refused_when_written():
    for changes, why in (({"mode": "ecsq", "grouped": True}, "grouped block sections belong to a fixed-rate blob"),
                         ({"grouped": True, "layered": True}, "fixed-grouped is not allowed in a per-layer container"),
                         ({"mode": "ecsq", "layered": True, "outliers": True}, "outliers is not allowed in a per-layer"),
                         ({"truncated": True}, "truncated applies to ecsq blobs, not fixed-blocks")):
        with pytest.raises(ValueError, match=why):
            replace(HEADER, **changes)
    for version in (0, 3, True, "2"):
        with pytest.raises(ValueError, match="blob format version must be one of"):
            write_blob(HEADER, SECTIONS, version)


def test_a_codec_writes_version_2_or_version_1_where_asked_its_segments_too_and_reads_both():
    spec = synthetic_spec(2, 1, 8, 4.0, groups=[(0, 1), (1, 2)], sinks=1, window=1, kept=6, seed=3)
    keys = [torch.randn(1, 6, 8, dtype=torch.float16), torch.randn(1, 4, 8, dtype=torch.float16)]
    values = [torch.randn(1, 6, 8, dtype=torch.float16), torch.randn(1, 4, 8, dtype=torch.float16)]
    out = {}
    for version in (1, 2):
        data = KVTCCodec(spec, backend="torch", mode="fixed", blob_version=version).encode(keys, values, start=0)
        header, sections = read_blob(data)
        segments = [bytes(s.stored) for s in sections if s.key.tag == TAG_SEGMENT]
        assert header.layered and segments and {struct.unpack_from("<H", b, 4)[0] for b in [data, *segments]} == {version}
        out[version] = KVTCCodec(spec, backend="torch", mode="fixed").decode(data)
    for a, b in zip(out[1], out[2]):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
