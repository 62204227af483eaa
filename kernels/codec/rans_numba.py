"""Interleaved rANS on the host, compiled: numba kernels bit-identical to the numpy reference (kernels/codec/rans.py).

The reference advances all lanes in lock-step with one numpy call per operation, so its cost is per
step of a lane (about 20 calls of a few microseconds each), whatever the lane count; a 256-token
chunk has few lanes (about 8,192 coded bits each) and thousands of steps. These kernels run each lane's
coder as a scalar loop (a few nanoseconds per symbol) and are used wherever numba imports; the numpy
reference stays the fallback and the specification. Compiled on first use and cached on disk.
"""
from __future__ import annotations

import numpy as np
from numba import njit

_LOW = 1 << 16
_MASK = 0xFFFF


@njit(cache=True, nogil=True)
def decode_steps(states: np.ndarray, offsets: np.ndarray, counts: np.ndarray, words: np.ndarray,
                 slot2sym: np.ndarray, fc: np.ndarray, comp_slot_base: np.ndarray, comp_sym_base: np.ndarray,
                 out: np.ndarray) -> int:
    """Decode every lane into out (N,) int32 (table indices, flat order), all lanes one step at a time
    (independent lanes overlap in the CPU's pipeline). -> 0; 1 for a lane that reads past its words; 2 for
    one that does not end at the encoder's initial state with all its words read."""
    w = states.shape[0]
    kept = comp_slot_base.shape[0]
    n = out.shape[0]
    x = states.astype(np.int64)
    ptr = offsets.astype(np.int64)
    end = ptr + counts
    comp = np.arange(w) % kept
    step_comp = w % kept
    for first in range(0, n, w):
        for lane in range(min(w, n - first)):
            xs = x[lane]
            c = comp[lane]
            slot = xs & _MASK
            sym = np.int64(slot2sym[comp_slot_base[c] + slot])
            e = fc[comp_sym_base[c] + sym]
            xs = (e & _MASK) * (xs >> 16) + slot - (e >> 16)
            out[first + lane] = sym
            if xs < _LOW:
                p = ptr[lane]
                if p >= end[lane]:
                    return 1
                xs = (xs << 16) | np.int64(words[p])
                ptr[lane] = p + 1
            x[lane] = xs
            c += step_comp
            comp[lane] = c - kept if c >= kept else c
    for lane in range(w):
        if x[lane] != _LOW or ptr[lane] != end[lane]:
            return 2
    return 0


@njit(cache=True, nogil=True)
def fill_escapes(idx: np.ndarray, radius: np.ndarray, esc: np.ndarray, max_symbol: int) -> int:
    """Table indices (T, kept) int32 -> symbols in place, escapes (index 2 r + 1) filled from esc in flat
    order. -> 0; 1 when the stream names more or fewer escapes than esc holds; 2 for an escaped value inside
    its model's range or beyond max_symbol (idx is left partly converted then)."""
    k = 0
    for t in range(idx.shape[0]):
        for j in range(idx.shape[1]):
            r = radius[j]
            v = idx[t, j]
            if v == 2 * r + 1:
                if k >= esc.shape[0]:
                    return 1
                e = esc[k]
                k += 1
                if abs(e) <= r or abs(e) > max_symbol:
                    return 2
                idx[t, j] = e
            else:
                idx[t, j] = v - r
    return 0 if k == esc.shape[0] else 1


@njit(cache=True, nogil=True)
def escapes_of(q: np.ndarray, radius: np.ndarray) -> np.ndarray:
    """Symbols (T, kept) -> the values outside their component's [-r, r], int32, in flat order."""
    k = 0
    for t in range(q.shape[0]):
        for j in range(q.shape[1]):
            k += abs(np.int64(q[t, j])) > radius[j]
    out = np.empty(k, dtype=np.int32)
    k = 0
    for t in range(q.shape[0]):
        for j in range(q.shape[1]):
            if abs(np.int64(q[t, j])) > radius[j]:
                out[k] = q[t, j]
                k += 1
    return out


@njit(cache=True, nogil=True)
def encode_steps(q: np.ndarray, radius: np.ndarray, fc: np.ndarray, comp_sym_base: np.ndarray, w: int,
                 states: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Symbols (N,) in flat order (values; an escape's table index is 2 r + 1) -> the lanes' words (uint16,
    lane by lane, each lane's in decoder order); fills states and counts (W,). All lanes one step at a time,
    last step first (independent lanes overlap in the CPU's pipeline)."""
    n = q.shape[0]
    kept = radius.shape[0]
    steps = (n + w - 1) // w
    buf = np.empty((w, steps), dtype=np.uint16)
    x = np.full(w, _LOW, dtype=np.int64)
    ptr = np.full(w, steps - 1, dtype=np.int64)
    for i in range(steps - 1, -1, -1):
        first = i * w
        comp = first % kept
        for lane in range(min(w, n - first)):
            r = radius[comp]
            v = np.int64(q[first + lane])
            sym = 2 * r + 1 if abs(v) > r else v + r
            e = fc[comp_sym_base[comp] + sym]
            f = e & _MASK
            xs = x[lane]
            if xs >= (f << 16):
                p = ptr[lane]
                buf[lane, p] = xs & _MASK
                ptr[lane] = p - 1
                xs >>= 16
            x[lane] = ((xs // f) << 16) + xs % f + (e >> 16)
            comp += 1
            if comp == kept:
                comp = 0
    total = 0
    for lane in range(w):
        states[lane] = x[lane]
        counts[lane] = steps - 1 - ptr[lane]
        total += counts[lane]
    words = np.empty(total, dtype=np.uint16)
    k = 0
    for lane in range(w):
        for j in range(ptr[lane] + 1, steps):
            words[k] = buf[lane, j]
            k += 1
    return words
