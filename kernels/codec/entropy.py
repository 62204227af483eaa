"""Per-section entropy coding: DEFLATE, stored plain when coding does not shrink the section.

Coding ids in the blob: 0 plain, 1 zlib stream (RFC 1950, CPU zlib), 2 raw DEFLATE (RFC 1951, as
nvCOMP's Deflate with BitstreamKind.RAW writes it). Every coding decodes on CPU with zlib, so a
blob written on a GPU host reads anywhere. Decoding never inflates past the declared raw length,
and `decode_sections` checks every declared raw length against its mode's bound first.
"""
from __future__ import annotations

import zlib

from kvtc.kernels.codec.blob import BlobError, Section, SectionBound, SectionKey

PLAIN, ZLIB, RAW_DEFLATE = 0, 1, 2
CODERS = ("zlib", "plain", "nvcomp")


def nvcomp_available() -> bool:
    """True when the optional nvCOMP package (nvidia-nvcomp-cu12) and a CUDA device are both present."""
    try:
        import torch  # noqa: PLC0415 - the light blob reader loads torch only for nvCOMP
        from nvidia import nvcomp  # noqa: F401, PLC0415 - optional (nvidia-nvcomp-cu12)
    except ImportError:
        return False
    return torch.cuda.is_available()


def _nvcomp_deflate(raw: bytes) -> bytes:
    """GPU DEFLATE via nvCOMP (raw RFC 1951 bitstream). Not exercised by CPU-only test runs."""
    import numpy as np  # noqa: PLC0415 - the nvCOMP path only: the light blob reader needs none of these
    import torch  # noqa: PLC0415 - as above
    from nvidia import nvcomp  # noqa: PLC0415 - as above (optional)

    codec = nvcomp.Codec(algorithm="Deflate", bitstream_kind=nvcomp.BitstreamKind.RAW)
    dev = torch.frombuffer(bytearray(raw), dtype=torch.uint8).cuda()
    return np.asarray(codec.encode(nvcomp.as_array(dev)).cpu()).tobytes()


def encode_section(raw: bytes, level: int = 1, coder: str = "zlib") -> tuple[int, bytes]:
    """raw bytes -> (coding id, stored bytes); plain when coding does not make it smaller."""
    if coder not in CODERS:
        raise ValueError(f"unknown entropy coder {coder!r}; expected one of {CODERS}")
    if coder == "plain" or level == 0 or not raw:
        return PLAIN, raw
    if coder == "nvcomp":
        if not nvcomp_available():
            raise RuntimeError("coder='nvcomp' needs a CUDA device and the nvidia-nvcomp package; use coder='zlib'")
        coding, packed = RAW_DEFLATE, _nvcomp_deflate(raw)
    else:
        coding, packed = ZLIB, zlib.compress(raw, level)
    return (coding, packed) if len(packed) < len(raw) else (PLAIN, raw)


def decode_section(coding: int, stored: bytes | memoryview, raw_len: int, what: str) -> bytes:
    """Inverse of encode_section; BlobError unless the payload inflates to exactly raw_len bytes."""
    if coding == PLAIN:
        if len(stored) != raw_len:
            raise BlobError(f"section {what}: plain payload has {len(stored)} bytes, table says {raw_len}")
        return bytes(stored)
    if coding not in (ZLIB, RAW_DEFLATE):
        raise BlobError(f"section {what}: unknown coding id {coding}")
    inflater = zlib.decompressobj(zlib.MAX_WBITS if coding == ZLIB else -zlib.MAX_WBITS)
    try:
        out = inflater.decompress(stored, raw_len)
        extra = inflater.decompress(inflater.unconsumed_tail, 1) if inflater.unconsumed_tail else b""
    except zlib.error as exc:
        raise BlobError(f"section {what}: corrupt DEFLATE data ({exc})") from exc
    if len(out) != raw_len or extra or not inflater.eof or inflater.unused_data:
        raise BlobError(f"section {what}: DEFLATE data does not inflate to exactly {raw_len} bytes")
    return out


def check_sections(sections: list[Section], bounds: list[SectionBound]) -> None:
    """BlobError unless the section table is exactly `bounds` (keys in order) and every declared raw
    length and coding is within its bound; the one check every blob mode's sections pass before inflating."""
    if len(sections) != len(bounds) or any(s.key != b.key for s, b in zip(sections, bounds)):
        raise BlobError("blob section table does not match the artifact's allocation for this ratio")
    for s, b in zip(sections, bounds):
        if s.raw_len > b.max_raw or (b.exact and s.raw_len != b.max_raw):
            raise BlobError(f"section {tuple(s.key)} declares {s.raw_len} raw bytes; its header allows "
                            f"{'exactly' if b.exact else 'at most'} {b.max_raw}: the blob is corrupt")
        if b.plain and s.coding != PLAIN:
            raise BlobError(f"section {tuple(s.key)} must be stored plain, has coding {s.coding}: the blob is corrupt")


def decode_sections(sections: list[Section], bounds: list[SectionBound]) -> dict[SectionKey, bytes]:
    """check_sections, then inflate each section to its (bounded) raw length."""
    check_sections(sections, bounds)
    return {s.key: decode_section(s.coding, s.stored, s.raw_len, str(tuple(s.key))) for s in sections}
