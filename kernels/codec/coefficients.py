"""Quantized PCA coefficients held in memory, and per-layer decode from them.

The blob (kernels/codec/kvtc_codec.py) is the storage form of a cache; this is its resident form for a cache
that keeps running, in the codec's mode (kernels/codec/modes.py, which owns each mode's form): "fixed" holds
the same quantized blocks (packed codes + fp16 params, no DEFLATE, so they can be dequantized every step);
"ecsq" holds, per stream, group and sequence, the ECSQ group's ANS words and escapes (kernels/codec/ecsq.py
`encode_group`, with the codec's rate control), entropy-decoded when read. Either way a decode of one layer
at a time reads only that layer's rows of its group's components.

Shapes: a layer's cache (B, H, T, D); a token block of all layers (L, B, H, n, D); coefficients of
a group z (B * n, kept) float32, rows in (batch, token) order.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtc.artifacts.groups import FeatureGroup
from kvtc.kernels.codec.backend import Ops, resolve_ops
from kvtc.kernels.codec.basis_product import project, reconstruct
from kvtc.kernels.codec.mode import Mode
from kvtc.kernels.codec.modes import FIXED, mode_for
from kvtc.kernels.codec.rope import RopeSpec
from kvtc.kernels.codec.spec import STREAMS, CodecSpec

Packed = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True, eq=False)
class CodedTokens:
    """n consecutive tokens (absolute positions start .. start + n - 1) of B sequences, all layers.

    `coding`, the mode they are held in (its ResidentForm owns `blocks`): fixed-rate, blocks[stream][group][block] =
    (packed (B*n, nbytes) uint8, params (B*n, 2) fp16), None for a block without bits; ECSQ,
    blocks[stream][group][sequence] = (words, escapes) bytes of that sequence's n tokens (the codec's ECSQ
    sections). `device` is where they decode to.
    """

    start: int
    tokens: int
    batch: int
    blocks: dict[str, tuple[tuple, ...]]
    coding: Mode = FIXED
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.start < 0 or self.tokens < 1 or self.batch < 1:
            raise ValueError(f"coded tokens need start >= 0, tokens >= 1, batch >= 1; got {self.start}, "
                             f"{self.tokens}, {self.batch}")

    @property
    def mode(self) -> str:
        """The name of the mode they are held in."""
        return self.coding.name

    @property
    def nbytes(self) -> int:
        """Bytes held: the tensors' (fixed), or the ANS words and escapes (ecsq; payload bytes, not
        counting Python's ~33-byte header per bytes object)."""
        return self.coding.resident.nbytes(self.blocks)

    def select_batch(self, index: torch.Tensor) -> "CodedTokens":
        """Keep (or repeat, reorder) sequences: index (B',) into the batch."""
        blocks = self.coding.resident.select(self.blocks, self.batch, self.tokens, index)
        return CodedTokens(self.start, self.tokens, int(index.numel()), blocks, self.coding, self.device)


class CoefficientCoder:
    """Encode token blocks of every layer to CodedTokens; decode one layer of one stream from them.

    Uses only a CodecSpec: its groups' means, kept components and block allocation (mode "fixed") or
    ECSQ groups (mode "ecsq", as KVTCCodec codes them: same centring, step, symbol models, centroid
    offsets and, with rate_control, the same per-sequence budget), and its RoPE (None when the keys
    were calibrated with RoPE kept).
    """

    def __init__(self, spec: CodecSpec, backend: str = "auto", mode: Mode | str = "fixed", rate_control: bool = True,
                 ecsq_format: str = "rans", basis_dtype: torch.dtype | None = None) -> None:
        self.coding = mode if isinstance(mode, Mode) else mode_for(mode)  # a name: a caller's setting
        self.coding.check(spec)
        self.coding.resident.check(spec)
        self.spec = spec
        self.backend = backend
        self.rate_control, self.ecsq_format = rate_control, ecsq_format
        self.basis_dtype = basis_dtype  # None: the cache's dtype on CUDA, float32 elsewhere (as KVTCCodec)
        self.layer_ropes: list[RopeSpec | None] = spec.layer_ropes  # each layer's own RoPE (None: NoPE / kept)
        self._on_device: dict[tuple[str, str, int], tuple[torch.Tensor, torch.Tensor]] = {}
        # layer -> [(group index, row offset of the layer inside the group's keys features, (h0, h1))], a
        # layer in several groups when groups split its KV heads; layer_group: its first (group, row)
        self.layer_parts: dict[int, list[tuple[int, int, tuple[int, int]]]] = {}
        for gi, g in enumerate(spec.streams["keys"]):
            heads = g.group.head_range(spec.kv_heads)
            for layer in g.group.layers:
                row = g.group.layer_offset(layer, spec.kv_heads, spec.head_dim)
                self.layer_parts.setdefault(layer, []).append((gi, row, heads))
        self.layer_group = {layer: parts[0][:2] for layer, parts in self.layer_parts.items()}

    @property
    def mode(self) -> str:
        """The name of the mode it encodes in (`coding`): "fixed" or "ecsq" (kernels/codec/modes.py)."""
        return self.coding.name

    def _group(self, stream: str, gi: int, device: torch.device, dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean float32, the mode's kept components in the basis dtype for a cache of `dtype`) on `device`."""
        dt = self.basis_dtype or (dtype if device.type == "cuda" else torch.float32)
        key = (stream, str(device), gi, str(dt))
        if key not in self._on_device:
            code = self.coding.codes(self.spec, stream)[gi]
            comps = code.components[:, :code.kept].to(device=device, dtype=dt).contiguous()
            # the codec centres with the fixed-rate groups' mean in both modes
            self._on_device[key] = (self.spec.streams[stream][gi].mean.to(device), comps)
        return self._on_device[key]

    def _decoding(self, stream: str, gi: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """The mode's kept decoding matrix (the decoder, or the components of an orthonormal basis) as `_group`
        holds the components; an orthonormal basis shares the components' tensor."""
        mean, comps = self._group(stream, gi, device, dtype)
        code = self.coding.codes(self.spec, stream)[gi]
        if code.decoder is None:
            return comps
        key = ("decoding", stream, str(device), gi, str(comps.dtype))
        if key not in self._on_device:
            self._on_device[key] = (mean, code.decoder[:, : comps.shape[1]].to(device=device, dtype=comps.dtype)
                                    .contiguous())
        return self._on_device[key][1]

    def _ops(self, device: torch.device) -> Ops:
        return resolve_ops(self.backend, device)

    def _cos_sin(self, stream: str, start: int, tokens: int, batch: int, device: torch.device,
                 rope: RopeSpec | None) -> tuple[torch.Tensor | None, torch.Tensor | None, str]:
        if stream != self.spec.rope_stream or rope is None:
            return None, None, "half"
        positions = torch.arange(start, start + tokens, device=device).repeat(batch)
        cos, sin = rope.cos_sin(positions)
        return cos.contiguous(), sin.contiguous(), rope.layout

    def _features(self, stream: str, cache: torch.Tensor, group: FeatureGroup, mean: torch.Tensor, ops: Ops,
                  start: int, n: int, batch: int) -> torch.Tensor:
        """A group's centred, RoPE-removed features (B*n, p_g): fused when its layers share one RoPE."""
        x = _group_cache(cache, group, self.spec.kv_heads)
        ropes = {self.layer_ropes[l] for l in group.layers} if stream == self.spec.rope_stream else {None}
        if len(ropes) == 1:
            cos, sin, layout = self._cos_sin(stream, start, n, batch, cache.device, ropes.pop())
            return ops.rope_center(x, cos, sin, mean, layout)
        positions = torch.arange(start, start + n, device=cache.device).repeat(batch)
        plain = torch.stack([x[j].float() if self.layer_ropes[l] is None else self.layer_ropes[l].remove(x[j].float(), positions)
                             for j, l in enumerate(group.layers)])
        return ops.rope_center(plain, None, None, mean, "half")

    def encode(self, keys: torch.Tensor, values: torch.Tensor, start: int) -> CodedTokens:
        """keys, values (L, B, H, n, D) as the model cached them, first token at position `start`."""
        s = self.spec
        if keys.ndim != 5 or values.ndim != 5 or keys.shape[:4] != values.shape[:4] or keys.shape[0] != s.num_layers \
                or keys.shape[2] != s.kv_heads or (keys.shape[4], values.shape[4]) != (s.dim("keys"), s.dim("values")):
            raise ValueError(f"expected keys and values (layers, batch, kv_heads, tokens, width) with "
                             f"layers={s.num_layers} ({s.widths}); got {tuple(keys.shape)} and {tuple(values.shape)}")
        L, B, H, n, _ = keys.shape
        dev = keys.device
        ops = self._ops(dev)
        blocks: dict[str, tuple] = {}
        for stream, x in zip(STREAMS, (keys, values)):
            x = self.coding.admit(x, stream)  # saturated (fixed-rate) or refused beyond any step (ECSQ)
            cache = x.permute(0, 2, 1, 3, 4).reshape(L, H, B * n, x.shape[4])  # tokens in (batch, token) order
            groups = []
            for gi, g in enumerate(s.streams[stream]):
                mean, comps = self._group(stream, gi, dev, x.dtype)
                feat = self._features(stream, cache, g.group, mean, ops, start, n, B)
                z = project(feat, comps).contiguous()
                groups.append(self.coding.resident.encode(self, z, stream, gi, ops, B, n))
            blocks[stream] = tuple(groups)
        return CodedTokens(start, n, B, blocks, self.coding, str(dev))

    def coefficients(self, coded: CodedTokens, stream: str, gi: int) -> torch.Tensor:
        """Dequantized coefficients z (B * n, kept) float32 of one group."""
        return coded.coding.resident.coefficients(self, coded, stream, gi)

    def decode_layer(self, coded: CodedTokens, z: torch.Tensor, stream: str, layer: int, dtype: torch.dtype
                     ) -> torch.Tensor:
        """z of the layer's group (from `coefficients`) -> that layer's cache (B, H, n, D) in `dtype`.
        A layer whose heads are split over groups: z is a dict {group index: z} of those groups."""
        D, B, n = self.spec.dim(stream), coded.batch, coded.tokens
        parts = self.layer_parts[layer]
        zs = z if isinstance(z, dict) else {parts[0][0]: z}
        dev = next(iter(zs.values())).device
        out = torch.empty(1, self.spec.kv_heads, B * n, D, dtype=dtype, device=dev)
        cos, sin, layout = self._cos_sin(stream, coded.start, n, B, dev, self.layer_ropes[layer])
        for gi, _, (h0, h1) in parts:
            row = self.spec.streams[stream][gi].group.layer_offset(layer, self.spec.kv_heads, D)
            mean, _ = self._group(stream, gi, dev, dtype)
            decoding = self._decoding(stream, gi, dev, dtype)
            rows = slice(row, row + (h1 - h0) * D)
            feat = reconstruct(zs[gi], decoding[rows])  # (B*n, heads*D): this layer's rows only
            self._ops(dev).rope_restore(feat, cos, sin, mean[rows].contiguous(), out[:, h0:h1], layout)
        return out[0].reshape(-1, B, n, D).transpose(0, 1)


def _group_cache(cache: torch.Tensor, group: FeatureGroup, kv_heads: int) -> torch.Tensor:
    """cache (L, H, N, D) -> the group's layers and heads (L_g, H_g, N, D), a view when its layers are a range."""
    h0, h1 = group.head_range(kv_heads)
    a = group.layers[0]
    if group.layers == tuple(range(a, a + len(group.layers))):
        return cache[a:a + len(group.layers), h0:h1]
    return cache[list(group.layers), h0:h1]

