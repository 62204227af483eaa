"""The on-disk form of calibration statistics: raw little-endian arrays followed by a JSON footer.

    [tensor bytes ...][footer JSON][u64 footer length][32-byte tag][magic]

The footer names every tensor with its dtype, shape, offset and sha256, plus free JSON metadata. The
tag authenticates the footer (and through its sha256s every tensor): with magic b"KVTCSTA3" it is an
HMAC-SHA256 under the shard store's key (`kvtc.pipeline.job.store`: a forged footer does not verify
without the key), with b"KVTCSTA2" a plain sha256 (stand-alone files, `CalibrationStats.save`).
Writing streams each array straight from memory (no second copy of a Gram); reading can fetch one
tensor alone. Reading never trusts the footer: it is size-limited, its JSON shape checked, dtypes
come from an allow-list (never an object dtype) and every shape must match its byte count and lie
inside the data before anything is allocated. Every failure is a `CorruptStats` error naming the
object, never a silently different basis, a crash or a huge allocation. No pickle.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import math
import struct
from typing import Any, BinaryIO

import numpy as np

MAGIC = b"KVTCSTA2"        # footer tag: sha256 of the footer
MAGIC_KEYED = b"KVTCSTA3"  # footer tag: HMAC-SHA256 of the footer under the store's key
_TAIL = 8 + 32 + len(MAGIC)
_CHUNK = 1 << 26
MAX_FOOTER = 64 << 20
DTYPES = frozenset({"<f8", "<f4", "<f2", "<i8", "<i4", "<i2", "|i1", "<u8", "<u4", "<u2", "|u1", "|b1"})


class CorruptStats(ValueError):
    """A statistics object that fails its checksum or cannot be parsed."""

    def __init__(self, name: str, problem: str) -> None:
        super().__init__(f"statistics object {name} is corrupt ({problem}); rerun the calibration to recompute it")
        self.name = name


class DegenerateStats(CorruptStats):
    """A statistics object that reads back intact but whose math is impossible (a zero or negative variance
    where the fit needs it positive): handled like a corrupt one (moved aside, recomputed)."""

    def __init__(self, name: str, tensor: str, problem: str) -> None:
        ValueError.__init__(self, f"statistics object {name} is degenerate: tensor {tensor} {problem}; it was moved "
                            "aside, so a rerun of the calibration recomputes it (if the recomputed one is degenerate "
                            "too, the model's attention gives no such weight: pass --attention-weighting none or "
                            "--objective mse)")
        self.name = name
        self.tensor = tensor


def _digest(array: np.ndarray) -> str:
    h = hashlib.sha256()
    flat = memoryview(np.ascontiguousarray(array)).cast("B")
    for i in range(0, len(flat), _CHUNK):
        h.update(flat[i : i + _CHUNK])
    return h.hexdigest()


def _tag(footer: bytes, key: bytes | None) -> tuple[bytes, bytes]:
    """(32-byte tag, magic) of a footer: keyed HMAC when the store has a key, sha256 otherwise."""
    if key is None:
        return hashlib.sha256(footer).digest(), MAGIC
    return hmac.new(key, footer, hashlib.sha256).digest(), MAGIC_KEYED


def write_stats(f: BinaryIO, tensors: dict[str, np.ndarray], metadata: dict[str, Any], key: bytes | None = None) -> int:
    """Write arrays then the footer to an open binary file; returns the bytes written.
    key: the store's HMAC key (authenticated object), or None (plain sha256)."""
    entries, offset = {}, 0
    for name, array in tensors.items():
        array = np.ascontiguousarray(array)
        dtype = array.dtype.newbyteorder("<")
        if array.dtype != dtype:
            array = array.astype(dtype)
        if dtype.str not in DTYPES:
            raise ValueError(f"statistics tensor {name!r} has dtype {dtype.str}, not one of {sorted(DTYPES)}")
        entries[name] = {"dtype": dtype.str, "shape": list(array.shape), "offset": offset,
                         "nbytes": int(array.nbytes), "sha256": _digest(array)}
        f.write(memoryview(array).cast("B"))
        offset += array.nbytes
    footer = json.dumps({"metadata": metadata, "tensors": entries}, sort_keys=True).encode()
    f.write(footer)
    tag, magic = _tag(footer, key)
    f.write(struct.pack("<Q", len(footer)) + tag + magic)
    return offset + len(footer) + _TAIL


def _check_entry(name: str, key: str, entry: Any, data_bytes: int) -> None:
    """Raise CorruptStats unless a tensor entry is well-formed and lies inside the data."""
    if not isinstance(entry, dict) or not isinstance(entry.get("shape"), list) or entry.get("dtype") not in DTYPES:
        raise CorruptStats(name, f"tensor {key!r} has no valid dtype (allowed: {sorted(DTYPES)}) or shape")
    shape, offset, nbytes = entry["shape"], entry.get("offset"), entry.get("nbytes")
    ints = [offset, nbytes, *shape]
    if any(not isinstance(v, int) or isinstance(v, bool) or v < 0 for v in ints):
        raise CorruptStats(name, f"tensor {key!r} has a negative or non-integer offset, size or shape")
    if math.prod(shape) * np.dtype(entry["dtype"]).itemsize != nbytes:
        raise CorruptStats(name, f"tensor {key!r}: shape {shape} of {entry['dtype']} is not its {nbytes} bytes")
    if offset + nbytes > data_bytes:
        raise CorruptStats(name, f"tensor {key!r} lies past the end of the data")
    if not isinstance(entry.get("sha256"), str):
        raise CorruptStats(name, f"tensor {key!r} has no sha256")


def read_footer(f: BinaryIO, name: str, key: bytes | None = None) -> dict[str, Any]:
    """{"metadata": ..., "tensors": {...}, "data_bytes": n} of an object, authenticated and checked;
    f must be seekable. key: the store's HMAC key (then only an object tagged with it is accepted)."""
    try:
        size = f.seek(0, 2)
        if size < _TAIL:
            raise CorruptStats(name, f"{size} bytes is shorter than the footer")
        f.seek(size - _TAIL)
        tail = f.read(_TAIL)
        if tail[-len(MAGIC):] not in (MAGIC, MAGIC_KEYED):
            raise CorruptStats(name, "no statistics footer marker; truncated or not a statistics object")
        (length,) = struct.unpack("<Q", tail[:8])
        if length > size - _TAIL or length > MAX_FOOTER:
            raise CorruptStats(name, f"footer length {length} exceeds the object size or {MAX_FOOTER} bytes")
        f.seek(size - _TAIL - length)
        footer = f.read(length)
    except OSError as exc:
        raise CorruptStats(name, f"unreadable: {exc}") from exc
    if key is not None and tail[-len(MAGIC):] != MAGIC_KEYED:
        raise CorruptStats(name, "not authenticated with the store's key (forged, or written by an older release)")
    tag, _ = _tag(footer, key if tail[-len(MAGIC):] == MAGIC_KEYED else None)
    if key is None and tail[-len(MAGIC):] == MAGIC_KEYED:
        raise CorruptStats(name, "authenticated with a store key; read it through its shard store")
    if not hmac.compare_digest(tag, tail[8:40]):
        raise CorruptStats(name, "footer checksum mismatch" if key is None else "footer authentication failed "
                           "(tampered, or written under another store key)")
    try:
        out = json.loads(footer)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptStats(name, f"footer is not JSON ({exc})") from None
    if not isinstance(out, dict) or not isinstance(out.get("metadata"), dict) or not isinstance(out.get("tensors"), dict):
        raise CorruptStats(name, "footer is not {metadata: {...}, tensors: {...}}")
    out["data_bytes"] = size - _TAIL - length
    for tensor, entry in out["tensors"].items():
        _check_entry(name, tensor, entry, out["data_bytes"])
    return out


def read_tensor(f: BinaryIO, footer: dict[str, Any], key: str, name: str) -> np.ndarray:
    """One tensor of an object (fresh writable array), checksum verified."""
    entry = footer["tensors"].get(key)
    if entry is None:
        raise CorruptStats(name, f"no tensor {key!r}")
    _check_entry(name, key, entry, footer["data_bytes"])
    array = np.empty(entry["shape"], dtype=np.dtype(entry["dtype"]))
    f.seek(entry["offset"])
    view = memoryview(array).cast("B") if array.nbytes else memoryview(b"")
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
