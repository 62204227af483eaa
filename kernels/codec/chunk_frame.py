"""A stored chunk's frame: what precedes its blob (kernels/codec/blob.py) in a store, binding it to the storage key
it was stored under and to its identity (kernels/codec/chunk_identity.py).

Bytes, little-endian (version 2, 48 bytes; magic b"KVTCCHK3" unkeyed, b"KVTCCHK4" keyed):

    offset  0  8s   magic
    offset  8  16s  unkeyed: the storage key's `binding` (zeros where the caller has no key); keyed: `keyed_binding`,
                    a MAC under the deployment's chunk key of the key's binding, the identity and the blob
    offset 24  Q    blob length n
    offset 32  16s  identity: four 4-byte digests (artifact, model, RoPE, KV layout: chunk_identity.PARTS)
    offset 48       the blob (n bytes), then, where the store pads, zeros up to its bound

The first 32 bytes are laid out as version 1's whole frame (b"KVTCCHK1" unkeyed, b"KVTCCHK2" keyed: magic, binding
or MAC, blob length; no identity). `read_frame` still reads version 1 (identity None), so the blobs stored before
keep decoding at the blob level; a serving transform refuses them (chunk_identity.old_frame: a miss).
"""
from __future__ import annotations

import hashlib
import struct
from typing import NamedTuple

from kvtc.kernels.codec.blob import BlobError
from kvtc.kernels.codec.chunk_identity import IDENTITY_BYTES

_V1 = struct.Struct("<8s16sQ")
_V2 = struct.Struct(f"<8s16sQ{IDENTITY_BYTES}s")
FRAME_MAGIC = b"KVTCCHK3"  # the key's unkeyed binding digest and the chunk's identity (no chunk key configured)
KEYED_MAGIC = b"KVTCCHK4"  # a MAC, under the deployment's chunk key, of the key's binding, the identity and the blob
V1_MAGIC = b"KVTCCHK1"  # version 1, unkeyed: no identity
V1_KEYED_MAGIC = b"KVTCCHK2"  # version 1, keyed: no identity
FRAME_BYTES = _V2.size
V1_FRAME_BYTES = _V1.size
UNBOUND = bytes(16)
_MAGICS = {FRAME_MAGIC: (False, 2), KEYED_MAGIC: (True, 2), V1_MAGIC: (False, 1), V1_KEYED_MAGIC: (True, 1)}


class Frame(NamedTuple):
    magic: bytes
    keyed: bool
    bound: bytes  # the key's binding, or the keyed MAC
    identity: bytes | None  # None: a version-1 frame, which carries none
    blob: memoryview


def binding(*parts: object) -> bytes:
    """16-byte digest of a storage key's fields (bytes as they are, anything else by its repr), which a
    chunk's frame carries so that bytes stored under one key never decode for another."""
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        b = bytes(part) if isinstance(part, (bytes, bytearray, memoryview)) else repr(part).encode()
        h.update(struct.pack("<Q", len(b)) + b)
    return h.digest()


def keyed_binding(chunk_key: bytes, key: bytes, blob: bytes | memoryview, identity: bytes = b"") -> bytes:
    """16-byte MAC (keyed BLAKE2b) under the deployment's chunk key of a storage key's `binding`, the chunk's identity
    and the blob: without the chunk key no writer of the store can make a chunk that loads for any key, or alter one."""
    h = hashlib.blake2b(key=chunk_key, digest_size=16, person=b"kvtc-chunk-mac")
    h.update(bytes(key))
    h.update(identity)
    h.update(blob)
    return h.digest()


def frame(blob: bytes, key: bytes, identity: bytes, chunk_key: bytes | None = None) -> bytes:
    """A version-2 frame and the blob: bound to `key` (a `binding`), or under `chunk_key` its MAC."""
    if len(key) != 16 or len(identity) != IDENTITY_BYTES:
        raise ValueError(f"a frame binds a 16-byte key binding and a {IDENTITY_BYTES}-byte identity, got "
                         f"{len(key)} and {len(identity)}")
    if chunk_key is None:
        return _V2.pack(FRAME_MAGIC, bytes(key), len(blob), identity) + blob
    return _V2.pack(KEYED_MAGIC, keyed_binding(chunk_key, key, blob, identity), len(blob), identity) + blob


def read_frame(data: bytes | bytearray | memoryview) -> Frame:
    """A stored chunk's bytes -> its Frame (trailing padding left out of the blob); BlobError if not kvtc's."""
    view = memoryview(data).cast("B")
    if len(view) < _V1.size:
        raise BlobError(f"kvtc chunk of {len(view)} bytes is too short")
    magic = bytes(view[:8])
    if magic not in _MAGICS:
        raise BlobError(f"not a kvtc chunk (frame magic {magic!r}, expected {FRAME_MAGIC!r} or {KEYED_MAGIC!r}): "
                        "written by another serde")
    keyed, version = _MAGICS[magic]
    size = _V2.size if version == 2 else _V1.size
    if len(view) < size:
        raise BlobError(f"kvtc chunk of {len(view)} bytes is too short for its frame ({size} bytes)")
    _, bound, n, *rest = (_V2 if version == 2 else _V1).unpack(view[:size])
    if n > len(view) - size:
        raise BlobError(f"kvtc chunk declares {n} blob bytes, holds {len(view) - size}")
    return Frame(magic, keyed, bytes(bound), bytes(rest[0]) if rest else None, view[size:size + n])


def unframe(data: bytes | bytearray | memoryview) -> tuple[bytes, memoryview]:
    """A stored chunk's bytes (either version) -> (its key binding or keyed MAC, its blob); BlobError if not kvtc's."""
    f = read_frame(data)
    return f.bound, f.blob


def unframe_keyed(data: bytes | bytearray | memoryview) -> tuple[bool, bytes, memoryview]:
    """A stored chunk's bytes -> (whether its frame is keyed, its binding or MAC, its blob); BlobError if not kvtc's."""
    f = read_frame(data)
    return f.keyed, f.bound, f.blob
