"""KV chunks as a storage layer hands them (LMCache: (2, layers, tokens, kv_heads * head_dim)) <->
bounded-size KVTC bytes. The pure transform behind kernels/integrations/lmcache_serde.py; imports no LMCache.

Sinks and window: a chunk is never the end of a sequence, so no recent window is kept raw. A chunk
that starts before position `sinks` (the artifact's; the first chunk of every sequence) keeps those
first tokens raw inside its blob, as the main job's protocol keeps them: the attention sinks' error is
above 100% (the seed's second chart) and every later query attends to them. That needs positions: a
transform built with `positions=False` (a store that hands chunks by content hash alone) cannot tell
the first chunk from the others and codes every token (docs/serving.md: what that costs). With
`sink_budget="shared"` (the default) the raw sinks come out of the first chunk's own budget (its other
tokens at a coarser ECSQ step; where ECSQ cannot code it so, fixed-rate keeping every sink raw, the first
alone or none, the most the bound holds: two codings at most), so the size bound, and every chunk a padding
store keeps, is a later chunk's: the ratio's bytes. Where a first
chunk would keep less than MIN_SHARED_SCALE of its budget (short chunks at a high ratio) or is coded
fixed-rate, its sinks come on top as with "extra", said once in the log: the bound then counts them and a
store that pads every chunk to the bound pays them on every chunk. `sink_format="int8"` (the default)
stores the sinks as int8 codes with a float32 scale per token vector (kernels/codec/sinks_int8.py): about
half the bytes of bfloat16, at about 1% error.

Keys and RoPE: an artifact calibrated with `--keys rope-kept` codes keys as cached, whatever their
position. One calibrated with RoPE removed (the default) needs each chunk's position: the caller
passes `start` (the absolute position of the chunk's first token; in a prefix cache chunk i starts at
i x chunk size), the blob records it and decode re-applies RoPE there. A caller that cannot know
positions builds its transforms with `positions=False`, and a RoPE-removed artifact is then refused.
With `positions=True` every chunk's position is required, for either kind of artifact.

Binding: a blob records the artifact (name, version), ratio, placement (the model id names the
rank's KV heads and the stage's layers) and start position it was coded for, and the frame
(kernels/codec/chunk_frame.py) carries a digest of the storage key it was stored under (`binding`) and the chunk's
identity (kernels/codec/chunk_identity.py): the artifact's digest, the model (model id, revision, tokenizer, the
engine's name for it), its RoPE configuration and the KV layout (heads, head width, layers, placement, dtype, tokens,
world size), four 4-byte digests. `deserialize` compares them with the transform and with what the caller knows of
the key (its position, its digest, what the store says of the chunk: `engine`): any disagreement is a BlobError,
which a storage layer counts as a miss; nothing is written to the destination then. Another identity is an
IdentityMismatch naming the parts that differ (told apart from another key); a version-1 frame (b"KVTCCHK1" or
b"KVTCCHK2", written before frames carried an identity) is one too: a miss, its blob still readable (`unframe`).
Where the caller knows no position for the key (a server restarted on the same store), the blob's own start is used
once the frame binds the chunk to the key asked for. With a deployment chunk key (`key_file`, or the file
$KVTC_CHUNK_KEY_FILE names: 32 random bytes created once with mode 0600, shared by every server of the
store and kept outside it) the frame carries instead a MAC of the key's binding, the identity and the whole blob
under that key (magic b"KVTCCHK4"), so a writer of the store cannot make or alter a chunk that loads for any key;
a server with a key refuses unkeyed frames (b"KVTCCHK3"), one without a key refuses keyed ones.

Placement: a storage layer keys chunks by a rank (LMCache packs world size, global rank, local world
size and local rank into `ObjectKey.kv_rank`: kernels/integrations/lmcache_ranks.py decodes it). With an artifact calibrated for T
tensor-parallel ranks (`kvtc calibrate --tp T`; T = 1 without it), world size W = T x P: global rank g
holds TP rank g % T's KV heads of pipeline stage g // T, whose layers are vLLM's partition of the
model's layers into P stages (its default, or `pp_partition`, vLLM's VLLM_PP_LAYER_PARTITION). A
stage is coded with the bases of its layers alone, which needs every basis group inside one stage
(calibrate with `--groups layer` or `layers:K`); other placements are refused with the reason.

Mode: the artifact's default (ECSQ where it carries ECSQ tables for the ratio, else fixed-rate), or
`mode=` explicitly. Size bound (`serialized_size`): ECSQ's rate control coarsens the step of any
(stream, group) whose bytes would exceed the ratio's budget, so an ECSQ blob is at most its header,
its raw sinks and the budgets; a finite chunk that ECSQ cannot code within that (values thousands of
times the calibration's, a 1e10 spike) is coded fixed-rate instead, whose size is exact. The bound is
the largest of these over a first chunk (raw sinks) and any other, and every finite chunk is stored.
Sections are stored plain (no DEFLATE). The bound of a chunk shape is the same for every rank and
stage that can hold it (a storage layer sizes a chunk by its shape alone, before its key).

Bytes: the frame "<8s16sQ16s" (48 bytes: magic b"KVTCCHK3", or b"KVTCCHK4" keyed; the key's binding digest or
zeros, or the MAC; blob length; identity), then the blob (kernels/codec/blob.py); with `pad` (the default), zero
padding up to the bound, for storage layers that read back exactly the bound (LMCache's filesystem adapter); without
it, exactly the blob, for layers that keep variable-size objects.
"""
from __future__ import annotations

import hmac
import logging
from dataclasses import dataclass, replace
from typing import Any

import torch

from kvtc.kernels.codec.chunk_options import CHUNK_KEY_BYTES, CHUNK_KEY_ENV, SINK_BUDGETS
from kvtc.kernels.codec.blob import TAG_RAW_HEAD, TAG_RAW_TAIL, BlobError, BlobHeader, Section, read_blob, write_blob
from kvtc.kernels.codec.blob_plan import BlobPlan
from kvtc.kernels.codec.chunk_frame import FRAME_BYTES, UNBOUND, Frame, frame, keyed_binding, read_frame
# the frame's names, imported from here by earlier callers and benches
from kvtc.kernels.codec.chunk_frame import FRAME_MAGIC as FRAME_MAGIC, KEYED_MAGIC as KEYED_MAGIC, binding as binding
from kvtc.kernels.codec.chunk_frame import unframe as unframe, unframe_keyed as unframe_keyed
from kvtc.kernels.codec.chunk_identity import ChunkIdentity, Engine, old_frame
from kvtc.kernels.codec.extremes import all_finite
from kvtc.kernels.codec.kvtc_codec import KVTCCodec
from kvtc.kernels.codec.layered import restrict
from kvtc.kernels.codec.model_config import check_config
from kvtc.kernels.codec.spec import CodecSpec

_log = logging.getLogger("kvtc.chunk_serde")
_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
_TOLD: set[tuple] = set()  # the first-chunk shapes whose sinks come on top, said once per process (INFO: a server's log)
MIN_SHARED_SCALE = 0.5  # shared sinks where the first chunk keeps at least this share of its budget, else extra
FLOOR_SHARE = 0.9  # and where the mode's floor (every symbol 0) is at most this share of what it keeps


def nonfinite_where(kv: torch.Tensor) -> str | None:
    """None if every value of the chunk (2, L, T, F) is finite, else where the first non-finite one is."""
    if all_finite(kv):
        return None
    bad = ~torch.isfinite(kv)
    flat = int(bad.reshape(-1).to(torch.uint8).argmax())
    i = [int(n) for n in torch.unravel_index(torch.tensor(flat), tuple(kv.shape))]
    return (f"{int(bad.sum())} NaN or infinite value(s), the first in the {('keys', 'values')[i[0]]} of layer {i[1]}, "
            f"token {i[2]} of the chunk, feature {i[3]}")


# ------------------------------------------------------------------ ranks and placements


def stage_layers(num_layers: int, stage: int, stages: int, partition: tuple[int, ...] | None = None) -> tuple[int, int]:
    """[first, end) of the model layers pipeline stage `stage` of `stages` holds: vLLM's partition
    (`vllm.distributed.utils.get_pp_indices`: equal shares, the remainder one layer each to the stages
    before the last, counting back), or `partition` (layers per stage, VLLM_PP_LAYER_PARTITION)."""
    if partition is not None:
        if len(partition) != stages or sum(partition) != num_layers:
            raise ValueError(f"pp_partition {list(partition)} does not split the artifact's {num_layers} layers into "
                             f"{stages} pipeline stages")
        parts = list(partition)
    else:
        if stages > num_layers:
            raise ValueError(f"{stages} pipeline stages cannot split the artifact's {num_layers} layers")
        parts = [num_layers // stages] * stages
        for i in range(2, num_layers % stages + 2):
            parts[-i] += 1
    first = sum(parts[:stage])
    return first, first + parts[stage]


@dataclass(frozen=True)
class Placement:
    """What one rank's chunks hold: TP rank `tp_rank` of the artifact's `tp` and model layers [first, end)."""

    tp_rank: int
    tp: int
    first: int
    end: int

    def describe(self, spec: CodecSpec) -> str:
        heads = spec.tensor_parallel.heads(self.tp_rank) if spec.tensor_parallel is not None else (0, spec.kv_heads)
        where = f"TP rank {self.tp_rank} of {self.tp} (KV heads {heads[0]}-{heads[1] - 1})"
        if (self.first, self.end) != (0, spec.num_layers):
            where += f", layers {self.first}-{self.end - 1} of {spec.num_layers}"
        return where


def place(spec: CodecSpec, kv: Any, partition: tuple[int, ...] | None = None) -> Placement:
    """The placement rank `kv` (its `world_size` and global `rank`, str naming both: an integration's key rank,
    e.g. LMCache's KVRank) holds under the artifact `spec` (every KV head, rank None); ValueError naming the
    rank, the world size and what the artifact has."""
    tp = spec.tensor_parallel.tp if spec.tensor_parallel is not None else 1
    ref = f"{spec.name}@{spec.version}"
    calibrated = f"calibrated with --tp {tp}" if tp > 1 else "calibrated for one rank, no --tp"
    if kv.world_size % tp:
        raise ValueError(f"{kv}: artifact {ref} has {tp} tensor-parallel rank(s) ({calibrated}); world size "
                         f"{kv.world_size} is not {tp} x pipeline stages: serve it with an artifact calibrated with "
                         f"--tp {kv.world_size} (or the deployment's TP size)")
    stages = kv.world_size // tp
    stage, tp_rank = divmod(kv.rank, tp)
    if stages == 1:
        return Placement(tp_rank, tp, 0, spec.num_layers)
    try:
        first, end = stage_layers(spec.num_layers, stage, stages, partition)
    except ValueError as exc:
        raise ValueError(f"{kv}: artifact {ref} has {tp} tensor-parallel rank(s) ({calibrated}), so world size "
                         f"{kv.world_size} means {stages} pipeline stages: {exc}") from exc
    return Placement(tp_rank, tp, first, end)


def placement_spec(spec: CodecSpec, placement: Placement) -> CodecSpec:
    """The spec coding `placement`'s chunks: its TP rank's heads, restricted to its layers."""
    out = spec.for_rank(placement.tp_rank) if spec.tensor_parallel is not None else spec
    if (placement.first, placement.end) == (0, spec.num_layers):
        return out
    if spec.coded_layers != list(range(spec.num_layers)):
        raise ValueError(f"artifact {spec.name}@{spec.version}: pipeline stages of a model with layers that keep no "
                         "KV cache are not served")
    try:
        out = restrict(out, range(placement.first, placement.end))
    except ValueError as exc:
        raise ValueError(f"{placement.describe(spec)}: artifact {spec.name}@{spec.version} has bases spanning "
                         f"layers of several pipeline stages ({exc}); to serve pipeline-parallel chunks calibrate "
                         "with --groups layer (or layers:K with K dividing every stage)") from exc
    return replace(out, model_id=f"{out.model_id}/layers{placement.first}-{placement.end}")


# ------------------------------------------------------------------ one placement's transform


class ChunkTransform:
    """One placement's transform. codec: a KVTCCodec whose spec is the placement's (`placement_spec`);
    model_config: checked if given (a whole-model spec only); mode: None keeps the codec's mode; pad:
    see the module docstring; positions: whether callers pass each chunk's position (`start`): an
    artifact calibrated with RoPE removed needs it, and only then are a first chunk's sinks kept raw;
    label: how errors name what this transform codes; charge: the bound `encode` keeps a chunk within
    (`chunk_bound`), "shape" the largest over starts (a store sizing every chunk of a shape alike: LMCache),
    "start" its own start's (a store charging a first chunk, its raw sinks on top, more: the vLLM tier);
    level, coder: the blob sections' entropy coding (KVTCCodec's), 0 plain; a section DEFLATE would not shrink
    is stored plain, so a blob coded at any level is within the bound; identity: what every frame binds
    (kernels/codec/chunk_identity.py; default the placement spec's, `ChunkIdentity.of`)."""

    def __init__(self, codec: KVTCCodec, model_config: Any = None, *, mode: str | None = None,
                 pad: bool = True, positions: bool = False, label: str | None = None,
                 sink_budget: str = "shared", sink_format: str = "int8", chunk_key: bytes | None = None,
                 charge: str = "shape", level: int = 0, coder: str = "zlib", identity: ChunkIdentity | None = None) -> None:
        spec = codec.spec
        self.identity = ChunkIdentity.of(spec) if identity is None else identity
        if charge not in ("shape", "start"):
            raise ValueError(f'charge must be "shape" or "start", got {charge!r}')
        self.charge = charge
        if chunk_key is not None and len(chunk_key) != CHUNK_KEY_BYTES:
            raise ValueError(f"a chunk key is {CHUNK_KEY_BYTES} bytes, got {len(chunk_key)}")
        self.chunk_key = chunk_key
        if sink_budget not in SINK_BUDGETS:
            raise ValueError(f"sink_budget must be one of {SINK_BUDGETS}, got {sink_budget!r}")
        if spec.value_dim is not None:
            raise ValueError(f"artifact {spec.name}@{spec.version} is for a multi-head latent attention model "
                             f"({spec.widths}): servers move its cache as one latent plane per token (kv_size 1), "
                             "which the chunk serde does not code; use KVTCCodec or KVTCCache for MLA caches")
        self.needs_positions = any(spec.layer_ropes[i] is not None for i in spec.coded_layers)
        if self.needs_positions and not positions:
            raise ValueError(f"artifact {spec.name}@{spec.version} codes keys with RoPE removed, which needs each "
                             "chunk's position; this storage layer hands the serde chunks by content hash, without "
                             "positions. Serve it through `kvtc lmcache-server` (which records the positions of "
                             "LMCache's chunks), or calibrate with --keys rope-kept for chunk stores")
        if model_config is not None and spec.rank is None:
            check_config(spec, model_config)
        self.sinks = spec.sinks if positions else 0  # raw in a first chunk; unknowable without positions
        self.positional = self.needs_positions or self.sinks > 0  # whether a chunk's bytes depend on its start
        self.spec = replace(spec, sinks=self.sinks, window=0)
        self.label = label or f"artifact {spec.name}@{spec.version}"
        options = replace(codec.options, mode=codec.mode if mode is None else mode, sink_format=sink_format, level=level,
                          coder=coder)  # a mode or sink format of another name: CodecOptions' ValueError
        self.codec = KVTCCodec(self.spec, options=options)  # one codec: each blob's choices are its plan
        self.mode, self.coding = self.codec.mode, self.codec.coding  # its name, and the mode (kernels/codec/mode.py)
        self.own = self.codec.plan()  # kernels/codec/blob_plan.py
        self.pad = pad
        # shared: a first chunk's raw sinks come out of its own budget (ECSQ at a coarser step), or, where they
        # cannot, it is coded whole, sinks included (fixed-rate, a later chunk's size): the bound is a later chunk's
        self.shared = sink_budget == "shared" and self.sinks > 0
        # the fixed-rate fallback where the mode has one (a chunk it cannot code within the bound), in order: all
        # raw sinks; where they would not fit a first chunk sharing its budget (text far from the calibration's),
        # the first token alone, the strongest sink; then none, the chunk coded whole
        fixed = self.coding.sizes.fallback or self.coding
        sinks = (self.sinks, *((1,) if self.shared and self.sinks > 1 else ()), *((0,) if self.shared else ()))
        self.fallbacks = tuple(self.codec.plan(fixed, n) for n in sinks)
        self._size_cache: dict[tuple, tuple[int, int, int]] = {}
        self._floors: dict[int, float] = {}  # coded tokens -> the mode's floor over its budget

    def check(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        """-> tokens; ValueError naming what does not match the artifact."""
        s = self.spec
        width = s.kv_heads * s.head_dim
        if len(shape) != 4 or shape[0] != 2:
            raise ValueError(f"expected a KV chunk (2, layers={s.num_layers}, tokens, {width}), got {tuple(shape)}: "
                             f"is {self.label} for this model?")
        if shape[1] != s.num_layers:
            raise ValueError(f"the chunk holds {shape[1]} layers, {self.label} codes {s.num_layers}: "
                             f"expected (2, {s.num_layers}, tokens, {width}), got {tuple(shape)}")
        if shape[3] != width:
            raise ValueError(f"chunk rows hold {shape[3]} features, {self.label} covers {s.kv_heads} KV heads x "
                             f"{s.head_dim} = {width}: a tensor-parallel rank holding a subset of the heads needs an "
                             "artifact calibrated per rank (kvtc calibrate --tp N) and keys naming the rank")
        if dtype not in _DTYPE_NAMES:
            raise ValueError(f"chunk dtype {dtype} is not supported; use float16, bfloat16 or float32")
        return int(shape[2])

    def _sizes(self, plan: BlobPlan, tokens: int, dtype: torch.dtype, start: int) -> tuple[int, int, int]:
        """(header and section table bytes, raw sinks' bytes, coded tokens) of a chunk coded with `plan`;
        computed once per plan, shape and raw head (every store asks for its bound)."""
        s = self.spec
        head, mid, tail = self.codec.split(tokens, start, plan.sinks)
        key = (plan.mode.name, plan.sinks, plan.outliers, tokens, dtype, head)
        found = self._size_cache.get(key)
        if found is None:
            header = BlobHeader(s.name, s.version, s.model_id, s.ratio, _DTYPE_NAMES[dtype], s.num_layers, s.kv_heads,
                                tokens, s.head_dim, start, plan.sinks, 0, head, tail, mode=plan.mode.name,
                                sink_format=plan.sink_format.name if head else "cache",
                                outliers=plan.outliers and mid > 0,  # fixed-width: the table holds its sections
                                **plan.mode.blob.header_fields())
            expected = self.codec.expected_sections(header)
            frame = len(write_blob(header, [Section(k, 0, 0, b"") for k, _ in expected]))
            raw = sum(n or 0 for k, n in expected if k.tag in (TAG_RAW_HEAD, TAG_RAW_TAIL))
            found = self._size_cache.setdefault(key, (frame, raw, mid))
        return found

    def _starts(self, tokens: int, dtype: torch.dtype) -> tuple[int, ...]:
        """Starts whose blobs differ in size and bound a chunk: a first chunk (raw sinks; not with shared sinks,
        which fits a later chunk's bound) and any later one."""
        if self._shares(tokens, dtype):
            return (self.sinks,)
        return (0, self.sinks) if self.sinks else (0,)

    def _shares(self, tokens: int, dtype: torch.dtype) -> bool:
        """Whether a first chunk of this shape pays its raw sinks from its own budget: shared sinks, a mode with
        a budget (ECSQ; not one whose sizes are exact), at least MIN_SHARED_SCALE of the budget left for its other
        tokens, and a mode able to code them in what is left (its floor, every symbol 0, at most FLOOR_SHARE of it:
        a basis capped by --basis-budget at a high ratio may not be). Elsewhere its sinks come on top as with
        "extra" (short chunks at a high ratio; the fixed-rate mode, whose sizes are exact), said once per chunk
        shape in the log."""
        if not self.shared:
            return False
        scale = 0.0 if self.coding.sizes.exact else self._shared_scale(tokens, dtype, 0)
        _, _, mid = self._sizes(self.own, tokens, dtype, 0)
        floor = self._floors.get(mid)
        if floor is None:
            budget = self.coding.sizes.bound_bytes(self.spec, mid)
            floor = self._floors.setdefault(mid, self.coding.sizes.floor_bytes(self.spec, mid) / budget if budget else 0.0)
        if scale >= MIN_SHARED_SCALE and floor <= FLOOR_SHARE * scale:
            return True
        told = (self.label, self.spec.ratio, tokens, dtype)
        if told not in _TOLD:  # once per process: every transform of the artifact and ratio would say the same
            _TOLD.add(told)
            why = (f"is coded {self.coding.label}, whose sizes are exact" if self.coding.sizes.exact else
                   f"would keep {scale:.0%} of its budget for its other tokens, below {MIN_SHARED_SCALE:.0%}"
                   if scale < MIN_SHARED_SCALE else
                   f"would keep {scale:.0%} of its budget for its other tokens, where the artifact's {self.coding.label} "
                   f"symbol models cannot code them below {floor:.0%} of it")
            _log.info("%s: a first chunk of %d tokens %s; its %d raw sinks come on top of its budget (sink_budget "
                         "\"extra\"), so chunks padded to the size bound store %.1fx below bf16 at CR %g", self.label,
                         tokens, why, self.sinks, self._padded_ratio(tokens, dtype), self.spec.ratio)
        return False

    def _padded_ratio(self, tokens: int, dtype: torch.dtype) -> float:
        """A chunk's bytes in bfloat16 over the size bound with sinks on top (what a padding store keeps)."""
        s = self.spec
        bound = max(self.blob_bound(tokens, dtype, a) for a in ((0, self.sinks) if self.sinks else (0,)))
        return 2 * s.num_layers * tokens * s.kv_heads * s.head_dim * 2 / (bound + FRAME_BYTES)

    def _shared_scale(self, tokens: int, dtype: torch.dtype, start: int) -> float:
        """The share of its ECSQ budget a first chunk may spend so that it fits a later chunk's bound (0: none)."""
        head, raw, mid = self._sizes(self.own, tokens, dtype, start)
        budget = self.coding.sizes.bound_bytes(self.spec, mid)
        room = self._bound_at(self.own, tokens, dtype, self.sinks) - head - raw
        return min(1.0, room / budget) if budget and room > 0 else 0.0

    def fixed_size(self, tokens: int, dtype: torch.dtype, start: int | None = None) -> int:
        """Blob bytes of a chunk of `tokens` tokens at `start` coded fixed-rate (exact; the mode's fallback, or the
        mode itself where it has none), or the largest over starts."""
        starts = self._starts(tokens, dtype) if start is None else (start,)
        return max(self._bound_at(self.fallbacks[0], tokens, dtype, a) for a in starts)

    def mode_bound(self, tokens: int, dtype: torch.dtype, start: int | None = None) -> int:
        """Largest blob of `tokens` tokens at `start` (None: any) the transform's mode writes within its bound
        (SizeBounds.bound_bytes): header, raw sinks, and for ECSQ each (stream, group)'s rate-control budget (its share
        of the ratio's bits per coded token, in bytes), for fixed-rate its exact sections."""
        starts = self._starts(tokens, dtype) if start is None else (start,)
        return max(self._bound_at(self.own, tokens, dtype, a) for a in starts)

    def _bound_at(self, plan: BlobPlan, tokens: int, dtype: torch.dtype, start: int) -> int:
        head, raw, mid = self._sizes(plan, tokens, dtype, start)
        return head + raw + plan.mode.sizes.bound_bytes(self.spec, mid)

    def blob_bound(self, tokens: int, dtype: torch.dtype, start: int | None = None) -> int:
        """Largest blob of `tokens` tokens at `start` (None: any) this transform stores: the mode's bound, or the
        fixed-rate fallback's exact size where that is larger."""
        return max(self.fixed_size(tokens, dtype, start), self.mode_bound(tokens, dtype, start))

    def chunk_bound(self, tokens: int, dtype: torch.dtype, start: int) -> int:
        """Most bytes `encode` codes a chunk of `tokens` tokens at `start` in (see `charge`): the mode's attempts
        above it are coded by its fixed-rate fallback, whose exact size it holds."""
        return self.blob_bound(tokens, dtype, self._start(start) if self.charge == "start" else None)

    def serialized_size(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        """Upper bound on `serialize`'s output for a chunk of this shape at any position (what LMCache
        allocates), exact for every chunk when padding."""
        return FRAME_BYTES + self.blob_bound(self.check(shape, dtype), dtype)

    def _start(self, start: int | None) -> int:
        if start is not None and (not isinstance(start, int) or isinstance(start, bool) or start < 0):
            raise ValueError(f"a chunk's start position must be an integer >= 0, got {start!r}")
        if not self.positional:
            return 0  # RoPE kept and no sinks: the bytes do not depend on the position
        if start is None:
            why = "codes keys with RoPE removed at their positions" if self.needs_positions else \
                "keeps a first chunk's attention sinks raw"
            raise ValueError(f"the chunk's position is unknown, and {self.label} {why}; it is not stored")
        return start

    def encode(self, kv: torch.Tensor, start: int | None = None) -> bytes:
        """kv (2, L, T, H * D) -> blob: the transform's mode, or fixed-rate where ECSQ cannot code the chunk
        within its bound; at most two codings. start: the absolute position of the chunk's first token (required with
        positions)."""
        tokens = self.check(tuple(kv.shape), kv.dtype)
        start = self._start(start)
        where = nonfinite_where(kv)
        if where is not None:
            raise ValueError(f"the chunk at position {start} holds {where}; it is not stored (check the model's "
                             "numerics)" if self.positional else
                             f"the chunk holds {where}; it is not stored (check the model's numerics)")
        s = self.spec
        x = kv.reshape(2, s.num_layers, tokens, s.kv_heads, s.head_dim).permute(0, 1, 3, 2, 4)
        if self.coding.sizes.fallback is None:  # sizes exact: the bound is the blob's
            return self.codec.encode(x[0], x[1], start=start)
        first = start < self.sinks and self._shares(tokens, kv.dtype)
        limit = self.chunk_bound(tokens, kv.dtype, start)  # what the store keeps for this chunk
        try:  # rate control holds each (stream, group) to its budget: a blob above the bound is one it cannot code
            plan = replace(self.own, budget_scale=self._shared_scale(tokens, kv.dtype, start), truncate=True) \
                if first else self.own
            blob = self.codec.encode(x[0], x[1], start=start, plan=plan)
            if len(blob) <= limit:
                return blob
        except (ValueError, OverflowError, RuntimeError):
            pass  # beyond any ECSQ step or symbol range
        # fixed-rate, whose sizes are exact: the most raw sinks within the bound (a first chunk sharing its budget)
        fits = [p for p in self.fallbacks if self._bound_at(p, tokens, kv.dtype, start) <= limit]
        return self.codec.encode(x[0], x[1], start=start, plan=fits[0])

    def identity_bytes(self, chunk: torch.Tensor, engine: Engine | None = None) -> bytes:
        """The frame's identity field for a chunk like `chunk` (its dtype and tokens) as the store describes it."""
        return self.identity.encode(_DTYPE_NAMES.get(chunk.dtype, str(chunk.dtype)), int(chunk.shape[2]), engine)

    def serialize(self, kv: torch.Tensor, size: int | None = None, start: int | None = None,
                  key: bytes = UNBOUND, engine: Engine | None = None) -> bytes:
        """kv (2, L, T, H * D) -> bytes: at most `size` (default serialized_size(kv.shape, kv.dtype)),
        padded to exactly `size` when padding; start: see `encode`; key: the storage key's `binding`; engine: what
        the store says of the chunk (its model name, world size), bound in the frame's identity."""
        if len(key) != 16:
            raise ValueError(f"a chunk's key binding is 16 bytes (chunk_serde.binding), got {len(key)}")
        blob = self.encode(kv, start)
        size = self.serialized_size(tuple(kv.shape), kv.dtype) if size is None else size
        out = frame(blob, key, self.identity_bytes(kv, engine), self.chunk_key)
        if len(out) > size:
            raise RuntimeError(f"kvtc serde wrote {len(out)} bytes, above its bound {size}")
        return out + bytes(size - len(out)) if self.pad else out

    def _verified(self, f: Frame, key: bytes | None, out: torch.Tensor, engine: Engine | None) -> bool:
        """Check a stored chunk's frame against this reader's identity for `out` and the key asked for (None: not
        checked) -> whether the chunk is bound to that key, so its blob's start can be trusted. A version-1 frame (no
        identity) or another identity is an IdentityMismatch naming it; keyed frames verify their MAC under this
        transform's chunk key; with a chunk key, unkeyed frames are refused (anyone who can write the store can
        make one)."""
        keyed, bound, blob = f.keyed, f.bound, f.blob
        if f.identity is None:
            raise old_frame(f.magic)
        if keyed:
            if self.chunk_key is None:
                raise BlobError("the stored chunk is keyed (written by a server with a chunk key) and this one has "
                                f"none: set the serde's key_file (or {CHUNK_KEY_ENV}) to the deployment's key; "
                                "not loaded")
            self._same_identity(f.identity, out, engine)  # named before the MAC, which covers it
            want = keyed_binding(self.chunk_key, UNBOUND if key is None else key, blob, f.identity)
            if not hmac.compare_digest(bound, want):
                raise BlobError("the stored chunk's keyed binding does not verify: written under another key, "
                                "altered, or made without the deployment's chunk key; not loaded")
            return key is not None
        if self.chunk_key is not None:
            raise BlobError("the stored chunk has an unkeyed frame and this server has a chunk key: written by a "
                            "server without the key, or by a writer of the store; not loaded")
        self._same_identity(f.identity, out, engine)
        if key is not None and bound != bytes(key):
            raise BlobError("the stored chunk was written under another key (its key binding differs): a file "
                            "copied or moved between keys; not loaded")
        return key is not None

    def _same_identity(self, stored: bytes, out: torch.Tensor, engine: Engine | None) -> None:
        dtype, tokens = _DTYPE_NAMES.get(out.dtype, str(out.dtype)), int(out.shape[2])
        reasons = self.identity.differing(stored, dtype, tokens, engine)
        if reasons:
            raise self.identity.mismatch(reasons, dtype, tokens, engine)

    def deserialize(self, data: bytes | bytearray | memoryview, out: torch.Tensor, start: int | None = None,
                    key: bytes | None = None, engine: Engine | None = None) -> None:
        """Bytes from `serialize` (trailing bytes ignored) -> written into out (2, L, T, H * D) in its
        dtype (RoPE re-applied at the positions the blob records). start: the position the storage layer
        knows for the key; None: the blob's own, trusted where the frame binds the chunk to `key` (a server that
        restarted knows no positions), else refused with RoPE removed; key: the key's `binding` (None: not
        checked); engine: what the store says of the chunk (as `serialize`). BlobError if corrupt, not this
        placement's, bound to another key or position, or of another identity (an IdentityMismatch naming the parts
        that differ; a version-1 frame, which carries none, too); `out` is left untouched then."""
        tokens = self.check(tuple(out.shape), out.dtype)
        f = read_frame(data)
        bound = self._verified(f, key, out, engine)
        blob = f.blob
        header, _ = read_blob(blob)
        if self.positional:
            if start is None and self.needs_positions and not bound:
                raise BlobError(f"the chunk's position is unknown, and {self.label} re-applies RoPE at it; "
                                "not loaded")
            if start is None:
                start = header.start  # recorded by the server that stored it, and bound to the key asked for
            if header.start != start:
                raise BlobError(f"the stored chunk was coded for position {header.start}, its key is at position "
                                f"{start}; not loaded")
        keys, values = self.codec.decode(blob, device=out.device, max_tokens=tokens)
        if keys.shape[2] != tokens:
            raise BlobError(f"kvtc chunk holds {keys.shape[2]} tokens, the destination expects {tokens}")
        s = self.spec
        for i, x in enumerate((keys, values)):
            out[i].copy_(x.permute(0, 2, 1, 3).reshape(s.num_layers, tokens, s.kv_heads * s.head_dim))
