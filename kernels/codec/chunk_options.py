"""The chunk transform's option vocabulary, without torch: what a serving integration validates in its settings
before anything heavy loads (kernels/codec/chunk_serde.py codes with them)."""
from __future__ import annotations

from kvtc.kernels.codec.blob import MODES

CHUNK_MODES = MODES  # the modes whose chunk sizes the transform bounds: every blob mode
SINK_BUDGETS = ("shared", "extra")  # the default first: a first chunk's raw sinks out of its own budget, or on top
SINK_FORMATS = ("int8", "cache")  # the default first: raw sinks as int8 with a scale per vector, or the cache's dtype
CHUNK_KEY_BYTES = 32  # a deployment's chunk key (the keyed frame's MAC key)
CHUNK_KEY_ENV = "KVTC_CHUNK_KEY_FILE"  # the file holding it, where a serving integration's settings name none
