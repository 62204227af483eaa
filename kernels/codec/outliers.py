"""Outlier vectors: the (layer, token) vectors the transform codes worst, stored int8 inside the ratio's budget.

Some tokens in the middle of a sequence act as attention sinks in a few layers (" ", " the" in the embedded
model's layers 3-10): there their value vectors are 5-10x shorter than a typical token's, so the transform's
noise, about the same for every token, is 100-190% of them, and every later query attends to them. After
coding the middle, encode measures each (layer, token)'s relative error per stream and keeps those above
`factor` times the stream's own (at most OUTLIER_SHARE of the middle's budget, worst first) as int8 codes with
a float32 scale per (KV head) vector (kernels/codec/sinks_int8.py's format); the middle is then re-coded at a budget smaller by
their bytes, so a blob's size bound is unchanged. Decode writes them over the restored tokens.

Section layout (TAG_OUTLIERS, one per stream, stored plain): n uint32 indices layer * coded_tokens + token,
strictly increasing, little endian; then codes (n, H, 1, W) int8 and scales (n, H, 1) float32 (sinks_int8).
"""
from __future__ import annotations

import struct

import torch

from kvtc.kernels.codec.blob import BlobError
from kvtc.kernels.codec.sinks_int8 import int8_bytes, sinks_from_int8, sinks_to_int8

OUTLIER_SHARE = 0.1  # of the coded middle's budget, at most, spent on outlier vectors


def vector_bytes(heads: int, width: int) -> int:
    """Bytes of one stored outlier vector: its index, codes and scales."""
    return 4 + int8_bytes(1, heads, 1, width)


def errors(feat: torch.Tensor, feat_hat: torch.Tensor, mean: torch.Tensor, layers: int
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """feat, feat_hat (n, L * H * W) centred features of n tokens and their reconstruction, mean (L * H * W,) ->
    (squared error, squared norm) of each (token, layer) vector, both (n, L) float32."""
    err = (feat_hat.float() - feat.float()).reshape(feat.shape[0], layers, -1).pow(2).sum(-1)
    return err, norms(feat, mean, layers)


def norms(feat: torch.Tensor, mean: torch.Tensor, layers: int) -> torch.Tensor:
    """feat (n, L * H * W) centred features, mean (L * H * W,) -> the squared norm of each (token, layer) vector
    (n, L) float32."""
    return (feat.float() + mean.float()).reshape(feat.shape[0], layers, -1).pow(2).sum(-1)


def select(blocks: list[tuple[torch.Tensor, torch.Tensor]], factor: float, budget: int, per_vector: int
           ) -> torch.Tensor:
    """`errors` of consecutive token blocks of one stream -> the indices layer * tokens + token, increasing, of the
    vectors whose relative error ||x_hat - x|| / ||x|| exceeds `factor` times the stream's own over every token (at
    CR 32 the embedded model's values are coded at about 32%, its mid-sequence sinks at 100-190%), the worst first
    while `budget` bytes hold them."""
    err = torch.cat([e for e, _ in blocks]).cpu()
    norm = torch.cat([n for _, n in blocks]).cpu()
    tiny = torch.finfo(torch.float32).tiny
    score = (err / norm.clamp_min(tiny)).T.reshape(-1)  # layer-major: layer * tokens + token
    typical = float(err.sum() / norm.sum().clamp_min(tiny))
    index = torch.nonzero(score > factor * factor * typical).flatten()
    worst = index[torch.argsort(score[index], descending=True)][: max(0, budget) // per_vector]
    return torch.sort(worst).values


def pack(index: torch.Tensor, x: torch.Tensor) -> bytes:
    """index (n,) layer * coded_tokens + token, x (L, H, coded_tokens, W) the stream's coded tokens -> the
    section's bytes."""
    tokens = x.shape[2]
    layer, token = index // tokens, index % tokens
    vectors = x[layer.to(x.device), :, token.to(x.device)][:, :, None]  # (n, H, 1, W)
    return struct.pack(f"<{len(index)}I", *index.tolist()) + sinks_to_int8(vectors)


def unpack(data: bytes, layers: int, heads: int, tokens: int, width: int, dtype: torch.dtype
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The section's bytes -> (index (n,), vectors (n, H, W) in `dtype`); BlobError where the bytes are not n
    whole vectors, or the indices are not increasing within the coded tokens."""
    per = vector_bytes(heads, width)
    if len(data) % per:
        raise BlobError(f"the outlier section holds {len(data)} bytes, not a whole number of {per}-byte vectors: the "
                        "blob is corrupt")
    n = len(data) // per
    index = torch.tensor(struct.unpack_from(f"<{n}I", data), dtype=torch.int64)
    if n and (int(index[-1]) >= layers * tokens or bool((index[1:] <= index[:-1]).any())):
        raise BlobError(f"the outlier section's indices are not increasing within {layers} layers x {tokens} coded "
                        "tokens: the blob is corrupt or forged")
    if not n:
        return index, torch.empty(0, heads, width, dtype=dtype)
    return index, sinks_from_int8(data[4 * n:], (n, heads, 1, width), dtype)[:, :, 0]


def scatter(index: torch.Tensor, vectors: torch.Tensor, out: torch.Tensor) -> None:
    """Write vectors (n, H, W) over out (L, H, coded_tokens, W) at their indices."""
    tokens = out.shape[2]
    layer, token = (index // tokens).to(out.device), (index % tokens).to(out.device)
    out[layer, :, token] = vectors.to(device=out.device, dtype=out.dtype)
