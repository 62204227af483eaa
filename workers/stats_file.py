"""The on-disk form of calibration statistics: raw little-endian arrays followed by a JSON footer.

    [tensor bytes ...][footer JSON][u64 footer length][32-byte sha256 of the footer][b"KVTCSTA2"]

The footer names every tensor with its dtype, shape, offset and sha256, plus free JSON metadata.
Writing streams each array straight from memory (no second copy of a Gram); reading can fetch one
tensor alone. Every read verifies the checksums it touches: a flipped byte is a `CorruptStats`
error naming the object, never a silently different basis. No pickle.
"""
from __future__ import annotations

import hashlib
import json
import struct
from typing import Any, BinaryIO

import numpy as np

MAGIC = b"KVTCSTA2"
_TAIL = 8 + 32 + len(MAGIC)
_CHUNK = 1 << 26


class CorruptStats(ValueError):
    """A statistics object that fails its checksum or cannot be parsed."""

    def __init__(self, name: str, problem: str) -> None:
        super().__init__(f"statistics object {name} is corrupt ({problem}); rerun the calibration to recompute it")
        self.name = name


def _digest(array: np.ndarray) -> str:
    h = hashlib.sha256()
    flat = memoryview(np.ascontiguousarray(array)).cast("B")
    for i in range(0, len(flat), _CHUNK):
        h.update(flat[i : i + _CHUNK])
    return h.hexdigest()


def write_stats(f: BinaryIO, tensors: dict[str, np.ndarray], metadata: dict[str, Any]) -> int:
    """Write arrays then the footer to an open binary file; returns the bytes written."""
    entries, offset = {}, 0
    for key, array in tensors.items():
        array = np.ascontiguousarray(array)
        dtype = array.dtype.newbyteorder("<")
        if array.dtype != dtype:
            array = array.astype(dtype)
        entries[key] = {"dtype": dtype.str, "shape": list(array.shape), "offset": offset,
                        "nbytes": int(array.nbytes), "sha256": _digest(array)}
        f.write(memoryview(array).cast("B"))
        offset += array.nbytes
    footer = json.dumps({"metadata": metadata, "tensors": entries}, sort_keys=True).encode()
    f.write(footer)
    f.write(struct.pack("<Q", len(footer)) + hashlib.sha256(footer).digest() + MAGIC)
    return offset + len(footer) + _TAIL


def read_footer(f: BinaryIO, name: str) -> dict[str, Any]:
    """{"metadata": ..., "tensors": {...}} of an object, checksum verified; f must be seekable."""
    try:
        size = f.seek(0, 2)
        if size < _TAIL:
            raise CorruptStats(name, f"{size} bytes is shorter than the footer")
        f.seek(size - _TAIL)
        tail = f.read(_TAIL)
        if tail[-len(MAGIC):] != MAGIC:
            raise CorruptStats(name, "no statistics footer marker; truncated or not a statistics object")
        (length,) = struct.unpack("<Q", tail[:8])
        if length > size - _TAIL:
            raise CorruptStats(name, f"footer length {length} exceeds the object size")
        f.seek(size - _TAIL - length)
        footer = f.read(length)
    except OSError as exc:
        raise CorruptStats(name, f"unreadable: {exc}") from exc
    if hashlib.sha256(footer).digest() != tail[8:40]:
        raise CorruptStats(name, "footer checksum mismatch")
    out = json.loads(footer)
    out["data_bytes"] = size - _TAIL - length
    return out


def read_tensor(f: BinaryIO, footer: dict[str, Any], key: str, name: str) -> np.ndarray:
    """One tensor of an object (fresh writable array), checksum verified."""
    entry = footer["tensors"].get(key)
    if entry is None:
        raise CorruptStats(name, f"no tensor {key!r}")
    if entry["offset"] + entry["nbytes"] > footer["data_bytes"]:
        raise CorruptStats(name, f"tensor {key!r} lies past the end of the data")
    array = np.empty(entry["shape"], dtype=np.dtype(entry["dtype"]))
    f.seek(entry["offset"])
    view = memoryview(array).cast("B")
    got = 0
    while got < entry["nbytes"]:
        n = f.readinto(view[got:]) if hasattr(f, "readinto") else None
        if n is None:
            chunk = f.read(entry["nbytes"] - got)
            n = len(chunk)
            view[got : got + n] = chunk
        if not n:
            raise CorruptStats(name, f"tensor {key!r} is truncated")
        got += n
    if _digest(array) != entry["sha256"]:
        raise CorruptStats(name, f"checksum mismatch in tensor {key!r}")
    return array
