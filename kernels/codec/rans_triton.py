"""Interleaved rANS on the device: Triton decode and encode kernels and their launchers.

Same format and tables as kernels/codec/rans.py (the numpy reference, bit-identical). One program
codes BLOCK consecutive lanes; each step of its loop codes flat symbol positions
[i W + lane]; the tables (slot -> symbol, packed frequency | cumulative, per-component bases)
are small static arrays that stay cache-resident. Sections are parsed and checked on the host
(kernels/codec/rans.Layout) before any launch; the launchers only move a section's bytes to the device
and never copy symbols back: `decode_device` returns the symbols on the device, `encode_device`
returns the coded section's bytes.
"""
from __future__ import annotations

import functools

import numpy as np
import torch
import triton
import triton.language as tl

from kvtc.kernels.codec.blob import BlobError
from kvtc.kernels.codec.rans import (MAX_LANE_SYMBOLS, MAX_SYMBOL, PROB_BITS, STATE_LOW, Layout, RansTables, check_escapes,
                                     choose_lanes)

BLOCK = 64


@triton.jit
def _rans_decode_kernel(states_ptr, offsets_ptr, counts_ptr, words_ptr, s2s_ptr, fc_ptr, slot_base_ptr,
                        sym_base_ptr, out_ptr, status_ptr, N, W, KEPT, STEPS, STEP_COMP,
                        STATE_LO: tl.constexpr, BLOCK: tl.constexpr):
    lane = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = lane < W
    x = tl.load(states_ptr + lane, mask=live, other=STATE_LO).to(tl.int64) & 0xFFFFFFFF
    ptr = tl.load(offsets_ptr + lane, mask=live, other=0).to(tl.int64)
    end = ptr + tl.load(counts_ptr + lane, mask=live, other=0).to(tl.int64)
    comp = (lane % KEPT).to(tl.int64)
    bad = tl.zeros((BLOCK,), dtype=tl.int32)
    pos = lane.to(tl.int64)
    for _ in range(STEPS):
        act = live & (pos < N)
        slot = x & 0xFFFF
        sb = tl.load(slot_base_ptr + comp, mask=act, other=0)
        sym = tl.load(s2s_ptr + sb + slot, mask=act, other=0).to(tl.int64)
        yb = tl.load(sym_base_ptr + comp, mask=act, other=0)
        e = tl.load(fc_ptr + yb + sym, mask=act, other=1)
        xn = (e & 0xFFFF) * (x >> 16) + slot - (e >> 16)
        need = act & (xn < STATE_LO)
        has = ptr < end
        word = tl.load(words_ptr + ptr, mask=need & has, other=0).to(tl.int64) & 0xFFFF
        bad = bad | (need & (ptr >= end)).to(tl.int32)
        xn = tl.where(need, (xn << 16) | word, xn)
        ptr = ptr + need.to(tl.int64)
        x = tl.where(act, xn, x)
        tl.store(out_ptr + pos, sym.to(tl.int32), mask=act)
        pos = pos + W
        comp = comp + STEP_COMP
        comp = tl.where(comp >= KEPT, comp - KEPT, comp)
    ok = (x == STATE_LO) & (ptr == end) & (bad == 0)
    tl.store(status_ptr + lane, ok.to(tl.int8), mask=live)


@triton.jit
def _rans_encode_kernel(freq_ptr, cum_ptr, buf_ptr, states_ptr, counts_ptr, N, W, STEPS,
                        STATE_LO: tl.constexpr, PB: tl.constexpr, BLOCK: tl.constexpr):
    lane = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = lane < W
    x = tl.zeros((BLOCK,), dtype=tl.int64) + STATE_LO
    ptr = tl.zeros((BLOCK,), dtype=tl.int64) + STEPS - 1
    row = lane.to(tl.int64) * STEPS
    pos = (tl.zeros((BLOCK,), dtype=tl.int64) + STEPS - 1) * W + lane
    for _ in range(STEPS):
        act = live & (pos < N)
        f = tl.load(freq_ptr + pos, mask=act, other=1)
        c = tl.load(cum_ptr + pos, mask=act, other=0)
        emit = act & (x >= (f << 16))
        tl.store(buf_ptr + row + ptr, (x & 0xFFFF).to(tl.int32), mask=emit)
        ptr = ptr - emit.to(tl.int64)
        x = tl.where(emit, x >> 16, x)
        xn = ((x // f) << PB) + x % f + c
        x = tl.where(act, xn, x)
        pos = pos - W
    tl.store(states_ptr + lane, x, mask=live)
    tl.store(counts_ptr + lane, STEPS - 1 - ptr, mask=live)


class DeviceTables:
    """RansTables on one device: slot2sym int16, fc int64, per-component bases and radius int64."""

    def __init__(self, tables: RansTables, device: torch.device) -> None:
        def put(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a)).to(device)

        self.kept = tables.kept
        self.slot2sym, self.fc = put(tables.slot2sym), put(tables.fc)
        self.slot_base, self.sym_base = put(tables.comp_slot_base), put(tables.comp_sym_base)
        self.radius = put(tables.comp_radius)


@functools.lru_cache(maxsize=64)
def device_tables(tables: RansTables, device: str) -> DeviceTables:
    return DeviceTables(tables, torch.device(device))


def _to_device(raw: bytes | memoryview, device: torch.device) -> torch.Tensor:
    """Bytes -> uint8 tensor on `device`, storage offset 0 (dtype views stay aligned)."""
    host = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if len(raw) else torch.zeros(0, dtype=torch.uint8)
    return host.to(device)


def decode_device(section: bytes | memoryview, escapes: bytes | memoryview, tokens: int, tables: RansTables,
                  device: torch.device) -> torch.Tensor:
    """rANS section + escapes -> symbols (tokens, kept) int32 on `device` (Triton; the interpreter on CPU).
    Everything the blob declares is checked on the host before the launch; BlobError if inconsistent."""
    layout = Layout(section, tokens, tables.kept, tables)
    esc_host = check_escapes(escapes, layout.symbols)
    dt = device_tables(tables, str(device))
    out = torch.empty(tokens, tables.kept, dtype=torch.int32, device=device)
    if layout.symbols == 0:
        return out
    w = layout.lanes
    raw = _to_device(section, device)
    states = raw[4:4 + 4 * w].view(torch.int32)
    counts = raw[4 + 4 * w:4 + 6 * w].view(torch.int16).to(torch.int64) & 0xFFFF
    offsets = torch.cumsum(counts, 0) - counts
    words = raw[layout.words_offset:].view(torch.int16)
    if words.numel() == 0:
        words = torch.zeros(1, dtype=torch.int16, device=device)
    status = torch.empty(w, dtype=torch.int8, device=device)
    _rans_decode_kernel[(triton.cdiv(w, BLOCK),)](
        states, offsets, counts, words, dt.slot2sym, dt.fc, dt.slot_base, dt.sym_base, out, status,
        layout.symbols, w, tables.kept, layout.steps, w % tables.kept, STATE_LO=STATE_LOW, BLOCK=BLOCK)
    if not bool(status.bool().all()):
        raise BlobError("rANS stream does not end where its encoder started (a lane read past its words, or its "
                        "state or words are left over): it is truncated or corrupt")
    return fill_escapes_device(out, _to_device(escapes, device).view(torch.int32), esc_host.size, dt)


def fill_escapes_device(idx: torch.Tensor, esc: torch.Tensor, count: int, dt: DeviceTables) -> torch.Tensor:
    """Table indices (T, kept) int32 on the device -> symbols with escapes filled in flat order (torch)."""
    r = dt.radius.to(torch.int32)
    out = idx == 2 * r + 1
    v = idx - r
    k = int(out.sum())
    if k != count:
        raise BlobError(f"ECSQ stream names {k} escaped symbols, the blob holds {count}: it is corrupt")
    if k:
        rad = torch.masked_select(r.expand_as(idx), out)
        if bool(((esc.abs() <= rad) | (esc.abs() > MAX_SYMBOL) | (esc == -(1 << 31))).any()):
            raise BlobError("ECSQ escaped symbol lies inside its model's range or beyond 2^30: the blob is corrupt")
        v.masked_scatter_(out, esc)
    return v


def encode_device(q: torch.Tensor, tables: RansTables, lanes: int | None = None) -> tuple[bytes, bytes]:
    """Symbols (T, kept) int32 on the device -> (rANS section bytes, escapes bytes), bit-identical to
    rans.encode; only the coded bytes leave the device."""
    dev = q.device
    dt = device_tables(tables, str(dev))
    kept = tables.kept
    tokens = q.shape[0] if kept else 0
    n = tokens * kept
    w = choose_lanes(tokens, tables) if lanes is None else lanes
    if n == 0:
        return (0).to_bytes(4, "little"), b""
    if not 1 <= w <= n or -(-n // w) > MAX_LANE_SYMBOLS:
        raise ValueError(f"lanes must be in [ceil(N / {MAX_LANE_SYMBOLS}), N] for N = {n} symbols, got {w}")
    v = q.to(torch.int64)
    r = dt.radius
    out = v.abs() > r
    idx = torch.where(out, 2 * r + 1, v + r)
    escapes = torch.masked_select(v, out).to(torch.int32)
    e = dt.fc[(idx + dt.sym_base).reshape(-1)]
    freq, cum = (e & 0xFFFF).contiguous(), (e >> 16).contiguous()
    steps = -(-n // w)
    buf = torch.empty(w * steps, dtype=torch.int32, device=dev)
    states = torch.empty(w, dtype=torch.int64, device=dev)
    counts = torch.empty(w, dtype=torch.int64, device=dev)
    _rans_encode_kernel[(triton.cdiv(w, BLOCK),)](freq, cum, buf, states, counts, n, w, steps,
                                                  STATE_LO=STATE_LOW, PB=PROB_BITS, BLOCK=BLOCK)
    keep = torch.arange(steps, device=dev)[None, :] >= (steps - counts)[:, None]
    words = buf.view(w, steps)[keep].to(torch.int16)
    head = torch.tensor([w], dtype=torch.int32, device=dev)
    section = torch.cat([head.view(torch.uint8), states.to(torch.int32).view(torch.uint8),
                         counts.to(torch.int16).view(torch.uint8), words.view(torch.uint8)])
    return section.cpu().numpy().tobytes(), escapes.cpu().numpy().astype("<i4").tobytes()
