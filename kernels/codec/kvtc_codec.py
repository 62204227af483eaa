"""KVTCCodec: one sequence's KV cache <-> a self-describing compressed blob.

Cache tensors are (layers, kv_heads, tokens, head_dim) exactly as the model cached them (keys
with RoPE), layers = the layers that keep a KV cache. A cache whose layers hold different token counts
(sliding-window or chunked layers, layers without a KV cache) is passed per layer, as a sequence of
(kv_heads, tokens, head_dim) tensors (None for a layer without a cache), and decodes to the same form
(kernels/codec/layered.py). Each layer's keys lose that layer's own RoPE (none for NoPE layers).
Tokens at absolute positions < sinks and the last `window` tokens stay raw; the middle
is RoPE-removed (keys), centred, projected on each group's kept components, quantized per block,
packed and entropy-coded. Decode reverses it and re-applies RoPE at the original positions.

A multi-head latent attention model's cache (spec.value_dim set) is passed as the model caches it: the
latent c_KV (layers, 1, tokens, kv_lora_rank) as `keys`, the RoPE key (layers, 1, tokens, qk_rope_head_dim)
as `values`; the RoPE comes off the values (spec.rope_stream). Caches may also be float8_e4m3fn (what
servers store): coded from their exact bfloat16 values, decoded back to float8_e4m3fn.
"""
from __future__ import annotations

from dataclasses import fields, replace
import warnings
import weakref
from typing import Any, Sequence

import torch

from kvtc.artifacts import kernel_bundle_hash, pull
from kvtc.artifacts.env_values import env_flag
from kvtc.artifacts.groups import group_columns
from kvtc.kernels.codec import outliers
from kvtc.kernels.codec.blob import (NO_CACHE, TAG_OUTLIERS, TAG_RAW_HEAD, TAG_RAW_TAIL, BlobError, BlobHeader,
                                     Section, SectionBound, SectionKey, read_blob, write_blob)
from kvtc.kernels.codec.blob_plan import BlobPlan
from kvtc.kernels.codec.codec_options import CodecOptions
from kvtc.kernels.codec.extremes import all_finite
from kvtc.kernels.codec.entropy import PLAIN, decode_section, decode_sections
from kvtc.kernels.codec.error_sketch import ErrorSketch, block_tokens, vector_errors
from kvtc.kernels.codec.backend import Ops, resolve_ops
from kvtc.kernels.codec.layered import decode_layered, encode_layered, layer_counts, restrict
from kvtc.kernels.codec.mode import BlobContext, HeldOffsets, Mode, SectionCoder, StageTimer
from kvtc.kernels.codec.modes import mode_for, resolve_mode
from kvtc.kernels.codec.sink_formats import CACHE, sink_format_for
from kvtc.kernels.codec.spec import STREAMS, CodecSpec

_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
_FP8 = {torch.float8_e4m3fn: "float8_e4m3fn"}  # cache dtypes coded through their exact bfloat16 values
_CACHE_DTYPES = {**_DTYPES, **_FP8}
_MAX_TOKENS = 1 << 31
_MAX_START = 1 << 62
_OPTION_NAMES = frozenset(f.name for f in fields(CodecOptions)) - {"mode"}  # `mode` is the property below


class KernelBundleWarning(UserWarning):
    """The artifact was made for other runtime kernels than the ones running."""


class KVTCCodec:
    """Encode/decode KV caches for one artifact at one compression ratio.

    How it codes is `options` (kernels/codec/codec_options.py: backend, level, coder, max_tokens, mode, rate_control,
    ecsq_format, basis_dtype, sink_format, outlier_factor), given whole or as keywords (`KVTCCodec(art, 16,
    level=0)`; with `options` too, they replace its fields); read them as `codec.options.level` or `codec.level`.
    Another codec like this one: `KVTCCodec(spec, options=replace(codec.options, ...))`.
    rank: a tensor-parallel rank of an artifact calibrated with --tp: the codec then takes and returns
    that rank's local cache, (layers, its KV heads, tokens, head_dim) (`spec.heads` says which heads);
    None codes the whole cache (every head, each range with its rank's bases).
    Set `profile = {}` to accumulate seconds per stage (synchronizes CUDA between stages).
    """

    def __init__(self, artifact: Any, ratio: float | None = None, *, rank: int | None = None,
                 options: CodecOptions | None = None, **kwargs: Any) -> None:
        if isinstance(artifact, CodecSpec):
            if ratio is not None and float(ratio) != artifact.ratio:
                raise ValueError(f"ratio {ratio} differs from the CodecSpec's ratio {artifact.ratio}")
            self.spec = artifact if rank is None else artifact.for_rank(rank)
        else:
            if ratio is None:
                raise ValueError("KVTCCodec(artifact, ratio): ratio is required, e.g. 8, 16 or 32")
            self.spec = CodecSpec.from_artifact(artifact, ratio, rank=rank)
        options = replace(CodecOptions() if options is None else options, **kwargs)  # an unknown name: TypeError
        self.coding: Mode = resolve_mode(self.spec, options.mode)  # the mode object; `mode` its name
        self.options = replace(options, mode=self.coding.name)
        self._sinks = sink_format_for(self.options.sink_format)
        self._own_plan = self.plan()
        self.device_entropy: bool | None = None  # rANS on the device: None = where the tensors are on CUDA
        self.profile: dict[str, float] | None = None
        shared, self.rope = self.spec.shared_rope  # one RoPE for every coded layer: fused into the kernels
        self._per_layer_rope = not shared
        self._subs: dict[tuple[int, ...], KVTCCodec] = {}
        self._on_device: dict[tuple[str, str], tuple[torch.Tensor, list]] = {}
        self._sketches: dict[tuple, ErrorSketch] = {}  # the outlier stage's, per (stream, device, mode, dtype)
        self._offsets: dict = {}  # HeldOffsets.held: the ECSQ offsets on each device

    def __getattr__(self, name: str) -> Any:  # codec.level, codec.backend, ...: its options' fields
        if name in _OPTION_NAMES and "options" in self.__dict__:
            return getattr(self.__dict__["options"], name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _OPTION_NAMES:
            raise AttributeError(f"{name} is one of the codec's options: make another codec with "
                                 f"KVTCCodec(codec.spec, options=replace(codec.options, {name}=...))")
        super().__setattr__(name, value)

    @property
    def mode(self) -> str:
        """The mode new blobs are written in: "ecsq" or "fixed" (kernels/codec/modes.py)."""
        return self.coding.name

    @classmethod
    def from_registry(cls, ref: str, ratio: float, registry: Any = None, *, public_key: Any = None,
                      require_signature: bool | None = None, **kwargs: Any) -> "KVTCCodec":
        """ref "name@version|alias|sha256:HEX" pulled and verified through artifacts.pull (imported lazily);
        public_key / require_signature check the version's Ed25519 signature (see artifacts.pull).
        The artifact names the kernel bundle it was made for: running other kernels warns, or with
        require_kernels=True (or $KVTC_REQUIRE_KERNELS=1) is refused. rank=r (a keyword, see the class)
        gives tensor-parallel rank r's codec."""
        require_kernels = kwargs.pop("require_kernels", None)
        if require_kernels is None:
            require_kernels = env_flag("KVTC_REQUIRE_KERNELS")
        artifact = pull(ref, registry=registry, public_key=public_key, require_signature=require_signature)
        if not artifact.kernels_match():
            made_for, running = artifact.manifest.get("kernel_bundle_hash"), kernel_bundle_hash()
            message = (f"{artifact.name}@{artifact.version} was made for kernel bundle {str(made_for)[:16]}, this "
                       f"process runs {str(running)[:16]}: its kernels/ folder holds the code it was made with")
            if require_kernels:
                raise ValueError(message + "; install that kvtc version or recalibrate")
            warnings.warn(message, KernelBundleWarning, stacklevel=2)
        return cls(artifact, ratio, **kwargs)

    def _timer(self, device: torch.device) -> StageTimer:
        """`with self._timer(dev)("stage"):` times a stage into `profile` where it is set."""
        return StageTimer(self.profile, device)

    def basis_dtype_on(self, device: torch.device, cache_dtype: torch.dtype) -> torch.dtype:
        """dtype of the components held on `device`: `basis_dtype`, or by default the cache's dtype on CUDA
        (fp16/bf16 GEMMs) and on the host the dtype the spec holds them in (float32 as read from an artifact; a
        server's half basis is used as held, its products computed in float32 blocks: basis_product.py)."""
        if self.basis_dtype is not None:
            return self.basis_dtype
        return cache_dtype if device.type == "cuda" else self.spec.held_dtype

    def _params(self, stream: str, device: torch.device, mode: Mode, dtype: torch.dtype = torch.float32,
                decode: bool = False) -> tuple[torch.Tensor, list]:
        """(mean (p,) float32, per group (feature slice, components (p_g, kept) in `dtype`, group)) for one
        mode on one device: only the columns that mode's code uses, and only that mode's basis.
        decode: the matrices that reconstruct instead (each group's `decoding`); a group without a decoder
        shares its components' tensor, so an orthonormal basis is held once."""
        if decode:
            return self._decoding_params(stream, device, mode, dtype)
        key = (stream, str(device), mode, str(dtype))
        if key not in self._on_device:
            groups = self.spec.streams[stream]
            cols = self._columns(device, stream)
            mean = torch.empty(self.spec.stream_features(stream), dtype=torch.float32, device=device)
            for c, g in zip(cols, groups):
                mean[c] = g.mean.to(device)
            codes = mode.codes(self.spec, stream)
            parts = [(c, _held(g.components[:, : g.kept], device, dtype, g, "components"), g) for c, g in zip(cols, codes)]
            self._on_device[key] = (mean, parts)
        return self._on_device[key]

    def _decoding_params(self, stream: str, device: torch.device, mode: Mode, dtype: torch.dtype
                         ) -> tuple[torch.Tensor, list]:
        """_params with each group's decoding matrix (p_g, kept) in place of its components."""
        encoding = self._params(stream, device, mode, dtype)
        mean, parts = encoding
        if all(g.decoder is None for _, _, g in parts):
            return encoding
        key = ("decoding", stream, str(device), mode, str(dtype))
        if key not in self._on_device:
            self._on_device[key] = (mean, [(c, comps if g.decoder is None else
                                            _held(g.decoding[:, : g.kept], device, dtype, g, "decoder"), g)
                                           for c, comps, g in parts])
        return self._on_device[key]

    def _columns(self, device: torch.device, stream: str = "keys") -> list[slice | torch.Tensor]:
        """Each group's columns in a token's (layer, KV head, head_dim) features of `stream`: a slice, or an index tensor."""
        s = self.spec
        return [c if isinstance(c, slice) else torch.as_tensor(c, device=device)
                for c in group_columns([g.group for g in s.streams["keys"]], s.kv_heads, s.dim(stream))]

    def basis_bytes(self) -> int:
        """Bytes of means, components and the outlier stage's decoder sketches this codec holds on its devices (the
        runtime's basis memory): each storage once, whole (a view of a basis other codecs share counts that basis)."""
        seen, total = set(), 0
        held = [t for mean, parts in self._on_device.values() for t in [mean] + [c for _, c, _ in parts]]
        for t in held + [g for sk in self._sketches.values() for g in sk.sketched]:
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        return total

    def split(self, tokens: int, start: int, sinks: int | None = None) -> tuple[int, int, int]:
        """(raw head, coded middle, raw tail) token counts for a cache of `tokens` starting at `start`, keeping
        `sinks` raw (None: the artifact's)."""
        head = min(tokens, max(0, (self.spec.sinks if sinks is None else sinks) - start))
        tail = min(self.spec.window, tokens - head)
        return head, tokens - head - tail, tail

    def _cos_sin(self, stream: str, positions: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, str]:
        if stream != self.spec.rope_stream or self.rope is None:
            return None, None, "half"
        cos, sin = self.rope.cos_sin(positions)
        return cos.contiguous(), sin.contiguous(), self.rope.layout

    def _context(self, dev: torch.device, ops: Ops, projections: dict | None = None) -> BlobContext:
        """What a mode's blob methods get of this codec on `dev` (kernels/codec/mode.py): never the codec itself."""
        timer = self._timer(dev)
        return BlobContext(self.spec, dev, ops, timer, SectionCoder(self.level, self.coder, timer),
                           HeldOffsets(self.spec, dev, self._offsets), self.on_device(dev, ops.name), self.ecsq_format,
                           self.rate_control, projections)

    def _check_cache(self, keys: torch.Tensor, values: torch.Tensor, start: int) -> None:
        s = self.spec
        layers = len(s.coded_layers)
        for name, x in (("keys", keys), ("values", values)):
            want = (layers, s.kv_heads, "tokens", s.dim(name))
            if not isinstance(x, torch.Tensor) or x.ndim != 4 or x.shape[0] != layers \
                    or x.shape[1] != s.kv_heads or x.shape[3] != s.dim(name):
                got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                if s.value_dim is None:
                    raise ValueError(f"{name} must be shaped (layers, kv_heads, tokens, head_dim) = {want}, got {got}")
                what = "latent" if name == "keys" else "rope key"
                raise ValueError(f"{name} ({what}) must be shaped (layers, kv_heads, tokens, width) = {want} for artifact "
                                 f"{s.name}@{s.version} ({s.widths}), got {got}: every layer's width must match")
            if x.dtype not in _CACHE_DTYPES:
                raise ValueError(f"{name} dtype {x.dtype} is not supported; use float16, bfloat16, float32 or float8_e4m3fn")
        if keys.shape[:3] != values.shape[:3] or keys.dtype != values.dtype or keys.device != values.device:
            raise ValueError("keys and values must have the same shape (but for an MLA cache's widths), dtype and device")
        if not 0 <= start < _MAX_START or keys.shape[2] >= _MAX_TOKENS:
            raise ValueError(f"start must be >= 0 and tokens < 2^31; got start={start}, tokens={keys.shape[2]}")

    def _sub(self, layers: tuple[int, ...]) -> "KVTCCodec":
        """The codec of the spec restricted to `layers` (one segment of a per-layer cache)."""
        if layers not in self._subs:
            self._subs[layers] = KVTCCodec(restrict(self.spec, layers), options=self.options)
            self._subs[layers].device_entropy = self.device_entropy
        return self._subs[layers]

    def _remove_rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(L, H, n, D) rope stream of the coded layers -> float32, each layer's own RoPE removed."""
        ropes = [self.spec.layer_ropes[i] for i in self.spec.coded_layers]
        return torch.stack([x[j].float() if r is None else r.remove(x[j].float(), positions) for j, r in enumerate(ropes)])

    def _apply_rope(self, x: torch.Tensor, positions: torch.Tensor, out: torch.Tensor) -> None:
        """(L, H, n, D) float32 RoPE-removed keys -> `out` with each layer's own RoPE applied."""
        for j, i in enumerate(self.spec.coded_layers):
            r = self.spec.layer_ropes[i]
            out[j] = x[j] if r is None else r.apply(x[j], positions)

    def _restore(self, stream: str, feat: torch.Tensor, mean: torch.Tensor, out: torch.Tensor, first: int, ops: Any,
                 stored: torch.dtype) -> None:
        """feat (n, p) centred RoPE-removed features of tokens at positions first.. -> out (L, H, n, D): mean
        added, RoPE applied, values rounded past the stored dtype's range kept finite; BlobError on NaN."""
        L, H, n, D = out.shape
        positions = torch.arange(first, first + n, device=feat.device)
        cos, sin, layout = self._cos_sin(stream, positions)
        with self._timer(feat.device)("rope_restore"):
            if stream == self.spec.rope_stream and self._per_layer_rope:
                plain = torch.empty(L, H, n, D, dtype=torch.float32, device=feat.device)
                ops.rope_restore(feat, None, None, mean, plain, layout)
                self._apply_rope(plain, positions, out)
            else:
                ops.rope_restore(feat, cos, sin, mean, out, layout)
            finite = torch.finfo(stored).max  # values rounded past the dtype's range stay finite
            out.clamp_(-finite, finite)
            if bool(torch.isnan(out).any()):
                raise BlobError(f"the coded {stream} decode to NaN: the blob's parameters are corrupt or forged")

    def encode(self, keys: torch.Tensor | Sequence[torch.Tensor | None], values: torch.Tensor | Sequence[torch.Tensor | None],
               start: int = 0, *, plan: BlobPlan | None = None) -> bytes:
        """keys, values (L, H, T, D) fp16/bf16/fp32 (L: the layers that keep a KV cache), token 0 at absolute
        position `start` -> blob bytes. Per-layer sequences (see the module doc) -> a per-layer blob.
        ValueError for a cache holding NaN or inf anywhere (raw sinks and window included), naming the first.
        plan: what this blob chooses (kernels/codec/blob_plan.py: mode, raw sinks and their format, the budget's
        share, truncation, outlier vectors); None: the codec's own (`self.plan()`). A per-layer cache takes the
        codec's own."""
        start = _position(start)
        plan = self._checked(plan)
        if isinstance(keys, (list, tuple)) or isinstance(values, (list, tuple)):
            counts = layer_counts(self.spec, keys, values)
            first = next(keys[i] for i, n in enumerate(counts) if n != NO_CACHE)
            longest = max(n for n in counts if n != NO_CACHE)
            if first.dtype not in _CACHE_DTYPES or not 0 <= start < _MAX_START or longest >= _MAX_TOKENS:
                raise ValueError("per-layer cache: dtype must be float16, bfloat16, float32 or float8_e4m3fn, start >= 0, "
                                 "tokens < 2^31")
            return encode_layered(self.spec, self._sub, keys, values, start, _CACHE_DTYPES[first.dtype], self.mode,
                                  self.blob_version)
        self._check_cache(keys, values, start)
        cache_dtype = keys.dtype
        if cache_dtype in _FP8:  # every float8_e4m3fn value is exact in bfloat16
            keys, values = keys.to(torch.bfloat16), values.to(torch.bfloat16)
        for name, x in (("keys", keys), ("values", values)):
            where = _first_non_finite(x)
            if where is not None:
                raise ValueError(f"{name} hold a non-finite value at (layer, kv head, token, dim) {where} (token "
                                 f"{where[2]} is position {start + where[2]}); a cache must be finite everywhere, the "
                                 "raw sinks and window included: check the model's numerics")
        dev, (L, H, T, D) = keys.device, keys.shape
        head, mid, tail = self.split(T, start, plan.sinks)
        ops, mode = resolve_ops(self.backend, dev), plan.mode
        sections, ctx = [], replace(self._context(dev, ops, {} if plan.outliers else None), truncate=plan.truncate,
                                    steps={} if plan.outliers else None, symbols={} if plan.outliers else None)
        bd = self.basis_dtype_on(dev, keys.dtype)
        sinks = plan.sink_format if head else CACHE
        for tag, fmt, lo, hi in ((TAG_RAW_HEAD, sinks, 0, head), (TAG_RAW_TAIL, CACHE, T - tail, T)):
            for si, x in enumerate((keys, values)) if hi > lo else ():
                sections.append(ctx.section(SectionKey(tag, si, 0, 0), fmt.encode(x[:, :, lo:hi], cache_dtype)))
        s = self.spec
        header = BlobHeader(s.name, s.version, s.model_id, s.ratio, _CACHE_DTYPES[cache_dtype], L, H, T, D, start,
                            plan.sinks, s.window, head, tail, mode=mode.name, ecsq_format=self.ecsq_format,
                            sink_format=sinks.name, **mode.blob.header_fields())
        if mid:
            positions = torch.arange(start + head, start + head + mid, device=dev)
            found = []
            for si, (stream, x) in enumerate(zip(STREAMS, (keys, values))):
                cos, sin, layout = self._cos_sin(stream, positions)
                mean, parts = self._params(stream, dev, mode, bd)
                with ctx.stage("rope_center"):
                    xm = mode.admit(x[:, :, head:head + mid], stream)
                    if stream == self.spec.rope_stream and self._per_layer_rope:
                        xm = self._remove_rope(xm, positions)
                    feat = ops.rope_center(xm, cos, sin, mean, layout)
                coded = mode.blob.encode(ctx, feat, si, stream, parts, plan.budget_scale)
                if plan.outliers:
                    coded, kept = self._with_outliers(ctx, mode, feat, coded, header, bd, si, x[:, :, head:head + mid],
                                                      plan.budget_scale)
                    found.append(kept)
                sections += coded
                del feat
            header = replace(header, **mode.blob.blob_fields(sections))
            if any(found):
                header = replace(header, outliers=True)
                sections += [Section(SectionKey(TAG_OUTLIERS, si, 0, 0), PLAIN, len(b), b) for si, b in enumerate(found)]
        return write_blob(header, sections, self.blob_version)

    def plan(self, mode: Mode | None = None, sinks: int | None = None, budget_scale: float = 1.0,
             truncate: bool = False) -> BlobPlan:
        """This codec's plan for a blob (kernels/codec/blob_plan.py) in `mode` (None: the codec's) keeping `sinks` raw
        (None: the artifact's), in the codec's sink format; outlier vectors where the codec's options set a factor
        and the mode's budget can shrink by their bytes (ECSQ with rate control; fixed-rate sizes are exact)."""
        mode = self.coding if mode is None else mode
        return BlobPlan(mode, self.spec.sinks if sinks is None else sinks, self._sinks, budget_scale, truncate,
                        self.outlier_factor is not None and not mode.sizes.exact and self.rate_control)

    def _checked(self, plan: BlobPlan | None) -> BlobPlan:
        if plan is None:
            return self._own_plan
        if not isinstance(plan, BlobPlan):
            raise ValueError(f"plan must be a BlobPlan (KVTCCodec.plan), got {type(plan).__name__}")
        if plan.sinks > self.spec.sinks:
            raise ValueError(f"a plan keeps at most the artifact's {self.spec.sinks} sinks raw, got {plan.sinks}")
        if plan.mode is not self.coding:
            plan.mode.check(self.spec)
        return plan

    @property
    def uses_outliers(self) -> bool:
        """Whether the codec's own blobs may carry outlier vectors (`plan`)."""
        return self._own_plan.outliers

    def _with_outliers(self, ctx: BlobContext, mode: Mode, feat: torch.Tensor, coded: list[Section], header: BlobHeader,
                       bd: torch.dtype, si: int, middle: torch.Tensor, budget_scale: float) -> tuple[list[Section], bytes]:
        """One stream's coded middle read as a reader would, its outlier vectors found (kernels/codec/outliers.py,
        each vector's error estimated through the decoder's sketch and measured where it may count: error_sketch.py)
        -> (its sections, re-coded at a budget smaller by their bytes where they do not fit beside them; its outlier
        section's bytes, empty where none). feat (mid, p) its centred features, middle (L, H, mid, W) its tokens."""
        s, dev, mid, stream = self.spec, ctx.device, feat.shape[0], STREAMS[si]
        data = {c.key: decode_section(c.coding, c.stored, c.raw_len, str(tuple(c.key))) for c in coded}
        mean, parts = self._params(stream, dev, mode, bd, decode=True)
        coefficients = mode.blob.coefficients(ctx, data, si, stream, mid, header, parts)
        with ctx.stage("outliers"):
            key = (stream, str(dev), mode, str(bd))
            if key not in self._sketches:
                self._sketches[key] = ErrorSketch(len(s.coded_layers), s.kv_heads * s.dim(stream),
                                                  [c for c, _, _ in parts], [d for _, d, _ in parts], dev)
            errors = vector_errors(self._sketches[key], feat, mean, coefficients,
                                   token_blocks(mid, block_tokens(sum(d.shape[1] for _, d, _ in parts))),
                                   self.outlier_factor)
            bound = mode.sizes.stream_bound_bytes(s, mid, stream)
            found = outliers.select(errors, self.outlier_factor, int(outliers.OUTLIER_SHARE * bound * budget_scale),
                                    outliers.vector_bytes(s.kv_heads, s.dim(stream)))
        packed = outliers.pack(found, middle) if len(found) else b""
        if packed and sum(len(c.stored) for c in coded) + len(packed) > budget_scale * bound:  # else they fit beside it
            coded = mode.blob.encode(ctx, feat, si, stream, self._params(stream, dev, mode, bd)[1],
                                      budget_scale - len(packed) / bound)  # the projections and steps kept
        ctx.projections.clear()
        ctx.steps.clear()
        ctx.symbols.clear()
        return coded, packed

    def on_device(self, dev: torch.device, ops_name: str) -> bool:
        """Whether the rANS symbols are coded by the Triton kernels where the tensors are."""
        if self.device_entropy is not None:
            return self.device_entropy and ops_name == "triton"
        return dev.type == "cuda" and ops_name == "triton"

    def section_bounds(self, header: BlobHeader, sections: list[Section] | None = None) -> list[SectionBound]:
        """Every section a blob with this header must hold, in order, each with the most raw bytes it may
        inflate to (from the header: token count, kept components, symbol models). The raw sinks and window
        are common to every mode; the coded middle's sections come from the blob's mode (Mode.section_bounds).
        `sections`: the blob's table, for a mode whose bound on one section depends on another's stored length."""
        L, H, T = header.layers, header.kv_heads, header.tokens
        widths = (header.head_dim, self.spec.dim("values") if self.spec.value_dim is not None else header.head_dim)
        item = torch.empty(0, dtype=getattr(torch, header.dtype)).element_size()
        head, mid, tail = self.split(T, header.start, header.sinks)
        out = [SectionBound(SectionKey(tag, si, 0, 0), fmt.nbytes((L, H, n, widths[si]), item))
               for tag, fmt, n in ((TAG_RAW_HEAD, sink_format_for(header.sink_format), head), (TAG_RAW_TAIL, CACHE, tail))
               if n for si in range(2)]
        if mid:
            out += mode_for(header.mode).blob.section_bounds(self.spec, mid, {s.key: s for s in sections or ()}, header)
        if mid and header.outliers:
            out += [SectionBound(SectionKey(TAG_OUTLIERS, si, 0, 0), L * mid * outliers.vector_bytes(H, widths[si]),
                                 exact=False, plain=True) for si in range(2)]
        return out

    def expected_sections(self, header: BlobHeader) -> list[tuple[SectionKey, int | None]]:
        """(key, raw length; None where only a bound is known) of every section, in order (see section_bounds)."""
        return [(b.key, b.max_raw if b.exact else None) for b in self.section_bounds(header)]

    def _check_header(self, h: BlobHeader) -> None:
        s = self.spec
        if (h.name, h.version, h.ratio) != (s.name, s.version, s.ratio):
            raise BlobError(f"blob was written with artifact {h.name}@{h.version} at ratio {h.ratio:g}; this codec "
                            f"is {s.name}@{s.version} at ratio {s.ratio:g}: decode it with the matching codec")
        if h.model_id != s.model_id:
            raise BlobError(f"blob is for model {h.model_id}, this codec's artifact is for model {s.model_id}")
        if (h.layers, h.kv_heads, h.head_dim, h.window) != (len(s.coded_layers), s.kv_heads, s.head_dim, s.window) \
                or h.sinks > s.sinks:  # a plan keeps at most the artifact's sinks raw
            raise BlobError("blob shape or sink/window settings do not match the codec's artifact")
        head, _mid, tail = self.split(h.tokens, h.start, h.sinks)
        if h.tokens >= _MAX_TOKENS or h.start >= _MAX_START or (h.head_raw, h.tail_raw) != (head, tail):
            raise BlobError(f"blob declares inconsistent token counts (tokens={h.tokens}, start={h.start})")

    def decode(self, blob: bytes | bytearray | memoryview, device: str | torch.device = "cpu", *,
               max_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """blob -> (keys, values) (L, H, T, D) in the encoded dtype on `device`.

        Every failure caused by the blob's bytes is a BlobError (a ValueError), including a blob declaring
        more than `max_tokens` tokens (default: the codec's `max_tokens`), refused before allocating; any
        other exception is not the blob's doing (a device, memory or a bug) and propagates as it is.
        """
        dev = _usable_device(device)
        limit = self.max_tokens if max_tokens is None else max_tokens
        return self._decode(blob, dev, limit)

    def _decode(self, blob: bytes | bytearray | memoryview, dev: torch.device, max_tokens: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
        header, sections = read_blob(blob)
        if header.tokens > max_tokens:
            raise BlobError(f"blob declares {header.tokens} tokens, over this decoder's limit of {max_tokens}; "
                            "pass max_tokens= to KVTCCodec or decode() if such long caches are expected")
        if header.layered:
            if (header.name, header.version, header.ratio, header.model_id) != \
                    (self.spec.name, self.spec.version, self.spec.ratio, self.spec.model_id):
                raise BlobError(f"blob was written with artifact {header.name}@{header.version} at ratio "
                                f"{header.ratio:g} for model {header.model_id}; this codec is {self.spec.name}@"
                                f"{self.spec.version} at ratio {self.spec.ratio:g}: decode it with the matching codec")
            return decode_layered(self.spec, self._sub, header, sections, dev, max_tokens)
        self._check_header(header)
        bounds = self.section_bounds(header, sections)
        mode, head, mid, tail = mode_for(header.mode), *self.split(header.tokens, header.start, header.sinks)
        mode.blob.check_capacity(self.spec, mid, sections, header)  # before any per-token array is built
        with self._timer(dev)("entropy_decode"):
            data = decode_sections(sections, bounds)
        L, H, T = header.layers, header.kv_heads, header.tokens
        widths = [header.head_dim if st == "keys" else self.spec.dim(st) for st in STREAMS]
        stored = getattr(torch, header.dtype)
        dtype = torch.bfloat16 if stored in _FP8 else stored  # float8 caches are decoded through bfloat16
        out = [torch.empty(L, H, T, D, dtype=dtype, device=dev) for D in widths]
        for tag, fmt, lo, hi in ((TAG_RAW_HEAD, sink_format_for(header.sink_format), 0, head),
                                 (TAG_RAW_TAIL, CACHE, T - tail, T)):
            for si in range(2) if hi > lo else ():
                raw = fmt.decode(data[SectionKey(tag, si, 0, 0)], (L, H, hi - lo, widths[si]), dtype, stored)
                where = _first_non_finite(raw)
                if where is not None:
                    raise BlobError(f"raw {'sink' if tag == TAG_RAW_HEAD else 'window'} section of the {STREAMS[si]} "
                                    f"holds a non-finite value at (layer, kv head, token, dim) "
                                    f"{(where[0], where[1], lo + where[2], where[3])}: encode never stores one, the "
                                    "blob is corrupt or forged")
                out[si][:, :, lo:hi] = raw.to(dev).to(dtype)
        patches = [outliers.unpack(data[SectionKey(TAG_OUTLIERS, si, 0, 0)], L, H, mid, widths[si], dtype)
                   for si in range(2)] if mid and header.outliers else []
        if mid:
            ops = resolve_ops(self.backend, dev)
            ctx = self._context(dev, ops)
            for si, stream in enumerate(STREAMS):
                D = widths[si]
                mean, parts = self._params(stream, dev, mode, self.basis_dtype_on(dev, dtype), decode=True)
                rows = mode.blob.decoder(ctx, data, si, stream, mid, header, parts)
                # bounded blocks: the peak is the output, the stream's symbols and one block's features
                for a, b in token_blocks(mid, decode_block_tokens(L * H * D, mid)):
                    feat = torch.empty(b - a, L * H * D, dtype=torch.float32, device=dev)
                    rows(a, b, feat)
                    self._restore(stream, feat, mean, out[si][:, :, head + a:head + b], header.start + head + a, ops,
                                  stored)
                del rows
        for si, (index, vectors) in enumerate(patches):
            outliers.scatter(index, vectors, out[si][:, :, head:head + mid])
        if stored != dtype:
            return out[0].to(stored), out[1].to(stored)
        return out[0], out[1]


DECODE_BLOCK_BYTES = (1 << 20, 1 << 25)  # a block of one stream's float32 features: 1 MiB to 32 MiB
DECODE_BLOCKS = 32  # a stream is decoded in about this many blocks between those sizes
MIN_BLOCK_TOKENS = 64  # and never in blocks of fewer tokens (a BLAS rounds a few rows as it rounds many)


def decode_block_tokens(features: int, tokens: int) -> int:
    """Coded tokens decode reconstructs at once, of `tokens`, for a stream of `features` features per token: about
    1/32 of the stream's features (dequantizing and projecting a block holds several times its features), within
    DECODE_BLOCK_BYTES, so decode's peak is about the output, its symbols and one block."""
    per_token = 4 * max(1, features)
    lo, hi = DECODE_BLOCK_BYTES
    return max(MIN_BLOCK_TOKENS, min(tokens, min(hi, max(lo, tokens * per_token // DECODE_BLOCKS)) // per_token))


def token_blocks(tokens: int, block: int) -> list[tuple[int, int]]:
    """[a, b) ranges of about `block` tokens (never fewer than `block` but for the last) covering `tokens`, evenly."""
    count = max(1, tokens // max(1, block))
    size = -(-tokens // count)
    return [(a, min(tokens, a + size)) for a in range(0, tokens, size)]


def _position(start: object) -> int:
    """An absolute token position: an integer (numpy integers too), never a bool."""
    if isinstance(start, bool) or not hasattr(start, "__index__"):
        raise ValueError(f"start must be an integer token position, got {start!r} ({type(start).__name__})")
    return start.__index__()


def _first_non_finite(x: torch.Tensor) -> tuple[int, ...] | None:
    """Index of the first NaN or inf of `x`, None when every value is finite."""
    if all_finite(x):
        return None
    bad = ~torch.isfinite(x.to(torch.bfloat16) if x.dtype in _FP8 else x)
    return tuple(int(i) for i in torch.nonzero(bad)[0])


_CONVERTED: "weakref.WeakValueDictionary[tuple, torch.Tensor]" = weakref.WeakValueDictionary()


def _held(matrix: torch.Tensor, device: torch.device, dtype: torch.dtype, group: Any, what: str) -> torch.Tensor:
    """A basis matrix as the codec holds it: a view of one tensor per (basis, device, dtype) in the process, so the
    codecs of every ratio and mode (leading columns of one basis) share it. ValueError when `dtype` cannot hold its
    values (inf there)."""
    root = matrix if matrix._base is None else matrix._base
    leading = (matrix.dim() == root.dim() == 2 and matrix.shape[0] == root.shape[0] and matrix.stride() == root.stride()
               and matrix.storage_offset() == root.storage_offset())  # matrix is root's first columns
    if matrix.device == device and matrix.dtype == dtype:
        held = matrix
    elif not leading:
        held = matrix.to(device=device, dtype=dtype).contiguous()  # a basis of its own (a rank's rows)
    else:
        key = (root.untyped_storage().data_ptr(), tuple(root.shape), root.stride(), str(device), dtype)
        whole = _CONVERTED.get(key)
        if whole is None:
            whole = root.to(device=device, dtype=dtype)
            whole._kvtc_source = root  # the source lives while its copy does: its address names no other basis
            _CONVERTED[key] = whole
        held = whole[:, : matrix.shape[1]]
    if not bool(torch.isfinite(held).all()):
        raise ValueError(f"group {group.group.label}: its {what} hold values beyond {dtype}'s range "
                         f"({float(matrix.abs().max()):.3g}); pass basis_dtype=torch.float32 to KVTCCodec")
    return held


def _usable_device(device: str | torch.device) -> torch.device:
    """torch.device(device), or ValueError (bad input, not a bad blob) when it is no device decode can write to."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device={device!r} is not a torch device ({exc}); pass e.g. 'cpu' or 'cuda:0'") from None
    if dev.type == "meta" or (dev.type == "cuda" and not (torch.cuda.is_available()
                                                         and (dev.index or 0) < torch.cuda.device_count())):
        raise ValueError(f"device={device!r} is not available here (CUDA devices: "
                         f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}); pass 'cpu' or an existing GPU")
    return dev
