"""A small ECSQ CodecSpec fitted on a synthetic cache, for tests and benchmarks of the ECSQ blob mode."""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from kvtc.kernels.codec.ecsq import EcsqGroup
from kvtc.kernels.codec.rope import RopeSpec
from kvtc.kernels.codec.spec import STREAMS, CodecSpec
from helpers.synthetic import synthetic_cache, synthetic_spec
from kvtc.pipeline.fit.ecsq import fit_ecsq


def synthetic_ecsq_spec(num_layers: int, kv_heads: int, head_dim: int, ratio: float = 8.0, *, sinks: int = 2,
                        window: int = 3, seed: int = 0, tokens: int = 400) -> CodecSpec:
    """synthetic_spec's bases (every component kept) with ECSQ tables fitted on `tokens` synthetic tokens."""
    p = num_layers * kv_heads * head_dim
    base = synthetic_spec(num_layers, kv_heads, head_dim, ratio, sinks=sinks, window=window, seed=seed, kept=p)
    caches = synthetic_cache(base, tokens, torch.float32, seed=seed + 7)
    tables = {}
    for stream, cache in zip(STREAMS, caches):
        if stream == "keys" and base.rope:
            cache = RopeSpec.from_dict(base.rope).remove(cache.float(), torch.arange(tokens))
        g = base.streams[stream][0]
        z = (cache.float().permute(2, 0, 1, 3).reshape(tokens, p) - g.mean) @ g.components
        fit = fit_ecsq(ratio, z, p)
        tables[stream] = (EcsqGroup(g.group, g.mean, g.components[:, :fit.kept].contiguous(), fit.step,
                                    fit.model.astype(np.int64), torch.from_numpy(fit.offsets), fit.models),)
    return dataclasses.replace(base, ecsq=tables)
