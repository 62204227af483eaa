"""KVTC inside vLLM without an LMCache server: an out-of-tree KV offloading spec for vLLM's own
`OffloadingConnector` (vLLM 0.33, `vllm.v1.kv_offload`). vLLM loads it by module path:

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "KVTCOffloadingSpec",
        "spec_module_path": "kvtc.kernels.vllm_offload", "kvtc_artifact": "NAME@production",
        "kvtc_ratio": 16, "kvtc_registry": "s3://bucket/kvtc", "cpu_bytes_to_use": 8000000000,
        "block_size": 256}}'

Scheduler side, `KVTCOffloadingManager` tracks which offload keys (one per chunk of
`blocks_per_chunk` GPU blocks) are stored, in slots of a fixed count sized from `cpu_bytes_to_use`
at the ratio's bytes, least recently used evicted first. vLLM records each key's end-token position
in the request context; the manager hands every stored chunk's first position to the workers with
the slots, so keys are coded with RoPE removed at their true positions (the default artifacts), and
the first `sinks` tokens of a request stay raw, as the codec keeps them.

Worker side, `KVTCOffloadingWorker` reads each layer's pages from the KV cache tensors vLLM
registers (one (num_blocks, page bytes) view per layer: page = [tokens, kv heads, K|V] or [kv heads,
tokens, K|V] by the cache layout), codes a chunk as one blob with the rank's codec (`KVTCCodec`,
this rank's bases of a `--tp N` artifact), keeps the blob in host memory under its slot, and on a
load decodes it back into the GPU blocks vLLM names. Transfers run synchronously when submitted.

Supported: one full-attention KV cache group (no sliding-window, Mamba or MLA groups), K and V of
equal head size, float16 / bfloat16 / float32 caches (no fp8 KV cache), cache layouts LBNHC, BLNHC,
LBHNC, BLHNC, tensor parallelism with an artifact calibrated for the same TP size, pipeline stages
whose layers are whole groups of the artifact. Anything else is refused when the spec or the worker
is built, with the reason.

The page transform (`PageFormat`, `ChunkCodec`) needs only torch and the codec; the vLLM classes
are defined when vLLM is importable.
"""
from __future__ import annotations

import math
import re
import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any, Sequence

import numpy as np
import torch

from kvtc.kernels.codec import KVTCCodec
from kvtc.kernels.layered import restrict

PAGE_ORDERS = {"LBNHC": "NHC", "BLNHC": "NHC", "LBHNC": "HNC", "BLHNC": "HNC"}
CACHE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
SLOT_SLACK = 1.05  # a chunk's blob: the ratio's budget plus header and raw sinks


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
    """A rank's codec for offload chunks: no recent window (a chunk is not the end of the sequence),
    sinks kept raw where a chunk starts at position 0, and only the `layers` this worker holds (a
    pipeline stage), in the order vLLM lists them."""

    def __init__(self, codec: KVTCCodec, layers: Sequence[int]) -> None:
        spec = replace(codec.spec, window=0)
        coded = list(spec.coded_layers)
        missing = [layer for layer in layers if layer not in coded]
        if missing:
            raise ValueError(f"artifact {spec.name}@{spec.version} codes layers {coded}; vLLM's cache group holds "
                             f"layers {missing} it has no basis for")
        if list(layers) != coded:
            spec = restrict(spec, list(layers))
        self.spec = spec
        self.codec = KVTCCodec(spec, mode=codec.mode, backend=codec.backend, level=codec.level, coder=codec.coder,
                               ecsq_format=codec.ecsq_format, basis_dtype=codec.basis_dtype)

    def encode(self, keys: torch.Tensor, values: torch.Tensor, start: int) -> bytes:
        """keys, values (layers, kv_heads, tokens, head_dim), first token at absolute position `start`."""
        return self.codec.encode(keys, values, start=start)

    def decode(self, blob: bytes, device: torch.device, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        from kvtc.kernels.blob import BlobError, read_blob

        header, _ = read_blob(blob)
        if header.start != start:
            raise BlobError(f"stored chunk starts at position {header.start}, the load expects {start}")
        return self.codec.decode(blob, device=device)


@dataclass(frozen=True)
class OffloadSettings:
    """kv_connector_extra_config keys of this spec: kvtc_artifact "NAME[@VERSION|ALIAS]", kvtc_ratio,
    kvtc_registry (URI; default $KVTC_REGISTRY), kvtc_mode ("ecsq" | "fixed"; default the artifact's),
    kvtc_backend (codec backend), cpu_bytes_to_use (host bytes for stored chunks, all workers)."""

    artifact: str
    ratio: float
    cpu_bytes_to_use: int
    registry: str | None = None
    mode: str | None = None
    backend: str = "auto"

    def __post_init__(self) -> None:
        if not isinstance(self.artifact, str) or not self.artifact:
            raise ValueError('the kvtc offloading spec needs "kvtc_artifact": "NAME[@VERSION|ALIAS]" in '
                             "kv_connector_extra_config")
        if isinstance(self.ratio, bool) or not isinstance(self.ratio, (int, float)) or not self.ratio > 1:
            raise ValueError(f'the kvtc offloading spec needs "kvtc_ratio": a ratio > 1 the artifact was allocated '
                             f"for, got {self.ratio!r}")
        if isinstance(self.cpu_bytes_to_use, bool) or not isinstance(self.cpu_bytes_to_use, int) \
                or self.cpu_bytes_to_use <= 0:
            raise ValueError(f'the kvtc offloading spec needs "cpu_bytes_to_use": host bytes > 0, got '
                             f"{self.cpu_bytes_to_use!r}")

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> "OffloadSettings":
        cpu = extra.get("cpu_bytes_to_use")
        return cls(artifact=extra.get("kvtc_artifact"), ratio=extra.get("kvtc_ratio"),  # type: ignore[arg-type]
                   cpu_bytes_to_use=int(cpu) if isinstance(cpu, (int, float)) and not isinstance(cpu, bool) else cpu,
                   registry=extra.get("kvtc_registry"), mode=extra.get("kvtc_mode"),
                   backend=extra.get("kvtc_backend", "auto"))


def slot_count(settings: OffloadSettings, worker_kv_bytes_per_block: int, blocks_per_chunk: int,
               world_size: int) -> int:
    """Stored chunks `cpu_bytes_to_use` holds: each chunk's raw bytes (all workers) over the ratio, with slack."""
    if worker_kv_bytes_per_block <= 0:
        raise ValueError("vLLM reported no KV bytes per block; the kvtc offloading spec cannot size its slots")
    per_chunk = math.ceil(worker_kv_bytes_per_block * blocks_per_chunk * world_size / settings.ratio * SLOT_SLACK)
    return settings.cpu_bytes_to_use // per_chunk


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

        def __init__(self, slots: Sequence[int], starts: Sequence[int]) -> None:
            self.slots = np.asarray(slots, dtype=np.int64)
            self.starts = np.asarray(starts, dtype=np.int64)
            if self.slots.shape != self.starts.shape:
                raise ValueError("a kvtc load/store spec needs one start position per slot")

        def __repr__(self) -> str:
            return f"KVTCLoadStoreSpec(slots={self.slots.tolist()}, starts={self.starts.tolist()})"

    @dataclass
    class _Entry:
        slot: int
        start: int
        ready: bool = False
        pins: int = 0

    class KVTCOffloadingManager(OffloadingManager):
        """Slots for stored chunks, least recently used evicted first; entered from one thread."""

        def __init__(self, num_slots: int, tokens_per_chunk: int, enable_events: bool = False) -> None:
            if num_slots < 1:
                raise ValueError(f"the kvtc offloading tier has room for {num_slots} chunks; raise cpu_bytes_to_use")
            self.num_slots, self.tokens_per_chunk = num_slots, tokens_per_chunk
            self._free = list(range(num_slots - 1, -1, -1))
            self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
            self._events: list[OffloadingEvent] = [] if enable_events else None  # type: ignore[assignment]

        def lookup(self, key, req_context) -> LookupResult:
            entry = self._entries.get(key)
            return LookupResult.HIT if entry is not None and entry.ready else LookupResult.MISS

        def prepare_load(self, keys, req_context) -> KVTCLoadStoreSpec:
            entries = [self._entries[k] for k in keys]
            for e in entries:
                e.pins += 1
            return KVTCLoadStoreSpec([e.slot for e in entries], [e.start for e in entries])

        def touch(self, keys, req_context) -> None:
            for k in keys:
                if k in self._entries:
                    self._entries.move_to_end(k)

        def complete_load(self, keys, req_context) -> None:
            for k in keys:
                if k in self._entries:
                    self._entries[k].pins = max(0, self._entries[k].pins - 1)

        def _start(self, key, req_context) -> int:
            end = req_context.get_offload_key_position(key)
            if end is None:
                raise ValueError("vLLM gave no token position for an offloaded chunk; the kvtc tier codes keys at "
                                 "their positions and cannot store it")
            return max(0, int(end) - self.tokens_per_chunk)

        def prepare_store(self, keys, req_context) -> PrepareStoreOutput | None:
            new = [k for k in dict.fromkeys(keys) if k not in self._entries]
            wanted = set(keys)
            short = len(new) - len(self._free)
            victims = []
            if short > 0:
                victims = [k for k, e in self._entries.items() if e.ready and not e.pins and k not in wanted][:short]
                if len(victims) < short:
                    return None
            for k in victims:
                self._free.append(self._entries.pop(k).slot)
            if victims and self._events is not None:
                self._events.append(OffloadingEvent(victims, Medium.CPU, removed=True))
            starts = [self._start(k, req_context) for k in new]
            slots = [self._free.pop() for _ in new]
            for k, slot, start in zip(new, slots, starts):
                self._entries[k] = _Entry(slot, start)
            return PrepareStoreOutput(keys_to_store=new, store_spec=KVTCLoadStoreSpec(slots, starts),
                                      evicted_keys=victims)

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
                    self._free.append(self._entries.pop(k).slot)
            if stored and self._events is not None:
                self._events.append(OffloadingEvent(stored, Medium.CPU, removed=False))

        def on_new_request(self, req_context) -> RequestOffloadingContext:
            return RequestOffloadingContext()

        def take_events(self):
            events, self._events = (self._events or []), ([] if self._events is not None else None)
            return events

        def reset_cache(self) -> None:
            for e in self._entries.values():
                self._free.append(e.slot)
            self._entries.clear()

    class KVTCOffloadingWorker(OffloadingWorker):
        """Codes chunks of GPU blocks into host-memory blobs and back, on the worker that owns the blocks."""

        def __init__(self, kv_caches: CanonicalKVCaches, chunk_codec: ChunkCodec, page: PageFormat,
                     blocks_per_chunk: int) -> None:
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
            self.blobs: dict[int, bytes] = {}
            self._finished: list[TransferResult] = []

        def _ids(self, ids: Any) -> torch.Tensor:
            return torch.as_tensor(np.asarray(ids, dtype=np.int64), device=self.pages[0].device)

        def gather(self, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            """-> keys, values (layers, kv_heads, blocks x tokens, head_dim) of the given GPU blocks."""
            read = [self.page.read(p, block_ids) for p in self.pages]
            return torch.stack([k for k, _ in read]), torch.stack([v for _, v in read])

        def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: KVTCLoadStoreSpec) -> bool:
            t0, size = time.perf_counter(), 0
            ids, n = self._ids(src_spec.block_ids), self.blocks_per_chunk
            if len(ids) != n * len(dst_spec.slots):
                raise ValueError(f"store of {len(dst_spec.slots)} chunks got {len(ids)} GPU blocks, not "
                                 f"{n} per chunk")
            for i, (slot, start) in enumerate(zip(dst_spec.slots.tolist(), dst_spec.starts.tolist())):
                keys, values = self.gather(ids[i * n:(i + 1) * n])
                blob = self.codec.encode(keys, values, start)
                self.blobs[slot] = blob
                size += len(blob)
            self._finished.append(TransferResult(job_id, True, size, time.perf_counter() - t0))
            return True

        def submit_load(self, job_id: int, src_spec: KVTCLoadStoreSpec, dst_spec: GPULoadStoreSpec,
                        expedited: bool = False) -> bool:
            t0, size = time.perf_counter(), 0
            ids, n, N = self._ids(dst_spec.block_ids), self.blocks_per_chunk, self.page.tokens
            skip = int(dst_spec.block_indices[0]) % n if len(dst_spec.block_indices) else 0
            done = 0
            for slot, start in zip(src_spec.slots.tolist(), src_spec.starts.tolist()):
                blob = self.blobs[slot]
                size += len(blob)
                keys, values = self.codec.decode(blob, self.pages[0].device, start)
                first = skip if done == 0 else 0
                count = min(keys.shape[2] // N - first, len(ids) - done)
                tokens = slice(first * N, (first + count) * N)
                for layer, p in enumerate(self.pages):
                    self.page.write(p, ids[done:done + count], keys[layer, :, tokens], values[layer, :, tokens])
                done += count
            if done != len(ids):
                raise ValueError(f"load of {len(src_spec.slots)} chunks filled {done} of {len(ids)} GPU blocks")
            self._finished.append(TransferResult(job_id, True, size, time.perf_counter() - t0))
            return True

        def get_finished(self) -> list[TransferResult]:
            out, self._finished = self._finished, []
            return out

        def wait(self, job_ids: set[int]) -> None:
            return  # transfers finish when submitted

    class KVTCOffloadingSpec(OffloadingSpec):
        """vLLM's OffloadingConnector spec: `spec_name` "KVTCOffloadingSpec", `spec_module_path`
        "kvtc.kernels.vllm_offload"; settings in kv_connector_extra_config (see OffloadSettings)."""

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
            self.num_slots = slot_count(self.settings, config.worker_kv_bytes_per_block, self.blocks_per_chunk,
                                        config.parallel.world_size)
            self._manager: KVTCOffloadingManager | None = None
            self._worker: KVTCOffloadingWorker | None = None

        def get_manager(self) -> KVTCOffloadingManager:
            if self._manager is None:
                self._manager = KVTCOffloadingManager(self.num_slots, self.tokens_per_chunk,
                                                      self.kv_events_config.enable_kv_cache_events)
            return self._manager

        def load_codec(self) -> KVTCCodec:
            """This worker's rank codec (its tensor-parallel rank's bases), pulled and verified."""
            s, par = self.settings, self.config.parallel
            tp_rank = par.rank % par.tp_size
            codec = KVTCCodec.from_registry(s.artifact, s.ratio, registry=s.registry, backend=s.backend,
                                            mode=s.mode, rank=tp_rank)
            if codec.spec.heads is None and par.tp_size > 1:
                raise ValueError(f"artifact {s.artifact} has one basis over all KV heads (TP 1); this deployment runs "
                                 f"tensor-parallel size {par.tp_size}: calibrate with kvtc calibrate --tp "
                                 f"{par.tp_size}")
            return codec

        def get_worker(self, kv_caches: CanonicalKVCaches) -> KVTCOffloadingWorker:
            if self._worker is None:
                codec = self.load_codec()
                layers = [layer_index(name) for name in self.config.groups[0].layer_names]
                chunk_codec = ChunkCodec(codec, layers)
                dtype = CACHE_DTYPES.get(self.config.model.dtype)
                if dtype is None:
                    raise ValueError(f"KV cache dtype {self.config.model.dtype!r} is not supported by the kvtc "
                                     "offloading tier (float16, bfloat16, float32)")
                page = PageFormat.for_layout(self.config.kv_cache_layout, kv_heads=codec.spec.kv_heads,
                                             tokens=self.config.groups[0].tokens_per_block,
                                             head_dim=codec.spec.head_dim, dtype=dtype)
                self._worker = KVTCOffloadingWorker(kv_caches, chunk_codec, page, self.blocks_per_chunk)
            return self._worker
