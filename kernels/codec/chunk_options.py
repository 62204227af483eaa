"""The chunk transform's option vocabulary, without torch: what a serving integration validates in its settings
before anything heavy loads (kernels/codec/chunk_serde.py codes with them)."""
from __future__ import annotations

from kvtc.kernels.codec.blob import MODES

CHUNK_MODES = MODES  # the modes whose chunk sizes the transform bounds: every blob mode
SINK_BUDGETS = ("shared", "extra")  # the default first: a first chunk's raw sinks out of its own budget, or on top
SINK_FORMATS = ("int8", "cache")  # the default first: raw sinks as int8 with a scale per vector, or the cache's dtype
OUTLIER_FACTOR = 2.5  # outlier vectors (kernels/codec/outliers.py): stored int8 where a (layer, token) vector's
# relative error exceeds this many times its stream's (2.0 and 3.0 served less well on unseen text at CR 8, 16, 32)
CHUNK_KEY_BYTES = 32  # a deployment's chunk key (the keyed frame's MAC key)
CHUNK_KEY_ENV = "KVTC_CHUNK_KEY_FILE"  # the file holding it, where a serving integration's settings name none


def check_outlier_factor(value: object, where: str = "outlier_factor") -> float | None:
    """None (no outlier vectors) or a finite number > 0 -> itself; ValueError naming `where` otherwise."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ValueError(f"{where} must be null/None (no outlier vectors) or a number > 0 (times the stream's relative "
                         f"error; default {OUTLIER_FACTOR}), got {value!r}")
    return float(value)
