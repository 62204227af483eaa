"""LMCache's ranks of one artifact: the packed `ObjectKey.kv_rank` (KVRank) and every placement's chunk transform,
built on first use of each (RankedChunkTransforms), from the artifact pulled once from its registry."""
from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from typing import Any

import torch

from kvtc.kernels.codec.chunk_options import OUTLIER_FACTOR
from kvtc.kernels.codec.chunk_serde import ChunkTransform, Placement, place, placement_spec
from kvtc.kernels.codec.held_basis import return_freed_memory, served_codec
from kvtc.kernels.codec.kvtc_codec import KVTCCodec
from kvtc.kernels.codec.model_config import check_config
from kvtc.kernels.integrations.lmcache_settings import ChunkSerdeSettings, parse_partition


@dataclass(frozen=True)
class KVRank:
    """A storage key's rank: LMCache's `ObjectKey.kv_rank` packs
    (world_size << 24) | (global_rank << 16) | (local_world_size << 8) | local_rank
    (`ObjectKey.ComputeKVRank`), world_size and global_rank over TP x PP."""

    world_size: int
    rank: int
    local_world_size: int
    local_rank: int

    @classmethod
    def decode(cls, kv_rank: int | None) -> "KVRank":
        """LMCache's packed kv_rank -> its fields; None (a caller without keys) is rank 0 of world size 1."""
        if kv_rank is None:
            return cls(1, 0, 1, 0)
        if not isinstance(kv_rank, int) or isinstance(kv_rank, bool) or not 0 <= kv_rank < 1 << 32:
            raise ValueError(f"kv_rank must be LMCache's packed rank, an integer in [0, 2^32), got {kv_rank!r}")
        out = cls((kv_rank >> 24) & 0xFF, (kv_rank >> 16) & 0xFF, (kv_rank >> 8) & 0xFF, kv_rank & 0xFF)
        if out.world_size == 0 or out.rank >= out.world_size or out.local_rank >= max(out.local_world_size, 1):
            raise ValueError(f"kv_rank {kv_rank} ({kv_rank:#010x}) is not LMCache's packed rank "
                             "(world_size << 24 | rank << 16 | local_world_size << 8 | local_rank, "
                             f"ObjectKey.ComputeKVRank): it decodes to {out}")
        return out

    def __str__(self) -> str:
        return f"rank {self.rank} of world size {self.world_size}"


def load_rank_codec(ref: str, ratio: float, rank: int | None, **kwargs: Any) -> KVTCCodec:
    """`KVTCCodec.from_registry(ref, ratio, rank=rank, ...)`: tensor-parallel rank `rank`'s codec (None:
    every KV head); a single-rank artifact has one rank, 0. Its basis is held as a server holds it: once per
    (artifact, rank) in the process, in half precision (kernels/codec/held_basis.py), the float32 one let go."""
    codec = served_codec(KVTCCodec.from_registry(ref, ratio, rank=rank, **kwargs))
    return_freed_memory()
    return codec


class RankedChunkTransforms:
    """Every placement's transform of one artifact, built on first use of each (LMCache keys carry a packed
    `kv_rank`: `KVRank`). codec: the artifact's whole-model codec (rank None); the options as ChunkTransform's;
    partition: layers per pipeline stage (None: vLLM's default partition)."""

    def __init__(self, codec: KVTCCodec, model_config: Any = None, *, mode: str | None = None, pad: bool = True,
                 positions: bool = False, partition: tuple[int, ...] | None = None, sink_budget: str = "shared",
                 sink_format: str = "int8", chunk_key: bytes | None = None,
                 outlier_factor: float | None = OUTLIER_FACTOR) -> None:
        self.spec = codec.spec
        if self.spec.rank is not None:
            raise ValueError("RankedChunkTransforms takes the artifact's whole-model codec (rank=None)")
        if model_config is not None:
            check_config(self.spec, model_config)
        self._codec, self._mode, self._pad, self._positions = codec, mode, pad, positions
        self._sink_budget, self._sink_format, self._chunk_key = sink_budget, sink_format, chunk_key
        self._outlier_factor = outlier_factor
        self.partition = parse_partition(partition)
        self._lock = threading.Lock()
        self._built: dict[Placement, ChunkTransform | ValueError] = {}
        self._sizes: dict[tuple, int | ValueError] = {}
        self._ranks: dict[int | None, ChunkTransform] = {}
        tp = self.spec.tensor_parallel.tp if self.spec.tensor_parallel is not None else 1
        self.default = self.transform(Placement(0, tp, 0, self.spec.num_layers))  # bad settings fail here

    @classmethod
    def from_settings(cls, settings: ChunkSerdeSettings, *, positions: bool = False) -> "RankedChunkTransforms":
        """Pull the artifact (verified) once; every bad setting fails here."""
        model_config = None
        if settings.model:
            from transformers import AutoConfig  # noqa: PLC0415 - loads only where a model config is checked

            model_config = AutoConfig.from_pretrained(settings.model)
        codec = load_rank_codec(settings.artifact, settings.ratio, None, registry=settings.registry,
                                backend=settings.backend)
        chunk_key = settings.chunk_key()
        return cls(codec, model_config, mode=settings.mode, pad=settings.pad, positions=positions,
                   partition=settings.pp_partition, chunk_key=chunk_key)

    def transform(self, placement: Placement) -> ChunkTransform:
        with self._lock:
            built = self._built.get(placement)
        if built is None:
            try:
                codec = KVTCCodec(placement_spec(self.spec, placement),
                                  options=replace(self._codec.options, outlier_factor=self._outlier_factor))
                built = ChunkTransform(codec, mode=self._mode, pad=self._pad, positions=self._positions,
                                       label=f"artifact {self.spec.name}@{self.spec.version} {placement.describe(self.spec)}",
                                       sink_budget=self._sink_budget, sink_format=self._sink_format,
                                       chunk_key=self._chunk_key)
            except ValueError as exc:
                built = exc
            with self._lock:
                built = self._built.setdefault(placement, built)
        if isinstance(built, ValueError):
            raise ValueError(str(built))
        return built

    def __call__(self, kv_rank: int | None) -> ChunkTransform:
        """The transform of a key's packed kv_rank; ValueError naming the rank, the world size and the mismatch."""
        found = self._ranks.get(kv_rank)
        if found is not None:
            return found
        kv = KVRank.decode(kv_rank)
        try:
            out = self.transform(place(self.spec, kv, self.partition))
        except ValueError as exc:
            text = str(exc)
            raise ValueError(text if text.startswith(str(kv)) else f"{kv}: {text}") from exc
        self._ranks[kv_rank] = out
        return out

    def serialized_size(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        """The bound of a chunk of this shape: the largest over every placement of the artifact that holds
        such chunks (each TP rank; a layer count below the model's: every run of that many layers a stage
        could hold), so it is the same whichever ranks have been seen (a store and a later load agree)."""
        key = (tuple(int(n) for n in shape), dtype)
        with self._lock:
            known = self._sizes.get(key)
        if known is None:
            known = self._bound(key[0], dtype)
            with self._lock:
                self._sizes[key] = known
        if isinstance(known, ValueError):
            raise ValueError(str(known))
        return known

    def _bound(self, shape: tuple[int, ...], dtype: torch.dtype) -> int | ValueError:
        n, tp = self.spec.num_layers, self.spec.tensor_parallel
        if len(shape) != 4 or not 0 < shape[1] < n:
            try:
                self.default.check(shape, dtype)
            except ValueError as exc:
                return exc
        layers = shape[1]
        runs = [(a, a + layers) for a in range(n - layers + 1)] if 0 < layers < n else [(0, n)]
        ranks = range(tp.tp if tp is not None else 1)
        sizes, errors = [], []
        for first, end in runs:
            for r in ranks:
                try:
                    t = self.transform(Placement(r, len(ranks), first, end))
                    sizes.append(t.serialized_size(shape, dtype))
                except ValueError as exc:
                    errors.append(exc)
        if sizes:
            return max(sizes)
        return ValueError(f"no placement of artifact {self.spec.name}@{self.spec.version} holds chunks of shape {shape} "
                          f"({errors[0] if errors else 'no layers'})")
