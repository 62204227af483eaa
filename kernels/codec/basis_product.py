"""Products with a basis matrix as the codec holds it, computed in float32.

A basis held in half precision on the host (a server's, kernels/codec/held_basis.py) is multiplied in float32 a
block of its columns (or rows) at a time, each block converted just for its product: host half-precision GEMMs are
hundreds of times slower than float32 ones, and the float32 transient stays bounded (BLOCK_BYTES). On CUDA, and for
a float32 basis, the product is the plain one in the basis' dtype, as the codec has always computed it.
"""
from __future__ import annotations

import torch

BLOCK_BYTES = 16 << 20  # float32 bytes of one converted block of a half basis on the host


def _blocked(basis: torch.Tensor) -> bool:
    return basis.device.type == "cpu" and basis.dtype in (torch.float16, torch.bfloat16)


def _step(other: int) -> int:
    """Columns (or rows) of a converted block whose other side is `other` long."""
    return max(1, BLOCK_BYTES // (4 * max(other, 1)))


def project(x: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """x (n, p) @ basis (p, k) -> coefficients (n, k) float32."""
    if not _blocked(basis):
        return (x.to(basis.dtype) @ basis).float()
    x = x.float()
    p, k = basis.shape
    out = torch.empty(x.shape[0], k, dtype=torch.float32, device=x.device)
    step = _step(p)
    for a in range(0, k, step):
        out[:, a:a + step] = x @ basis[:, a:a + step].float()
    return out


def reconstruct(z: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """z (n, k) @ basis (p, k).T -> features (n, p) float32 (basis: a decoding matrix, or the components)."""
    if not _blocked(basis):
        return (z.to(basis.dtype) @ basis.T).float()
    z = z.float()
    p, k = basis.shape
    out = torch.empty(z.shape[0], p, dtype=torch.float32, device=z.device)
    step = _step(k)
    for a in range(0, p, step):
        out[:, a:a + step] = z @ basis[a:a + step].float().T
    return out
