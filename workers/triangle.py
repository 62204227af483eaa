"""Packed upper triangle of a symmetric p x p matrix: rows i = 0..p-1 of entries (i, i..p-1), one
after another, p (p + 1) / 2 values. Half the bytes of the full matrix, and what is stored."""
from __future__ import annotations

import numpy as np
import torch


def packed_len(p: int) -> int:
    return p * (p + 1) // 2


def row_offset(p: int, i: int) -> int:
    """Index in the packed array of entry (i, i)."""
    return i * p - i * (i - 1) // 2


def add_upper_rows(packed: torch.Tensor, p: int, a: int, block: torch.Tensor) -> None:
    """packed (p(p+1)/2,) += the upper part of `block` (b - a, p - a), rows a..b-1, columns a..p-1."""
    rows, width = block.shape
    if width != p - a or a + rows > p:
        raise ValueError(f"block {tuple(block.shape)} does not fit rows {a}.. of a {p} x {p} triangle")
    mask = torch.arange(width, device=block.device)[None, :] >= torch.arange(rows, device=block.device)[:, None]
    start, end = row_offset(p, a), row_offset(p, a + rows)
    packed[start:end] += block[mask].to(packed.dtype)  # boolean selection is row-major: the packed order


def unpack_upper(packed: np.ndarray, p: int, out: np.ndarray | None = None) -> np.ndarray:
    """(p(p+1)/2,) -> (p, p) whose upper triangle holds the entries; the lower part is left as it was
    (zeros for a new array). LAPACK eigensolvers called with lower=False read only the upper part."""
    if packed.shape != (packed_len(p),):
        raise ValueError(f"packed triangle has {packed.shape} entries, expected ({packed_len(p)},) for p={p}")
    full = np.zeros((p, p), dtype=packed.dtype) if out is None else out
    for i in range(p):
        o = row_offset(p, i)
        full[i, i:] = packed[o : o + p - i]
    return full


def symmetric(packed: np.ndarray, p: int) -> np.ndarray:
    """(p(p+1)/2,) -> full symmetric (p, p)."""
    full = unpack_upper(packed, p)
    step = 512
    for a in range(0, p, step):  # mirror the upper triangle into the lower one, a block of columns at a time
        b = min(a + step, p)
        full[b:, a:b] = full[a:b, b:].T
        tile = full[a:b, a:b]
        tile += np.triu(tile, 1).T
    return full


def diagonal(packed: np.ndarray, p: int) -> np.ndarray:
    """(p,) diagonal entries of a packed triangle."""
    return packed[np.array([row_offset(p, i) for i in range(p)], dtype=np.int64)]
