"""Model quality with compressed caches: each method's reconstruction of a prefix cache scored by the
model's next-token distributions on the continuation (perplexity ratio and KL against the uncompressed
cache), with key and value errors and the stored bytes. `kvtc eval` (kvtc.pipeline.operations.quality) and
the main job's served check (kvtc.pipeline.job.served_check) run it; see the former for the protocol."""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from kvtc.artifacts.calibration import CalibrationRecord
from kvtc.artifacts.groups import FeatureGroup
from kvtc.kernels import KVTCCodec
from kvtc.kernels.codec.basis_product import shared_projections
from kvtc.kernels.codec.layers import cached_layers, is_mla, is_uniform
from kvtc.pipeline.evaluation import baselines as bl
from kvtc.pipeline.evaluation.eval_settings import EvalSettings
from kvtc.pipeline.evaluation.metrics import mean_interval
from kvtc.pipeline.evaluation.served import chunk_paths, chunk_transform
from kvtc.pipeline.fit.metric import AttentionMetric
from kvtc.workers import mla
from kvtc.workers.capture import metric_capture, raw_cache
from kvtc.workers.full_cache import cache_kwargs

SHARED_ROWS_BYTES = 64 << 20  # a prefix's features up to this size are kept for the next ratio's offline coding


@dataclass
class _Tally:
    """Sums over sequences for one method."""
    ratio: float | None = None
    tokens: int = 0
    k_err: float = 0.0
    k_norm: float = 0.0
    v_err: float = 0.0
    v_norm: float = 0.0
    k_attn: float = 0.0
    k_attn_norm: float = 0.0
    v_attn: float = 0.0
    v_attn_norm: float = 0.0
    stored: int = 0
    mid: int = 0
    features: int = 0
    extra: dict = field(default_factory=dict)
    dnll: list = field(default_factory=list)  # per scored token: its NLL through the method less the raw cache's
    kls: list = field(default_factory=list)   # per scored token: KL(raw || method)


def _forward(model, ids, cache, attention_mask=None, position_ids=None):
    with torch.no_grad():
        out = model(ids, use_cache=True, attention_mask=attention_mask,
                    **({} if position_ids is None else {"position_ids": position_ids}),
                    **(cache_kwargs(model, cache) if cache is not None else {}))
    return out.logits, out["cache"] if "cache" in out else out["past_key_values"]


def build_cache(model, keys, values, prefix_cache=None, coded=None):
    """keys, values (L, H, P, D) of a prefix -> a transformers Cache holding them in the model's dtype.

    Models whose layers differ pass `prefix_cache` (the model's own cache after the prefix) and `coded`
    (the model layer of each of the L rows): a copy of it gets each coded layer's keys and values (a
    sliding layer the last positions it holds), so states of layers without a KV cache stay the model's."""
    dtype = next(model.parameters()).dtype
    if prefix_cache is not None:
        cache = copy.deepcopy(prefix_cache)
        for j, layer in enumerate(coded):
            held = cache.layers[layer].keys.shape[-2]
            cache.layers[layer].keys = keys[j][None, :, keys.shape[2] - held:].to(dtype).contiguous()
            cache.layers[layer].values = values[j][None, :, values.shape[2] - held:].to(dtype).contiguous()
        return cache
    cache = DynamicCache(config=model.config)
    for layer in range(keys.shape[0]):
        cache.update(keys[layer][None].to(dtype).contiguous(), values[layer][None].to(dtype).contiguous(), layer)
    return cache


def own_cache(lm, ids, keys, values):
    """The model's own cache after the prefix ids (1, P), given every coded layer's keys and values (L, H, P, D) in
    the model's dtype as `raw_cache` returns them: where every layer keeps a KV cache, each layer's update is given
    its whole prefix, as the prefill's forward gives it (a sliding layer keeps its window, a chunked one its chunk),
    so the model does not run the prefix a second time; layers without a KV cache hold states only a forward makes."""
    cache = DynamicCache(config=lm.model.config)
    coded = cached_layers(lm.layers)
    if len(coded) != len(lm.layers) or len(cache.layers) != len(lm.layers):
        return _forward(lm.model, ids, cache)[1]
    for j, layer in enumerate(coded):
        cache.update(keys[j][None].clone(), values[j][None].clone(), layer)  # not aliasing the caller's
    return cache


def prefix_state(lm, ids, keys, values) -> dict:
    """`build_cache`'s keywords that continue `lm` after the prefix ids (1, P) whose cache `raw_cache` gave: {} for a
    model whose layers are alike, else its own cache (`own_cache`) and the model layer of each coded row."""
    if not lm.layers or is_uniform(lm.layers):
        return {}
    return {"prefix_cache": own_cache(lm, ids, keys, values), "coded": cached_layers(lm.layers)}


def continuation_logprobs(model, keys, values, feed, keep=None, prefix_cache=None, coded=None):
    """keys, values (L, H, P, D) prefix cache; feed (1, n) tokens at positions P.. -> (n, V) float64
    log-probabilities. keep (P,) bool masks evicted prefix positions out of attention. prefix_cache, coded: as
    `build_cache` takes them."""
    cache = build_cache(model, keys, values, prefix_cache, coded)
    mask = None
    if keep is not None:
        mask = torch.cat([keep.long().to(feed.device), torch.ones(feed.shape[1], dtype=torch.long, device=feed.device)])[None]
    logits, _ = _forward(model, feed, cache, mask)
    return torch.log_softmax(logits[0].double(), dim=-1)


class Codecs:
    """Each ratio's codec, chunk transform and uniform-PCA codec, built once for every sequence of a run (a codec
    reads and checks its bases when built, seconds at the embedded model's size)."""

    def __init__(self, artifact, mode: str | None) -> None:
        self.artifact, self.mode, self._made = artifact, mode, {}

    def _get(self, kind: str, ratio: float, make):
        if (kind, ratio) not in self._made:
            self._made[kind, ratio] = make()
        return self._made[kind, ratio]

    def codec(self, ratio: float):
        return self._get("codec", ratio, lambda: KVTCCodec(self.artifact, ratio, mode=self.mode))

    def chunk(self, ratio: float):
        return self._get("chunk", ratio, lambda: chunk_transform(self.codec(ratio)))

    def pca_uniform(self, ratio: float):
        return self._get("pca_uniform", ratio, lambda: bl.pca_uniform_codec(self.artifact, ratio))


def _methods(artifact, settings: EvalSettings, keys, values, sinks: int, window: int, codecs: Codecs):
    """Yield (method, target ratio or None, Reconstruction) for the codec and every baseline."""
    p = bl.features(keys, values)
    yield "uncompressed", None, bl.Reconstruction("uncompressed", keys.float(), values.float(),
                                                  4 * p * bl.split(keys.shape[2], sinks, window)[1],
                                                  bl.split(keys.shape[2], sinks, window)[1], p)
    offline = settings.ratios if settings.offline_ratios is None else settings.offline_ratios
    held: dict = {}  # a ratio's projection of a short prefix, read by the later, narrower ones (its columns)
    for r in offline:
        with shared_projections(held, SHARED_ROWS_BYTES if len(offline) > 1 else 0):
            rec = bl.run_codec(codecs.codec(r), keys, values)
        yield f"kvtc-{r:g}x", r, rec
    held.clear()
    if settings.served:  # every ratio's chunks coded side by side, each chunk projected once (served.restore_each)
        for r, rec in chunk_paths({r: codecs.chunk(r) for r in settings.ratios}, keys, values):
            yield rec.method, r, rec
    if "pca_uniform" in settings.baselines:
        for r in settings.ratios:
            yield f"pca-uniform-{r:g}x", r, bl.run_codec(codecs.pca_uniform(r), keys, values,
                                                          f"pca-uniform-{r:g}x")
    if "evict" in settings.baselines:
        for r in settings.ratios:
            yield f"evict-{r:g}x", r, bl.evict(keys, values, r, sinks, window)
    if "kivi" in settings.baselines:
        for bits, group in settings.kivi_configs:
            rec = bl.kivi(keys, values, bits, group, sinks, window)
            yield rec.method, None, rec
    if "fp8" in settings.baselines:
        yield "fp8-e4m3", None, bl.fp8_cast(keys, values, sinks, window)
    if "deflate" in settings.baselines:
        yield "deflate-fp16", None, bl.deflate(keys, values, sinks, window)


def evaluate_sequences(lm, artifact, sequences, settings: EvalSettings, progress=None, observe=None,
                       codecs: Codecs | None = None) -> list[dict]:
    """sequences: iterable of (T,) token arrays, or of their `RawPrefix` computed earlier. Returns one row per method: method, ratio (target,
    or None for fixed-rate methods), bytes_per_token, cr, key_rel_error, value_rel_error,
    ppl_ratio, kl, tokens, sequences; key_attn_error, value_attn_error: the same errors in the attention
    objective's metric (kvtc.pipeline.fit.metric, measured on each sequence's own queries), where the model's
    query and output projections can be read; for a multi-head latent attention model (keys: its latent, values: its
    RoPE key) also key_up_error, value_up_error: the per-head keys and values after kv_b_proj (workers.mla).
    observe(method, keys, values, reconstruction, state), where given, sees each method's reconstruction of each
    prefix cache ("uncompressed": the raw one) and the `build_cache` arguments that continue from it, {} for a
    model whose layers are alike (the served check reads its position errors from the offline codec's and asks its
    needles through the raw cache and the chunk path). codecs: the ratios' codecs (`Codecs`) where an earlier call
    on the same artifact built them (the served check scores its short sequences and its long window with the same)."""
    record = CalibrationRecord.from_manifest(artifact.manifest)
    projections = mla.up_projections(lm.model, lm.layers) if is_mla(lm.layers) else None
    metric = _metric_capture(lm) if settings.attention_errors else None
    sinks, window = record.sinks, record.window
    tallies: dict[str, _Tally] = {}
    codecs = Codecs(artifact, settings.mode) if codecs is None else codecs
    count = 0
    for seq in sequences:
        n = settings.continuation
        if isinstance(seq, RawPrefix):
            if metric is not None or seq.ids.shape[1] - seq.prefix - 1 != n:
                raise ValueError("a sequence's raw half was computed without the attention metric's capture, or for "
                                 f"another continuation than {n}: score it from its tokens")
            raw = seq
        else:
            raw = raw_prefix(lm, seq, n, metric)
        ids, keys, values, state, ref = raw.ids, raw.keys, raw.values, raw.state, raw.ref
        feed, target = ids[:, -n - 1:-1], ids[0, -n:]
        if metric is not None:
            metric.attend([k[None] for k in keys], sinks)
        blocks = None if metric is None else _metric_blocks(metric, keys.shape[0], keys.shape[1])
        ref_tok = ref.gather(1, target[:, None])[:, 0]
        head, mid, _ = bl.split(keys.shape[2], sinks, window)
        norms: dict[str, float] = {}  # the raw cache's squared norm over the coded middle, the same for every method
        for name, ratio, rec in _methods(artifact, settings, keys, values, sinks, window, codecs):
            if observe is not None:
                observe(name, keys, values, rec, state)
            keep = None if rec.keep is None else rec.keep.to(lm.device)
            # the raw cache's own continuation is the reference itself (the same forward on the same cache)
            lp = ref if name == "uncompressed" else continuation_logprobs(lm.model, rec.keys, rec.values, feed, keep,
                                                                          **state)
            t = tallies.setdefault(name, _Tally(ratio=ratio))
            dnll = ref_tok - lp.gather(1, target[:, None])[:, 0]
            kl = (ref.exp() * (ref - lp)).sum(-1)
            t.dnll.append(dnll)
            t.kls.append(kl)
            t.tokens += n
            for stream, x, xh in (("k", keys, rec.keys), ("v", values, rec.values)):
                if stream not in norms:
                    norms[stream] = bl.squared_norm(x[:, :, head:head + mid])
                err = 0.0 if xh is x else bl.squared_norm(x[:, :, head:head + mid], xh[:, :, head:head + mid])
                norm = norms[stream]
                setattr(t, f"{stream}_err", getattr(t, f"{stream}_err") + err)
                setattr(t, f"{stream}_norm", getattr(t, f"{stream}_norm") + norm)
                if blocks is not None:
                    err, norm = _attention_error(x[:, :, head:head + mid], xh[:, :, head:head + mid],
                                                 blocks["keys" if stream == "k" else "values"])
                    setattr(t, f"{stream}_attn", getattr(t, f"{stream}_attn") + err)
                    setattr(t, f"{stream}_attn_norm", getattr(t, f"{stream}_attn_norm") + norm)
            if projections is not None:
                window_ = slice(head, head + mid)
                up = mla.upprojected_sums(projections, cached_layers(lm.layers), keys[:, :, window_],
                                          rec.keys[:, :, window_], values[:, :, window_], rec.values[:, :, window_])
                for key, v in up.items():
                    t.extra[key] = t.extra.get(key, 0.0) + v
            t.stored += rec.stored_bytes
            t.mid += rec.mid
            t.features = rec.features
        count += 1
        if progress:
            progress(f"sequence {count}: {ids.shape[1]} tokens, {mid} middle tokens coded")
    if not count:
        raise ValueError("no held-out sequence to evaluate; pass another --corpus or raise --sequences")
    rows = []
    for name, t in tallies.items():
        dnll, kls = torch.cat(t.dnll), torch.cat(t.kls)
        rows.append({
            "method": name, "ratio": t.ratio, "bytes_per_token": t.stored / max(t.mid, 1),
            "cr": 4.0 * t.features * t.mid / max(t.stored, 1),
            "key_rel_error": math.sqrt(t.k_err / max(t.k_norm, 1e-300)),
            "value_rel_error": math.sqrt(t.v_err / max(t.v_norm, 1e-300)),
            "ppl_ratio": math.exp(float(dnll.sum()) / t.tokens), "kl": float(kls.sum()) / t.tokens, "tokens": t.tokens, "sequences": count,
        })
        lo, hi = mean_interval(dnll)
        rows[-1].update(ppl_ratio_ci=[math.exp(lo), math.exp(hi)], kl_ci=list(mean_interval(kls)))
        if t.k_attn_norm > 0:
            rows[-1].update(key_attn_error=math.sqrt(t.k_attn / t.k_attn_norm),
                            value_attn_error=math.sqrt(t.v_attn / max(t.v_attn_norm, 1e-300)))
        if projections is not None:
            up = mla.relative(t.extra)
            rows[-1].update(key_up_error=up["keys"], value_up_error=up["values"])
    return rows


@dataclass
class RawPrefix:
    """One sequence's raw half of the scoring, which needs the model and not the artifact: its prefix cache as
    `raw_cache` gives it (float32), the `build_cache` state that continues it, and the raw cache's log-probabilities
    of the continuation. The main job computes it while its fold still runs (kvtc.pipeline.job.served_prep)."""

    ids: torch.Tensor  # (1, T) the whole sequence
    keys: torch.Tensor  # (L, H, P, D) float32
    values: torch.Tensor
    state: dict
    ref: torch.Tensor  # (n, V) float64

    @property
    def prefix(self) -> int:
        return int(self.keys.shape[2])


def raw_prefix(lm, seq, continuation: int, metric=None) -> RawPrefix:
    """A (T,) token sequence -> its RawPrefix: the prefix (all but the last `continuation` + 1 tokens) run through
    the model once (`metric`: a MetricCapture collecting that forward's sums)."""
    ids = torch.as_tensor(seq, dtype=torch.long).reshape(1, -1).to(lm.device)
    n = continuation
    if ids.shape[1] < n + 2:
        raise ValueError(f"a sequence of {ids.shape[1]} tokens is too short for --continuation {n}")
    prefix, feed = ids[:, :-n - 1], ids[:, -n - 1:-1]
    keys, values = raw_cache(lm, prefix, metric)
    state = prefix_state(lm, prefix, keys, values)  # sliding / no-KV layers: from the model's own cache
    keys, values = keys.float(), values.float()
    return RawPrefix(ids, keys, values, state, continuation_logprobs(lm.model, keys, values, feed, **state))


def _metric_capture(lm):
    """The model's attention-metric hooks, or None where its projections cannot be read (MLA, unknown layouts)."""
    try:
        return metric_capture(lm)
    except ValueError:
        return None


def _metric_blocks(metric, layers: int, heads: int) -> dict:
    """{stream: (layers, heads, d, d) float64}: the attention objective's metric of the last forward's queries."""
    group = FeatureGroup(tuple(range(layers)))
    sums = {k: v.numpy() for k, v in metric.sums().items()}
    out = {}
    for stream in ("keys", "values"):
        # one fixed metric, comparable across artifacts whatever balance their calibration ran (the KL
        # sensitivity needs a backward pass the evaluation does not run)
        m = AttentionMetric("layer").blocks(sums, metric.tokens, stream, group, [group], heads)
        out[stream] = torch.from_numpy(m.reshape(layers, heads, *m.shape[-2:]))
    return out


def _attention_error(x, x_hat, blocks) -> tuple[float, float]:
    """(sum e^T M e, sum x^T M x) over (layers, heads, tokens, d) caches, M (layers, heads, d, d) per head."""
    x64 = x.double()
    e = x64 - x_hat.double()
    return (float(torch.einsum("lhtd,lhde,lhte->", e, blocks, e)),
            float(torch.einsum("lhtd,lhde,lhte->", x64, blocks, x64)))
