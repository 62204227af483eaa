"""Served quality: a cache through the chunk path the serving integrations use, and the job's check of it.

`chunk_path` codes a prefix cache the way `kvtc lmcache-server` and the vLLM offloading tier store it:
256-token chunks at their true positions (kernels/chunk_serde.py), bf16 as servers hold it, the first
chunk keeping the artifact's sinks raw, no recent window, every stored byte counted (frame and padding
included). `kvtc eval` reports it beside the offline codec (`kvtc-chunk-{r}x` rows), and the main job
scores a few of its own held-out sequences through it before publishing (`served_quality`), so the report
and the manifest's metrics say what serving will cost (split "served-chunk", beside "served-offline").
"""
from __future__ import annotations

import dataclasses
import math
import tempfile
from typing import Any

import torch

from kvtc.pipeline.evaluation.baselines import Reconstruction, features

CHUNK = 256  # LMCache's default chunk size
MAX_DRIVER_PARAMETERS = 2_000_000_000  # the job's check loads the model in the driver only below this


def chunk_path(artifact: Any, ratio: float, keys: torch.Tensor, values: torch.Tensor, chunk: int = CHUNK,
               mode: str | None = None) -> Reconstruction | None:
    """keys, values (L, H, T, D) -> the cache as the chunk path restores it, or None where the artifact is not
    served by chunks (a multi-head latent attention model)."""
    from kvtc.kernels.chunk_serde import ChunkTransform
    from kvtc.kernels.codec import KVTCCodec

    codec = KVTCCodec(artifact, ratio, mode=mode)
    try:
        transform = ChunkTransform(codec, positions=True)
    except ValueError:
        return None
    L, H, T, D = keys.shape
    kv = torch.stack([x.to(torch.bfloat16).permute(0, 2, 1, 3).reshape(L, T, H * D) for x in (keys, values)])
    out, stored = torch.empty_like(kv), 0
    for start in range(0, T, chunk):
        piece = kv[:, :, start:start + chunk].contiguous()
        data = transform.serialize(piece, start=start)
        restored = torch.empty_like(piece)
        transform.deserialize(data, restored, start=start)
        out[:, :, start:start + chunk] = restored
        stored += len(data)
    x = out.float().reshape(2, L, T, H, D).permute(0, 1, 3, 2, 4)
    # bytes against every token: each is stored (the raw sinks in the first chunk's blob)
    return Reconstruction(f"kvtc-chunk-{ratio:g}x", x[0].contiguous(), x[1].contiguous(), stored, T,
                          features(keys, values))


def metric_rows(rows: list[dict]) -> list[dict]:
    """`kvtc eval` rows of the codec and the chunk path -> the manifest's metric rows (ratio, split, metric)."""
    out = []
    for r in rows:
        method = str(r.get("method", ""))
        split = "served-chunk" if method.startswith("kvtc-chunk-") else "served-offline" \
            if method.startswith("kvtc-") else None
        if split is None or r.get("ratio") is None:
            continue
        for metric in ("ppl_ratio", "kl", "cr"):
            value = float(r[metric])
            out.append({"ratio": float(r["ratio"]), "stream": None, "group": None, "split": split, "metric": metric,
                        "value": value if math.isfinite(value) else None})
    return out


def served_quality(content: Any, model_spec: str, dtype: str | None, count: int, continuation: int,
                   model_config: Any = None, cache_dir: str | None = None) -> tuple[dict | None, str | None]:
    """Stage `content` in a temporary registry, load its model, score `count` of its held-out sequences through
    the offline codec and the chunk path -> (a `kvtc eval` result, None) or (None, why it was skipped)."""
    from kvtc import artifacts
    from kvtc.pipeline.operations.quality import EvalSettings, evaluate_sequences, heldout_sequences
    from kvtc.workers.models import load_model

    if model_config is not None and not torch.cuda.is_available():
        from kvtc.pipeline.fit.basis_budget import model_parameters

        params = model_parameters(model_config)
        if params > MAX_DRIVER_PARAMETERS:
            return None, (f"served quality not measured in the job: the model has {params / 1e9:.1f}B parameters and "
                          "the driver has no GPU; run `kvtc eval NAME` on a GPU node (its kvtc-chunk rows)")
    with tempfile.TemporaryDirectory(prefix="kvtc-served-") as tmp:
        # staged without its parent: the parent lives in the job's registry, not in this one
        ref = artifacts.publish(dataclasses.replace(content, parent=None), registry=tmp, alias_latest=False)
        art = artifacts.pull(f"{ref.name}@{ref.version}", registry=tmp)
        lm = load_model(model_spec, dtype=dtype, cache_dir=cache_dir)
        seqs = heldout_sequences(art, lm.tokenizer, None, count, lm.max_positions)
        settings = EvalSettings(ratios=tuple(art.ratios()), continuation=continuation, sequences=count, baselines=())
        rows = evaluate_sequences(lm, art, seqs, settings)
    return {"artifact": f"{content.name} (held-out sequences of its own corpus)", "corpus": content.corpus.get("spec"),
            "settings": {"ratios": list(settings.ratios), "continuation": continuation, "sequences": len(seqs),
                         "paths": "kvtc-Nx: offline codec (sinks and window raw); kvtc-chunk-Nx: 256-token chunks, "
                                  "sinks raw, no window, as served"},
            "rows": rows}, None
