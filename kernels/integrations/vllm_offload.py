"""KVTC inside vLLM without an LMCache server: an out-of-tree KV offloading spec for vLLM's own
`OffloadingConnector` (vLLM 0.33, `vllm.v1.kv_offload`). vLLM loads it by module path:

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "KVTCOffloadingSpec",
        "spec_module_path": "kvtc.kernels.integrations.vllm_offload", "kvtc_artifact": "NAME@production",
        "kvtc_ratio": 16, "kvtc_registry": "s3://bucket/kvtc", "cpu_bytes_to_use": 8000000000,
        "block_size": 256}}'

Scheduler side, `KVTCOffloadingManager` tracks which offload keys (one per chunk of
`blocks_per_chunk` GPU blocks) are stored, in at most a slot count sized from `cpu_bytes_to_use` at
the ratio's bytes (slots are numbered as chunks arrive, nothing is reserved up front), least recently
used evicted first. vLLM records each key's end-token position in the request context; the manager
checks every new key's position before it evicts anything (a store it refuses loses nothing stored),
and hands every stored chunk's first position and key binding to the workers with the slots, so keys
are coded with RoPE removed at their true positions (the default artifacts), the first `sinks` tokens
of a request stay raw, as the codec keeps them, and a load decodes only the blob stored for its key
at its position.

Worker side, `KVTCOffloadingWorker` reads each layer's pages from the KV cache tensors vLLM
registers (one (num_blocks, page bytes) view per layer: page = [tokens, kv heads, K|V] or [kv heads,
tokens, K|V] by the cache layout), codes a chunk as one blob with the rank's chunk coder (`ChunkCodec`:
the LMCache chunk transform over `KVTCCodec`, this rank's bases of a `--tp N` artifact, within the bound its
slot was charged), keeps the blob in host memory under its slot, and on a load decodes it back into the GPU
blocks vLLM names. Transfers are asynchronous: `submit_store` and
`submit_load` queue the job on a thread pool (`kvtc_transfer_threads`, default 1) and return, so the
engine's forward pass does not wait for a chunk's encode; `get_finished` reports the jobs done (vLLM's
connector then frees the fenced blocks or resumes the request) and `wait` blocks on the ones named. A
job that fails is logged with its reason and reported as failed (vLLM 0.33's connector does not
support failed jobs and stops on one: loud, never wrong data in the cache).

Supported: one full-attention KV cache group (no sliding-window, Mamba or MLA groups), K and V of
equal head size, float16 / bfloat16 / float32 caches (no fp8 KV cache), cache layouts LBNHC, BLNHC,
LBHNC, BLHNC, tensor parallelism with an artifact calibrated for the same TP size, pipeline stages
whose layers are whole groups of the artifact. Anything else is refused when the spec or the worker
is built, with the reason.

The page transform (`PageFormat`, `ChunkCodec`) needs only torch and the codec; the vLLM classes
are defined when vLLM is importable.
"""
from __future__ import annotations

import logging
import math
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from kvtc.kernels.codec.blob import BlobError, read_blob
from kvtc.artifacts.blocks import check_ratios
from kvtc.kernels.codec.chunk_options import CHUNK_MODES
from kvtc.kernels.codec.chunk_serde import UNBOUND, ChunkTransform, binding
from kvtc.kernels.codec.held_basis import return_freed_memory, served_codec
from kvtc.kernels.codec.kvtc_codec import KVTCCodec
from kvtc.kernels.codec.layered import restrict

PAGE_ORDERS = {"LBNHC": "NHC", "BLNHC": "NHC", "LBHNC": "HNC", "BLHNC": "HNC"}
CACHE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
SLOT_SLACK = 1.05  # a chunk's blob: the ratio's budget plus header and raw sinks (slot_count's estimate)
OBJECT_BYTES = 256  # Python's bytes object, its dict entry and key binding, per stored chunk
MAX_POSITION = 1 << 62
_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PageFormat:
    """One layer's page of one GPU block: `tokens` x `kv_heads` cells of K then V (`head_dim` each) in
    `dtype`, ordered "NHC" (token-major) or "HNC" (head-major)."""

    kv_heads: int
    tokens: int
    head_dim: int
    dtype: torch.dtype
    order: str = "NHC"

    def __post_init__(self) -> None:
        if min(self.kv_heads, self.tokens, self.head_dim) < 1:
            raise ValueError(f"a page needs kv_heads, tokens and head_dim >= 1, got {self}")
        if self.order not in ("NHC", "HNC"):
            raise ValueError(f"page order must be NHC or HNC, got {self.order!r}")
        if self.dtype not in CACHE_DTYPES.values():
            raise ValueError(f"KV cache dtype {self.dtype} is not supported (float16, bfloat16, float32; no fp8 cache)")

    @classmethod
    def for_layout(cls, layout: str | None, **kwargs: Any) -> "PageFormat":
        if layout not in PAGE_ORDERS:
            raise ValueError(f"KV cache layout {layout!r} is not supported by the kvtc offloading spec; supported: "
                             f"{sorted(PAGE_ORDERS)} (set --kv-cache-layout or use a backend with one of them)")
        return cls(order=PAGE_ORDERS[layout], **kwargs)

    @property
    def page_bytes(self) -> int:
        return self.tokens * self.kv_heads * 2 * self.head_dim * torch.finfo(self.dtype).bits // 8

    def _shape(self, n: int) -> tuple[int, ...]:
        if self.order == "NHC":
            return (n, self.tokens, self.kv_heads, 2 * self.head_dim)
        return (n, self.kv_heads, self.tokens, 2 * self.head_dim)

    def read(self, pages: torch.Tensor, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """pages (num_blocks, page_bytes) int8, block ids (n,) -> keys, values (kv_heads, n x tokens, head_dim)."""
        x = pages[block_ids].view(self.dtype).reshape(self._shape(len(block_ids)))
        x = x.permute(2, 0, 1, 3) if self.order == "NHC" else x.permute(1, 0, 2, 3)
        x = x.reshape(self.kv_heads, len(block_ids) * self.tokens, 2 * self.head_dim)
        return x[..., :self.head_dim], x[..., self.head_dim:]

    def write(self, pages: torch.Tensor, block_ids: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """keys, values (kv_heads, n x tokens, head_dim) -> the pages of blocks `block_ids`."""
        n = len(block_ids)
        x = torch.cat([keys, values], dim=-1).to(self.dtype).reshape(self.kv_heads, n, self.tokens, 2 * self.head_dim)
        x = x.permute(1, 2, 0, 3) if self.order == "NHC" else x.permute(1, 0, 2, 3)
        pages[block_ids] = x.contiguous().view(torch.int8).reshape(n, self.page_bytes)


def layer_index(name: str) -> int:
    """The model layer of a vLLM attention layer name ("model.layers.7.self_attn.attn" -> 7)."""
    found = [int(p) for p in name.split(".") if re.fullmatch(r"\d+", p)]
    if len(found) != 1:
        raise ValueError(f"cannot tell the layer index of vLLM layer {name!r}")
    return found[0]


class ChunkCodec:
    """A rank's coder for offload chunks: the LMCache chunk transform (kernels/codec/chunk_serde.py) of the `layers`
    this worker holds (a pipeline stage), in the order vLLM lists them, with positions (no recent window, sinks kept
    raw where a chunk starts before position `sinks`, as int8), unpadded, sections at the codec's DEFLATE level,
    each chunk within its own start's bound (`charge="start"`; a first chunk's raw sinks on top: "extra"). The
    tier's slots are charged that bound (SlotPlan), and a chunk ECSQ cannot code within it (values unlike the
    calibration's) is coded fixed-rate, whose size is exact: no chunk is held above what its slot was charged."""

    def __init__(self, codec: KVTCCodec, layers: Sequence[int]) -> None:
        spec = codec.spec
        coded = list(spec.coded_layers)
        missing = [layer for layer in layers if layer not in coded]
        if missing:
            raise ValueError(f"artifact {spec.name}@{spec.version} codes layers {coded}; vLLM's cache group holds "
                             f"layers {missing} it has no basis for")
        stage = codec if list(layers) == coded else KVTCCodec(restrict(spec, list(layers)), options=codec.options)
        self.transform = ChunkTransform(stage, pad=False, positions=True, sink_budget="extra",
                                        charge="start", level=codec.level, coder=codec.coder,
                                        label=f"the vLLM tier's artifact {spec.name}@{spec.version}")
        self.spec, self.codec = self.transform.spec, self.transform.codec

    def bound(self, tokens: int, dtype: torch.dtype, start: int) -> int:
        """Most blob bytes a chunk of `tokens` tokens in `dtype` at `start` is stored in (what its slot is charged)."""
        return self.transform.chunk_bound(tokens, dtype, start)

    def encode(self, keys: torch.Tensor, values: torch.Tensor, start: int) -> bytes:
        """keys, values (layers, kv_heads, tokens, head_dim), first token at absolute position `start` -> the blob
        the tier stores; ValueError naming where a non-finite value is."""
        L, H, T, D = keys.shape
        blob = self.transform.encode(torch.stack((keys, values)).transpose(2, 3).reshape(2, L, T, H * D), start)
        if len(blob) > self.bound(T, keys.dtype, start):  # never: the fixed-rate fallback's size is exact
            raise RuntimeError(f"the chunk at position {start} was coded in {len(blob)} bytes, above its slot's "
                               f"{self.bound(T, keys.dtype, start)}; it is not stored")
        return blob

    def decode(self, blob: bytes, device: torch.device, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        header, _ = read_blob(blob)
        if header.start != (start if self.transform.positional else 0):  # RoPE kept and no sinks: coded at 0
            raise BlobError(f"stored chunk starts at position {header.start}, the load expects {start}")
        return self.codec.decode(blob, device=device)


def _number(extra: dict[str, Any], name: str, default: Any = None) -> Any:
    """A count from the extra config: a whole float (JSON's 8e9) as an int, anything else as given."""
    value = extra.get(name, default)
    return int(value) if isinstance(value, float) and value.is_integer() else value


@dataclass(frozen=True)
class OffloadSettings:
    """kv_connector_extra_config keys of this spec: kvtc_artifact "NAME[@VERSION|ALIAS]", kvtc_ratio,
    kvtc_registry (URI; default $KVTC_REGISTRY), kvtc_mode ("ecsq" | "fixed"; default the artifact's),
    kvtc_backend (codec backend), kvtc_transfer_threads (threads coding chunks, default 1),
    cpu_bytes_to_use (host bytes for stored chunks, all workers). A bad value is a ValueError naming its key."""

    artifact: str
    ratio: float
    cpu_bytes_to_use: int
    registry: str | None = None
    mode: str | None = None
    backend: str = "auto"
    transfer_threads: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.artifact, str) or not self.artifact:
            raise ValueError('the kvtc offloading spec needs "kvtc_artifact": "NAME[@VERSION|ALIAS]" in '
                             "kv_connector_extra_config")
        if isinstance(self.ratio, bool) or not isinstance(self.ratio, (int, float)):
            raise ValueError(f'the kvtc offloading spec needs "kvtc_ratio": a finite ratio > 1 the artifact was '
                             f"allocated for, got {self.ratio!r}")
        check_ratios([self.ratio], 'the kvtc offloading spec\'s "kvtc_ratio": ')
        if isinstance(self.cpu_bytes_to_use, bool) or not isinstance(self.cpu_bytes_to_use, int) \
                or self.cpu_bytes_to_use <= 0:
            raise ValueError(f'the kvtc offloading spec needs "cpu_bytes_to_use": a whole number of host bytes > 0, '
                             f"got {self.cpu_bytes_to_use!r}")
        if self.mode is not None and self.mode not in CHUNK_MODES:
            raise ValueError(f'"kvtc_mode" must be one of {CHUNK_MODES} (or absent: the artifact\'s), got {self.mode!r}')
        if isinstance(self.transfer_threads, bool) or not isinstance(self.transfer_threads, int) \
                or not 1 <= self.transfer_threads <= 256:
            raise ValueError(f'"kvtc_transfer_threads" must be an integer in 1..256, got {self.transfer_threads!r}')

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> "OffloadSettings":
        return cls(artifact=extra.get("kvtc_artifact"), ratio=extra.get("kvtc_ratio"),  # type: ignore[arg-type]
                   cpu_bytes_to_use=_number(extra, "cpu_bytes_to_use"), registry=extra.get("kvtc_registry"),
                   mode=extra.get("kvtc_mode"), backend=extra.get("kvtc_backend", "auto"),
                   transfer_threads=_number(extra, "kvtc_transfer_threads", 1))


def slot_count(settings: OffloadSettings, worker_kv_bytes_per_block: int, blocks_per_chunk: int,
               world_size: int) -> int:
    """Stored chunks `cpu_bytes_to_use` holds: each chunk's raw bytes (all workers) over the ratio, with slack
    (an estimate: SlotPlan sizes the tier from the codec's true bounds)."""
    if worker_kv_bytes_per_block <= 0:
        raise ValueError("vLLM reported no KV bytes per block; the kvtc offloading spec cannot size its slots")
    per_chunk = math.ceil(worker_kv_bytes_per_block * blocks_per_chunk * world_size / settings.ratio * SLOT_SLACK)
    return settings.cpu_bytes_to_use // per_chunk


UNITS_PER_CHUNK = 64  # the budget is counted in units of 1/64 of a later chunk's bound, so first chunks fit closely


@dataclass(frozen=True)
class SlotPlan:
    """How `cpu_bytes_to_use` holds chunks: `units` units of `unit_bytes`; a later chunk (its largest blob over all
    workers, with per-object slack) takes `chunk_units`, a first chunk (start < `sinks`: its sinks raw)
    `first_chunk_units`. The manager counts units so, and the tier never holds more than its budget."""

    units: int
    unit_bytes: int
    chunk_units: int
    first_chunk_units: int
    sinks: int

    @property
    def num_slots(self) -> int:
        """Later chunks the budget holds."""
        return self.units // self.chunk_units

    @classmethod
    def for_codec(cls, settings: OffloadSettings, chunk_codec: "ChunkCodec", tokens: int, dtype: torch.dtype,
                  world_size: int) -> "SlotPlan":
        """From the rank's chunk coder: the bound it codes a first and a later chunk of `tokens` tokens in `dtype`
        within (ECSQ's rate-control bound, or the fixed-rate fallback's exact size where larger)."""
        sinks = min(chunk_codec.transform.sinks, tokens)

        def bound(start: int) -> int:
            return chunk_codec.bound(tokens, dtype, start) + OBJECT_BYTES  # Python's object and slot

        later = bound(sinks) * world_size
        first = bound(0) * world_size if sinks else later
        unit = -(-later // UNITS_PER_CHUNK)
        return cls(settings.cpu_bytes_to_use // unit, unit, UNITS_PER_CHUNK, -(-first // unit), sinks)


try:  # vLLM's offloading interfaces (0.33); without vLLM the page transform above still imports
    from vllm.v1.kv_offload.base import (CanonicalKVCaches, GPULoadStoreSpec, LoadStoreSpec, LookupResult, Medium,
                                         OffloadingEvent, OffloadingManager, OffloadingSpec, OffloadingWorker,
                                         PrepareStoreOutput, RequestOffloadingContext, TransferResult)
    from vllm.v1.kv_offload.config import OffloadingConfig
    VLLM = True
except ImportError:  # pragma: no cover - exercised where vLLM is absent
    VLLM = False

if VLLM:
    class KVTCLoadStoreSpec(LoadStoreSpec):
        """Where chunks live (slot per chunk) and each chunk's first token position."""

        def __init__(self, slots: Sequence[int], starts: Sequence[int], bindings: Sequence[bytes] | None = None,
                     drop: Sequence[int] = ()) -> None:
            self.slots = np.asarray(slots, dtype=np.int64)
            self.starts = np.asarray(starts, dtype=np.int64)
            self.bindings = list(bindings) if bindings is not None else [UNBOUND] * len(self.slots)
            self.drop = [int(x) for x in drop]  # a store's: slots the manager freed since, whose blobs go first
            if self.slots.shape != self.starts.shape or len(self.bindings) != len(self.slots):
                raise ValueError("a kvtc load/store spec needs one start position and one key binding per slot")

        def __repr__(self) -> str:
            return f"KVTCLoadStoreSpec(slots={self.slots.tolist()}, starts={self.starts.tolist()})"

    @dataclass
    class _Entry:
        slot: int
        start: int
        ready: bool = False
        pins: int = 0
        cost: int = 1  # units of the budget it holds (SlotPlan: a first chunk, its sinks raw, takes more)

    def key_binding(key: Any) -> bytes:
        """The binding digest of a vLLM offload key (bytes), stored beside its blob and checked on load."""
        return binding(b"vllm-offload", key)

    class KVTCOffloadingManager(OffloadingManager):
        """Stored chunks within `units` units of the budget, least recently used evicted first; entered from one
        thread. A chunk takes `chunk_units`, one starting before `sinks` (its sinks raw) `first_chunk_units`
        (SlotPlan). Slots are numbered as chunks arrive (nothing is allocated per slot up front)."""

        def __init__(self, units: int, tokens_per_chunk: int, enable_events: bool = False, *, chunk_units: int = 1,
                     first_chunk_units: int | None = None, sinks: int = 0) -> None:
            first_chunk_units = chunk_units if first_chunk_units is None else first_chunk_units
            if units < max(1, chunk_units, first_chunk_units):
                raise ValueError(f"the kvtc offloading tier has room for {units // max(1, chunk_units)} chunks; "
                                 "raise cpu_bytes_to_use")
            self.units, self.tokens_per_chunk = units, tokens_per_chunk
            self.chunk_units, self.first_chunk_units, self.sinks = chunk_units, first_chunk_units, sinks
            self.num_slots = units // chunk_units
            self._used = 0  # units held by stored and pending chunks
            self._undropped: list[int] = []  # freed slots whose blobs the worker still holds (dropped at the next store)
            self._free: list[int] = []  # slots freed by evictions and failed stores, reused first
            self._next = 0  # slots [0, _next) have been handed out
            self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
            self._events: list[OffloadingEvent] = [] if enable_events else None  # type: ignore[assignment]
            self._warned: set[str] = set()

        def _available(self) -> int:
            return self.units - self._used

        def _cost(self, start: int) -> int:
            return self.first_chunk_units if start < self.sinks else self.chunk_units

        def _slot(self) -> int:
            if self._free:
                return self._free.pop()
            self._next += 1
            return self._next - 1

        def lookup(self, key, req_context) -> LookupResult:
            entry = self._entries.get(key)
            return LookupResult.HIT if entry is not None and entry.ready else LookupResult.MISS

        def prepare_load(self, keys, req_context) -> KVTCLoadStoreSpec:
            entries = [self._entries[k] for k in keys]
            for e in entries:
                e.pins += 1
            return KVTCLoadStoreSpec([e.slot for e in entries], [e.start for e in entries],
                                     [key_binding(k) for k in keys])

        def touch(self, keys, req_context) -> None:
            for k in keys:
                if k in self._entries:
                    self._entries.move_to_end(k)

        def complete_load(self, keys, req_context) -> None:
            for k in keys:
                if k in self._entries:
                    self._entries[k].pins = max(0, self._entries[k].pins - 1)

        def _start(self, key, req_context) -> int:
            """The chunk's first position from vLLM's end position; ValueError when absent or out of range."""
            end = req_context.get_offload_key_position(key)
            if end is None:
                raise ValueError("vLLM gave no token position for an offloaded chunk; the kvtc tier codes keys at "
                                 "their positions and cannot store it")
            if isinstance(end, bool) or not isinstance(end, (int, np.integer)) \
                    or not self.tokens_per_chunk <= int(end) < MAX_POSITION:
                raise ValueError(f"vLLM gave end position {end!r} for a chunk of {self.tokens_per_chunk} tokens: a "
                                 f"chunk ends at a position in [{self.tokens_per_chunk}, 2^62); it is not stored")
            return int(end) - self.tokens_per_chunk

        def _warn(self, message: str) -> None:
            if message not in self._warned:
                self._warned.add(message)
                _log.warning("kvtc offloading tier: %s", message)

        def prepare_store(self, keys, req_context) -> PrepareStoreOutput | None:
            new = [k for k in dict.fromkeys(keys) if k not in self._entries]
            try:  # every new key's position first: a refused store evicts nothing
                starts = [self._start(k, req_context) for k in new]
            except ValueError as exc:
                self._warn(str(exc))
                return None
            wanted = set(keys)
            costs = [self._cost(start) for start in starts]
            short = sum(costs) - self._available()
            victims, freed = [], 0
            for k, e in self._entries.items() if short > 0 else ():
                if freed >= short:
                    break
                if e.ready and not e.pins and k not in wanted:
                    victims.append(k)
                    freed += e.cost
            if freed < short:
                return None
            for k in victims:
                self._release(self._entries.pop(k))
            if victims and self._events is not None:
                self._events.append(OffloadingEvent(victims, Medium.CPU, removed=True))
            slots = [self._slot() for _ in new]
            for k, slot, start, cost in zip(new, slots, starts, costs):
                self._entries[k] = _Entry(slot, start, cost=cost)
                self._used += cost
            reused = set(slots)
            drop, self._undropped = [x for x in self._undropped if x not in reused], []
            return PrepareStoreOutput(keys_to_store=new, store_spec=KVTCLoadStoreSpec(
                slots, starts, [key_binding(k) for k in new], drop), evicted_keys=victims)

        def complete_store(self, keys, req_context, success: bool = True) -> None:
            stored = []
            for k in keys:
                e = self._entries.get(k)
                if e is None or e.ready:
                    continue
                if success:
                    e.ready = True
                    stored.append(k)
                else:
                    self._release(self._entries.pop(k))
            if stored and self._events is not None:
                self._events.append(OffloadingEvent(stored, Medium.CPU, removed=False))

        def on_new_request(self, req_context) -> RequestOffloadingContext:
            return RequestOffloadingContext()

        def take_events(self):
            events, self._events = (self._events or []), ([] if self._events is not None else None)
            return events

        def _release(self, entry: _Entry) -> None:
            self._free.append(entry.slot)
            self._undropped.append(entry.slot)
            self._used -= entry.cost

        def reset_cache(self) -> None:
            self._entries.clear()
            self._free, self._next, self._used, self._undropped = [], 0, 0, []

    class KVTCOffloadingWorker(OffloadingWorker):
        """Codes chunks of GPU blocks into host-memory blobs and back, on the worker that owns the blocks,
        on a pool of `threads` threads (submit returns at once; get_finished / wait report the jobs)."""

        def __init__(self, kv_caches: CanonicalKVCaches, chunk_codec: ChunkCodec, page: PageFormat,
                     blocks_per_chunk: int, threads: int = 1) -> None:
            if len(kv_caches.group_data_refs) != 1:
                raise ValueError(f"the kvtc offloading tier codes one KV cache group, vLLM registered "
                                 f"{len(kv_caches.group_data_refs)}")
            refs = kv_caches.group_data_refs[0]
            if len(refs) != chunk_codec.spec.num_layers:
                raise ValueError(f"vLLM registered {len(refs)} layers, the codec codes {chunk_codec.spec.num_layers}")
            for i, ref in enumerate(refs):
                if ref.page_size_bytes != page.page_bytes:
                    raise ValueError(f"layer {i}: vLLM's page holds {ref.page_size_bytes} bytes; artifact "
                                     f"{chunk_codec.spec.name}@{chunk_codec.spec.version} for this rank expects "
                                     f"{page.tokens} tokens x {page.kv_heads} KV heads x 2 x {page.head_dim} x "
                                     f"{page.dtype} = {page.page_bytes}: is it this model's, at this TP size?")
            self.pages = [kv_caches.tensors[ref.tensor_idx].tensor for ref in refs]
            self.codec, self.page, self.blocks_per_chunk = chunk_codec, page, blocks_per_chunk
            self.blobs: dict[int, tuple[bytes, bytes]] = {}  # slot -> (key binding, blob)
            self._lock = threading.Lock()
            self._jobs: dict[int, Future] = {}
            self._streams: dict[int, Any] = {}  # CUDA: one stream per transfer thread
            self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvtc-offload")

        def _ids(self, ids: Any) -> torch.Tensor:
            return torch.as_tensor(np.asarray(ids, dtype=np.int64), device=self.pages[0].device)

        def gather(self, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            """-> keys, values (layers, kv_heads, blocks x tokens, head_dim) of the given GPU blocks."""
            read = [self.page.read(p, block_ids) for p in self.pages]
            return torch.stack([k for k, _ in read]), torch.stack([v for _, v in read])

        def blob(self, slot: int) -> bytes:
            """The blob stored in `slot` (KeyError if none)."""
            with self._lock:
                return self.blobs[slot][1]

        def _run(self, job_id: int, what: str, work: Any, ready: Any) -> TransferResult:
            t0 = time.perf_counter()
            try:
                if ready is None:
                    size = work()
                else:  # CUDA: after the engine's kernels that wrote the blocks, on the tier's own stream
                    stream = self._streams.get(threading.get_ident())
                    if stream is None:
                        stream = self._streams[threading.get_ident()] = torch.cuda.Stream(self.pages[0].device)
                    with torch.cuda.stream(stream):
                        stream.wait_event(ready)
                        size = work()
                    stream.synchronize()
            except Exception:  # noqa: BLE001 - a failed job is reported, never raised into vLLM's step
                _log.exception("kvtc offloading tier: %s job %d failed", what, job_id)
                return TransferResult(job_id, False, None, time.perf_counter() - t0)
            return TransferResult(job_id, True, size, time.perf_counter() - t0)

        def _submit(self, job_id: int, what: str, work: Any) -> bool:
            ready = None
            device = self.pages[0].device
            if device.type == "cuda":
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(device))
            with self._lock:
                self._jobs[job_id] = self._pool.submit(self._run, job_id, what, work, ready)
            return True

        def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: KVTCLoadStoreSpec) -> bool:
            ids, n = self._ids(src_spec.block_ids), self.blocks_per_chunk
            if len(ids) != n * len(dst_spec.slots):
                raise ValueError(f"store of {len(dst_spec.slots)} chunks got {len(ids)} GPU blocks, not "
                                 f"{n} per chunk")
            with self._lock:  # evicted or failed chunks' blobs: the host memory the budget no longer counts
                for slot in getattr(dst_spec, "drop", ()):
                    self.blobs.pop(slot, None)

            def store() -> int:
                size = 0
                for i, (slot, start) in enumerate(zip(dst_spec.slots.tolist(), dst_spec.starts.tolist())):
                    keys, values = self.gather(ids[i * n:(i + 1) * n])
                    blob = self.codec.encode(keys, values, start)
                    with self._lock:
                        self.blobs[slot] = (dst_spec.bindings[i], blob)
                    size += len(blob)
                return size

            return self._submit(job_id, "store", store)

        def submit_load(self, job_id: int, src_spec: KVTCLoadStoreSpec, dst_spec: GPULoadStoreSpec,
                        expedited: bool = False) -> bool:
            ids, n, N = self._ids(dst_spec.block_ids), self.blocks_per_chunk, self.page.tokens
            skip = int(dst_spec.block_indices[0]) % n if len(dst_spec.block_indices) else 0

            def load() -> int:
                decoded, size = [], 0
                for slot, start, bound in zip(src_spec.slots.tolist(), src_spec.starts.tolist(), src_spec.bindings):
                    with self._lock:
                        stored_binding, blob = self.blobs[slot]
                    if bound != UNBOUND and stored_binding != bound:
                        raise BlobError(f"slot {slot} holds the chunk of another key (its binding differs); not loaded")
                    decoded.append(self.codec.decode(blob, self.pages[0].device, start))  # all checked first
                    size += len(blob)
                done = 0
                for i, (keys, values) in enumerate(decoded):
                    first = skip if i == 0 else 0
                    count = min(keys.shape[2] // N - first, len(ids) - done)
                    tokens = slice(first * N, (first + count) * N)
                    for layer, p in enumerate(self.pages):
                        self.page.write(p, ids[done:done + count], keys[layer, :, tokens], values[layer, :, tokens])
                    done += count
                if done != len(ids):
                    raise ValueError(f"load of {len(src_spec.slots)} chunks filled {done} of {len(ids)} GPU blocks")
                return size

            return self._submit(job_id, "load", load)

        def get_finished(self) -> list[TransferResult]:
            with self._lock:
                done = [j for j, f in self._jobs.items() if f.done()]
                futures = [self._jobs.pop(j) for j in done]
            return [f.result() for f in futures]

        def wait(self, job_ids: set[int]) -> None:
            with self._lock:
                futures = [self._jobs[j] for j in job_ids if j in self._jobs]
            wait_futures(futures)

        def shutdown(self) -> None:
            self._pool.shutdown(wait=True)

    class KVTCOffloadingSpec(OffloadingSpec):
        """vLLM's OffloadingConnector spec: `spec_name` "KVTCOffloadingSpec", `spec_module_path`
        "kvtc.kernels.integrations.vllm_offload"; settings in kv_connector_extra_config (see OffloadSettings)."""

        def __init__(self, config: OffloadingConfig) -> None:
            super().__init__(config)
            self.settings = OffloadSettings.from_extra(dict(config.extra_config))
            if len(config.groups) != 1:
                raise ValueError(f"the kvtc offloading spec codes one full-attention KV cache group; this model has "
                                 f"{len(config.groups)} (sliding-window, Mamba or other layer kinds)")
            group = config.groups[0]
            if group.sliding_window_size_in_chunks is not None:
                raise ValueError("the kvtc offloading spec codes full-attention layers; this model's cache group is "
                                 "sliding-window or chunked")
            self.tokens_per_chunk = group.tokens_per_block * self.blocks_per_chunk
            slot_count(self.settings, config.worker_kv_bytes_per_block, self.blocks_per_chunk,
                       config.parallel.world_size)  # vLLM's block bytes checked before any artifact is pulled
            self._codec: KVTCCodec | None = None
            self._plan: SlotPlan | None = None
            self._manager: KVTCOffloadingManager | None = None
            self._worker: KVTCOffloadingWorker | None = None

        @property
        def plan(self) -> SlotPlan:
            """The tier's slots, from the codec's size bounds (the artifact pulled on first use)."""
            if self._plan is None:
                self._plan = SlotPlan.for_codec(self.settings, self.chunk_codec(), self.tokens_per_chunk,
                                                self.cache_dtype(), self.config.parallel.world_size)
            return self._plan

        @property
        def num_slots(self) -> int:
            return self.plan.num_slots

        def cache_dtype(self) -> torch.dtype:
            dtype = CACHE_DTYPES.get(self.config.model.dtype)
            if dtype is None:
                raise ValueError(f"KV cache dtype {self.config.model.dtype!r} is not supported by the kvtc "
                                 "offloading tier (float16, bfloat16, float32)")
            return dtype

        def chunk_codec(self) -> ChunkCodec:
            """This rank's chunk codec, its artifact pulled and verified once per process."""
            if self._codec is None:
                self._codec = self.load_codec()
            layers = [layer_index(name) for name in self.config.groups[0].layer_names]
            return ChunkCodec(self._codec, layers)

        def get_manager(self) -> KVTCOffloadingManager:
            if self._manager is None:
                plan = self.plan
                self._manager = KVTCOffloadingManager(plan.units, self.tokens_per_chunk,
                                                      self.kv_events_config.enable_kv_cache_events,
                                                      chunk_units=plan.chunk_units,
                                                      first_chunk_units=plan.first_chunk_units, sinks=plan.sinks)
            return self._manager

        def load_codec(self) -> KVTCCodec:
            """This worker's rank codec (its tensor-parallel rank's bases), pulled and verified; its basis held as a
            server holds it (kernels/codec/held_basis.py)."""
            s, par = self.settings, self.config.parallel
            tp_rank = par.rank % par.tp_size
            codec = served_codec(KVTCCodec.from_registry(s.artifact, s.ratio, registry=s.registry, backend=s.backend,
                                                         mode=s.mode, rank=tp_rank))
            return_freed_memory()
            if codec.spec.heads is None and par.tp_size > 1:
                raise ValueError(f"artifact {s.artifact} has one basis over all KV heads (TP 1); this deployment runs "
                                 f"tensor-parallel size {par.tp_size}: calibrate with kvtc calibrate --tp "
                                 f"{par.tp_size}")
            return codec

        def get_worker(self, kv_caches: CanonicalKVCaches) -> KVTCOffloadingWorker:
            if self._worker is None:
                chunk_codec = self.chunk_codec()
                codec, dtype = self._codec, self.cache_dtype()
                page = PageFormat.for_layout(self.config.kv_cache_layout, kv_heads=codec.spec.kv_heads,
                                             tokens=self.config.groups[0].tokens_per_block,
                                             head_dim=codec.spec.head_dim, dtype=dtype)
                self._worker = KVTCOffloadingWorker(kv_caches, chunk_codec, page, self.blocks_per_chunk,
                                                    self.settings.transfer_threads)
            return self._worker
