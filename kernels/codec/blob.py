"""The self-describing blob: fixed prefix, CRC-checked metadata with a section table, payloads.

Layout (little endian):
  prefix   16 bytes, in either version (so a blob's size never depends on it):
           version 2 (written) "<4sHBBII": magic b"KVTC", format version 2, format code (u8), option bits (u8),
             meta length, CRC32 of meta;
           version 1 (still decoded; written where asked, for readers older than version 2) "<4sHHII": magic,
             format version 1, flag bits (u16), meta length, CRC32 of meta.
           Both say the same (the table below), and the bytes after the prefix are the same in either version.
  meta     name, version, model id (each u16 length + UTF-8), then "<dBIIIIQIIIII": ratio, dtype code,
           layers, kv_heads, tokens, head_dim, start position, sinks, window, raw head tokens,
           raw tail tokens, section count; then per section "<BBHHBQQI": tag, stream, group, block,
           coding, stored length, raw length, CRC32 of the stored bytes
  payloads the sections' stored bytes, in table order, nothing after them
Parsing uses struct with explicit bounds checks; every failure is a BlobError. A section's raw length
is bounded by its stored bytes (equal when plain, at most DEFLATE's expansion when deflated), so no
declared size is believed beyond what the bytes given can hold.

Flags (`FLAGS`, the one table: writing, reading, the legality rule and this list derive from it). A blob has one
format code, how its coded middle is stored, and a set of option bits. Each row: its version-2 code or bit, its
version-1 bits (a version-1 blob's format is the row whose bits equal its bits 0x25), its name, the modes it
applies to, whether a per-layer container may carry it, and what it means:

  format code 0  v1 0x00  fixed-blocks (fixed): fixed-rate, two sections per block (TAG_PARAMS, TAG_CODES), an fp8
      block's params an fp16 shift of 0 and its scale; what the codec wrote before fixed-grouped, still decoded
  format code 1  v1 0x20  fixed-grouped (fixed, not in a container): fixed-rate, each (stream, group)'s blocks share
      one TAG_PARAMS and one TAG_CODES section, an fp8 block's params its fp16 scale alone
      (kernels/codec/fixed_mode.py)
  format code 2  v1 0x01  ecsq-constriction (ecsq): ECSQ, per (stream, group) a TAG_ECSQ words section in
      constriction's ANS format (the first ECSQ format, host only), then its TAG_ESCAPES
  format code 3  v1 0x05  ecsq-rans (ecsq): ECSQ, the words in the interleaved rANS format (kernels/codec/rans.py)
  option bit 0x01  v1 0x02  layered (fixed/ecsq): a per-layer container (below)
  option bit 0x02  v1 0x08  int8-sinks (fixed/ecsq): the raw sinks (TAG_RAW_HEAD) stored as int8 codes with a
      float32 scale per token vector (kernels/codec/sinks_int8.py), else in the cache's dtype
  option bit 0x04  v1 0x10  outliers (fixed/ecsq, not in a container): the coded middle is followed by one
      TAG_OUTLIERS section per stream (kernels/codec/outliers.py)
  option bit 0x08  v1 0x40  truncated (ecsq, not in a container): some (stream, group)'s words code its first
      components alone (kernels/codec/ecsq.py)

Legality, the same rule in both versions (version 1's checks exactly): every option applies to the format's mode,
and a per-layer container's format and options are all allowed there. A reader refuses anything else, and any
code or bit it does not know, as "unknown flags" (a reader older than a flag refuses the blob).

Per-layer container (the layered option): a cache whose layers hold different token counts (sliding-window or
chunked layers, layers without a KV cache). Its header gives the model's layer count and the longest
layer's tokens and first position; a TAG_LAYOUT section holds each layer's token count (u32 little
endian; NO_CACHE for a layer without a KV cache), then one TAG_SEGMENT section per run of layers with
the same count (group = segment index), each a complete blob of those layers' groups alone, never
itself a container (containers do not nest). The container's format names its segments' mode alone (an ECSQ
container is written ecsq-constriction whatever its segments' symbol format).
"""
from __future__ import annotations

import struct
import textwrap
import zlib
from dataclasses import dataclass
from functools import reduce
from operator import or_
from typing import Any, NamedTuple

MAGIC = b"KVTC"
FORMAT_VERSION = 2  # what new blobs are written in
VERSIONS = (1, 2)  # what this reader decodes, and write_blob writes where asked
DTYPES = ("float16", "bfloat16", "float32", "float8_e4m3fn")  # fp8: latent caches as servers store them
TAG_RAW_HEAD, TAG_RAW_TAIL, TAG_PARAMS, TAG_CODES = 1, 2, 3, 4
TAG_ECSQ, TAG_ESCAPES = 5, 6  # ECSQ mode: per (stream, group) the ANS words, then the escaped symbols
TAG_LAYOUT, TAG_SEGMENT = 7, 8  # per-layer container: layer token counts, then one inner blob per segment
TAG_OUTLIERS = 9  # per stream: (layer, token) vectors of the coded middle stored int8 (kernels/codec/outliers.py)
NO_CACHE = 0xFFFFFFFF
# version 1's flag bits, by name (what each means, and its version-2 code or bit: FLAGS)
FLAG_ECSQ = 1
FLAG_LAYERED = 2
FLAG_RANS = 4
FLAG_SINKS_INT8 = 8
FLAG_OUTLIERS = 16
FLAG_GROUPED = 32
FLAG_TRUNCATED = 64
_PREFIX_V1 = struct.Struct("<4sHHII")
_PREFIX_V2 = struct.Struct("<4sHBBII")
_FIELDS = struct.Struct("<dBIIIIQIIIII")
_SECTION = struct.Struct("<BBHHBQQI")
_MAX_SECTIONS = 1 << 20
DEFLATE_MAX_RATIO = 1032  # DEFLATE's largest expansion (258-byte matches in ~2 bits); a section claiming
_DEFLATE_SLACK = 64       # more raw bytes per stored byte is refused before anything is inflated
_KINDS = ("format", "option")


class BlobError(ValueError):
    """A blob that cannot be decoded: corrupt, truncated, another format, artifact or model."""


@dataclass(frozen=True)
class BlobFlag:
    """One row of the flags table: a format code (one per blob: how its coded middle is stored) or an option bit.

    `fields` are the BlobHeader fields it sets (a format's `mode` is its one mode; an absent option leaves its
    fields at BlobHeader's defaults); `v1` its version-1 flag bits; `v2` its version-2 format code or option bit."""

    kind: str
    name: str
    fields: tuple[tuple[str, Any], ...]
    v1: int
    v2: int
    modes: tuple[str, ...]  # the modes it applies to
    container: bool  # whether a per-layer container may carry it
    meaning: str

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"a blob flag's kind must be one of {_KINDS}, got {self.kind!r}")
        if not self.modes or (self.kind == "format" and len(self.modes) != 1):
            raise ValueError(f"blob flag {self.name}: a format applies to one mode, an option to some, got {self.modes}")
        if not 0 <= self.v1 <= 0xFFFF or not 0 <= self.v2 <= 0xFF:
            raise ValueError(f"blob flag {self.name}: version-1 bits fit 16 bits, a version-2 code or bit 8")
        if self.kind == "option" and (not self.v1 or self.v1 & (self.v1 - 1) or not self.v2 or self.v2 & (self.v2 - 1)):
            raise ValueError(f"blob flag {self.name}: an option is one bit in each version")

    @property
    def header_fields(self) -> dict[str, Any]:
        return {"mode": self.modes[0], **dict(self.fields)} if self.kind == "format" else dict(self.fields)

    def describe(self) -> str:
        """Its line in the module docstring's table."""
        code = f"code {self.v2}" if self.kind == "format" else f"bit {self.v2:#04x}"
        where = "/".join(self.modes) + ("" if self.container else ", not in a container")
        return textwrap.fill(f"{self.kind} {code}  v1 {self.v1:#04x}  {self.name} ({where}): {self.meaning}", 116,
                             initial_indent="  ", subsequent_indent="      ", break_on_hyphens=False)


FORMATS = (
    BlobFlag("format", "fixed-blocks", (("grouped", False),), 0, 0, ("fixed",), True,
             "fixed-rate, two sections per block (TAG_PARAMS, TAG_CODES), an fp8 block's params an fp16 shift of 0 "
             "and its scale; what the codec wrote before fixed-grouped, still decoded"),
    BlobFlag("format", "fixed-grouped", (("grouped", True),), FLAG_GROUPED, 1, ("fixed",), False,
             "fixed-rate, each (stream, group)'s blocks share one TAG_PARAMS and one TAG_CODES section, an fp8 "
             "block's params its fp16 scale alone (kernels/codec/fixed_mode.py)"),
    BlobFlag("format", "ecsq-constriction", (("grouped", False), ("ecsq_format", "constriction")), FLAG_ECSQ, 2,
             ("ecsq",), True, "ECSQ, per (stream, group) a TAG_ECSQ words section in constriction's ANS format "
             "(the first ECSQ format, host only), then its TAG_ESCAPES"),
    BlobFlag("format", "ecsq-rans", (("grouped", False), ("ecsq_format", "rans")), FLAG_ECSQ | FLAG_RANS, 3,
             ("ecsq",), True, "ECSQ, the words in the interleaved rANS format (kernels/codec/rans.py)"),
)
MODES = tuple(dict.fromkeys(f.modes[0] for f in FORMATS))  # the codec's modes (kernels/codec/modes.py)
LAYERED = BlobFlag("option", "layered", (("layered", True),), FLAG_LAYERED, 1, MODES, True,
                   "a per-layer container (below)")
OPTIONS = (
    LAYERED,
    BlobFlag("option", "int8-sinks", (("sink_format", "int8"),), FLAG_SINKS_INT8, 2, MODES, True,
             "the raw sinks (TAG_RAW_HEAD) stored as int8 codes with a float32 scale per token vector "
             "(kernels/codec/sinks_int8.py), else in the cache's dtype"),
    BlobFlag("option", "outliers", (("outliers", True),), FLAG_OUTLIERS, 4, MODES, False,
             "the coded middle is followed by one TAG_OUTLIERS section per stream (kernels/codec/outliers.py)"),
    BlobFlag("option", "truncated", (("truncated", True),), FLAG_TRUNCATED, 8, ("ecsq",), False,
             "some (stream, group)'s words code its first components alone (kernels/codec/ecsq.py)"),
)
FLAGS = FORMATS + OPTIONS
FLAGS_BY_NAME = {f.name: f for f in FLAGS}
ECSQ_FORMATS = tuple(dict(f.fields)["ecsq_format"] for f in FORMATS if "ecsq_format" in dict(f.fields))
SINK_FORMATS = ("cache", *(dict(o.fields)["sink_format"] for o in OPTIONS if "sink_format" in dict(o.fields)))
_V1_FORMAT_BITS = reduce(or_, (f.v1 for f in FORMATS))
_V1_FORMATS = {f.v1: f for f in FORMATS}
_V1_OPTION_BITS = reduce(or_, (o.v1 for o in OPTIONS))
_V2_FORMATS = {f.v2: f for f in FORMATS}
_V2_OPTION_BITS = reduce(or_, (o.v2 for o in OPTIONS))


def flag_table() -> str:
    """The flags table as the module docstring lists it."""
    return "\n".join(f.describe() for f in FLAGS)


def illegal(fmt: BlobFlag, options: tuple[BlobFlag, ...]) -> str | None:
    """Why a blob cannot have format `fmt` with `options`, or None where it can: the one legality rule."""
    for o in options:
        if fmt.modes[0] not in o.modes:
            return f"{o.name} applies to {'/'.join(o.modes)} blobs, not {fmt.name}"
    if LAYERED in options:
        for f in (fmt, *options):
            if not f.container:
                return f"{f.name} is not allowed in a per-layer container"
    return None


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
    """What made the blob and the shape of the cache it holds (tokens counted from `start`). The last seven fields
    are the blob's flags (`flags`: its format and options in FLAGS)."""

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
        self.flags  # noqa: B018 - a ValueError naming the fields no legal format and options describe

    @property
    def flags(self) -> tuple[BlobFlag, tuple[BlobFlag, ...]]:
        """The blob's format and options (rows of FLAGS); ValueError where no legal set describes the header."""
        def holds(f: BlobFlag) -> bool:
            return all(getattr(self, k) == v for k, v in f.header_fields.items())

        found = [f for f in FORMATS if holds(f)]
        if not found:
            raise ValueError(f"no blob format stores a {self.mode} blob with grouped={self.grouped}: grouped block "
                             "sections belong to a fixed-rate blob")
        fmt, options = found[0], tuple(o for o in OPTIONS if holds(o))
        why = illegal(fmt, options)
        if why is not None:
            raise ValueError(f"a blob header with format {fmt.name} and options {[o.name for o in options]}: {why}")
        return fmt, options


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


def write_blob(header: BlobHeader, sections: list[Section], version: int = FORMAT_VERSION) -> bytes:
    """Serialize header and sections (stored bytes already entropy-coded) in format `version` (1: for readers older
    than version 2, the same bytes but the prefix's flags)."""
    if version not in VERSIONS or isinstance(version, bool):
        raise ValueError(f"blob format version must be one of {VERSIONS}, got {version!r}")
    meta = [_pack_str(header.name), _pack_str(header.version), _pack_str(header.model_id),
            _FIELDS.pack(header.ratio, DTYPES.index(header.dtype), header.layers, header.kv_heads, header.tokens,
                         header.head_dim, header.start, header.sinks, header.window, header.head_raw,
                         header.tail_raw, len(sections))]
    for s in sections:
        meta.append(_SECTION.pack(*s.key, s.coding, len(s.stored), s.raw_len, zlib.crc32(s.stored)))
    meta_b = b"".join(meta)
    fmt, options = header.flags
    if version == 1:
        prefix = _PREFIX_V1.pack(MAGIC, 1, reduce(or_, (o.v1 for o in options), fmt.v1), len(meta_b), zlib.crc32(meta_b))
    else:
        prefix = _PREFIX_V2.pack(MAGIC, 2, fmt.v2, reduce(or_, (o.v2 for o in options), 0), len(meta_b), zlib.crc32(meta_b))
    return b"".join([prefix, meta_b, *(bytes(s.stored) for s in sections)])


def _read_flags(version: int, prefix: memoryview) -> tuple[BlobFlag, tuple[BlobFlag, ...]]:
    """The format and options a prefix of `version` names; BlobError for an unknown or illegal set."""
    if version == 1:
        bits = _PREFIX_V1.unpack(prefix)[2]
        fmt, unknown = _V1_FORMATS.get(bits & _V1_FORMAT_BITS), bits & ~(_V1_FORMAT_BITS | _V1_OPTION_BITS)
        said = f"{bits:#x}"
        if fmt is None or unknown:
            raise BlobError(f"blob has unknown flags {said}")
        options = tuple(o for o in OPTIONS if bits & o.v1)
    else:
        _, _, code, bits, _, _ = _PREFIX_V2.unpack(prefix)
        fmt, said = _V2_FORMATS.get(code), f"(format code {code}, option bits {bits:#x})"
        if fmt is None or bits & ~_V2_OPTION_BITS:
            raise BlobError(f"blob has unknown flags {said}: this reader knows format codes {sorted(_V2_FORMATS)} "
                            f"and option bits {_V2_OPTION_BITS:#x}")
        options = tuple(o for o in OPTIONS if bits & o.v2)
    why = illegal(fmt, options)
    if why is not None:
        raise BlobError(f"blob has unknown flags {said}: {why}")
    return fmt, options


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
    prefix = r.take(_PREFIX_V1.size)
    magic, fmt, _, meta_len, meta_crc = _PREFIX_V1.unpack(prefix)
    if magic != MAGIC:
        raise BlobError(f"not a KVTC blob (magic {bytes(magic)!r}, expected {MAGIC!r})")
    if fmt not in VERSIONS:
        raise BlobError(f"blob format version {fmt} is not supported by this reader (versions {VERSIONS}); "
                        "decode it with the kernels release that wrote it")
    code, options = _read_flags(fmt, prefix)
    r.what = "metadata"
    meta = r.take(meta_len)
    if zlib.crc32(meta) != meta_crc:
        raise BlobError("blob metadata checksum mismatch: the blob is corrupt")
    m = _Reader(meta, "metadata")
    name, version, mid = m.string(), m.string(), m.string()
    f = m.unpack(_FIELDS)
    if f[1] >= len(DTYPES):
        raise BlobError(f"blob has unknown dtype code {f[1]}")
    flag_fields = {k: v for o in (code, *options) for k, v in o.header_fields.items()}
    header = BlobHeader(name, version, mid, f[0], DTYPES[f[1]], *f[2:11], **flag_fields)
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
