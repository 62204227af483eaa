"""A GGUF file parsed once per use, however many times transformers reads it.

Converting a GGUF, transformers builds gguf's `GGUFReader` over the whole file for the config, again for the
tokenizer and again for the weights, each parse walking every metadata item (the embedded model's 49,152-token
vocabulary and merges: about 6 s a parse on this CPU), and it builds gguf's tensor-name map anew for every module
of the model (about 20 ms each, 397 times for SmolLM2). Inside `gguf_read_once()` both are made once: the reader
per (file, mode), the map per (architecture, layers). transformers imports both names from `gguf` when it calls
them, so the scope replaces them there and puts them back on the way out; nothing else changes.
"""
from __future__ import annotations

import functools
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_lock = threading.Lock()
_depth = 0
_saved: tuple[Any, Any] | None = None  # gguf's own reader and map, while a scope is open


@contextmanager
def gguf_read_once() -> Iterator[None]:
    """Within: each GGUF file is parsed by gguf's reader once, and each tensor-name map built once (re-entrant)."""
    global _depth, _saved
    import gguf  # noqa: PLC0415 - gguf loads only to read a GGUF file

    with _lock:
        if _depth == 0:
            _saved = reader, names = gguf.GGUFReader, gguf.get_tensor_name_map
            readers: dict[tuple, Any] = {}
            reading = threading.Lock()

            def read(path: str | os.PathLike, mode: str = "r") -> Any:
                st = os.stat(path)  # a file replaced within the scope is parsed again
                key = (os.path.realpath(os.fspath(path)), mode, st.st_size, st.st_mtime_ns)
                with reading:  # two threads reading one file: one parse
                    if key not in readers:
                        readers[key] = reader(path, mode)
                    return readers[key]

            gguf.GGUFReader, gguf.get_tensor_name_map = read, functools.lru_cache(maxsize=None)(names)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                gguf.GGUFReader, gguf.get_tensor_name_map = _saved
                _saved = None
