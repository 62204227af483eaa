"""Interleaved rANS for ECSQ symbols: the device-friendly format and its numpy reference.

Format (one section per stream and group; all integers little endian):
  "<I"  lanes W (0 only when there is no symbol)
  W x "<I"  each lane's final encoder state, in [STATE_LOW, 2^32)
  W x "<H"  each lane's word count (its 16-bit words follow the previous lanes' words)
  words     "<H" each, lane by lane, each lane's words in the order its decoder reads them
The N = tokens x kept symbols are taken in row-major (token, component) order; lane l codes the
flat positions l, l + W, l + 2W, ..., so every lane sees every component and the decoder's step i
writes positions [iW, iW + W) contiguously. Each lane is an independent 32-bit rANS coder (state in
[2^16, 2^32), 16-bit renormalisation, PROB_BITS-bit static tables): its final state and its word
offset (the sum of the previous lanes' counts) are read without decoding any other lane. The
encoder starts every lane at STATE_LOW, so a decoder that does not end every lane there, having
read exactly its words, holds a corrupt stream.

Work bound: a decode step leaves a state x' < rho (2 - rho) x, rho = f / 2^PROB_BITS for the symbol's frequency
f, so a symbol of component j consumes at least `RansTables.min_bits[j]` = -log2(rho_max (2 - rho_max)) bits
of state (rho_max: the largest frequency of its model); a word adds fewer than 17 bits, a lane starts below
2^32 and ends at 2^16. A section whose lanes and words cannot hold its declared symbols is refused before
any per-symbol array exists (`Layout`), so a small blob cannot make the decoder allocate for millions of
symbols.

Speed: `encode` and `decode` run compiled lane loops (kernels/codec/rans_numba.py) where numba imports, and
the numpy reference (`encode(..., reference=True)`, `decode_indices`, `fill_escapes`) otherwise; both
write and read the same bytes.

Tables (`RansTables`) come from the artifact's calibrated symbol models (kernels/codec/ecsq.py): each
model's integer counts are quantized to frequencies summing to 2^PROB_BITS, every symbol >= 1,
with integer arithmetic only, so every host and device builds the same tables. A model covers
[-r, r] (r = min(radius, MAX_RADIUS)) plus an escape; escaped values follow as int32 in the
escapes section, in flat order, as in the constriction format.
"""
from __future__ import annotations

import functools
import math
import struct
from typing import NamedTuple

import numpy as np

from kvtc.kernels.codec.blob import BlobError

PROB_BITS = 16
PROB_TOTAL = 1 << PROB_BITS
STATE_LOW = 1 << 16
WORD_MASK = 0xFFFF
MAX_RADIUS = 4095  # alphabets up to 8192 symbols: the frequency floor of 1 costs <= 1/8 of the total
MAX_LANE_SYMBOLS = 0xFFFF  # one word per symbol at most, so a lane's word count fits "<H"
LANE_BITS = 8192  # the encoder's target bits per lane: about 40 bits of lane overhead, 0.5%
MAX_SYMBOL = 1 << 30
_U32 = struct.Struct("<I")


def quantize_counts(counts: np.ndarray, total: int = PROB_TOTAL) -> np.ndarray:
    """Integer counts (a,) int64, each >= 1, a <= total -> frequencies (a,) int64 >= 1 summing to total."""
    c = np.asarray(counts, dtype=np.int64)
    s = int(c.sum())
    f = np.maximum(1, (c * total + s // 2) // s)
    diff = total - int(f.sum())
    order = np.argsort(-f, kind="stable")
    if diff > 0:
        f[order[0]] += diff
    for i in order if diff < 0 else ():
        take = min(-diff, int(f[i]) - 1)
        f[i] -= take
        diff += take
        if diff == 0:
            break
    return f


def model_frequencies(radius: int, counts: np.ndarray) -> tuple[int, np.ndarray]:
    """One symbol model -> (table radius r, frequencies (2r + 2,) summing to PROB_TOTAL, escape last);
    symbols beyond MAX_RADIUS move into the escape."""
    c = np.asarray(counts, dtype=np.int64)
    r = min(radius, MAX_RADIUS)
    if r < radius:
        cut = radius - r
        c = np.concatenate([c[cut:cut + 2 * r + 1], [c[:cut].sum() + c[cut + 2 * r + 1:-1].sum() + c[-1]]])
    return r, quantize_counts(c)


class RansTables:
    """Static tables of one ECSQ group, built from its symbol models and per-component model index.

    radius (K,) int64; fc (sum of alphabets,) int64 packs f | cum << 16 per symbol; sym_base (K,)
    the model's first entry in fc; slot2sym (K * PROB_TOTAL,) int16, symbol of each slot;
    comp_model (kept,) int64; comp_radius / comp_sym_base / comp_slot_base (kept,) int64 by component;
    bits (kept,) float64 each component's model entropy (for choosing the lane count); min_bits (kept,)
    float64 the fewest bits of decoder state a symbol of each component consumes (see the module doc).
    """

    def __init__(self, models: tuple, model: np.ndarray) -> None:
        radii, fcs, bases, slots, ent, least, base = [], [], [], [], [], [], 0
        for m in models:
            r, f = model_frequencies(int(m.radius), m.counts)
            cum = np.concatenate([[0], np.cumsum(f)[:-1]])
            radii.append(r)
            fcs.append(f | (cum << 16))
            bases.append(base)
            slots.append(np.repeat(np.arange(f.size, dtype=np.int16), f))
            p = f / PROB_TOTAL
            ent.append(float(-(p * np.log2(p)).sum()))
            rho = float(f.max()) / PROB_TOTAL
            least.append(-math.log2(rho * (2.0 - rho)))
            base += f.size
        self.radius = np.asarray(radii, dtype=np.int64)
        self.fc = np.concatenate(fcs).astype(np.int64) if fcs else np.zeros(0, np.int64)
        self.sym_base = np.asarray(bases, dtype=np.int64)
        self.slot2sym = np.concatenate(slots) if slots else np.zeros(0, np.int16)
        self.comp_model = np.asarray(model, dtype=np.int64)
        self.comp_radius = self.radius[self.comp_model]
        self.comp_sym_base = self.sym_base[self.comp_model]
        self.comp_slot_base = self.comp_model * PROB_TOTAL
        self.bits = np.asarray(ent, dtype=np.float64)[self.comp_model]
        self.min_bits = np.asarray(least, dtype=np.float64)[self.comp_model]

    @property
    def kept(self) -> int:
        return int(self.comp_model.shape[0])


@functools.lru_cache(maxsize=64)
def group_tables(group: object) -> RansTables:
    """The RansTables of an EcsqGroup (cached per group object)."""
    return RansTables(group.models, group.model)


def choose_lanes(tokens: int, tables: RansTables) -> int:
    """Lanes for tokens x kept symbols: about LANE_BITS estimated bits each, at most MAX_LANE_SYMBOLS symbols."""
    n = tokens * tables.kept
    if n == 0:
        return 0
    est = tokens * float(tables.bits.sum())
    return int(min(n, max(1, round(est / LANE_BITS), math.ceil(n / MAX_LANE_SYMBOLS))))


def symbol_indices(q: np.ndarray, tables: RansTables) -> tuple[np.ndarray, np.ndarray]:
    """Symbols (T, kept) int -> (table indices (T * kept,) int64: q + r, or 2r + 1 for an escape;
    escaped values int32 in flat order)."""
    v = np.asarray(q, dtype=np.int64).reshape(-1, tables.kept) if tables.kept else np.zeros((0, 0), np.int64)
    r = tables.comp_radius
    out = np.abs(v) > r
    idx = np.where(out, 2 * r + 1, v + r).reshape(-1)
    return idx, v[out].astype(np.int32)


def max_section_bytes(symbols: int) -> int:
    """Largest valid rANS section for `symbols` symbols: W <= N lanes and at most one word per symbol."""
    return 4 + 6 * symbols + 2 * symbols


def pack_section(lanes: int, states: np.ndarray, counts: np.ndarray, words: np.ndarray) -> bytes:
    return b"".join([_U32.pack(lanes), states.astype("<u4").tobytes(), counts.astype("<u2").tobytes(),
                     words.astype("<u2").tobytes()])


@functools.cache
def compiled() -> object | None:
    """kernels/codec/rans_numba (compiled lane loops), or None where numba does not import."""
    try:
        from kvtc.kernels.codec import rans_numba  # noqa: PLC0415 - numba is optional at runtime and slow to import
    except ImportError:
        return None
    return rans_numba


def warm_up() -> bool:
    """Compile (or load from numba's disk cache) the host kernels now, so a first restore does not pay
    for it (seconds once per host and kvtc version); -> whether the compiled path is in use."""
    if compiled() is None:
        return False
    tables = RansTables((SymbolModelLike(0, np.array([3, 1])),), np.zeros(1, dtype=np.int64))
    q = np.array([[0], [2]], dtype=np.int32)
    section, escapes = encode(q, tables, 1)
    return bool(np.array_equal(decode(section, escapes, 2, tables), q))


class SymbolModelLike(NamedTuple):
    """What RansTables reads of a symbol model (kernels/codec/ecsq.SymbolModel has the same fields)."""

    radius: int
    counts: np.ndarray


def encode(q: np.ndarray, tables: RansTables, lanes: int | None = None, *, reference: bool = False
           ) -> tuple[bytes, bytes]:
    """Symbols (T, kept) int32 -> (rANS section bytes, escapes int32 bytes); compiled lanes, or with
    `reference` (or without numba) numpy vectorised across lanes: the same bytes."""
    fast = None if reference else compiled()
    if fast is not None and tables.kept and np.asarray(q).size:
        v = np.ascontiguousarray(q, dtype=np.int32).reshape(-1, tables.kept)
        n = v.size
        w = choose_lanes(v.shape[0], tables) if lanes is None else lanes
        _check_lanes(w, n)
        states, counts = np.empty(w, dtype=np.int64), np.empty(w, dtype=np.int64)
        words = fast.encode_steps(v.reshape(-1), tables.comp_radius, tables.fc, tables.comp_sym_base, w, states, counts)
        return pack_section(w, states, counts, words), fast.escapes_of(v, tables.comp_radius).tobytes()
    idx, escapes = symbol_indices(q, tables)
    n, kept = idx.size, tables.kept
    w = choose_lanes(n // kept if kept else 0, tables) if lanes is None else lanes
    if n == 0:
        return pack_section(0, np.zeros(0), np.zeros(0), np.zeros(0)), escapes.tobytes()
    _check_lanes(w, n)
    steps = -(-n // w)
    e = tables.fc[(idx.reshape(-1, kept) + tables.comp_sym_base).reshape(-1)]
    freq, cum = e & WORD_MASK, e >> 16
    x = np.full(w, STATE_LOW, dtype=np.int64)
    buf = np.zeros(w * steps, dtype=np.int64)
    ptr = np.full(w, steps - 1, dtype=np.int64)
    row = np.arange(w, dtype=np.int64) * steps
    for i in range(steps - 1, -1, -1):
        a, b = i * w, min(n, i * w + w)
        f, xs = freq[a:b], x[:b - a]
        emit = np.flatnonzero(xs >= (f << 16))
        if emit.size:
            buf[row[emit] + ptr[emit]] = xs[emit] & WORD_MASK
            ptr[emit] -= 1
            xs[emit] >>= 16
        d, m = np.divmod(xs, f)
        x[:b - a] = (d << PROB_BITS) + m + cum[a:b]
    counts = steps - 1 - ptr
    words = buf.reshape(w, steps)[np.arange(steps)[None, :] > ptr[:, None]]
    return pack_section(w, x, counts, words), escapes.tobytes()


def _check_lanes(w: int, n: int) -> None:
    if not 1 <= w <= n or math.ceil(n / w) > MAX_LANE_SYMBOLS:
        raise ValueError(f"lanes must be in [ceil(N / {MAX_LANE_SYMBOLS}), N] for N = {n} symbols, got {w}")


class Layout:
    """A parsed, checked rANS section: lanes, final states (W,), counts (W,), word offsets (W,),
    words (total,) uint16 view, and the symbol geometry (N symbols, steps per lane). With `tables`, a
    section whose lanes and words cannot hold N symbols of those tables is refused (see the module doc):
    every decoder passes them, before it allocates anything per symbol."""

    def __init__(self, section: bytes | memoryview, tokens: int, kept: int, tables: RansTables | None = None
                 ) -> None:
        buf = memoryview(section).cast("B")
        n = tokens * kept
        if len(buf) < 4:
            raise BlobError("rANS section is shorter than its lane count: the stream is truncated")
        (w,) = _U32.unpack(buf[:4])
        lo = 0 if n == 0 else math.ceil(n / MAX_LANE_SYMBOLS)
        if not (lo <= w <= n) or (n > 0 and w == 0):
            raise BlobError(f"rANS section declares {w} lanes for {n} symbols (allowed {max(lo, min(n, 1))}..{n}): "
                            "the blob is corrupt")
        if len(buf) < 4 + 6 * w:
            raise BlobError(f"rANS section of {len(buf)} bytes cannot hold the lane table of {w} lanes: it is truncated")
        self.lanes, self.symbols = w, n
        self.steps = -(-n // w) if w else 0
        self.states = np.frombuffer(buf, dtype="<u4", count=w, offset=4).astype(np.int64)
        self.counts = np.frombuffer(buf, dtype="<u2", count=w, offset=4 + 4 * w).astype(np.int64)
        total = int(self.counts.sum())
        if len(buf) != 4 + 6 * w + 2 * total:
            raise BlobError(f"rANS section holds {len(buf)} bytes, its lane table says {4 + 6 * w + 2 * total}: "
                            "it is truncated or corrupt")
        if tables is not None and n:
            least = tokens * float(tables.min_bits.sum())
            if 17 * total + 16 * w < least * (1 - 1e-9):
                raise BlobError(f"rANS section holds {total} words in {w} lanes; its {n} symbols need at least "
                                f"{math.ceil((least - 16 * w) / 17)} under the artifact's symbol models: the blob is "
                                "truncated or corrupt")
        if w and int(self.states.min()) < STATE_LOW:
            raise BlobError("rANS lane state below the coder's range: the blob is corrupt")
        lane_symbols = self.steps - (np.arange(w) >= n - (self.steps - 1) * w) if w else np.zeros(0, np.int64)
        if w and (self.counts > lane_symbols).any():
            raise BlobError("rANS lane declares more words than it has symbols: the blob is corrupt")
        self.offsets = np.concatenate([[0], np.cumsum(self.counts)[:-1]]).astype(np.int64) if w else self.counts
        self.words = np.frombuffer(buf, dtype="<u2", count=total, offset=4 + 6 * w)
        self.words_offset = 4 + 6 * w


def check_escapes(escapes: bytes | memoryview, symbols: int) -> np.ndarray:
    """Escapes section -> int64 values; BlobError for a bad length or more escapes than symbols."""
    if len(escapes) % 4:
        raise BlobError("ECSQ escapes section length must be a multiple of 4 bytes: it is truncated or corrupt")
    if len(escapes) // 4 > symbols:
        raise BlobError(f"ECSQ escapes section holds {len(escapes) // 4} values for {symbols} symbols: it is corrupt")
    return np.frombuffer(escapes, dtype="<i4").astype(np.int64)


def fill_escapes(idx: np.ndarray, esc: np.ndarray, tables: RansTables) -> np.ndarray:
    """Table indices (T, kept) -> symbols (T, kept) int32 with escapes filled in flat order; BlobError
    when counts differ or an escaped value lies inside its model's range or beyond 2^30."""
    r = tables.comp_radius
    out = idx == 2 * r + 1
    v = idx - r
    k = int(np.count_nonzero(out))
    if k != esc.size:
        raise BlobError(f"ECSQ stream names {k} escaped symbols, the blob holds {esc.size}: it is corrupt")
    if k:
        rad = np.broadcast_to(r, idx.shape)[out]
        if (np.abs(esc) <= rad).any() or (np.abs(esc) > MAX_SYMBOL).any():
            raise BlobError("ECSQ escaped symbol lies inside its model's range or beyond 2^30: the blob is corrupt")
        v[out] = esc
    return v.astype(np.int32)


def decode_indices(layout: Layout, tables: RansTables) -> np.ndarray:
    """A checked Layout -> table indices (N,) int64 (numpy, vectorised across lanes); BlobError for a
    stream that reads past a lane's words or does not end where the encoder started."""
    w, n, kept = layout.lanes, layout.symbols, tables.kept
    out = np.empty(n, dtype=np.int64)
    if n == 0:
        return out
    x = layout.states.copy()
    ptr = layout.offsets.copy()
    end = ptr + layout.counts
    words = layout.words.astype(np.int64)
    s2s, fc = tables.slot2sym, tables.fc
    slot_base = np.tile(tables.comp_slot_base.astype(np.int32), n // kept)
    sym_base = np.tile(tables.comp_sym_base.astype(np.int32), n // kept)
    for i in range(layout.steps):
        a, b = i * w, min(n, i * w + w)
        x_a = x[:b - a]
        slot = x_a & WORD_MASK
        sym = s2s[slot_base[a:b] + slot]
        e = fc[sym_base[a:b] + sym]
        x_a = (e & WORD_MASK) * (x_a >> 16) + slot - (e >> 16)
        out[a:b] = sym
        need = np.flatnonzero(x_a < STATE_LOW)
        if need.size:
            p = ptr[need]
            if (p >= end[need]).any():
                raise BlobError("rANS lane reads past its words: the stream is truncated or corrupt")
            x_a[need] = (x_a[need] << 16) | words[p]
            ptr[need] = p + 1
        x[:b - a] = x_a
    if (x != STATE_LOW).any() or (ptr != end).any():
        raise BlobError("rANS stream does not end where its encoder started (lane state or words left over): "
                        "it is truncated or corrupt")
    return out


def decode(section: bytes | memoryview, escapes: bytes | memoryview, tokens: int, tables: RansTables, *,
           reference: bool = False) -> np.ndarray:
    """Inverse of encode -> symbols (tokens, kept) int32; BlobError for anything inconsistent. Compiled
    lanes, or with `reference` (or without numba) the numpy reference: the same symbols and verdicts."""
    layout = Layout(section, tokens, tables.kept, tables)
    esc = check_escapes(escapes, layout.symbols)
    fast = None if reference else compiled()
    if fast is None:
        idx = decode_indices(layout, tables).reshape(tokens, tables.kept)
        return fill_escapes(idx, esc, tables)
    out = np.empty((tokens, tables.kept), dtype=np.int32)
    if layout.symbols:
        status = fast.decode_steps(layout.states, layout.offsets, layout.counts, layout.words, tables.slot2sym,
                                   tables.fc, tables.comp_slot_base, tables.comp_sym_base, out.reshape(-1))
        if status == 1:
            raise BlobError("rANS lane reads past its words: the stream is truncated or corrupt")
        if status:
            raise BlobError("rANS stream does not end where its encoder started (lane state or words left over): "
                            "it is truncated or corrupt")
    status = fast.fill_escapes(out, tables.comp_radius, esc, MAX_SYMBOL)
    if status == 1:
        raise BlobError(f"ECSQ stream names more or fewer escaped symbols than the {esc.size} the blob holds: "
                        "it is corrupt")
    if status:
        raise BlobError("ECSQ escaped symbol lies inside its model's range or beyond 2^30: the blob is corrupt")
    return out
