"""Entropy-coded scalar quantization (ECSQ), the runtime half: quantize, reconstruct, code symbols.

One group's projections z (N, kept) are quantized with one global step, q = round(z / step), with
no per-token scale. Symbol q of component j is reconstructed at its calibrated bin centroid,
sign(q) (|q| - offsets[j, min(|q|, C) - 1]) step (0 for q = 0). Each component is assigned one
of the group's symbol models (a quantized Gaussian of the component's scale, stored as integer
counts so encoder and decoder build identical tables); a model covers symbols [-R, R] plus an
escape symbol, and escaped values follow in a separate int32 list, so any finite input
round-trips within one step. Symbols are coded in one of two formats (`ECSQ_FORMATS`):
"rans" (the default: interleaved rANS with static tables, kernels/codec/rans.py, decoded and encoded by
Triton kernels on the device, kernels/codec/rans_triton.py, or by the numpy reference on CPU hosts) or
"constriction" (the first format: constriction's ANS coder, model by model, all tokens of the
components that share a model in one call, on the host).

Rate control (`encode_group`): the calibrated step meets the ratio's budget on average over
held-out text; text that codes larger (another domain) gets a coarser step, step 2^(j / 32) for
the smallest j found that fits the budget, and j leads the words section (int32), so no blob
exceeds its budget while in-domain blobs keep the calibrated step. The symbol models are fixed, so
a coarser step cannot code a token below every symbol 0 (`zero_token_bits`: 62% of the budget for
the embedded model at CR 32, 93% for a basis capped by --basis-budget). Where the budget lies below
that, or the step had to be doubled, a caller may let the group code its first `coded` components
alone (the rest 0, their mean): the exponent field then says so (stream format 2) and a u32 `coded`
follows it; the (coded, step) pair with the least squared error that fits is kept. Such a section sets
the blob's truncated option (kernels/codec/blob.py).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import struct
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from kvtc.artifacts.blocks import ecsq_budget_bytes
from kvtc.artifacts.groups import FeatureGroup
from kvtc.kernels.codec import rans
from kvtc.kernels.codec.blob import BlobError
from kvtc.kernels.codec.extremes import within

MAX_SYMBOL = 1 << 30
PROBABILITY_TOTAL = 1 << 20
STEP_GRID = 32  # rate control: step multipliers 2^(j / STEP_GRID)
MAX_STEP_EXPONENT = 255
_EXPONENT = struct.Struct("<i")
_CODED = struct.Struct("<I")
ECSQ_FORMATS = ("rans", "constriction")
STREAM_FORMAT = 1  # high 16 bits of the exponent field: 1 = coder started from the end-of-stream state
TRUNCATED_FORMAT = 2  # as 1, the first `coded` components alone, a u32 after the field
EMPTY_BYTES = _EXPONENT.size + _CODED.size + 8  # a group coding no component: its header, at most 8 bytes of coder state
TRUNCATED_MIN_SHARE = 4  # a truncated words section holds at least 1/4 of its group's budget (amplification bound)
TRUNCATE_FROM = STEP_GRID  # rate control tries fewer components where the step had to grow by this exponent (x2)
_INITIAL = (0, 1)  # the coder's initial state 2^32 as constriction writes it (low word, high word)
_STATE_BITS = 32   # constriction's num_valid_bits() of that state; a well-formed stream never drops below it
_MAX_SYMBOL_BITS = 25  # a symbol costs at most 24 bits (+ rounding) under a 24-bit-precision model


def check_decoder(group: FeatureGroup, components: torch.Tensor, decoder: torch.Tensor | None) -> None:
    """ValueError unless `decoder` is None or a finite float tensor of the components' shape (p, k)."""
    if decoder is None:
        return
    if not isinstance(decoder, torch.Tensor) or decoder.shape != components.shape:
        got = tuple(decoder.shape) if isinstance(decoder, torch.Tensor) else type(decoder).__name__
        raise ValueError(f"group {group.label}: decoder {got} must be a tensor of the components' shape "
                         f"{tuple(components.shape)}")
    if not decoder.is_floating_point() or not bool(torch.isfinite(decoder).all()):
        raise ValueError(f"group {group.label}: decoder must hold finite floating-point values")


class SymbolModel(NamedTuple):
    """Symbols [-radius, radius] then one escape: counts (2 radius + 2,) int64, each >= 1."""

    radius: int
    counts: np.ndarray


@dataclass(frozen=True, eq=False)
class EcsqGroup:
    """One basis at one ratio: its group (layers x KV heads); mean (p,), components (p, kept) float32; step; model
    (kept,) int index into `models` per component; offsets (kept, C) float32 centroid offsets in steps;
    decoder (p, kept) float32 of a basis that is not orthonormal, None otherwise (see `decoding`); budget_bits:
    its bits per token at the ratio (its share of a joint split; 0: floor(16 p / CR), see `budget_bytes`)."""

    group: FeatureGroup
    mean: torch.Tensor
    components: torch.Tensor
    step: float
    model: np.ndarray
    offsets: torch.Tensor
    models: tuple[SymbolModel, ...]
    decoder: torch.Tensor | None = None
    budget_bits: int = 0

    def budget_bytes(self, ratio: float, tokens: int) -> int:
        """The rate control's bound for `tokens` coded tokens of this basis at `ratio`."""
        if self.budget_bits:
            return int(self.budget_bits) * tokens // 8
        return ecsq_budget_bytes(int(self.mean.shape[0]), ratio, tokens)

    def __post_init__(self) -> None:
        p, kept = self.components.shape if self.components.ndim == 2 else (-1, -1)
        if self.mean.ndim != 1 or p != self.mean.shape[0]:
            raise ValueError(f"ECSQ group {self.group.label}: mean {tuple(self.mean.shape)} and components "
                             f"{tuple(self.components.shape)} must be (p,) and (p, kept)")
        check_decoder(self.group, self.components, self.decoder)
        if not (self.step > 0 and np.isfinite(self.step)):
            raise ValueError(f"ECSQ group {self.group.label}: step must be a positive finite number, got {self.step}")
        if self.model.shape != (kept,) or self.offsets.ndim != 2 or self.offsets.shape[0] != kept \
                or self.offsets.shape[1] < 1:
            raise ValueError(f"ECSQ group {self.group.label}: model {self.model.shape} and offsets "
                             f"{tuple(self.offsets.shape)} must be ({kept},) and ({kept}, C)")
        if kept and (self.model.min() < 0 or self.model.max() >= len(self.models)):
            raise ValueError(f"ECSQ group {self.group.label}: a component names a symbol model outside 0..{len(self.models) - 1}")
        for m in self.models:
            if m.radius < 0 or m.counts.shape != (2 * m.radius + 2,) or m.counts.min() < 1:
                raise ValueError(f"ECSQ group {self.group.label}: a symbol model needs 2 radius + 2 counts, each >= 1")

    @property
    def kept(self) -> int:
        return int(self.components.shape[1])

    @property
    def decoding(self) -> torch.Tensor:
        """The matrix (p, kept) that reconstructs: the decoder, or the components of an orthonormal basis."""
        return self.decoder if self.decoder is not None else self.components

    @functools.cached_property
    def columns(self) -> tuple[np.ndarray, ...]:
        """Per model, the component indices that use it (ascending)."""
        return tuple(np.flatnonzero(self.model == i) for i in range(len(self.models)))

    @functools.cached_property
    def escape_bits(self) -> float:
        """The fewest bits an escape symbol costs in the words under any used model (measured on the coder)."""
        import constriction  # noqa: PLC0415 - only the constriction format needs it (a rans-only runtime may lack it)

        costs = []
        for m, cols, model in zip(self.models, self.columns, self.coders):
            if cols.size:
                coder = constriction.stream.stack.AnsCoder(np.array(_INITIAL, dtype=np.uint32))
                coder.encode_reverse(np.full(256, 2 * m.radius + 1, dtype=np.int32), model)
                costs.append(max(0.0, (coder.num_valid_bits() - _STATE_BITS - 1) / 256 - 0.05))
        return min(costs, default=0.0)

    @functools.cached_property
    def coders(self) -> tuple:
        """Per model, constriction's lookup-table categorical model."""
        import constriction  # noqa: PLC0415 - only the constriction format needs it (a rans-only runtime may lack it)

        return tuple(constriction.stream.model.Categorical(m.counts / m.counts.sum(), perfect=False)
                     for m in self.models)


@functools.lru_cache(maxsize=256)
def truncated(group: EcsqGroup, coded: int) -> EcsqGroup:
    """The group's first `coded` components alone (cached per group object, as its coding tables are): views of
    its tensors, no copy, and not checked again (a full pass over the decoder; the group's own check holds)."""
    sub = object.__new__(EcsqGroup)
    values = dict(vars(group), components=group.components[:, :coded], model=group.model[:coded].copy(),
                  offsets=group.offsets[:coded], decoder=None if group.decoder is None else group.decoder[:, :coded])
    for f in dataclasses.fields(EcsqGroup):
        object.__setattr__(sub, f.name, values[f.name])
    return sub


def component_zero_bits(group: EcsqGroup) -> np.ndarray:
    """(kept,) the bits each component's symbol 0 costs under its model (rANS frequencies)."""
    per_model = []
    for m in group.models:
        r, f = rans.model_frequencies(int(m.radius), m.counts)
        per_model.append(-math.log2(float(f[r]) / rans.PROB_TOTAL))
    return np.asarray(per_model, dtype=np.float64)[group.model] if group.kept else np.zeros(0)


def quantize(z: torch.Tensor, step: float, check: bool = True) -> torch.Tensor:
    """z (N, kept) float -> symbols (N, kept) int32; ValueError for non-finite or absurdly large values (check:
    False where the same z passed at a step no larger)."""
    q = torch.round(z.float() / step)
    if check and not within(q, MAX_SYMBOL):
        raise ValueError("the cache holds non-finite values or values beyond 2^30 quantizer steps; "
                         "ECSQ cannot code them (check the model's numerics, or use mode='fixed')")
    return q.to(torch.int32)


def dequantize(q: torch.Tensor, step: float, offsets: torch.Tensor) -> torch.Tensor:
    """symbols (N, kept) int32, offsets (kept, C) -> zhat (N, kept) float32 at the bin centroids."""
    a = q.abs()
    idx = (a.clamp(1, offsets.shape[1]) - 1).long()
    off = torch.gather(offsets.expand(q.shape[0], -1, -1), 2, idx.unsqueeze(2)).squeeze(2)
    return torch.where(a > 0, torch.sign(q).float() * (a.float() - off), torch.zeros((), device=q.device)) * step


def encode_symbols(q: np.ndarray, group: EcsqGroup) -> tuple[bytes, bytes]:
    """symbols (N, kept) int32 -> (ANS words as little-endian bytes, escaped symbols as int32 bytes)."""
    import constriction  # noqa: PLC0415 - only the constriction format needs it (a rans-only runtime may lack it)

    coder = constriction.stream.stack.AnsCoder(np.array(_INITIAL, dtype=np.uint32))
    chunks = []
    for m, cols, model in zip(group.models, group.columns, group.coders):
        s = q[:, cols].ravel().astype(np.int64)
        out = (s < -m.radius) | (s > m.radius)
        chunks.append((np.where(out, 2 * m.radius + 1, s + m.radius).astype(np.int32), s[out], model))
    for idx, _, model in reversed(chunks):  # a stack: the first chunk is encoded last, decoded first
        if idx.size:
            coder.encode_reverse(idx, model)
    escapes = np.concatenate([c[1] for c in chunks]) if chunks else np.zeros(0)
    return coder.get_compressed().astype("<u4").tobytes(), escapes.astype("<i4").tobytes()


def decode_symbols(words: bytes, escapes: bytes, tokens: int, group: EcsqGroup) -> np.ndarray:
    """Inverse of encode_symbols -> symbols (tokens, kept) int32; BlobError for a stream that does
    not decode to exactly `tokens` rows ending in the coder's initial state (truncated, corrupt,
    leftover words) or escapes that do not fit the models."""
    import constriction  # noqa: PLC0415 - only the constriction format needs it (a rans-only runtime may lack it)

    if len(words) % 4 or len(escapes) % 4 or len(words) < 4 * len(_INITIAL):
        raise BlobError("ECSQ section lengths must be multiples of 4 bytes and hold at least the coder's state: "
                        "the stream is truncated or corrupt")
    esc = np.frombuffer(escapes, dtype="<i4").astype(np.int64)
    q = np.empty((tokens, group.kept), dtype=np.int32)
    used = 0
    try:
        coder = constriction.stream.stack.AnsCoder(np.frombuffer(words, dtype="<u4").copy())
        for m, cols, model in zip(group.models, group.columns, group.coders):
            if not cols.size or not tokens:
                continue
            idx = coder.decode(model, tokens * cols.size).astype(np.int64)
            if coder.num_valid_bits() < _STATE_BITS:
                raise BlobError("ECSQ stream ran dry before its last symbol: it is truncated or corrupt")
            out = idx == 2 * m.radius + 1
            n = int(out.sum())
            if used + n > esc.size:
                raise BlobError("ECSQ stream names more escaped symbols than the blob holds: it is corrupt")
            vals = idx - m.radius
            extra = esc[used:used + n]
            if n and (np.abs(extra) <= m.radius).any() or (np.abs(extra) > MAX_SYMBOL).any():
                raise BlobError("ECSQ escaped symbol lies inside its model's range or beyond 2^30: the blob is corrupt")
            vals[out] = extra
            used += n
            q[:, cols] = vals.reshape(tokens, cols.size)
        rest = coder.get_compressed()
    except BlobError:
        raise
    except Exception as exc:  # constriction reports exhausted or invalid data as ValueError/AssertionError
        raise BlobError(f"ECSQ stream does not decode ({exc}): it is truncated or corrupt") from None
    if tuple(int(w) for w in rest) != _INITIAL or used != esc.size:
        raise BlobError("ECSQ stream does not end where its symbols do (leftover words or escapes, or a final "
                        "state other than the coder's initial state): it is truncated or corrupt")
    return q


def _check_format(fmt: str) -> None:
    if fmt not in ECSQ_FORMATS:
        raise ValueError(f"ECSQ format must be one of {ECSQ_FORMATS}, got {fmt!r}")


def section_bounds(group: EcsqGroup, tokens: int, words_len: int | None = None, fmt: str = "constriction"
                   ) -> tuple[int, int]:
    """(most bytes of the words section, its header included; most bytes of the escapes section) for
    `tokens` rows; with the words section's real length, escapes are also bounded by what it can name."""
    symbols = tokens * group.kept
    if fmt == "rans":
        words_max = _EXPONENT.size + _CODED.size + rans.max_section_bytes(symbols)
    else:
        words_max = _EXPONENT.size + _CODED.size + 4 * (len(_INITIAL) + 1 + (symbols * _MAX_SYMBOL_BITS + 31) // 32)
    escapes = symbols
    if fmt != "rans" and words_len is not None and group.escape_bits > 0:  # rans: no constriction needed
        bits = 8 * max(0, words_len - _EXPONENT.size) + 64
        escapes = min(escapes, int(bits / group.escape_bits) + 1)
    return words_max, 4 * escapes


@functools.lru_cache(maxsize=256)
def min_token_bits(group: EcsqGroup, fmt: str) -> float:
    """A lower bound on the bits one token's symbols add to the words section, from the group's models.

    An ANS coder whose state never drops below its word size W (rANS: state >= 2^16 = its table total M)
    grows by at least log2(M / f) + log2(1 - f / M) bits for a symbol of frequency f (the floor of state / f
    loses at most a factor 1 - f / M), so a model whose likeliest symbol has probability p costs at least
    log2((1 - p) / p) bits per symbol (0 when p >= 1/2). The words and final states hold every such bit:
    a section of B bytes can hold at most 8 B. constriction's tables are rounded from the counts, so its
    bound is halved."""
    per_model = []
    for m in group.models:
        if fmt == "rans":
            _, f = rans.model_frequencies(int(m.radius), m.counts)
            p = float(f.max()) / rans.PROB_TOTAL
        else:
            p = float(m.counts.max()) / float(m.counts.sum())
        per_model.append(max(0.0, math.log2((1 - p) / p)) if p < 1 else 0.0)
    bits = float(np.asarray(per_model, dtype=np.float64)[group.model].sum()) if group.kept else 0.0
    return bits if fmt == "rans" else bits / 2


def zero_token_bits(group: EcsqGroup) -> float:
    """The bits one token costs when every symbol is 0 (the coarsest step's limit): a step alone cannot code
    this group below it, its symbol models being fixed at calibration (rANS frequencies); fewer coded
    components can (`encode_group`)."""
    return float(component_zero_bits(group).sum())


def check_capacity(group: EcsqGroup, tokens: int, words: bytes | memoryview, fmt: str, budget: int = 0) -> None:
    """BlobError when a words section cannot hold `tokens` tokens' symbols (of the components its header says it
    codes; a truncated one, at least 1 / TRUNCATED_MIN_SHARE of `budget`, its group's budget for the tokens):
    checked before any array is built for them, so a short blob declaring many tokens costs nothing to refuse."""
    sub, _, head = coded_group(group, words)
    words_len = len(words)
    if sub is not group and words_len < budget // TRUNCATED_MIN_SHARE:
        raise BlobError(f"ECSQ section of {words_len} bytes cannot hold {tokens} tokens of group {group.group.label} "
                        f"coded to its first {sub.kept} components (such a section holds at least "
                        f"{budget // TRUNCATED_MIN_SHARE} bytes, a quarter of its budget): the blob is truncated or "
                        "declares tokens it does not hold")
    group = sub
    need = tokens * min_token_bits(group, fmt)
    have = 8 * max(0, words_len - head) + 64
    if need > have:
        raise BlobError(f"ECSQ section of {words_len} bytes cannot hold {tokens} tokens of group "
                        f"{group.group.label} (they need at least {math.ceil(need / 8)} bytes): the blob is "
                        "truncated or declares tokens it does not hold")


def encode_group(z: torch.Tensor, group: EcsqGroup, max_bytes: int | None = None, fmt: str = "constriction",
                 on_device: bool = False, truncate: bool = False, min_words: int = 0, first: int = 0,
                 symbols: list | None = None) -> tuple[bytes, bytes]:
    """z (N, kept) projections -> (words section: step exponent j [and the coded components] then the coded
    symbols, escapes section). max_bytes: the two sections' budget; j is the smallest exponent (step
    2^(j / STEP_GRID)) that fits; never within it, the coarsest tried, for the caller to weigh (a chunk store
    codes the chunk fixed-rate). truncate: where no step fits or j >= TRUNCATE_FROM, fewer coded components are
    tried (the module docstring): for a caller with no better way to meet the budget (a first chunk paying its raw
    sinks); min_words: the fewest bytes a truncated words section may take (a reader refuses fewer, so a short blob
    cannot declare a long cache; the codec passes TRUNCATED_MIN_SHARE's share of the group's budget).
    fmt: "rans" or "constriction"; on_device (rans): code with the Triton kernel where z lies, so only the coded
    bytes reach the host. first: the exponent the search starts from, one whose predecessor is known to exceed
    max_bytes (`step_exponent` of the same z fitted within a larger budget: the codec's re-coding after outlier
    vectors), so the search skips the exponents below it; 0 searches them all. symbols: where given, a list the
    coded symbols (N, kept) int32 are appended to, as `decode_group` reads them back (left empty for a truncated
    coding: read it back)."""
    _check_format(fmt)
    best, size, j, q = _fit_step(z, group, max_bytes, fmt, on_device, None, first)
    if max_bytes is None or not truncate or not q.numel() or (size <= max_bytes and j < TRUNCATE_FROM):
        if symbols is not None:
            symbols.append(q)
        return best
    return _fit_components(z, group, max_bytes, fmt, on_device, (best, size, j, q), min_words)


def _attempt(z: torch.Tensor, group: EcsqGroup, j: int, fmt: str, on_device: bool, coded: int | None,
             check: bool = True) -> tuple[tuple[bytes, bytes], int, torch.Tensor]:
    q = quantize(z, group.step * 2.0 ** (j / STEP_GRID), check)
    if fmt == "constriction":
        words, escapes = encode_symbols(q.cpu().numpy(), group)
    elif on_device:
        from kvtc.kernels.codec.rans_triton import encode_device  # noqa: PLC0415 - triton loads only to code on a device

        words, escapes = encode_device(q, rans.group_tables(group))
    else:
        words, escapes = rans.encode(q.cpu().numpy(), rans.group_tables(group))
    head = _EXPONENT.pack(j | STREAM_FORMAT << 16) if coded is None else \
        _EXPONENT.pack(j | TRUNCATED_FORMAT << 16) + _CODED.pack(coded)
    return (head + words, escapes), len(head) + len(words) + len(escapes), q


def _fit_step(z: torch.Tensor, group: EcsqGroup, max_bytes: int | None, fmt: str, on_device: bool,
              coded: int | None, first: int = 0) -> tuple[tuple[bytes, bytes], int, int, torch.Tensor]:
    """The smallest step exponent from `first` (encode_group) that fits max_bytes -> (sections, their bytes, j,
    symbols); never within the budget: the coarsest tried, for the caller to weigh."""
    best, size, q = _attempt(z, group, first, fmt, on_device, coded)
    if max_bytes is None or size <= max_bytes or not q.numel():
        return best, size, first, q
    lo, hi, j, found = first, None, first, (best, size, first, q)
    for _ in range(16):
        if hi is None:
            # a doubled step saves about one bit per token on each component coded at a useful rate
            live = max(1, int((q.abs().float().mean(0) >= 0.5).sum()))
            j = min(MAX_STEP_EXPONENT, j + max(1, math.ceil((size - max_bytes) * 8 / q.shape[0] / live * STEP_GRID)))
        else:
            j = (lo + hi) // 2
        out, size, q = _attempt(z, group, j, fmt, on_device, coded, check=False)  # j > first: checked there
        if size <= max_bytes:
            hi, found = j, (out, size, j, q)
        else:
            lo = j
            if j >= MAX_STEP_EXPONENT:
                return out, size, j, q
        if hi is not None and hi - lo <= 1:
            break
    return found if hi is not None else (out, size, j, q)


def _error(z: torch.Tensor, group: EcsqGroup, j: int, q: torch.Tensor) -> float:
    """Squared error of z (N, kept) coded as symbols q (N, coded <= kept) at exponent j, the rest 0."""
    coded = q.shape[1]
    zhat = dequantize(q.to(z.device), group.step * 2.0 ** (j / STEP_GRID), group.offsets[:coded].to(z.device))
    return float((z[:, :coded].float() - zhat).square().sum() + z[:, coded:].float().square().sum())


def _fit_components(z: torch.Tensor, group: EcsqGroup, max_bytes: int, fmt: str, on_device: bool,
                    plain: tuple, min_words: int) -> tuple[bytes, bytes]:
    """Rate control below the step's reach: the first `coded` components alone, for the counts whose symbols
    0 leave room in max_bytes (from the most, each 4/5 of the last), each at its smallest fitting step, words of
    at least min_words bytes; the one with the least squared error wins, the plain step's result among them where
    it fits (none fitting: the plain step's, over the budget, for the caller to weigh)."""
    n = z.shape[0]
    best, err = (plain[0], _error(z, group, plain[2], plain[3])) if plain[1] <= max_bytes else (None, math.inf)
    room = (max_bytes - _EXPONENT.size - _CODED.size - 8) * 8 / max(n, 1)  # 8: the rANS states' slack
    zero = np.concatenate([[0.0], np.cumsum(component_zero_bits(group))])
    coded = min(group.kept - 1, int(np.searchsorted(zero, 0.9 * room, side="right")) - 1)
    worse = 0
    while coded >= 0:
        out, size, j, q = _fit_step(z[:, :coded].contiguous(), truncated(group, coded), max_bytes, fmt, on_device,
                                    coded)
        e = _error(z, group, j, q) if size <= max_bytes and len(out[0]) >= min_words else math.inf
        if e < err:
            best, err, worse = out, e, 0
        elif best is not None:
            worse += 1
            if worse >= 2:
                break
        if coded == 0:
            break
        coded = int(coded * 0.8)
    return best if best is not None else plain[0]


def coded_group(group: EcsqGroup, words: bytes | memoryview) -> tuple[EcsqGroup, int, int]:
    """A words section's header -> (the group its symbols code: `group`, or its first components alone; step
    exponent j; header bytes). BlobError for a header that is not one this reader writes."""
    if len(words) < _EXPONENT.size:
        raise BlobError("ECSQ section is shorter than its step exponent: the stream is truncated")
    (field,) = _EXPONENT.unpack(words[:_EXPONENT.size])
    j, stream_format = field & 0xFFFF, field >> 16
    if stream_format == 0 and j <= MAX_STEP_EXPONENT:
        raise BlobError("ECSQ stream was written by an older release without an end-of-stream state (a truncated "
                        "one cannot be told apart): re-encode the cache with this release")
    if stream_format not in (STREAM_FORMAT, TRUNCATED_FORMAT) or not 0 <= j <= MAX_STEP_EXPONENT:
        raise BlobError(f"ECSQ step exponent {j} is outside 0..{MAX_STEP_EXPONENT}: the blob is corrupt")
    if stream_format == STREAM_FORMAT:
        return group, j, _EXPONENT.size
    if len(words) < _EXPONENT.size + _CODED.size:
        raise BlobError("ECSQ section is shorter than its coded-components count: the stream is truncated")
    (coded,) = _CODED.unpack(words[_EXPONENT.size:_EXPONENT.size + _CODED.size])
    if coded >= group.kept:
        raise BlobError(f"ECSQ section codes {coded} components of a group that keeps {group.kept} (a truncated "
                        "section codes fewer): the blob is corrupt")
    return truncated(group, coded), j, _EXPONENT.size + _CODED.size


def step_exponent(words: bytes | memoryview) -> int:
    """A words section's step exponent j (its step is the group's times 2^(j / STEP_GRID))."""
    return _EXPONENT.unpack(words[:_EXPONENT.size])[0] & 0xFFFF


def is_truncated(words: bytes | memoryview) -> bool:
    """Whether a words section codes fewer components than its group keeps (its header's stream format)."""
    return len(words) >= _EXPONENT.size and _EXPONENT.unpack(words[:_EXPONENT.size])[0] >> 16 == TRUNCATED_FORMAT


def _padded(q: np.ndarray | torch.Tensor, kept: int) -> np.ndarray | torch.Tensor:
    """Symbols of the first components (tokens, coded) -> (tokens, kept), the rest 0."""
    if q.shape[1] == kept:
        return q
    if isinstance(q, torch.Tensor):
        return torch.nn.functional.pad(q, (0, kept - q.shape[1]))
    return np.pad(q, ((0, 0), (0, kept - q.shape[1])))


def decode_group(words: bytes, escapes: bytes, tokens: int, group: EcsqGroup, fmt: str = "constriction"
                 ) -> tuple[np.ndarray, float]:
    """Inverse of encode_group on the host -> (symbols (tokens, kept) int32, the step they were quantized with)."""
    _check_format(fmt)
    sub, j, head = coded_group(group, words)
    if fmt == "rans":
        q = rans.decode(memoryview(words)[head:], escapes, tokens, rans.group_tables(sub))
    else:
        q = decode_symbols(words[head:], escapes, tokens, sub)
    return _padded(q, group.kept), group.step * 2.0 ** (j / STEP_GRID)


def decode_group_to(words: bytes, escapes: bytes, tokens: int, group: EcsqGroup, fmt: str,
                    device: torch.device, on_device: bool) -> tuple[torch.Tensor, float]:
    """decode_group -> symbols as an int32 tensor on `device`; with on_device (rans) the Triton kernel
    decodes where the symbols are used and only the coded bytes travel."""
    _check_format(fmt)
    if fmt == "rans" and on_device:
        from kvtc.kernels.codec.rans_triton import decode_device  # noqa: PLC0415 - triton loads only to code on a device

        sub, j, head = coded_group(group, words)
        q = decode_device(memoryview(words)[head:], escapes, tokens, rans.group_tables(sub), device)
        return _padded(q, group.kept), group.step * 2.0 ** (j / STEP_GRID)
    q, step = decode_group(words, escapes, tokens, group, fmt)
    return torch.from_numpy(q).to(device), step
