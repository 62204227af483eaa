"""The blob's bytes, pinned: a fixed cache coded with a tiny hand-built spec in each mode (and ECSQ symbol format)
hashes to what the codec wrote when this test was recorded. Every value is exact in float32 (an identity basis,
dyadic cache, mean and step, integer symbol counts, no RoPE, sections stored plain), so the bytes depend on the
wire format alone, not on a machine's BLAS or zlib. A change of format must change these, and a new format code or
option bit (or FORMAT_VERSION) must say it; the bytes written before a flag are pinned too, and still decode. Each is
pinned in both blob format versions: version 2 (written) and version 1 (still decoded, written where asked), which
differ in the prefix's flags alone. The chunk frame a store keeps around a blob (kernels/codec/chunk_frame.py: key
binding and identity) is pinned on the fixed-rate blob."""
from __future__ import annotations

import hashlib
from dataclasses import replace

import numpy as np
import pytest
import torch

from kvtc.artifacts.groups import FeatureGroup
from kvtc.kernels import FORMAT_VERSION, CodecSpec, KVTCCodec
from kvtc.kernels.codec.ecsq import EcsqGroup, SymbolModel
from kvtc.kernels.codec.spec import STREAMS, CodedBlock, GroupCode

L, H, D, T, RADIUS = 2, 2, 8, 21, 12
P = L * H * D
BLOCKS = (CodedBlock(0, 4, "fp8", 8), CodedBlock(4, 8, "int4", 4), CodedBlock(12, 4, "none", 0),
          CodedBlock(16, 8, "int2", 2))
PINNED = {  # (mode, ECSQ format, blob format version)
    ("fixed", "rans", 1): "c457c566cfe4012378187a24a1a096b79f0b0d26927ff135d2f35a237ee1fc40",
    ("ecsq", "rans", 1): "856171db23fce2b28328fb7b8e05ae7e4e0ce4e84da37dda587664835efef147",
    ("ecsq", "constriction", 1): "763798ab1d2a52189e5402c81e18225ba7269272221e31cbdcf94de0cbd337c4",
    ("fixed", "rans", 2): "9f604901fd1083ca61d96a5cc50dd65c1448164a6cd8245fb03eb472332131c2",
    ("ecsq", "rans", 2): "13380dc6552e05d8b1921d1d867823b140ba5258224514365e437679767dc499",
    ("ecsq", "constriction", 2): "5e164b31ccb017911273244b2c645fd2958bf241cba0e20c63347902e5c511f6",
}
PINNED_FIXED_BEFORE_GROUPED = {  # fixed, format fixed-blocks (version 1: flag bit 5 clear)
    1: "71b574cf7c3d5f78d6088c5acf13608a45277b0afd913d5588c41133eb50c191",
    2: "2edbbdd4e615c2ba950d007f8a978611b0e5cca395d5881f732c69120ff9f0f0",
}
PINNED_INT8_SINKS = {  # ECSQ, rANS, the raw sinks as int8 (the int8-sinks option)
    1: "cc694cb467595009571352ec9444c333853098294988c277fd7b1f1d459a35f1",
    2: "c7ab04068e3015f2d112e0d4cc34a796661d920db04c4d6cba62928e00aa05b5",
}


def _spec() -> CodecSpec:
    group = FeatureGroup.span(0, L)
    mean = torch.tensor([((i * 5) % 9 - 4) / 8 for i in range(P)], dtype=torch.float32)
    eye = torch.eye(P, dtype=torch.float32)
    counts = np.array([64 + 32 * (RADIUS - abs(s)) for s in range(-RADIUS, RADIUS + 1)] + [3], dtype=np.int64)
    models = (SymbolModel(RADIUS, counts), SymbolModel(2, np.array([1, 4, 9, 4, 1, 2], dtype=np.int64)))
    kept = 24
    model = np.array([0] * 16 + [1] * 8, dtype=np.int64)
    offsets = torch.full((kept, 2), 0.125)
    streams = {s: (GroupCode(group, mean, eye[:, :kept].contiguous(), BLOCKS),) for s in STREAMS}
    ecsq = {s: (EcsqGroup(group, mean, eye[:, :kept].contiguous(), 0.25, model, offsets, models, budget_bits=16 * P),)
            for s in STREAMS}
    return CodecSpec(name="pin", version="v1", ratio=4.0, model_id="pin-model", num_layers=L, kv_heads=H, head_dim=D,
                     sinks=2, window=3, rope=None, streams=streams, ecsq=ecsq)


def _cache() -> tuple[torch.Tensor, torch.Tensor]:
    """Dyadic values in [-4, 4] from a formula (no random generator whose stream could change)."""
    def stream(a: int, b: int) -> torch.Tensor:
        v = [((t * a + i * b + t * i) % 129 - 64) / 16 for t in range(T) for i in range(P)]
        return torch.tensor(v, dtype=torch.float32).reshape(T, L, H, D).permute(1, 2, 0, 3).contiguous()

    return stream(37, 11), stream(23, 7)


def _blob(mode: str, fmt: str, version: int = FORMAT_VERSION) -> bytes:
    codec = KVTCCodec(_spec(), backend="torch", level=0, mode=mode, ecsq_format=fmt, blob_version=version)
    return codec.encode(*_cache(), start=1)  # one raw sink token, three raw window tokens


@pytest.mark.parametrize("mode, fmt, version", sorted(PINNED))
def test_blob_bytes_are_pinned(mode, fmt, version):
    blob = _blob(mode, fmt, version)
    assert hashlib.sha256(blob).hexdigest() == PINNED[(mode, fmt, version)]
    keys, values = KVTCCodec(_spec(), backend="torch", mode=mode).decode(blob)
    k0, v0 = _cache()
    assert torch.equal(keys[:, :, :1], k0[:, :, :1]) and torch.equal(values[:, :, -3:], v0[:, :, -3:])
    assert keys.shape == k0.shape and bool(torch.isfinite(keys).all() and torch.isfinite(values).all())


@pytest.mark.parametrize("version", sorted(PINNED_INT8_SINKS))
def test_int8_sink_blob_bytes_are_pinned(version):
    codec = KVTCCodec(_spec(), backend="torch", level=0, mode="ecsq", ecsq_format="rans", sink_format="int8",
                      blob_version=version)
    blob = codec.encode(*_cache(), start=1)
    assert hashlib.sha256(blob).hexdigest() == PINNED_INT8_SINKS[version]
    keys, _ = KVTCCodec(_spec(), backend="torch").decode(blob)
    k0, _ = _cache()
    step = k0[:, :, :1].abs().amax(-1, keepdim=True) / 127  # each sink vector within half its int8 step
    assert ((keys[:, :, :1] - k0[:, :, :1]).abs() <= step / 2 * 1.001).all()


def test_a_fixed_rate_blob_written_before_grouped_sections_still_decodes():
    """Format fixed-grouped (version 1: flag bit 5): a new fixed-rate blob holds one params and one codes section per
    (stream, group), an fp8 block's params its fp16 scale alone (2 bytes per token, as the allocator charges it). The
    same blob cut into two sections per block, a zero fp16 shift beside each fp8 scale, format fixed-blocks, is byte
    for byte (in version 1) what the codec wrote before the flag; it decodes to the same cache."""
    from kvtc.kernels.codec.bitpack import packed_nbytes
    from kvtc.kernels.codec.blob import FLAGS_BY_NAME, TAG_CODES, TAG_PARAMS, Section, SectionKey, read_blob, write_blob

    new = _blob("fixed", "rans")
    header, sections = read_blob(new)
    assert header.grouped and new[6] == FLAGS_BY_NAME["fixed-grouped"].v2
    mid = T - 1 - 3  # one raw sink, three raw window tokens
    assert sum(1 for s in sections if s.key.tag in (TAG_PARAMS, TAG_CODES)) == 2 * len(STREAMS)
    old_sections = []
    for s in sections:
        if s.key.tag == TAG_CODES:
            continue
        if s.key.tag != TAG_PARAMS:
            old_sections.append(s)
            continue
        params = bytes(s.stored)
        codes = bytes(next(c.stored for c in sections if c.key == s.key._replace(tag=TAG_CODES)))
        po = co = 0
        for bi, b in enumerate(BLOCKS):
            if not b.bits:
                continue
            pn, cn = mid * (2 if b.qtype == "fp8" else 4), mid * packed_nbytes(b.size, b.bits)
            p = params[po:po + pn]
            p = bytes(pn) + p if b.qtype == "fp8" else p  # the shift's two byte planes, all 0, before the scale's
            key = SectionKey(TAG_PARAMS, s.key.stream, s.key.group, bi)
            old_sections += [Section(key, s.coding, len(p), p),
                             Section(key._replace(tag=TAG_CODES), s.coding, cn, codes[co:co + cn])]
            po, co = po + pn, co + cn
        assert (po, co) == (len(params), len(codes))
    codec = KVTCCodec(_spec(), backend="torch", mode="fixed")
    for version, pinned in PINNED_FIXED_BEFORE_GROUPED.items():
        old = write_blob(replace(header, grouped=False), old_sections, version)
        assert hashlib.sha256(old).hexdigest() == pinned
        for a, b in zip(codec.decode(new), codec.decode(old)):
            assert torch.equal(a, b)
        assert len(new) < len(old)


@pytest.mark.parametrize("mode, fmt", sorted({k[:2] for k in PINNED}))
def test_the_two_versions_of_a_blob_differ_in_the_prefix_flags_alone(mode, fmt):
    from kvtc.kernels.codec.blob import read_blob

    old, new = _blob(mode, fmt, 1), _blob(mode, fmt, 2)
    assert len(old) == len(new) and old[:4] == new[:4] and old[8:] == new[8:]
    assert (old[4:6], new[4:6]) == (b"\x01\x00", b"\x02\x00")
    assert read_blob(old)[0] == read_blob(new)[0]


@pytest.mark.parametrize("mode", ["ecsq", "layered"])
def test_the_grouped_flag_outside_a_plain_fixed_rate_blob_is_refused(mode):
    from kvtc.kernels.codec.blob import FLAG_ECSQ, FLAG_GROUPED, FLAG_LAYERED, FLAGS_BY_NAME, BlobError, read_blob

    forged = bytearray(_blob("ecsq" if mode == "ecsq" else "fixed", "rans", 1))
    forged[6] |= FLAG_GROUPED | (FLAG_ECSQ if mode == "ecsq" else FLAG_LAYERED)
    with pytest.raises(BlobError, match="unknown flags"):
        read_blob(bytes(forged))
    if mode == "layered":  # version 2 has one format code, so no grouped ECSQ blob to forge
        forged = bytearray(_blob("fixed", "rans"))
        forged[7] |= FLAGS_BY_NAME["layered"].v2
        with pytest.raises(BlobError, match="unknown flags .*fixed-grouped is not allowed in a per-layer container"):
            read_blob(bytes(forged))


def test_the_truncated_flag_outside_a_plain_ecsq_blob_is_refused():
    from kvtc.kernels.codec.blob import FLAG_LAYERED, FLAG_TRUNCATED, FLAGS_BY_NAME, BlobError, read_blob

    for blob, extra in ((_blob("fixed", "rans", 1), 0), (_blob("ecsq", "rans", 1), FLAG_LAYERED)):
        forged = bytearray(blob)
        forged[6] |= FLAG_TRUNCATED | extra
        with pytest.raises(BlobError, match="unknown flags"):
            read_blob(bytes(forged))
    truncated, layered = FLAGS_BY_NAME["truncated"].v2, FLAGS_BY_NAME["layered"].v2
    for blob, extra, why in ((_blob("fixed", "rans"), 0, "truncated applies to ecsq blobs, not fixed-grouped"),
                             (_blob("ecsq", "rans"), layered, "truncated is not allowed in a per-layer container")):
        forged = bytearray(blob)
        forged[7] |= truncated | extra
        with pytest.raises(BlobError, match=f"unknown flags .*{why}"):
            read_blob(bytes(forged))


def _frames(version: int) -> dict[str, bytes]:
    """The pinned fixed-rate blob (blob format `version`) in a version-2 chunk frame, unkeyed and keyed
    (kernels/codec/chunk_frame.py)."""
    from kvtc.kernels.codec.chunk_frame import binding, frame
    from kvtc.kernels.codec.chunk_identity import ChunkIdentity, Engine

    blob = _blob("fixed", "rans", version)
    identity = ChunkIdentity.of(_spec()).encode("float32", T, Engine("pin-engine", 1))
    return {"unkeyed": frame(blob, binding(b"pin", 1), identity),
            "keyed": frame(blob, binding(b"pin", 1), identity, chunk_key=bytes(range(32)))}


PINNED_FRAMES = {  # the frame's version 2: b"KVTCCHK3" unkeyed, b"KVTCCHK4" keyed (version 1 carried no identity);
    # by the blob's format version inside
    ("unkeyed", 1): "b646509a1fb8ce634b755d8c55e58844e9aff96ba89cace0d0553d484b8cb3c7",
    ("keyed", 1): "af5ac80144a8641d85f3c61cbabc0f5d0874afad9a90e449cf49e9bcc68f482f",
    ("unkeyed", 2): "29a325998fd8b819be033753019d06649519cfed94d155bd66b0e8f43b76510c",
    ("keyed", 2): "9dae5bc9a4bc5233c18244d91ebd4ccc8f4b4dabf97aaa233ffbf0781d0a6776",
}


@pytest.mark.parametrize("kind, version", sorted(PINNED_FRAMES))
def test_chunk_frame_bytes_are_pinned(kind, version):
    """Magic, the key's binding (or the MAC), the blob's length, the identity's four part digests, then the blob."""
    import struct

    from kvtc.kernels.codec.chunk_frame import FRAME_BYTES, read_frame
    from kvtc.kernels.codec.chunk_identity import ChunkIdentity, Engine

    data = _frames(version)[kind]
    blob = _blob("fixed", "rans", version)
    assert hashlib.sha256(data).hexdigest() == PINNED_FRAMES[(kind, version)]
    magic, _, n, identity = struct.unpack("<8s16sQ16s", data[:FRAME_BYTES])
    assert magic == (b"KVTCCHK4" if kind == "keyed" else b"KVTCCHK3") and n == len(blob) and data[FRAME_BYTES:] == blob
    assert identity == ChunkIdentity.of(_spec()).encode("float32", T, Engine("pin-engine", 1))
    assert bytes(read_frame(data).blob) == blob
