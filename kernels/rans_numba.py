"""Interleaved rANS on the host, compiled: numba kernels bit-identical to the numpy reference (kernels/rans.py).

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
def encode_lanes(idx: np.ndarray, fc: np.ndarray, comp_sym_base: np.ndarray, w: int, steps: int,
                 states: np.ndarray, counts: np.ndarray, buf: np.ndarray) -> None:
    """Table indices (n,) in flat order -> per lane: final state, word count, and its words at the end of
    its row of buf (w, steps) in decoder order (as the reference's buffer)."""
    n = idx.shape[0]
    kept = comp_sym_base.shape[0]
    for lane in range(w):
        x = np.int64(_LOW)
        ptr = steps - 1
        pos = lane + (steps - 1) * w
        if pos >= n:
            pos -= w
        comp = pos % kept
        back = w % kept
        while pos >= 0:
            e = fc[comp_sym_base[comp] + idx[pos]]
            f = e & _MASK
            if x >= (f << 16):
                buf[lane, ptr] = x & _MASK
                ptr -= 1
                x >>= 16
            x = ((x // f) << 16) + x % f + (e >> 16)
            pos -= w
            comp -= back
            if comp < 0:
                comp += kept
        states[lane] = x
        counts[lane] = steps - 1 - ptr
