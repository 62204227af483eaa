"""Tiny artifacts and KV the LMCache tests share, calibrated once per test session (the first module
that asks calibrates; tests/kernels/integrations/test_lmcache_serde.py and
tests/kernels/integrations/test_lmcache_live.py both use them).

- "tiny-kept": tiny:llama (3 layers x 2 KV heads x head_dim 16), keys RoPE-kept, one basis for the
  model (--groups auto), ECSQ tables at CR 4, each stream its own share (--bit-split even: its tests bound the
  ECSQ mode's squared error by the fixed mode's at equal bytes);
- "tiny-tp2": the same model calibrated the default way (keys RoPE-removed) for --tp 2 with one basis
  per layer (--groups layer), so it serves two tensor-parallel ranks and pipeline stages;
- "tiny-attn": the same model with `--objective attention` (separate encode and decode matrices), keys
  RoPE-removed and 4 sinks, the way docs/serving.md serves it: a first chunk keeps its sinks raw.
"""
from __future__ import annotations

from pathlib import Path

import torch

RATIO = 4
MODEL = "tiny:llama"
_cached: dict[str, object] = {}


def artifacts(root: Path) -> dict[str, str]:
    """-> {"registry": path, "kept": ref, "tp2": ref, "attn": ref}, calibrated under `root` on first use."""
    if "artifacts" not in _cached:
        from kvtc.pipeline.job.calibrate import run
        from kvtc.pipeline.settings import JobSettings

        out = {"registry": str(root / "reg")}
        for key, name, options in (("kept", "tiny-kept", dict(keys="rope-kept", sinks=0, bit_split="even")),
                                   ("tp2", "tiny-tp2", dict(tp=2, groups="layer", sinks=0)),
                                   ("attn", "tiny-attn", dict(objective="attention", sinks=4))):
            cfg = JobSettings.of(model=MODEL, corpus="pydoc", eval_corpus=None, seq_len=64, tokens=1024,
                                 seqs_per_shard=4, heldout_rows=512, ratios=(float(RATIO),), tokens_curve_points=1,
                                 window=0, served_sequences=0, registry=out["registry"], store=str(root / "store"),
                                 name=name, **options)  # no served check: the tests serve the artifacts themselves
            out[key] = f"{name}@{run(cfg, in_process=True)['version']}"
        _cached["artifacts"] = out
    return dict(_cached["artifacts"])  # type: ignore[arg-type]


def model_cache(tokens: int = 512) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """-> (token ids, keys, values) of the tiny model on text it was not calibrated on: keys (L, H, T, D)
    with RoPE as the model caches them, bf16."""
    if tokens not in _cached:
        from kvtc.workers.capture import raw_cache
        from kvtc.workers.models import load_model

        lm = load_model(MODEL, device="cpu")
        text = "The interpreter reads the module, compiles it to bytecode and caches it next to the source. " * 60
        ids = lm.tokenizer(text).input_ids[:tokens]
        assert len(ids) == tokens
        keys, values = raw_cache(lm, torch.tensor([ids]))
        _cached[tokens] = (ids, keys.to(torch.bfloat16), values.to(torch.bfloat16))
    return _cached[tokens]  # type: ignore[return-value]


def chunk(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """(L, H, T, D) keys and values -> LMCache's chunk layout (2, L, T, H * D)."""
    L, H, T, D = keys.shape
    return torch.stack([x.permute(0, 2, 1, 3).reshape(L, T, H * D) for x in (keys, values)])
