"""A stored chunk's identity (kernels/codec/chunk_identity.py) in its frame (kernels/codec/chunk_frame.py): a chunk
written for another artifact, model, RoPE configuration or KV layout is a miss naming what differs, told apart from
another key, with the destination untouched; a version-1 frame (no identity) still decodes at the blob level and is a
miss for a serving transform; a keyed frame's MAC covers the identity."""
from __future__ import annotations

import struct
from dataclasses import replace

import pytest
import torch

from kvtc.kernels import KVTCCodec
from kvtc.kernels.codec.blob import BlobError, read_blob
from kvtc.kernels.codec.chunk_frame import FRAME_BYTES, UNBOUND, V1_KEYED_MAGIC, V1_MAGIC, binding, read_frame, unframe
from kvtc.kernels.codec.chunk_identity import WHAT, ChunkIdentity, Engine, IdentityMismatch
from kvtc.kernels.codec.chunk_serde import ChunkTransform
from helpers.lmcache_artifacts import chunk
from helpers.synthetic import synthetic_cache, synthetic_spec

START, TOKENS = 16, 16
KEY = binding(b"chunk", START)
ENGINE = Engine("org/model", 1)
MANIFEST = {"artifact": "synthetic@v0", "digest": "sha256:" + "a" * 64, "model_id": "synthetic-0", "revision": "r1",
            "tokenizer": "hf:org/model@r1", "rope": '{"rope":null}'}


def _spec(**identity):
    return replace(synthetic_spec(2, 2, 8, 4.0, sinks=2, window=3), identity={**MANIFEST, **identity})


def _transform(spec=None, **kwargs) -> ChunkTransform:
    return ChunkTransform(KVTCCodec(_spec() if spec is None else spec), positions=True, **kwargs)


def _kv(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return chunk(*synthetic_cache(_spec(), TOKENS, torch.float32, start=START)).to(dtype)


def _refused(reader: ChunkTransform, data: bytes, like: torch.Tensor, engine=ENGINE, key=KEY, **kwargs):
    """The error `reader` raises for `data`, its destination checked untouched."""
    out = torch.zeros_like(like)
    with pytest.raises(BlobError) as info:
        reader.deserialize(data, out, start=START, key=key, engine=engine, **kwargs)
    assert not out.any()
    return info.value


@pytest.mark.parametrize("what, reader, dtype, engine", [
    ("artifact", dict(digest="sha256:" + "b" * 64), torch.float32, ENGINE),  # another version of the artifact
    ("model", dict(model_id="other-model"), torch.float32, ENGINE),
    ("model", dict(revision="r2"), torch.float32, ENGINE),
    ("model", {}, torch.float32, Engine("org/other-model", 1)),  # the engine serves it under another name
    ("rope", dict(rope='{"rope":{"theta":500000.0}}'), torch.float32, ENGINE),
    ("layout", {}, torch.bfloat16, ENGINE),  # the destination's dtype
    ("layout", {}, torch.float32, Engine("org/model", 2)),  # another world size
], ids=["artifact-digest", "model-id", "revision", "served-name", "rope", "dtype", "world-size"])
def test_a_chunk_of_another_identity_is_a_miss_naming_what_differs(what, reader, dtype, engine):
    data = _transform().serialize(_kv(), start=START, key=KEY, engine=ENGINE)
    err = _refused(_transform(_spec(**reader)), data, _kv(dtype), engine=engine)
    assert isinstance(err, IdentityMismatch) and err.reasons == (what,), str(err)
    assert WHAT[what] in str(err) and "another key" not in str(err)
    # the same chunk under another key is told apart: not an identity mismatch
    other_key = _refused(_transform(), data, _kv(), key=binding(b"other", START))
    assert not isinstance(other_key, IdentityMismatch) and "another key" in str(other_key)


def test_the_identity_comes_from_the_spec_and_a_hand_built_specs_rope_and_placement_are_in_it():
    spec = synthetic_spec(2, 2, 8, 4.0, sinks=2, window=3)
    base = ChunkIdentity.of(spec)
    assert base.artifact == "synthetic@v0" and base.model_id == "synthetic-0" and base.digest == ""
    other_rope = ChunkIdentity.of(synthetic_spec(2, 2, 8, 4.0, sinks=2, window=3, rope_theta=500000.0))
    assert other_rope.differing(base.encode("float32", TOKENS), "float32", TOKENS) == ("rope",)
    stage = ChunkIdentity.of(replace(spec, model_id="synthetic-0/layers0-1"))  # a pipeline stage's spec
    assert stage.differing(base.encode("float32", TOKENS), "float32", TOKENS) == ("layout",)
    assert ChunkIdentity.of(_spec()).digest == MANIFEST["digest"] and len(base.encode("float32", TOKENS)) == 16
    kv = _kv()
    t = ChunkTransform(KVTCCodec(spec), positions=True)
    data = t.serialize(kv, start=START, key=KEY)  # no engine said on either side: the same identity
    out = torch.empty_like(kv)
    t.deserialize(data, out, start=START, key=KEY)
    assert read_frame(data).identity == base.encode("float32", TOKENS)
    with pytest.raises(IdentityMismatch, match="another RoPE configuration"):
        ChunkTransform(KVTCCodec(replace(spec, rope={**spec.rope, "theta": 500000.0})), positions=True).deserialize(
            data, out, start=START, key=KEY)


@pytest.mark.parametrize("keyed", [False, True])
def test_a_version_1_frame_still_decodes_at_the_blob_level_and_is_a_miss_for_a_serving_transform(keyed):
    chunk_key = bytes(range(32)) if keyed else None
    t = _transform(chunk_key=chunk_key)
    kv = _kv()
    blob = t.encode(kv, START)
    magic = V1_KEYED_MAGIC if keyed else V1_MAGIC
    old = struct.pack("<8s16sQ", magic, KEY, len(blob)) + blob + bytes(40)  # as version 1 wrote it, padded
    bound, got = unframe(old)
    assert bound == KEY and bytes(got) == blob and read_frame(old).identity is None
    assert read_blob(got)[0].start == START
    keys, values = t.codec.decode(bytes(got))
    assert keys.shape == (2, 2, TOKENS, 8) and torch.isfinite(keys).all() and torch.isfinite(values).all()
    err = _refused(t, old, kv)
    assert isinstance(err, IdentityMismatch) and err.reasons == ("frame",) and "earlier kvtc release" in str(err)
    new = t.serialize(kv, start=START, key=KEY, engine=ENGINE)
    assert new[:8] == (b"KVTCCHK4" if keyed else b"KVTCCHK3") and read_frame(new).blob == blob
    assert len(new) == t.serialized_size(tuple(kv.shape), kv.dtype) and FRAME_BYTES == 48


def test_a_keyed_frames_mac_covers_its_identity():
    chunk_key = bytes(range(32))
    writer = _transform(_spec(digest="sha256:" + "b" * 64), chunk_key=chunk_key)  # the same key, another artifact
    reader = _transform(chunk_key=chunk_key)
    kv = _kv()
    data = bytearray(writer.serialize(kv, start=START, key=KEY, engine=ENGINE))
    assert _refused(reader, bytes(data), kv).reasons == ("artifact",)
    data[32:48] = reader.identity.encode("float32", TOKENS, ENGINE)  # its identity rewritten to the reader's
    err = _refused(reader, bytes(data), kv)
    assert not isinstance(err, IdentityMismatch) and "does not verify" in str(err)
    reader.deserialize(reader.serialize(kv, start=START, key=KEY, engine=ENGINE), torch.empty_like(kv), start=None,
                       key=KEY, engine=ENGINE)  # its own chunk: a hit, its position from the bound blob
    with pytest.raises(ValueError, match="16 bytes"):
        reader.serialize(kv, start=START, key=UNBOUND[:8])
