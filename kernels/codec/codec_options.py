"""CodecOptions: how a KVTCCodec codes, apart from its spec (artifact, ratio, rank). One frozen value, checked when
made; a codec holds it as `codec.options`, and another codec like it is `KVTCCodec(spec, options=replace(codec.options,
...))`, naming only what differs."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtc.kernels.codec.backend import BACKENDS
from kvtc.kernels.codec.blob import FORMAT_VERSION, MODES, SINK_FORMATS, VERSIONS
from kvtc.kernels.codec.chunk_options import OUTLIER_FACTOR, check_outlier_factor
from kvtc.kernels.codec.ecsq import ECSQ_FORMATS
from kvtc.kernels.codec.entropy import CODERS

DEFAULT_MAX_TOKENS = 1 << 17  # 131072: decode refuses longer blobs unless the caller raises the limit
BASIS_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class CodecOptions:
    """A KVTCCodec's options; a bad value is a ValueError naming its field.

    Parameters
    ----------
    backend : str, default "auto"
        "auto" (Triton on CUDA, torch on CPU), "torch", or "triton" (the interpreter on CPU).
    level : int, default 1
        zlib level per blob section, 0..9 (0 = store plain).
    coder : str, default "zlib"
        The sections' entropy coder: "zlib", "plain" or "nvcomp".
    max_tokens : int, default 131072
        Decode refuses a blob declaring more tokens, before allocating anything for it.
    mode : str or None, default None
        The mode new blobs are written in: "ecsq" (entropy-coded) or "fixed" (per-block fixed-rate codes with
        per-token scales, DEFLATE); None: ECSQ where the artifact carries its tables for the ratio. A codec holds
        the mode it resolved. Decode follows the blob's mode.
    rate_control : bool, default True
        ECSQ: coarsen the step of a (stream, group) whose coded bytes would exceed the ratio's budget (text unlike
        the calibration's); False keeps the calibrated step everywhere.
    ecsq_format : str, default "rans"
        The ECSQ symbols' format in new blobs: "rans" (interleaved rANS, coded on the device by Triton kernels where
        the cache lives on CUDA, by the numpy reference elsewhere) or "constriction" (the first format, host only).
    basis_dtype : torch.dtype or None, default None
        dtype of the components held on the device (float16, bfloat16 or float32; only the columns the mode's code
        uses); None: the cache's dtype on CUDA, float32 on CPU.
    sink_format : str, default "cache"
        The raw sinks in new blobs: "cache" (the cache's dtype) or "int8" (codes and a float32 scale per token
        vector, about half of bfloat16: kernels/codec/sinks_int8.py). Decode follows the blob's format.
    outlier_factor : float or None, default 2.5
        ECSQ with rate control: the coded middle's (layer, token) vectors whose relative error exceeds this many
        times their stream's are stored int8 inside the budget (kernels/codec/outliers.py); None: none.
    blob_version : int, default 2
        The blob format version new blobs are written in (kernels/codec/blob.py): 2, or 1 while readers older than
        version 2 still read them (a rolling upgrade: upgrade every reader, then writers, then drop this). Only the
        16-byte prefix differs, never a blob's size. Decode reads both.
    """

    backend: str = "auto"
    level: int = 1
    coder: str = "zlib"
    max_tokens: int = DEFAULT_MAX_TOKENS
    mode: str | None = None
    rate_control: bool = True
    ecsq_format: str = "rans"
    basis_dtype: torch.dtype | None = None
    sink_format: str = "cache"
    outlier_factor: float | None = OUTLIER_FACTOR
    blob_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        for name, value, choices in (("backend", self.backend, BACKENDS), ("coder", self.coder, CODERS),
                                     ("mode", self.mode, (None, *MODES)), ("ecsq_format", self.ecsq_format, ECSQ_FORMATS),
                                     ("basis_dtype", self.basis_dtype, (None, *BASIS_DTYPES)),
                                     ("sink_format", self.sink_format, SINK_FORMATS),
                                     ("blob_version", self.blob_version, VERSIONS)):
            if value not in choices or (name == "blob_version" and isinstance(value, bool)):
                raise ValueError(f"{name} must be one of {choices}, got {value!r}")
        for name, value, top in (("level", self.level, 9), ("max_tokens", self.max_tokens, None)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0 or (top is not None and value > top):
                raise ValueError(f"{name} must be an int in 0..{top or ''}, got {value!r}")
        if not isinstance(self.rate_control, bool):
            raise ValueError(f"rate_control must be True or False, got {self.rate_control!r}")
        object.__setattr__(self, "outlier_factor", check_outlier_factor(self.outlier_factor))
