"""CodecSpec: everything the runtime codec needs, decoupled from how it was calibrated.

Built from an Artifact (`CodecSpec.from_artifact`) or directly from tensors (tests, benches).
One GroupCode per (stream, group): a group (kvtc.artifacts.groups.FeatureGroup) is an ordered set
of layers x a KV head range [h0, h1) whose features (layer, kv head, head_dim order) get one basis.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from kvtc.artifacts.blocks import Block, qtype_bits
from kvtc.artifacts.fingerprint import model_id
from kvtc.artifacts.groups import FeatureGroup, check_cover, parse_groups
from kvtc.kernels.codec.layers import LayerSpec, cached_layers, is_mla, layers_from_json
from kvtc.kernels.codec.rope import RopeSpec
from kvtc.artifacts.schema import STREAMS
from kvtc.artifacts.tensor_parallel import TensorParallelLayout
from kvtc.kernels.codec.chunk_identity import artifact_identity
from kvtc.kernels.codec.ecsq import EcsqGroup, SymbolModel, check_decoder


CodedBlock = Block  # the allocation block of kvtc.artifacts.blocks, under the runtime's name


@dataclass(frozen=True, eq=False)
class GroupCode:
    """One basis: its group (layers x KV heads); mean (p_g,) and components (p_g, k) float32; blocks
    sorted, disjoint (components in gaps are coded as "none"); decoder (p_g, k) float32 of a basis that
    is not orthonormal, None otherwise: encode z = (x - mean) @ components, decode mean + z @ decoding.T."""

    group: FeatureGroup
    mean: torch.Tensor
    components: torch.Tensor
    blocks: tuple[CodedBlock, ...]
    decoder: torch.Tensor | None = None

    def __post_init__(self) -> None:
        p = self.mean.shape[0]
        if self.mean.ndim != 1 or self.components.ndim != 2 or self.components.shape[0] != p:
            raise ValueError(f"group {self.group.label}: mean {tuple(self.mean.shape)} and components "
                             f"{tuple(self.components.shape)} must be (p,) and (p, k)")
        check_decoder(self.group, self.components, self.decoder)
        pos = 0
        for b in self.blocks:
            if b.start < pos or b.size < 1:
                raise ValueError(f"group {self.group.label}: blocks must be sorted and disjoint; {b} starts before {pos}")
            if qtype_bits(b.qtype) != b.bits:
                raise ValueError(f"group {self.group.label}: block {b} has bits {b.bits}, type says {qtype_bits(b.qtype)}")
            pos = b.start + b.size
        if pos > self.components.shape[1]:
            raise ValueError(f"group {self.group.label}: blocks cover {pos} components, basis has {self.components.shape[1]}")

    @property
    def kept(self) -> int:
        """Components actually used (end of the last block that has bits)."""
        return max((b.start + b.size for b in self.blocks if b.bits), default=0)

    @property
    def decoding(self) -> torch.Tensor:
        """The matrix (p_g, k) that reconstructs: the decoder, or the components of an orthonormal basis."""
        return self.decoder if self.decoder is not None else self.components


@dataclass(frozen=True, eq=False)
class CodecSpec:
    """Runtime codec parameters for one artifact at one compression ratio.

    rope: the model's RoPE, removed from keys before coding; None for keys calibrated with RoPE kept.
    layers: the per-layer schema (kvtc.kernels.codec.layers) of a model whose layers differ (kinds, RoPE); None:
    every layer full attention with `rope`. Groups cover the layers that keep a KV cache; each layer's
    keys lose that layer's RoPE (none for NoPE layers, none at all when keys were calibrated RoPE-kept).
    tensor_parallel: the artifact's TP layout (None: single-rank). A rank's spec (`for_rank`) codes only
    that rank's KV heads: kv_heads is its head count, its groups' heads count from 0, `heads` says
    which of the model's KV heads they are, and its model_id names them (blobs of other heads are refused).
    value_dim: the width of a head in the values slot when it differs from head_dim: a multi-head latent
    attention model's values slot holds its RoPE key (head_dim is then its latent width, kv_heads 1, and the
    RoPE is removed from the values stream: `rope_stream`).
    identity: the artifact's digest, model id, revision, tokenizer and RoPE as its manifest records them
    (kernels/codec/chunk_identity.py: what a stored chunk's frame binds); None for a spec built by hand.
    """

    name: str
    version: str
    ratio: float
    model_id: str
    num_layers: int
    kv_heads: int
    head_dim: int
    sinks: int
    window: int
    rope: dict[str, Any] | None
    streams: dict[str, tuple[GroupCode, ...]] = field(default_factory=dict)
    ecsq: dict[str, tuple[EcsqGroup, ...]] | None = None  # the ECSQ mode's groups, when calibrated
    layers: tuple[LayerSpec, ...] | None = None
    tensor_parallel: TensorParallelLayout | None = None
    rank: int | None = None
    heads: tuple[int, int] | None = None
    value_dim: int | None = None
    identity: dict[str, str] | None = None  # what the artifact's manifest says of a stored chunk's identity

    def __post_init__(self) -> None:
        if self.value_dim is not None and self.value_dim < 1:
            raise ValueError(f"value_dim must be >= 1 or None, got {self.value_dim}")
        if self.layers is not None and len(self.layers) != self.num_layers:
            raise ValueError(f"the layer schema lists {len(self.layers)} layers, the spec {self.num_layers}")
        if min(self.num_layers, self.kv_heads, self.head_dim) < 1 or self.sinks < 0 or self.window < 0:
            raise ValueError("num_layers, kv_heads, head_dim must be >= 1 and sinks, window >= 0")
        if not (self.ratio > 0 and math.isfinite(self.ratio)):
            raise ValueError(f"ratio must be a positive number, got {self.ratio}")
        if set(self.streams) != set(STREAMS):
            raise ValueError(f"streams must be exactly {STREAMS}, got {sorted(self.streams)}")
        for stream, groups in self.streams.items():
            check_cover([g.group for g in groups], self.coded_layers, self.kv_heads, f"{stream} groups")
            dim = self.dim(stream)
            for g in groups:
                if g.mean.shape[0] != g.group.dim(self.kv_heads, dim):
                    raise ValueError(f"{stream} group {g.group.label}: p_g {g.mean.shape[0]} is not layers x heads "
                                     f"x {dim} = {g.group.dim(self.kv_heads, dim)}")
        if [g.group for g in self.streams["keys"]] != [g.group for g in self.streams["values"]]:
            raise ValueError("keys and values must have the same groups in the same order")
        if self.ecsq is not None:
            if set(self.ecsq) != set(STREAMS) or any(
                    [e.group for e in self.ecsq[st]] != [g.group for g in self.streams[st]] for st in STREAMS):
                raise ValueError("ECSQ groups must match the fixed-rate groups stream by stream")

    @property
    def features(self) -> int:
        """p = layers * kv_heads * head_dim (the keys stream; see `stream_features`)."""
        return len(self.coded_layers) * self.kv_heads * self.head_dim

    def dim(self, stream: str) -> int:
        """Width of one head of `stream`: head_dim, or value_dim for the values of an MLA model."""
        return self.head_dim if stream == "keys" or self.value_dim is None else self.value_dim

    def stream_features(self, stream: str) -> int:
        """p of `stream` = layers * kv_heads * its head width."""
        return len(self.coded_layers) * self.kv_heads * self.dim(stream)

    @property
    def rope_stream(self) -> str:
        """The stream whose RoPE is removed before coding: "keys", or "values" (the RoPE key) for MLA."""
        return "values" if is_mla(self.layers) else "keys"

    @property
    def held_dtype(self) -> torch.dtype:
        """The dtype its bases are held in on the host: float32 as an Artifact reads them, half as a server holds
        them (kernels/codec/held_basis.py)."""
        return next((g.components.dtype for groups in self.streams.values() for g in groups), torch.float32)

    @property
    def widths(self) -> str:
        """The per-token shape a cache must have, in words (for error messages)."""
        if self.value_dim is None:
            return f"{self.kv_heads} KV heads x head_dim {self.head_dim}"
        return f"latent width {self.head_dim}, rope width {self.value_dim}"

    @property
    def coded_layers(self) -> list[int]:
        """Layers that keep a KV cache (all of them without a schema), ascending."""
        return list(range(self.num_layers)) if self.layers is None else cached_layers(self.layers)

    @property
    def layer_ropes(self) -> list[RopeSpec | None]:
        """Per layer, the RoPE removed from its keys before coding (None: none)."""
        if self.layers is None:
            rope = None if self.rope is None else RopeSpec.from_dict(self.rope)
            return [rope] * self.num_layers
        return [l.rope for l in self.layers]

    @property
    def shared_rope(self) -> tuple[bool, RopeSpec | None]:
        """(True, rope) when every coded layer removes the same RoPE (or none), else (False, None)."""
        ropes = {self.layer_ropes[i] for i in self.coded_layers}
        return (True, ropes.pop()) if len(ropes) == 1 else (False, None)

    def for_rank(self, rank: int) -> "CodecSpec":
        """The spec of tensor-parallel rank `rank`: its groups only, over its KV heads renumbered from 0.
        A single-rank artifact has one rank, 0: the whole cache."""
        if self.rank is not None:
            raise ValueError(f"this spec is already rank {self.rank}'s; build the rank's spec from the artifact's")
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            raise ValueError(f"rank must be an integer >= 0 (a tensor-parallel rank), got {rank!r}")
        if self.tensor_parallel is None:
            if rank != 0:
                raise ValueError(f"artifact {self.name}@{self.version} was calibrated for one rank (no --tp): its only "
                                 f"rank is 0, got rank={rank!r}; recalibrate with --tp N for per-rank bases")
            return self
        tp = self.tensor_parallel
        h0, h1 = heads = tp.heads(rank)
        picked = tp.rank_groups(rank, [g.group for g in self.streams["keys"]])

        def local(codes: tuple) -> tuple:
            return tuple(replace(codes[i], group=FeatureGroup(codes[i].group.layers, (0, h1 - h0))) for i in picked)

        return replace(self, kv_heads=h1 - h0, model_id=f"{self.model_id}/kv{h0}-{h1}", rank=rank, heads=heads,
                       streams={st: local(self.streams[st]) for st in STREAMS},
                       ecsq=None if self.ecsq is None else {st: local(self.ecsq[st]) for st in STREAMS})

    @classmethod
    def from_artifact(cls, artifact: Any, ratio: float, rank: int | None = None) -> "CodecSpec":
        """Read basis and allocation through the Artifact interface (.manifest, .basis, .allocation);
        `rank`: that tensor-parallel rank's spec (see for_rank), None: every KV head."""
        spec = cls._from_artifact(artifact, ratio)
        return spec if rank is None else spec.for_rank(rank)

    @classmethod
    def _from_artifact(cls, artifact: Any, ratio: float) -> "CodecSpec":
        m = artifact.manifest
        fp, cal = m["model"], m["calibration"]
        num_layers = int(fp["num_layers"])
        groups = parse_groups(cal.get("groups") or [[0, num_layers]])
        streams: dict[str, tuple[GroupCode, ...]] = {}
        bases = {(stream, gi): artifact.basis(stream, gi) for stream in STREAMS for gi in range(len(groups))}
        for stream in STREAMS:
            codes = []
            for gi, group in enumerate(groups):
                mean, _eig, comps = bases[stream, gi]
                blocks = tuple(CodedBlock(int(s), int(n), str(t), int(bits))
                               for s, n, t, bits in artifact.allocation(ratio, stream, gi))
                kept = max((b.start + b.size for b in blocks if b.bits), default=0)
                blocks = tuple(b for b in blocks if b.start < kept)
                codes.append(GroupCode(group, torch.as_tensor(mean, dtype=torch.float32).contiguous(),
                                       _columns(comps, kept), blocks, _decoder(artifact, stream, gi, kept)))
            streams[stream] = tuple(codes)
        return cls(name=str(m["name"]), version=str(m["version"]), ratio=float(ratio), model_id=model_id(fp),
                   num_layers=num_layers, kv_heads=int(fp["num_kv_heads"]), head_dim=int(fp["head_dim"]),
                   sinks=int(cal["sinks"]), window=int(cal["window"]), streams=streams,
                   rope=None if cal.get("keys") == "rope-kept" else fp.get("rope"),
                   ecsq=_ecsq_groups(artifact, ratio, groups, bases), layers=_schema(fp, cal.get("keys") == "rope-kept"),
                   tensor_parallel=TensorParallelLayout.from_dict(cal.get("tensor_parallel"), groups),
                   value_dim=None if fp.get("value_dim") is None else int(fp["value_dim"]),
                   identity=artifact_identity(artifact))


def _columns(matrix: np.ndarray | torch.Tensor, kept: int) -> torch.Tensor:
    """The first `kept` columns of a (p, k) basis matrix as a view of it, no copy: an Artifact reads each matrix
    once (a server holds it once, in half precision: kernels/codec/held_basis.py), so every ratio's and mode's
    components (leading columns of one basis) share its memory. Float32 unless the matrix is held in half."""
    if isinstance(matrix, np.ndarray):
        matrix = matrix if matrix.dtype == np.float32 else matrix.astype(np.float32)
    whole = torch.as_tensor(matrix)
    if whole.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        whole = whole.float()
    if kept > whole.shape[1]:
        raise ValueError(f"the allocation keeps {kept} components, the basis held has {whole.shape[1]}")
    return whole[:, :kept]


def _decoder(artifact: Any, stream: str, group: int, kept: int) -> torch.Tensor | None:
    """The basis' decoder's first `kept` columns, or None for an orthonormal basis (or an artifact-like
    object without decoders)."""
    decoder = artifact.decoder(stream, group) if hasattr(artifact, "decoder") else None
    return None if decoder is None else _columns(decoder, kept)


def _schema(fingerprint: dict, rope_kept: bool) -> tuple[LayerSpec, ...] | None:
    """The manifest's layer schema (None for uniform models); keys calibrated RoPE-kept remove no RoPE."""
    if not fingerprint.get("layers"):
        return None
    layers = layers_from_json(fingerprint["layers"])
    return tuple(dataclasses.replace(l, rope=None) for l in layers) if rope_kept else layers


def _ecsq_groups(artifact: Any, ratio: float, groups: list, bases: dict) -> dict[str, tuple[EcsqGroup, ...]] | None:
    """The artifact's ECSQ tables at `ratio` as runtime groups (`bases`: its bases by (stream, group), read once);
    None when it has none for every group."""
    if not hasattr(artifact, "ecsq"):
        return None
    out = {}
    for stream in STREAMS:
        codes = []
        for gi, group in enumerate(groups):
            table = artifact.ecsq(ratio, stream, gi)
            if table is None:
                return None
            mean, _eig, comps = bases[stream, gi]
            kept = int(table["kept"])
            codes.append(EcsqGroup(group, torch.as_tensor(mean, dtype=torch.float32).contiguous(),
                                   _columns(comps, kept),
                                   float(table["step"]), np.asarray(table["model"], dtype=np.int64),
                                   torch.as_tensor(table["offsets"], dtype=torch.float32),
                                   tuple(SymbolModel(int(r), np.asarray(c, dtype=np.int64)) for r, c in table["models"]),
                                   _decoder(artifact, stream, gi, kept), int(table["budget_bits"])))
        out[stream] = tuple(codes)
    return out
