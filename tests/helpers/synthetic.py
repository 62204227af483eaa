"""Synthetic CodecSpecs and caches for tests and benches: no calibration or artifact needed.

A synthetic basis is a random orthonormal matrix; a synthetic cache is drawn from it with a
decaying spectrum (sigma_i ~ (i + 1)^-0.7) plus small isotropic noise, keys rotated by RoPE.
"""
from __future__ import annotations

import functools
import random

import torch

from kvtc.artifacts.blocks import QTYPES, block_cost_bits, budget_bits, qtype_bits
from kvtc.artifacts.groups import FeatureGroup
from kvtc.kernels.codec.rope import RopeSpec
from kvtc.kernels.codec.spec import STREAMS, CodecSpec, CodedBlock, GroupCode


@functools.lru_cache(maxsize=4)
def _orthonormal(p: int, seed: int) -> torch.Tensor:
    """Dense random orthonormal (p, p): Kronecker product of two small random rotations (cheap at p=5760)."""
    g = torch.Generator().manual_seed(seed)
    a = max(d for d in range(1, int(p ** 0.5) + 1) if p % d == 0)
    qa, _ = torch.linalg.qr(torch.randn(a, a, generator=g, dtype=torch.float64))
    qb, _ = torch.linalg.qr(torch.randn(p // a, p // a, generator=g, dtype=torch.float64))
    return torch.kron(qa, qb).to(torch.float32).contiguous()


def budget_blocks(p: int, ratio: float) -> tuple[CodedBlock, ...]:
    """A DP-like allocation within B = floor(16 p / ratio) bits: fp8 head, int4 body, int2 tail."""
    budget = budget_bits(p, ratio)
    template = [(1, "fp8")] * 4 + [(16, "int8"), (16, "fp8"), (16, "none")] + [(64, "int4")] * 4
    blocks, pos = [], 0
    for size, qtype in template + [(256, "int2")] * (p // 256 + 1):
        size = min(size, p - pos)
        if size <= 0 or block_cost_bits(qtype, size) > budget:
            break
        budget -= block_cost_bits(qtype, size)
        blocks.append(CodedBlock(pos, size, qtype, qtype_bits(qtype)))
        pos += size
    while blocks and blocks[-1].qtype == "none":
        blocks.pop()
    return tuple(blocks)


def random_blocks(k: int, seed: int) -> tuple[CodedBlock, ...]:
    """Random odd-sized blocks of every type covering exactly [0, k)."""
    rng = random.Random(seed)
    blocks, pos = [], 0
    while pos < k:
        size = min(k - pos, rng.choice([1, 3, 5, 16, 17, 33]))
        qtype = rng.choice(QTYPES) if pos + size < k else rng.choice(QTYPES[1:])
        blocks.append(CodedBlock(pos, size, qtype, qtype_bits(qtype)))
        pos += size
    return tuple(blocks)


def synthetic_spec(num_layers: int, kv_heads: int, head_dim: int, ratio: float = 16.0, *,
                   groups: list[tuple[int, int] | FeatureGroup] | None = None, sinks: int = 4, window: int = 128, seed: int = 0,
                   kept: int | None = None, rope_theta: float | None = 10000.0, name: str = "synthetic",
                   version: str = "v0") -> CodecSpec:
    """CodecSpec with random orthonormal bases; allocation by budget_blocks, or random_blocks over `kept`.
    groups: FeatureGroups, or (a, b) pairs meaning layers [a, b) (default: one group of every layer)."""
    groups = [g if isinstance(g, FeatureGroup) else FeatureGroup.span(*g) for g in groups or [(0, num_layers)]]
    streams = {}
    for si, stream in enumerate(STREAMS):
        codes = []
        for gi, group in enumerate(groups):
            p = group.dim(kv_heads, head_dim)
            blocks = random_blocks(kept, seed + 7 * si + gi) if kept else budget_blocks(p, ratio)
            k = blocks[-1].start + blocks[-1].size if blocks else 0
            basis = _orthonormal(p, seed + 101 * si + gi)[:, :k].contiguous()
            g = torch.Generator().manual_seed(seed + 13 * si + gi)
            codes.append(GroupCode(group, torch.randn(p, generator=g) * 0.5, basis, blocks))
        streams[stream] = tuple(codes)
    rope = None
    if rope_theta is not None:
        inv = [rope_theta ** (-2 * i / head_dim) for i in range(head_dim // 2)]
        rope = {"rope_type": "default", "theta": rope_theta, "head_dim": head_dim, "rotary_dim": head_dim,
                "inv_freq": inv, "attention_scaling": 1.0, "layout": "half"}
    return CodecSpec(name=name, version=version, ratio=float(ratio), model_id=f"synthetic-{seed}",
                     num_layers=num_layers, kv_heads=kv_heads, head_dim=head_dim, sinks=sinks, window=window,
                     rope=rope, streams=streams)


def synthetic_cache(spec: CodecSpec, tokens: int, dtype: torch.dtype = torch.float16, start: int = 0,
                    seed: int = 0, noise: float = 0.02) -> tuple[torch.Tensor, torch.Tensor]:
    """keys, values (L, H, T, D) drawn from the spec's bases, keys with RoPE at positions start..start+T."""
    L, H, D = spec.num_layers, spec.kv_heads, spec.head_dim
    g = torch.Generator().manual_seed(seed)
    out = []
    for stream in STREAMS:
        feats = []
        for code in spec.streams[stream]:
            k = code.components.shape[1]
            sigma = (torch.arange(k, dtype=torch.float32) + 1) ** -0.7 * 4
            z = torch.randn(tokens, k, generator=g) * sigma
            x = code.mean + z @ code.components.T + noise * torch.randn(tokens, code.mean.shape[0], generator=g)
            feats.append(x)
        x = torch.cat(feats, dim=1).reshape(tokens, L, H, D).permute(1, 2, 0, 3)
        if stream == "keys" and spec.rope:
            x = RopeSpec.from_dict(spec.rope).apply(x, torch.arange(start, start + tokens))
        out.append(x.to(dtype).contiguous())
    return out[0], out[1]


def synthetic_ecsq(spec: CodecSpec, step: float = 0.05, noise: float = 0.02) -> CodecSpec:
    """The spec with ECSQ groups matched to synthetic_cache's spectrum: one step, Gaussian symbol models
    of std 2^c steps (c = 0..6), each component on the nearest; centroid offsets 0.02 steps."""
    import dataclasses

    import numpy as np

    from kvtc.kernels.codec.ecsq import EcsqGroup, SymbolModel

    def model(std: float) -> SymbolModel:
        radius = max(1, int(6 * std))
        s = np.arange(-radius, radius + 1)
        p = np.exp(-0.5 * (s / std) ** 2)
        return SymbolModel(radius, np.append(np.maximum(np.round(p / p.sum() * (1 << 20)), 1).astype(np.int64), 3))

    models = tuple(model(2.0 ** c) for c in range(7))
    groups = {}
    for stream in STREAMS:
        out = []
        for g in spec.streams[stream]:
            k = g.components.shape[1]
            std = np.hypot((np.arange(k) + 1.0) ** -0.7 * 4, noise) / step
            index = np.clip(np.round(np.log2(std)), 0, 6).astype(np.int64)
            out.append(EcsqGroup(g.group, g.mean, g.components, step, index, torch.full((k, 2), 0.02), models))
        groups[stream] = tuple(out)
    return dataclasses.replace(spec, ecsq=groups)
