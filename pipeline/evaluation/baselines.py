"""Baseline cache compressors, compared with the KVTC codec at their real stored bytes.

Every method sees one sequence's cache (layers, kv_heads, T, head_dim), keys with RoPE as the
model cached them, and compresses only the middle tokens: positions [0, sinks) and the last
`window` stay raw, exactly as the codec keeps them, so bytes are compared on the middle alone.
Bytes count everything a method must store for the middle (codes, scales and zero points,
positions); CR = 16 p bits per token and stream (fp16) over the stored bits.

- `kivi`: integer min/max quantization as KIVI does it: keys per channel (groups of `group`
  tokens along each channel), values per token (groups of `group` channels of each layer's
  kv_heads * head_dim vector); an fp16 zero point and scale per group.
- `fp8_cast`: e4m3 cast of every element (saturating at +-448), no scale.
- `pca_uniform`: the artifact's PCA basis with one bit width for every kept component (blocks of
  64 with their per-token scales, no DP), encoded by the KVTC codec itself (same entropy coder).
- `evict`: StreamingLLM-style eviction: sinks and window kept, plus the most recent middle tokens
  the byte budget pays for in fp16; evicted tokens are simulated by masking them out of attention
  (`keep` is False there), so every kept token keeps its original position.
- `deflate`: zlib (DEFLATE) over the raw fp16 middle tokens; lossless up to the fp16 cast.
Relative errors are ||X - X_hat||_F / ||X||_F over the middle tokens, evicted tokens counting as
X_hat = 0. RoPE rotates each token orthogonally, so this equals the RoPE-removed error.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import numpy as np
import torch

from kvtc.artifacts.blocks import budget_bits
from kvtc.kernels import CodecSpec, CodedBlock, GroupCode, KVTCCodec
from kvtc.kernels.codec.blob import TAG_RAW_HEAD, TAG_RAW_TAIL, read_blob
from kvtc.kernels.codec.reference import quantize_dequantize

PCA_UNIFORM_BLOCK = 64


@dataclass(frozen=True)
class Reconstruction:
    """keys, values (L, H, T, D) float32 as the model will read them; stored_bytes: bytes stored for
    the `mid` middle tokens (both streams); keep (T,) bool or None: False = evicted (masked)."""

    method: str
    keys: torch.Tensor
    values: torch.Tensor
    stored_bytes: int
    mid: int
    features: int
    keep: torch.Tensor | None = None

    @property
    def bytes_per_token(self) -> float:
        return self.stored_bytes / max(self.mid, 1)

    @property
    def cr(self) -> float:
        """fp16 size of the middle tokens (both streams) over the stored bytes."""
        return 4.0 * self.features * self.mid / max(self.stored_bytes, 1)


def split(tokens: int, sinks: int, window: int) -> tuple[int, int, int]:
    """(raw head, middle, raw tail) token counts, as KVTCCodec.split(tokens, start=0)."""
    head = min(tokens, sinks)
    tail = min(window, tokens - head)
    return head, tokens - head - tail, tail


def rel_error(x: torch.Tensor, x_hat: torch.Tensor) -> tuple[float, float]:
    """(squared error, squared norm) of x_hat against x, any shapes alike, summed in float64."""
    return squared_norm(x, x_hat), squared_norm(x)


def squared_norm(x: torch.Tensor, x_hat: torch.Tensor | None = None) -> float:
    """The squared norm of x, or of x - x_hat where given (shapes alike), summed in float64."""
    if x_hat is None:
        return float(torch.linalg.vector_norm(x, dtype=torch.float64)) ** 2
    return float(torch.linalg.vector_norm(x.float() - x_hat.float(), dtype=torch.float64)) ** 2


def _check(keys: torch.Tensor, values: torch.Tensor) -> None:
    """Same layers, heads and tokens; the head widths may differ (an MLA cache: latent and RoPE key)."""
    if keys.ndim != 4 or values.ndim != 4 or keys.shape[:3] != values.shape[:3]:
        raise ValueError(f"keys and values must both be (layers, kv_heads, tokens, head_dim), head_dim per stream; got "
                         f"{tuple(keys.shape)} and {tuple(values.shape)}")


def features(keys: torch.Tensor, values: torch.Tensor) -> int:
    """Values per token and stream, averaged over the two streams (p, when both have one width)."""
    return (keys[:, :, 0].numel() + values[:, :, 0].numel()) // 2


def _splice(x: torch.Tensor, middle: torch.Tensor, head: int, mid: int) -> torch.Tensor:
    out = x.float().clone()
    out[:, :, head:head + mid] = middle
    return out


def _grouped(rows: torch.Tensor, group: int, qtype: str) -> tuple[torch.Tensor, int]:
    """rows (R, n): quantize each run of `group` columns per row (the last run may be shorter).
    Returns (round trip (R, n), number of (row, run) groups)."""
    r, n = rows.shape
    out = torch.empty_like(rows, dtype=torch.float32)
    full = (n // group) * group
    if full:
        out[:, :full] = quantize_dequantize(rows[:, :full].reshape(-1, group), qtype).view(r, full)
    if full < n:
        out[:, full:] = quantize_dequantize(rows[:, full:], qtype)
    return out, r * math.ceil(n / group)


def kivi(keys: torch.Tensor, values: torch.Tensor, bits: int, group: int, sinks: int, window: int) -> Reconstruction:
    """KIVI-style quantization: keys per channel over token groups, values per token over channel groups."""
    _check(keys, values)
    if bits not in range(1, 9) or group < 1:
        raise ValueError(f"kivi: bits must be in 1..8 and group >= 1, got bits={bits}, group={group}")
    L, H, T, D = keys.shape
    Dv = values.shape[3]
    head, mid, _ = split(T, sinks, window)
    qtype = f"int{bits}"
    k_mid = keys[:, :, head:head + mid].float()
    v_mid = values[:, :, head:head + mid].float()
    k_rows = k_mid.permute(0, 1, 3, 2).reshape(-1, mid)  # (L*H*D channels, mid tokens)
    k_hat, k_groups = _grouped(k_rows, group, qtype) if mid else (k_rows, 0)
    k_hat = k_hat.view(L, H, D, mid).permute(0, 1, 3, 2)
    v_rows = v_mid.permute(0, 2, 1, 3).reshape(L * mid, H * Dv)  # (layer-token rows, channels)
    v_hat, v_groups = _grouped(v_rows, group, qtype) if mid else (v_rows, 0)
    v_hat = v_hat.view(L, mid, H, Dv).permute(0, 2, 1, 3)
    stored = math.ceil(L * H * D * mid * bits / 8) + math.ceil(L * H * Dv * mid * bits / 8) \
        + 4 * (k_groups + v_groups)  # fp16 zero point + scale per group
    return Reconstruction(f"kivi-int{bits}-g{group}", _splice(keys, k_hat, head, mid), _splice(values, v_hat, head, mid),
                          stored, mid, features(keys, values))


def fp8_cast(keys: torch.Tensor, values: torch.Tensor, sinks: int, window: int) -> Reconstruction:
    """e4m3 cast of the middle tokens, saturating at +-448."""
    _check(keys, values)
    L, H, T, D = keys.shape
    head, mid, _ = split(T, sinks, window)

    def cast(x: torch.Tensor) -> torch.Tensor:
        m = x[:, :, head:head + mid].float().clamp(-448.0, 448.0)
        return _splice(x, m.to(torch.float8_e4m3fn).float(), head, mid)

    return Reconstruction("fp8-e4m3", cast(keys), cast(values), 2 * features(keys, values) * mid, mid,
                          features(keys, values))


def deflate(keys: torch.Tensor, values: torch.Tensor, sinks: int, window: int, level: int = 6) -> Reconstruction:
    """zlib over the fp16 bytes of the middle tokens (both streams compressed separately)."""
    _check(keys, values)
    L, H, T, D = keys.shape
    head, mid, _ = split(T, sinks, window)
    stored, outs = 0, []
    for x in (keys, values):
        m = x[:, :, head:head + mid].to(torch.float16).contiguous()
        stored += len(zlib.compress(m.cpu().view(torch.uint8).numpy().tobytes(), level)) if mid else 0
        outs.append(_splice(x, m.float(), head, mid))
    return Reconstruction("deflate-fp16", outs[0], outs[1], stored, mid, features(keys, values))


def evict(keys: torch.Tensor, values: torch.Tensor, ratio: float, sinks: int, window: int) -> Reconstruction:
    """Keep sinks, window and the most recent floor(mid / ratio) middle tokens (fp16); mask the rest.
    The kept middle tokens are one contiguous run, so their positions cost one int64 (8 bytes)."""
    _check(keys, values)
    if not ratio >= 1:
        raise ValueError(f"evict: ratio must be >= 1, got {ratio}")
    T = keys.shape[2]
    head, mid, _ = split(T, sinks, window)
    p = features(keys, values)
    budget = math.floor(4 * p * mid / ratio)
    kept = min(mid, max(0, budget - 8) // (4 * p))
    keep = torch.ones(T, dtype=torch.bool, device=keys.device)
    keep[head:head + mid - kept] = False
    outs = []
    for x in (keys, values):
        out = x.float().clone()
        out[:, :, head:head + mid - kept] = 0.0  # only for the error; attention never reads them
        out[:, :, head + mid - kept:head + mid] = x[:, :, head + mid - kept:head + mid].to(torch.float16).float()
        outs.append(out)
    return Reconstruction(f"evict-{ratio:g}x", outs[0], outs[1], 4 * p * kept + (8 if kept else 0), mid, p, keep)


def blob_middle_bytes(blob: bytes) -> int:
    """Bytes of a KVTC blob minus its raw sink and window sections (header and tables stay counted)."""
    _, sections = read_blob(blob)
    return len(blob) - sum(len(s.stored) for s in sections if s.key.tag in (TAG_RAW_HEAD, TAG_RAW_TAIL))


def run_codec(codec, keys: torch.Tensor, values: torch.Tensor, method: str | None = None) -> Reconstruction:
    """Encode and decode with a KVTCCodec; bytes are the blob's middle bytes (`blob_middle_bytes`)."""
    _check(keys, values)
    blob = codec.encode(keys, values)
    k_hat, v_hat = codec.decode(blob)
    _, mid, _ = codec.split(keys.shape[2], 0)
    return Reconstruction(method or f"kvtc-{codec.spec.ratio:g}x", k_hat.float(), v_hat.float(),
                          blob_middle_bytes(blob), mid, features(keys, values))


def uniform_blocks(eigenvalues, p: int, ratio: float, block: int = PCA_UNIFORM_BLOCK,
                   bit_choices: tuple[int, ...] = (2, 4, 8)) -> list[tuple[int, int, str, int]]:
    """Uniform-bit allocation within B = floor(16 p / ratio): n blocks of `block` components, all at
    b bits (cost block * b + 32 each); b is the choice in bit_choices whose analytic error
    (dropped variance + lambda 4^-b on the kept ones) is lowest. Returns [(start, size, type, bits)]."""
    lam = torch.tensor(np.array(eigenvalues, dtype=np.float64))
    budget = budget_bits(p, ratio)
    best: tuple[float, list] | None = None
    for b in bit_choices:
        n = min(budget // (block * b + 32), math.ceil(lam.numel() / block))
        blocks = [(i * block, min(block, lam.numel() - i * block), f"int{b}", b) for i in range(n)]
        while blocks and sum(s * bb + 32 for _, s, _, bb in blocks) > budget:
            blocks.pop()
        kept = sum(s for _, s, _, _ in blocks)
        err = float(lam[kept:].sum() + lam[:kept].sum() * 4.0 ** -b)
        if blocks and (best is None or err < best[0]):
            best = (err, blocks)
    if best is None:
        raise ValueError(f"ratio {ratio:g} leaves {budget} bits per token: not one uniform block fits")
    return best[1]


def pca_uniform_codec(artifact, ratio: float):
    """A KVTCCodec on the artifact's basis with `uniform_blocks` instead of the DP allocation."""
    spec = CodecSpec.from_artifact(artifact, max(artifact.ratios()))
    groups = {}
    for stream in ("keys", "values"):
        codes = []
        for gi, g in enumerate(spec.streams[stream]):
            mean, eig, comps = artifact.basis(stream, gi)
            blocks = tuple(CodedBlock(*b) for b in uniform_blocks(eig, mean.shape[0], ratio))
            kept = blocks[-1].start + blocks[-1].size
            decoder = artifact.decoder(stream, gi)
            codes.append(GroupCode(g.group, g.mean, torch.as_tensor(comps[:, :kept], dtype=torch.float32).contiguous(),
                                   blocks, None if decoder is None else torch.as_tensor(decoder[:, :kept]).contiguous()))
        groups[stream] = tuple(codes)
    uniform = CodecSpec(spec.name, spec.version, float(ratio), spec.model_id, spec.num_layers, spec.kv_heads,
                        spec.head_dim, spec.sinks, spec.window, spec.rope, groups, layers=spec.layers,
                        value_dim=spec.value_dim)
    return KVTCCodec(uniform)
