"""KV capture: forward a batch, take the keys and values of every layer that keeps a KV cache, remove
RoPE from the keys with each layer's own RoPE (none for NoPE layers), or keep it (`keys="rope-kept"`,
for consumers that store and code keys as the model cached them).

Feature order of a captured row: coded layer (ascending), then KV head, then head_dim
(p = coded layers * kv_heads * head_dim). Layers without a KV cache (linear attention, SSM) add nothing.
Multi-head latent attention layers ("mla") are captured as the cache holds them: the latent c_KV in the
keys slot (its "keys" stream, p = layers x kv_lora_rank, no RoPE) and the shared RoPE key in the values
slot (its "values" stream, p = layers x qk_rope_head_dim, RoPE removed like other kinds' keys).

Sliding-window and chunked layers are captured at every selected position, like full ones: the
forward keeps their whole cache (plain DynamicLayers; the model still masks with its window). A
sliding layer's key at position t depends only on the window ending at t, so it is the same vector
whether or not a server still holds it, and every position is held by a server while it is within the
window: statistics over all positions are statistics over the positions a server holds, each once.

Groups (one basis each): "model" (every coded layer; refused when coded layers differ in kind, whose
caches hold different positions), "auto" (one group per layer kind: full-attention layers share one
basis, sliding layers another, chunked layers a third; "model" for models of one kind), "layer", or
"layers:K" (K consecutive coded layers of one kind).
"""
from __future__ import annotations

import weakref
import zlib
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from kvtc.kernels.codec.layers import LayerSpec, cached_layers
from kvtc.workers.attention_metric import MetricCapture
from kvtc.workers.capture_settings import FIRST_COPY_PROBE_FORM, CaptureSettings
from kvtc.workers.full_cache import cache_kwargs, full_cache
from kvtc.workers.models import LoadedModel



def resolve_groups(groups: str, layers: Sequence[LayerSpec]) -> str:
    """"auto" on a model whose coded layers are all of one kind is "model" (what earlier releases recorded)."""
    if groups == "auto" and len({layers[i].kind for i in cached_layers(layers)}) == 1:
        return "model"
    return groups


@dataclass
class CapturedKV:
    """keys, values (N, p) float32 (keys RoPE-removed unless settings.keys is "rope-kept"); positions, sequence (N,) int64 (row in the batch).

    source_dtype: the dtype the model computed in ("float32", "bfloat16", ...).
    metric: with an objective that captures it (attention), the batch's attention-metric sums over `metric_tokens` query
    tokens (kvtc.workers.attention_metric): {"keys": (layers, kv_heads, head_dim), "values": (..., head_dim)}.
    """

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    sequence: torch.Tensor
    source_dtype: str = "float32"
    metric: dict[str, torch.Tensor] | None = None
    metric_tokens: int = 0


_METRIC_CAPTURES: "weakref.WeakKeyDictionary[torch.nn.Module, Any]" = weakref.WeakKeyDictionary()


def metric_capture(lm: LoadedModel) -> Any:
    """The model's attention-metric hooks (kvtc.workers.attention_metric.MetricCapture), built once per model."""
    if lm.model not in _METRIC_CAPTURES:
        base = lm.base
        _METRIC_CAPTURES[lm.model] = MetricCapture(getattr(base, "language_model", base), tuple(lm.layers))
    return _METRIC_CAPTURES[lm.model]


def check_seq_len(lm: LoadedModel, seq_len: int, settings: CaptureSettings) -> None:
    """Raise ValueError if seq_len exceeds the model's limit or leaves no position after sinks and window."""
    if seq_len > lm.max_positions:
        raise ValueError(
            f"seq_len {seq_len} exceeds the model's limit of {lm.max_positions} positions; use a shorter seq_len"
        )
    if settings.eligible(seq_len) < 1:
        raise ValueError(
            f"seq_len {seq_len} leaves no position after excluding sinks={settings.sinks} and "
            f"window={settings.window}; use seq_len > {settings.sinks + settings.window}"
        )


def _select_positions(input_ids: torch.Tensor, settings: CaptureSettings) -> torch.Tensor:
    """(B, T) ids -> (B, k) sorted positions; sampling is seeded by settings.seed and each sequence's tokens."""
    b, t = input_ids.shape
    n = settings.eligible(t)
    base = torch.arange(settings.sinks, settings.sinks + n, dtype=torch.int64)
    if settings.sample >= 1.0:
        return base.expand(b, n).clone()
    k = max(1, round(settings.sample * n))
    rows = []
    for seq in input_ids.cpu().numpy():
        gen = torch.Generator().manual_seed((settings.seed * 1_000_003 + zlib.crc32(seq.tobytes())) % (1 << 62))
        rows.append(base[torch.randperm(n, generator=gen)[:k].sort().values])
    return torch.stack(rows)


def _forward_cache(lm: LoadedModel, input_ids: torch.Tensor, metric: Any = None
                   ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """-> keys, values of each coded layer (ascending), each (B, H, T, D) with every position; `metric`: a
    MetricCapture collecting this forward's query statistics."""
    with torch.inference_mode(), (metric.during(tuple(input_ids.shape)) if metric is not None else nullcontext()):
        out = lm.base(input_ids=input_ids.to(lm.device), **cache_kwargs(lm.base, full_cache(lm)), use_cache=True)
    cache = out.cache if "cache" in out else out.past_key_values  # renamed in transformers 5.x
    coded = cached_layers(lm.layers)
    if len(cache.layers) != lm.num_layers:
        raise RuntimeError(f"the model's cache has {len(cache.layers)} layers, its config {lm.num_layers}")
    keys = [cache.layers[i].keys for i in coded]
    values = [cache.layers[i].values for i in coded]
    t = input_ids.shape[1]
    if any(k is None or k.shape[-2] != t for k in keys):
        raise RuntimeError("the model's cache does not hold every position of every coded layer; "
                           "capture needs each attention layer's whole cache")
    return keys, values


def capture_kv(lm: LoadedModel, input_ids: torch.Tensor, settings: CaptureSettings, sensitivity: int = 0,
               probe: bool = False) -> CapturedKV:
    """input_ids (B, T) -> CapturedKV with N = B * rows-per-sequence rows, on the model's device; with the
    attention metric, the KL sensitivity of the batch's first `sensitivity` sequences joins its sums
    (kvtc.workers.sensitivity: one backward pass each), and with `probe` (and settings.copy_probe) that of the
    long-range copy probe made from the first sequence (kvtc.workers.sensitivity.copy_probe)."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (B, T), got shape {tuple(input_ids.shape)}")
    b, t = input_ids.shape
    check_seq_len(lm, t, settings)
    metric = metric_capture(lm) if settings.objective.resolved().captures_metric else None  # auto: refused
    # first, while nothing else is held: its backward is the capture's largest working set
    extra = _sensitivity(lm, input_ids, settings, sensitivity, probe) if metric is not None and sensitivity > 0 \
        else {}
    keys, values = _forward_cache(lm, input_ids, metric)
    if metric is not None:
        metric.attend(keys, settings.sinks, values)
    pos = _select_positions(input_ids, settings).to(lm.device)
    k = pos.shape[1]
    bi = torch.arange(b, device=lm.device)[:, None].expand(b, k)
    with torch.inference_mode():
        def gather(per_layer: list[torch.Tensor]) -> torch.Tensor:
            """per-layer (B, H, T, D) -> rows (N, L, H, D) float32, N = B*k in (sequence, position) order,
            written layer by layer (no stacked copy of the whole cache)."""
            first = per_layer[0]
            rows = torch.empty(b, k, len(per_layer), *first.shape[1:2], first.shape[-1], dtype=torch.float32,
                               device=lm.device)
            for slot, x in enumerate(per_layer):
                rows[:, :, slot] = x.to(lm.device).transpose(1, 2)[bi, pos]  # (B, k, H, D)
            return rows.reshape(b * k, *rows.shape[2:])

        rows = {"keys": gather(keys), "values": gather(values)}
        del keys, values  # the model's cache: the rows are all the capture keeps
        flat_pos = pos.reshape(-1)
        if settings.keys == "rope-removed":
            for slot, i in enumerate(cached_layers(lm.layers)):
                rope, x = lm.layers[i].rope, rows[lm.layers[i].rope_stream]
                if rope is not None:
                    x[:, slot] = rope.remove(x[:, slot].transpose(0, 1), flat_pos).transpose(0, 1)
        krows, vrows = rows["keys"], rows["values"]
    n = b * k
    return CapturedKV(
        keys=krows.reshape(n, -1).contiguous(),
        values=vrows.reshape(n, -1),
        positions=flat_pos.to(torch.int64),
        sequence=bi.reshape(-1).to(torch.int64),
        source_dtype=str(lm.dtype).removeprefix("torch."),
        metric=None if metric is None else {**metric.sums(), **extra},
        metric_tokens=0 if metric is None else metric.tokens,
    )


def _sensitivity(lm: LoadedModel, input_ids: torch.Tensor, settings: CaptureSettings, n: int,
                 probe: bool = False) -> dict[str, torch.Tensor]:
    """The Fisher sums of the first `n` sequences' first SENSITIVITY_TOKENS tokens, and the positions they
    sum over (`fisher_positions`); with `probe`, the copy probe's sums and the positions it scores (`probe_*`)."""
    from kvtc.workers.sensitivity import SENSITIVITY_TOKENS, copy_probe, kl_sensitivity  # noqa: PLC0415 - transformers

    out: dict[str, torch.Tensor] = {}
    positions = 0.0
    for row in input_ids[:n]:  # each sequence's first SENSITIVITY_TOKENS tokens (sensitivity.py: why)
        ids = row[None, :SENSITIVITY_TOKENS]
        positions += max(0, int(ids.shape[1]) - settings.sinks - settings.window)  # [sinks, T - window): the coded ones
        for name, t in kl_sensitivity(lm, ids, settings.sinks, settings.window, settings.seed).items():
            out[name] = out[name] + t if name in out else t
    out["fisher_positions"] = torch.tensor([positions], dtype=torch.float64)
    if probe and settings.copy_probe:
        ids, scored_from = copy_probe(input_ids[0], settings.copy_probe, settings.copy_probe_form)
        got = kl_sensitivity(lm, ids[None], settings.sinks, settings.window, settings.seed, scored_from=scored_from)
        out["probe_keys"], out["probe_values"] = got["sensitivity_keys"], got["sensitivity_values"]
        scored = ids.shape[0] - scored_from  # the copied passage; the first form counted its coded positions
        if settings.copy_probe_form == FIRST_COPY_PROBE_FORM:
            scored = max(0, ids.shape[0] - settings.sinks - settings.window)
        out["probe_positions"] = torch.tensor([float(scored)], dtype=torch.float64)
    return out


def raw_cache(lm: LoadedModel, input_ids: torch.Tensor, metric: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids (1, T) -> (keys, values) each (coded layers, kv_heads, T, head_dim), keys WITH RoPE, model
    dtype, every position of every coded layer (layers without a KV cache left out). metric: a MetricCapture
    (`metric_capture`) that collects this forward's attention-metric sums."""
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"raw_cache takes one sequence, input_ids of shape (1, T); got {tuple(input_ids.shape)}")
    if input_ids.shape[1] > lm.max_positions:
        raise ValueError(f"sequence of {input_ids.shape[1]} tokens exceeds the model's limit of {lm.max_positions}")
    keys, values = _forward_cache(lm, input_ids, metric)
    return torch.stack([x[0].to(lm.device) for x in keys]), torch.stack([x[0].to(lm.device) for x in values])
