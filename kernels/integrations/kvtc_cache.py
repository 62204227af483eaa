"""KVTCCache: a transformers cache that holds older tokens as KVTC coefficients.

    cache = KVTCCache(codec, config=model.config)
    model.generate(ids, cache=cache, max_new_tokens=256)    # transformers 5 (4.x: past_key_values=cache)

Per layer, the first `sinks` positions and the recent tokens stay in the model's dtype. The codec's
basis spans every layer of a token, so tokens are coded only once all layers hold them: after the
last layer's update of a forward, when more than `window + chunk - 1` recent tokens wait, all but
the last `window` are coded in one chunk (in the codec's mode: packed fixed-rate quantized PCA
coefficients, or ECSQ's ANS-coded symbols per stream, group and sequence; see kernels/codec/coefficients.py)
and dropped from every layer. Each update decodes the layer's slice of the
coded tokens from their coefficients (its own rows of the group's components only); a group's
dequantized coefficients live only while its layers decode in that forward.

Multi-head latent attention models (DeepSeek V2/V3, Kimi, MiniCPM3...): each layer's update carries the
latent c_KV (B, 1, q, kv_lora_rank) as keys and the RoPE key (B, 1, q, qk_rope_head_dim) as values; both are
coded like keys and values of other kinds, each at its own width, and returned as the model cached them.

Models whose layers differ: only full-attention layers are coded. A sliding-window or chunked layer
keeps at most its window (transformers' own DynamicSlidingWindowLayer, bounded, raw), and a layer
without a KV cache (linear attention, SSM) keeps transformers' own state layer; every layer therefore
returns exactly the shapes transformers' DynamicCache(config) would. The artifact's full-attention
layers must form their own groups (`--groups auto`).

Also here: `compress_cache` / `restore_cache`, a DynamicCache <-> blob for one sequence (per-layer blobs
for caches whose layers hold different token counts). This module imports transformers;
`kvtc.kernels` imports it only when `KVTCCache` is first used.
"""
from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

from kvtc.kernels.codec.blob import read_blob
from kvtc.kernels.codec.kvtc_codec import KVTCCodec
from kvtc.kernels.codec.coefficients import CodedTokens, CoefficientCoder
from kvtc.kernels.codec.layered import restrict
from kvtc.kernels.codec.model_config import check_config, spec_kinds

DEFAULT_CHUNK = 64


class _CodedStore:
    """The coded chunks of a cache, shared by its layers, and the per-forward decode of each group."""

    def __init__(self, coder: CoefficientCoder, hold_decoded: bool = False) -> None:
        self.coder = coder
        self.chunks: list[CodedTokens] = []
        self._z: dict[tuple[str, int], list[torch.Tensor]] = {}
        self.hold_decoded = hold_decoded
        self._held: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> its decoded coded tokens
        self._fixed: CoefficientCoder | None = coder if coder.coding.sizes.fallback is None else None

    def fixed(self) -> CoefficientCoder:
        """The fixed-rate coder of the same spec (built on first use), for chunks the ECSQ mode cannot code."""
        if self._fixed is None:
            c = self.coder
            self._fixed = CoefficientCoder(c.spec, c.backend, c.coding.sizes.fallback, c.rate_control,
                                           c.ecsq_format, c.basis_dtype)
        return self._fixed

    def encode(self, keys: torch.Tensor, values: torch.Tensor, start: int) -> CodedTokens:
        """Tokens in the coder's mode, or fixed-rate where the ECSQ mode cannot code them (values thousands of
        times the calibration's, a 1e10 spike), as the chunk stores do; fixed-rate saturates what it cannot hold."""
        try:
            return self.coder.encode(keys, values, start)
        except (ValueError, OverflowError, RuntimeError):
            if self._fixed is self.coder:  # a mode without a fallback (fixed-rate saturates: a real error)
                raise
            return self.fixed().encode(keys, values, start)

    def _coder(self, chunk: CodedTokens) -> CoefficientCoder:
        return self.coder if chunk.coding == self.coder.coding else self.fixed()

    @property
    def tokens(self) -> int:
        return sum(c.tokens for c in self.chunks)

    def add(self, chunk: CodedTokens) -> None:
        self.chunks.append(chunk)
        self._z.clear()
        self._held.clear()

    def select_batch(self, index: torch.Tensor) -> None:
        self.chunks = [c.select_batch(index) for c in self.chunks]
        self._z.clear()
        self._held.clear()

    def clear(self) -> None:
        self.chunks.clear()
        self._z.clear()
        self._held.clear()

    def layer(self, layer: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Coded tokens of `layer` -> keys, values (B, H, coded tokens, D) in `dtype` (held until more tokens are
        coded where `hold_decoded`)."""
        held = self._held.get(layer)
        if held is not None and held[0].dtype == dtype:
            return held
        groups = [gi for gi, _, _ in self.coder.layer_parts[layer]]
        out = []
        for stream in ("keys", "values"):
            per_group = {}
            for gi in groups:
                if (stream, gi) not in self._z:
                    self._z[(stream, gi)] = [self._coder(c).coefficients(c, stream, gi) for c in self.chunks]
                per_group[gi] = self._z[(stream, gi)]
            out.append(torch.cat([self._coder(c).decode_layer(c, {gi: zs[i] for gi, zs in per_group.items()}, stream,
                                                          layer, dtype) for i, c in enumerate(self.chunks)], dim=2))
            for gi in groups:
                if layer == max(self.coder.spec.streams["keys"][gi].group.layers):
                    del self._z[(stream, gi)]
        if self.hold_decoded:
            self._held[layer] = out[0], out[1]
        return out[0], out[1]


class KVTCCacheLayer(DynamicLayer):
    """One layer: raw sinks and recent tokens (model dtype), plus the shared coded store.

    `keys` / `values` hold the recent raw tokens (B, H, t, D); `sink_keys` / `sink_values` the first
    positions. The returned states are sinks, decoded coded tokens, recent tokens, in that order.
    """

    is_croppable = False

    def __init__(self, layer_idx: int, sinks: int, store: _CodedStore) -> None:
        super().__init__()
        self.layer_idx, self.sinks, self.store = layer_idx, sinks, store
        self.cumulative_length = 0
        self.sink_keys: torch.Tensor | None = None
        self.sink_values: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.keys = key_states[:, :, :0].clone()
        self.values = value_states[:, :, :0].clone()
        self.sink_keys, self.sink_values = self.keys.clone(), self.values.clone()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """key_states, value_states (B, H, q, D) -> all cached keys, values (B, H, seen + q, D)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.cumulative_length += key_states.shape[-2]
        room = self.sinks - self.sink_keys.shape[-2]
        if room > 0:
            self.sink_keys = torch.cat([self.sink_keys, key_states[:, :, :room]], dim=-2)
            self.sink_values = torch.cat([self.sink_values, value_states[:, :, :room]], dim=-2)
            key_states, value_states = key_states[:, :, room:], value_states[:, :, room:]
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        parts_k, parts_v = [self.sink_keys], [self.sink_values]
        if self.store.chunks:
            k, v = self.store.layer(self.layer_idx, self.keys.dtype)
            parts_k.append(k)
            parts_v.append(v)
        return torch.cat([*parts_k, self.keys], dim=-2), torch.cat([*parts_v, self.values], dim=-2)

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def take_oldest(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Remove and return the oldest n recent tokens (B, H, n, D); the rest is copied so memory is freed."""
        k, v = self.keys[:, :, :n], self.values[:, :, :n]
        self.keys, self.values = self.keys[:, :, n:].clone(), self.values[:, :, n:].clone()
        return k, v

    def nbytes(self) -> int:
        if not self.is_initialized:
            return 0
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values, self.sink_keys, self.sink_values))

    def reset(self) -> None:
        super().reset()
        self.cumulative_length = 0
        self.sink_keys = self.sink_values = None

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("KVTCCache cannot crop coded tokens; use DynamicCache for assisted decoding")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._select(torch.arange(self.keys.shape[0], device=self.keys.device).repeat_interleave(repeats))

    def _select(self, index: torch.Tensor) -> None:
        if not self.is_initialized:
            return
        index = index.to(self.keys.device)
        self.keys, self.values = self.keys.index_select(0, index), self.values.index_select(0, index)
        self.sink_keys = self.sink_keys.index_select(0, index)
        self.sink_values = self.sink_values.index_select(0, index)
        if self.layer_idx == 0:  # the coded store is shared: select it once
            self.store.select_batch(index)


class KVTCCache(Cache):
    """A transformers Cache holding tokens past the recent window as KVTC coefficients.

    codec: a KVTCCodec (its artifact and ratio set the basis, the allocation, sinks and window).
    config: the model's config (shapes are checked against the artifact here, not at first use).
    window / sinks: override the artifact's; chunk: tokens coded together (>= 1).
    hold_decoded: keep each layer's decoded coded tokens from one forward to the next until more tokens are coded
    (the same outputs, decoded once instead of at every step, at a raw cache's memory: for scoring, not serving).
    The coded chunks follow the codec's mode (`codec.mode`, and `codec.rate_control` for ECSQ).
    Batches code every row with positions = cache index. With a RoPE-removed artifact, a forward whose
    position_ids differ from the cache index (a left-padded batch: per-row positions) is refused with
    a ValueError before anything is cached; an artifact calibrated with `--keys rope-kept` codes
    without positions and takes left-padded batches.
    """

    def __init__(self, codec: KVTCCodec, config: Any, *, window: int | None = None, sinks: int | None = None,
                 chunk: int = DEFAULT_CHUNK, backend: str | None = None, hold_decoded: bool = False) -> None:
        if not isinstance(codec, KVTCCodec):
            raise TypeError(f"KVTCCache(codec, config=...): codec must be a KVTCCodec, got {type(codec).__name__}")
        spec = codec.spec
        check_config(spec, config)
        self.window = spec.window if window is None else int(window)
        self.sinks = spec.sinks if sinks is None else int(sinks)
        self.chunk = int(chunk)
        if self.window < 0 or self.sinks < 0 or self.chunk < 1:
            raise ValueError(f"window and sinks must be >= 0 and chunk >= 1; got window={self.window}, "
                             f"sinks={self.sinks}, chunk={self.chunk}")
        self.codec = codec
        full = [i for i, kind in enumerate(spec_kinds(spec)) if kind in ("full", "mla")]
        coded = spec if full == list(range(spec.num_layers)) else restrict(spec, full)
        self.store = _CodedStore(CoefficientCoder(coded, backend or codec.backend, codec.coding, codec.rate_control,
                                                    codec.ecsq_format, codec.basis_dtype), hold_decoded)
        own = DynamicCache(config=config).layers if full != list(range(spec.num_layers)) else []
        local = {layer: j for j, layer in enumerate(full)}
        layers = [KVTCCacheLayer(local[i], self.sinks, self.store) if i in local else own[i]
                  for i in range(spec.num_layers)]
        self._coded = [layers[i] for i in full]
        self._last_coded = full[-1] if full else -1
        self._first_coded = full[0] if full else -1
        super().__init__(layers=layers)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx == self._first_coded and self.codec.spec.rope is not None:
            self._check_positions(_position_ids(args, kwargs), key_states.shape[-2])
        out = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if layer_idx == self._last_coded:
            self._code_due_tokens()
        return out

    def _check_positions(self, position_ids: torch.Tensor | None, new: int) -> None:
        """Refuse positions that are not the cache index (RoPE is removed and re-applied at the cache index)."""
        if position_ids is None:
            return
        seen = self.layers[self._first_coded].cumulative_length
        want = torch.arange(seen, seen + new, device=position_ids.device)
        rows = position_ids.reshape(-1, position_ids.shape[-1])
        if rows.shape[-1] != new or not bool((rows == want).all()):
            bad = next(i for i in range(rows.shape[0]) if rows.shape[-1] != new or not bool((rows[i] == want).all()))
            raise ValueError(f"KVTCCache: row {bad} runs at positions {rows[bad, :4].tolist()}..., the cache index at "
                             f"{want[:4].tolist()}...: left-padded batches (per-row positions) are not supported with "
                             "a RoPE-removed artifact, whose keys are coded at the cache index. Pad on the right, run "
                             "rows separately, or use an artifact calibrated with --keys rope-kept")

    def _code_due_tokens(self) -> None:
        recent = {layer.keys.shape[-2] for layer in self._coded if layer.is_initialized}
        if len(recent) != 1 or not all(layer.is_initialized for layer in self._coded):
            raise RuntimeError("KVTCCache: the layers hold different token counts; every layer must be updated "
                               "with the same tokens in each forward")
        (n,) = recent
        if n < self.window + self.chunk:
            return
        n -= self.window
        start = self.sinks + self.store.tokens
        pairs = [layer.take_oldest(n) for layer in self._coded]
        keys = torch.stack([k for k, _ in pairs])
        values = torch.stack([v for _, v in pairs])
        self.store.add(self.store.encode(keys, values, start))

    @property
    def coded_tokens(self) -> int:
        """Tokens per sequence held as coefficients."""
        return self.store.tokens

    def resident_bytes(self) -> int:
        """Bytes of every tensor the cache holds: raw sinks and recent tokens, packed codes and params."""
        raw = sum(t.numel() * t.element_size() for layer in self.layers if not isinstance(layer, KVTCCacheLayer)
                  for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if isinstance(t, torch.Tensor))
        return sum(layer.nbytes() for layer in self._coded) + sum(c.nbytes for c in self.store.chunks) + raw

    def reset(self) -> None:
        super().reset()
        self.store.clear()


def _position_ids(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The forward's position_ids, as transformers hands them to Cache.update (in its kwargs dict)."""
    for source in (kwargs, kwargs.get("kwargs") or {}, *(a for a in args if isinstance(a, dict))):
        ids = source.get("position_ids") if isinstance(source, dict) else None
        if isinstance(ids, torch.Tensor):
            return ids
    return None


def cache_layers(cache: Any) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
    """DynamicCache with batch 1 -> per layer keys, values (kv_heads, tokens, head_dim), None for a layer
    without a KV cache (linear attention / SSM state layers)."""
    keys, values = [], []
    for layer in getattr(cache, "layers", None) or ():
        k, v = getattr(layer, "keys", None), getattr(layer, "values", None)
        ok = isinstance(k, torch.Tensor) and k.ndim == 4
        keys.append(k[0] if ok else None)
        values.append(v[0] if ok else None)
    if not any(k is not None for k in keys):
        raise ValueError("the cache is empty or not initialised; run the model with use_cache=True first")
    batch = next(k for k in (getattr(layer, "keys", None) for layer in cache.layers) if isinstance(k, torch.Tensor)).shape[0]
    if batch != 1:
        raise ValueError(f"compress_cache handles one sequence; the cache has batch size {batch}")
    return keys, values


def cache_tensors(cache: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """DynamicCache with batch 1 whose layers all hold the same tokens -> keys, values (layers, kv_heads,
    tokens, head_dim)."""
    keys, values = cache_layers(cache)
    if any(k is None for k in keys) or len({k.shape[1] for k in keys}) != 1:
        raise ValueError("cache layers hold different token counts (sliding-window layers, or layers without a KV "
                         "cache); use cache_layers and pass the per-layer lists to the codec")
    return torch.stack(keys), torch.stack(values)


def compress_cache(codec: KVTCCodec, cache: Any, start: int = 0) -> bytes:
    """DynamicCache (batch 1, its first position at absolute position `start`) -> blob bytes; a cache whose
    layers hold different token counts (sliding-window layers keep their window) -> a per-layer blob."""
    keys, values = cache_layers(cache)
    counts = [None if k is None else k.shape[1] for k in keys]
    if len(set(counts)) == 1 and len(keys) == len(codec.spec.coded_layers):
        return codec.encode(torch.stack(keys), torch.stack(values), start=start)
    seen = max(int(layer.get_seq_length()) for layer, k in zip(cache.layers, keys) if k is not None)
    return codec.encode(keys, values, start=start + seen - max(c for c in counts if c is not None))


def restore_cache(codec: KVTCCodec, blob: bytes, config: Any = None, device: str | torch.device = "cpu") -> Any:
    """blob -> DynamicCache the model can continue from (pass the model config for sliding-window models).
    Layers without a KV cache come back empty: their recurrent state is not part of a KV blob."""
    keys, values = codec.decode(blob, device=device)
    if isinstance(keys, torch.Tensor):
        keys, values = list(keys), list(values)
    cache = DynamicCache(config=config) if config is not None else DynamicCache()
    header = read_blob(blob)[0]
    seen = header.start + header.tokens  # positions the sequence has reached
    for layer, (k, v) in enumerate(zip(keys, values)):
        if k is None:
            continue
        cache.update(k[None].contiguous(), v[None].contiguous(), layer)
        if hasattr(cache.layers[layer], "cumulative_length"):  # sliding layers hold their window of `seen` tokens
            cache.layers[layer].cumulative_length = seen
    return cache
