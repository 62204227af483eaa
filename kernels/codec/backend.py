"""Backend dispatch: compiled Triton kernels on CUDA, plain torch on CPU, the interpreter on request.

backend "auto" picks "triton" for CUDA tensors and "torch" otherwise; "triton" on CPU runs the
Triton interpreter and therefore needs TRITON_INTERPRET=1 set before kernels was imported.
"""
from __future__ import annotations

import os
from typing import Callable, NamedTuple

import torch

from kvtc.kernels.codec.dequantize import unpack_dequantize, unpack_dequantize_reference
from kvtc.kernels.codec.quantize import quantize_pack, quantize_pack_reference
from kvtc.kernels.codec.rope_center import rope_center, rope_center_reference, rope_restore, rope_restore_reference

BACKENDS = ("auto", "torch", "triton")


class Ops(NamedTuple):
    """One implementation of each element-wise stage (signatures of the Triton launchers)."""

    name: str
    rope_center: Callable[..., torch.Tensor]
    rope_restore: Callable[..., torch.Tensor]
    quantize_pack: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    unpack_dequantize: Callable[..., torch.Tensor]


def _restore_torch(feat: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, mean: torch.Tensor,
                   out: torch.Tensor, layout: str = "half") -> torch.Tensor:
    out.copy_(rope_restore_reference(feat, cos, sin, mean, tuple(out.shape), out.dtype, layout))
    return out


TORCH_OPS = Ops("torch", rope_center_reference, _restore_torch, quantize_pack_reference, unpack_dequantize_reference)
TRITON_OPS = Ops("triton", rope_center, rope_restore, quantize_pack, unpack_dequantize)


def resolve_ops(backend: str, device: torch.device) -> Ops:
    """Kernel set for `backend` on `device`; clear error when Triton cannot run there."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    if backend == "auto":
        return TRITON_OPS if device.type == "cuda" else TORCH_OPS
    if backend == "torch":
        return TORCH_OPS
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("backend='triton' on CPU needs the Triton interpreter: set TRITON_INTERPRET=1 before "
                         "importing kernels, or use backend='torch'")
    return TRITON_OPS
