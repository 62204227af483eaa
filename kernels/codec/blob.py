"""The self-describing blob: fixed prefix, CRC-checked metadata with a section table, payloads.

Layout (little endian):
  prefix   "<4sHHII": magic b"KVTC", format version, flags (bit 0: ECSQ mode; 0: fixed-rate mode;
           bit 1: per-layer container, see below; bit 2, with bit 0: ECSQ symbols in the interleaved
           rANS format, else constriction's; bit 3: the raw sinks (TAG_RAW_HEAD) stored as int8 codes with a
           float32 scale per token vector, kernels/codec/sinks_int8.py, else in the cache's dtype; bit 4: the
           coded middle is followed by one TAG_OUTLIERS section per stream, kernels/codec/outliers.py; bit 5,
           fixed-rate only: each (stream, group)'s blocks share one TAG_PARAMS and one TAG_CODES section, an fp8
           block's params its fp16 scale alone, kernels/codec/fixed_mode.py; else two sections per block, an fp8
           block's params an fp16 shift of 0 and its scale; bit 6, ECSQ only: some (stream, group)'s words code
           its first components alone, kernels/codec/ecsq.py), meta length, CRC32 of meta
  meta     name, version, model id (each u16 length + UTF-8), then "<dBIIIIQIIIII": ratio, dtype code,
           layers, kv_heads, tokens, head_dim, start position, sinks, window, raw head tokens,
           raw tail tokens, section count; then per section "<BBHHBQQI": tag, stream, group, block,
           coding, stored length, raw length, CRC32 of the stored bytes
  payloads the sections' stored bytes, in table order, nothing after them
Parsing uses struct with explicit bounds checks; every failure is a BlobError. A section's raw length
is bounded by its stored bytes (equal when plain, at most DEFLATE's expansion when deflated), so no
declared size is believed beyond what the bytes given can hold.

Per-layer container (flag bit 1): a cache whose layers hold different token counts (sliding-window or
chunked layers, layers without a KV cache). Its header gives the model's layer count and the longest
layer's tokens and first position; a TAG_LAYOUT section holds each layer's token count (u32 little
endian; NO_CACHE for a layer without a KV cache), then one TAG_SEGMENT section per run of layers with
the same count (group = segment index), each a complete blob of those layers' groups alone, never
itself a container (containers do not nest).
"""
from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import NamedTuple

MAGIC = b"KVTC"
FORMAT_VERSION = 1
DTYPES = ("float16", "bfloat16", "float32", "float8_e4m3fn")  # fp8: latent caches as servers store them
TAG_RAW_HEAD, TAG_RAW_TAIL, TAG_PARAMS, TAG_CODES = 1, 2, 3, 4
TAG_ECSQ, TAG_ESCAPES = 5, 6  # ECSQ mode: per (stream, group) the ANS words, then the escaped symbols
TAG_LAYOUT, TAG_SEGMENT = 7, 8  # per-layer container: layer token counts, then one inner blob per segment
TAG_OUTLIERS = 9  # per stream: (layer, token) vectors of the coded middle stored int8 (kernels/codec/outliers.py)
NO_CACHE = 0xFFFFFFFF
FLAG_ECSQ = 1
FLAG_LAYERED = 2
FLAG_RANS = 4
FLAG_SINKS_INT8 = 8
FLAG_OUTLIERS = 16
FLAG_GROUPED = 32
FLAG_TRUNCATED = 64
_FLAGS = FLAG_ECSQ | FLAG_LAYERED | FLAG_RANS | FLAG_SINKS_INT8 | FLAG_OUTLIERS | FLAG_GROUPED | FLAG_TRUNCATED
MODE_FLAGS = {"fixed": 0, "ecsq": FLAG_ECSQ}  # each codec mode's flag (kernels/codec/modes.py)
MODES = tuple(MODE_FLAGS)  # by flag bit 0
ECSQ_FORMATS = ("constriction", "rans")  # ECSQ symbol formats, by flag bit 2
SINK_FORMATS = ("cache", "int8")  # the raw sinks' format, by flag bit 3
_PREFIX = struct.Struct("<4sHHII")
_FIELDS = struct.Struct("<dBIIIIQIIIII")
_SECTION = struct.Struct("<BBHHBQQI")
_MAX_SECTIONS = 1 << 20
DEFLATE_MAX_RATIO = 1032  # DEFLATE's largest expansion (258-byte matches in ~2 bits); a section claiming
_DEFLATE_SLACK = 64       # more raw bytes per stored byte is refused before anything is inflated


class BlobError(ValueError):
    """A blob that cannot be decoded: corrupt, truncated, another format, artifact or model."""


class SectionKey(NamedTuple):
    tag: int
    stream: int
    group: int
    block: int


class SectionBound(NamedTuple):
    """What a blob's mode allows one section to be, derived from the header before anything is inflated:
    `max_raw` bytes at most (exactly, when `exact`), stored plain when `plain` (its bytes are the stream)."""

    key: SectionKey
    max_raw: int
    exact: bool = True
    plain: bool = False


@dataclass(frozen=True)
class BlobHeader:
    """What made the blob and the shape of the cache it holds (tokens counted from `start`)."""

    name: str
    version: str
    model_id: str
    ratio: float
    dtype: str
    layers: int
    kv_heads: int
    tokens: int
    head_dim: int
    start: int
    sinks: int
    window: int
    head_raw: int
    tail_raw: int
    mode: str = "fixed"
    layered: bool = False
    ecsq_format: str = "constriction"  # the ECSQ mode's symbol format; ignored by the fixed mode
    sink_format: str = "cache"  # the raw sinks' format: the cache's dtype, or int8 codes and a scale per vector
    outliers: bool = False  # the coded middle's worst (layer, token) vectors follow it, int8
    grouped: bool = False  # fixed-rate: one params and one codes section per (stream, group), fp8 params a scale
    truncated: bool = False  # ECSQ: some words sections code their group's first components alone

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"blob mode must be one of {MODES}, got {self.mode!r}")
        if self.ecsq_format not in ECSQ_FORMATS:
            raise ValueError(f"blob ECSQ format must be one of {ECSQ_FORMATS}, got {self.ecsq_format!r}")
        if self.sink_format not in SINK_FORMATS:
            raise ValueError(f"blob sink format must be one of {SINK_FORMATS}, got {self.sink_format!r}")
        if self.grouped and (self.mode != "fixed" or self.layered):
            raise ValueError("grouped block sections belong to a fixed-rate blob, not a container or an ECSQ blob")
        if self.truncated and (self.mode != "ecsq" or self.layered):
            raise ValueError("truncated ECSQ sections belong to an ECSQ blob, not a container or a fixed-rate blob")


@dataclass(frozen=True)
class Section:
    key: SectionKey
    coding: int
    raw_len: int
    stored: bytes | memoryview


def _pack_str(s: str) -> bytes:
    b = s.encode()
    if len(b) > 0xFFFF:
        raise ValueError(f"string field too long for a blob header ({len(b)} bytes)")
    return struct.pack("<H", len(b)) + b


def write_blob(header: BlobHeader, sections: list[Section]) -> bytes:
    """Serialize header and sections (stored bytes already entropy-coded)."""
    meta = [_pack_str(header.name), _pack_str(header.version), _pack_str(header.model_id),
            _FIELDS.pack(header.ratio, DTYPES.index(header.dtype), header.layers, header.kv_heads, header.tokens,
                         header.head_dim, header.start, header.sinks, header.window, header.head_raw,
                         header.tail_raw, len(sections))]
    for s in sections:
        meta.append(_SECTION.pack(*s.key, s.coding, len(s.stored), s.raw_len, zlib.crc32(s.stored)))
    meta_b = b"".join(meta)
    flags = MODE_FLAGS[header.mode] | (FLAG_LAYERED if header.layered else 0)
    if flags & FLAG_ECSQ and header.ecsq_format == "rans":
        flags |= FLAG_RANS
    if header.sink_format == "int8":
        flags |= FLAG_SINKS_INT8
    if header.outliers:
        flags |= FLAG_OUTLIERS
    if header.grouped:
        flags |= FLAG_GROUPED
    if header.truncated:
        flags |= FLAG_TRUNCATED
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, flags, len(meta_b), zlib.crc32(meta_b))
    return b"".join([prefix, meta_b, *(bytes(s.stored) for s in sections)])


class _Reader:
    def __init__(self, buf: memoryview, what: str) -> None:
        self.buf, self.pos, self.what = buf, 0, what

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise BlobError(f"truncated blob: {self.what} needs {n} bytes at offset {self.pos}, "
                            f"only {len(self.buf) - self.pos} left")
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def unpack(self, st: struct.Struct) -> tuple:
        return st.unpack(self.take(st.size))

    def string(self) -> str:
        (n,) = struct.unpack("<H", self.take(2))
        try:
            return bytes(self.take(n)).decode()
        except UnicodeDecodeError as exc:
            raise BlobError(f"corrupt blob: {self.what} has a string that is not UTF-8") from exc


def read_blob(data: bytes | bytearray | memoryview) -> tuple[BlobHeader, list[Section]]:
    """Parse and checksum a blob; raises BlobError naming what is wrong."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise BlobError(f"a blob must be bytes, got {type(data).__name__}")
    r = _Reader(memoryview(data).cast("B"), "prefix")
    magic, fmt, flags, meta_len, meta_crc = r.unpack(_PREFIX)
    if magic != MAGIC:
        raise BlobError(f"not a KVTC blob (magic {bytes(magic)!r}, expected {MAGIC!r})")
    if fmt != FORMAT_VERSION:
        raise BlobError(f"blob format version {fmt} is not supported by this reader (version {FORMAT_VERSION}); "
                        "decode it with the kernels release that wrote it")
    if flags & ~_FLAGS or (flags & FLAG_RANS and not flags & FLAG_ECSQ) or (flags & FLAG_OUTLIERS and flags & FLAG_LAYERED) \
            or (flags & FLAG_GROUPED and flags & (FLAG_ECSQ | FLAG_LAYERED)) \
            or (flags & FLAG_TRUNCATED and (flags & FLAG_LAYERED or not flags & FLAG_ECSQ)):
        raise BlobError(f"blob has unknown flags {flags:#x}")
    r.what = "metadata"
    meta = r.take(meta_len)
    if zlib.crc32(meta) != meta_crc:
        raise BlobError("blob metadata checksum mismatch: the blob is corrupt")
    m = _Reader(meta, "metadata")
    name, version, mid = m.string(), m.string(), m.string()
    f = m.unpack(_FIELDS)
    if f[1] >= len(DTYPES):
        raise BlobError(f"blob has unknown dtype code {f[1]}")
    header = BlobHeader(name, version, mid, f[0], DTYPES[f[1]], *f[2:11], mode=MODES[flags & FLAG_ECSQ],
                        layered=bool(flags & FLAG_LAYERED), ecsq_format=ECSQ_FORMATS[(flags & FLAG_RANS) >> 2],
                        sink_format=SINK_FORMATS[(flags & FLAG_SINKS_INT8) >> 3], outliers=bool(flags & FLAG_OUTLIERS),
                        grouped=bool(flags & FLAG_GROUPED),
                        truncated=bool(flags & FLAG_TRUNCATED))
    count = f[11]
    if count > _MAX_SECTIONS or count * _SECTION.size > len(meta) - m.pos:
        raise BlobError(f"blob section table declares {count} sections, metadata holds fewer")
    table = [m.unpack(_SECTION) for _ in range(count)]
    if m.pos != len(meta):
        raise BlobError("blob metadata has trailing bytes")
    sections = []
    r.what = "section payloads"
    for tag, stream, group, block, coding, stored_len, raw_len, crc in table:
        key = SectionKey(tag, stream, group, block)
        stored = r.take(stored_len)
        if zlib.crc32(stored) != crc:
            raise BlobError(f"section {tuple(key)} checksum mismatch: the blob is corrupt")
        if raw_len > (stored_len if coding == 0 else DEFLATE_MAX_RATIO * stored_len + _DEFLATE_SLACK):
            raise BlobError(f"section {tuple(key)} declares {raw_len} raw bytes, more than its {stored_len} stored "
                            "bytes can hold: the blob is corrupt")
        sections.append(Section(key, coding, raw_len, stored))
    if r.pos != len(r.buf):
        raise BlobError(f"blob has {len(r.buf) - r.pos} unexpected trailing bytes")
    return header, sections
