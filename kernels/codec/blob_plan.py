"""BlobPlan: what one blob's coding may choose, apart from the codec it is coded with (artifact, ratio, options).

A codec codes every blob with its own plan unless given another (`KVTCCodec.encode(..., plan=...)`); the chunk
coder (kernels/codec/chunk_serde.py) tries an ordered list of them and keeps the first that fits its bound. The
blob's header records what the plan chose (mode, raw sinks, their format, truncation, outlier vectors), so any
codec of the same artifact and ratio decodes it.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvtc.kernels.codec.mode import Mode
from kvtc.kernels.codec.sink_formats import SinkFormat


@dataclass(frozen=True)
class BlobPlan:
    """mode: how the coded middle is quantized; sinks: raw tokens kept at positions below it (at most the
    artifact's); sink_format: their format; budget_scale (ECSQ with rate control): the share in (0, 1] of each
    (stream, group)'s budget the middle gets (the rest pays for raw sinks); truncate (ECSQ): a group no step fits
    codes its first components alone; outliers: the middle's worst (layer, token) vectors stored int8 inside the
    budget (a mode whose sizes are exact has no budget to take them from)."""

    mode: Mode
    sinks: int
    sink_format: SinkFormat
    budget_scale: float = 1.0
    truncate: bool = False
    outliers: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.sinks, bool) or not isinstance(self.sinks, int) or self.sinks < 0:
            raise ValueError(f"a plan's sinks must be an int >= 0, got {self.sinks!r}")
        if isinstance(self.budget_scale, bool) or not isinstance(self.budget_scale, (int, float)) \
                or not 0 < self.budget_scale <= 1:
            raise ValueError(f"budget_scale must be a share in (0, 1], got {self.budget_scale!r}")
        if self.outliers and self.mode.sizes.exact:
            raise ValueError(f"outlier vectors need a mode with a budget to take them from, not {self.mode.label}")
        if self.truncate and self.mode.sizes.exact:
            raise ValueError(f"truncation is an ECSQ choice, not {self.mode.label}'s")
