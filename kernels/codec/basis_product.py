"""Products with a basis matrix as the codec holds it, computed in float32.

A basis held in half precision on the host (a server's, kernels/codec/held_basis.py) is multiplied in float32 a
block of its columns (or rows) at a time, each block converted just for its product: host half-precision GEMMs are
hundreds of times slower than float32 ones, and the float32 transient stays bounded (BLOCK_BYTES). On CUDA, and for
a float32 basis, the product is the plain one in the basis' dtype, as the codec has always computed it.
"""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator

import torch

BLOCK_BYTES = 16 << 20  # float32 bytes of one converted block of a half basis on the host

_CONVERTED: ContextVar[dict | None] = ContextVar("kvtc_converted_blocks", default=None)
_SHARED: ContextVar[tuple[dict, int | None] | None] = ContextVar("kvtc_shared_projections", default=None)


@contextmanager
def converted_blocks() -> Iterator[None]:
    """Within it, each block of a half basis is converted to float32 once and kept for the next product (the same
    GEMMs on the same values: every product is bit for bit the one outside it), at the memory of a float32 copy of
    the bases used: for a caller coding many chunks with one transform (the served check, `kvtc eval`), where the
    conversions were 40% of each product. A server holds its bases in half precision and does not use it."""
    token = _CONVERTED.set({})
    try:
        yield
    finally:
        _CONVERTED.reset(token)


@contextmanager
def shared_projections(held: dict | None = None, max_bytes: int | None = None) -> Iterator[dict]:
    """Within it, a projection onto leading columns of a basis is read from the last, wider projection of the same
    rows onto the same matrix where there is one: a caller coding each chunk at several ratios of one artifact,
    widest first (every ratio's components are leading columns of one held matrix, kernels/codec/held_basis.py),
    projects each chunk once. Each pairing of a width with a row count is first computed both ways and read from
    the wider product only where the two agree bit for bit (a BLAS may sum a narrower product another way: a
    one-column block is a matrix-vector product), so the codings are the ones made without it. held: what an
    earlier scope kept (the dict it yielded), to go on from it; max_bytes: rows larger than this are not kept."""
    held = {} if held is None else held
    token = _SHARED.set((held, max_bytes))
    try:
        yield held
    finally:
        _SHARED.reset(token)


def _root(basis: torch.Tensor) -> torch.Tensor | None:
    """The matrix `basis` is leading columns of (itself where it is whole), or None for another kind of view."""
    root = basis if basis._base is None else basis._base
    if root.dim() == basis.dim() == 2 and root.shape[0] == basis.shape[0] and root.stride() == basis.stride() \
            and root.storage_offset() == basis.storage_offset():
        return root
    return None


def _shared(x: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """project(x, basis) within `shared_projections`, from a wider projection of x where it agrees."""
    scope, root = _SHARED.get(), _root(basis)
    if scope is None or root is None:
        return _project(x, basis)
    shared, max_bytes = scope
    key = (root.untyped_storage().data_ptr(), root.storage_offset(), tuple(root.shape), root.stride(), root.dtype,
           str(root.device))
    k, held = basis.shape[1], shared.get(key)
    # the held root keeps its storage alive: a key naming that storage names these values, whatever tensor holds it
    same = held is not None and held[1].shape == x.shape and held[1].dtype == x.dtype \
        and held[1].device == x.device and torch.equal(held[1], x)
    if same and held[2].shape[1] >= k:
        wide = held[2][:, :k]
        if held[2].shape[1] == k:  # the same product
            return wide.clone()
        pairing = ("agrees", key, k, tuple(x.shape), torch.get_num_threads())
        agrees = shared.get(pairing)
        if agrees:
            return wide.contiguous()
        out = _project(x, basis)
        shared[pairing] = torch.equal(out, wide)
        return out
    out = _project(x, basis)
    if max_bytes is None or x.numel() * x.element_size() <= max_bytes:
        shared[key] = (root, x.clone(), out)
    return out


def _block(basis: torch.Tensor, a: int, step: int, rows: bool) -> torch.Tensor:
    """basis[a:a + step] (rows) or basis[:, a:a + step] in float32 (kept within `converted_blocks`)."""
    cache = _CONVERTED.get()
    if cache is None:
        return (basis[a:a + step] if rows else basis[:, a:a + step]).float()
    key = (basis.data_ptr(), tuple(basis.shape), basis.dtype, a, step, rows)
    held = cache.get(key)
    if held is None or held[0] is not basis:  # the tensor itself is kept: its memory is not another's meanwhile
        held = cache[key] = (basis, (basis[a:a + step] if rows else basis[:, a:a + step]).float())
    return held[1]


def _blocked(basis: torch.Tensor) -> bool:
    return basis.device.type == "cpu" and basis.dtype in (torch.float16, torch.bfloat16)


def _step(other: int) -> int:
    """Columns (or rows) of a converted block whose other side is `other` long."""
    return max(1, BLOCK_BYTES // (4 * max(other, 1)))


def project(x: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """x (n, p) @ basis (p, k) -> coefficients (n, k) float32."""
    return _shared(x, basis)


def _project(x: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    if not _blocked(basis):
        return (x.to(basis.dtype) @ basis).float()
    x = x.float()
    p, k = basis.shape
    out = torch.empty(x.shape[0], k, dtype=torch.float32, device=x.device)
    step = _step(p)
    for a in range(0, k, step):
        out[:, a:a + step] = x @ _block(basis, a, step, rows=False)
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
        out[:, a:a + step] = z @ _block(basis, a, step, rows=True).T
    return out
