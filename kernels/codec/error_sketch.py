"""Each (token, layer) vector's coding error without reconstructing the coded middle: the outlier stage's measure.

Outlier selection (kernels/codec/outliers.py) needs the squared error ||x_hat - x||^2 of every (token, layer)
vector of a stream, and a basis mixes layers, so the exact errors take a whole reconstruction: z_hat (n, k) times
the decoder (k x p), as much work as the projection that coded the middle. A sketch S_l (w, r) of Gaussian entries
of variance 1/r per layer (w = the layer's features, r = SKETCH_ROWS) keeps the expected squared norm of any
vector, and sketching the decoder once per codec (G = S^T D, k x L r) turns the error of every vector into

    ||S_l^T (x_l - x_hat_l)||^2  with  S_l^T x_hat_l = z_hat G_l:  n k L r work instead of n k p (p = L w)

an estimate of relative spread sqrt(2 / r) (25% at r = 32) for a sixth of the work at the embedded model's 192
features a layer. The vectors an estimate puts above CANDIDATE_SHARE of the selection's threshold are measured
exactly (their layer's rows of the decoder only), so the selection is the exact one unless an estimate falls below
half its value (probability about 1% for a vector right at the threshold, 1e-4 at 1.6x it). The threshold's
"typical" error is the estimated total: the same sketch serves every token, so it is within about sqrt(2 / (r L w))
of the exact one (0.3% here) where the errors spread over the features, and a vector that close to the threshold
may go either way.

The sketch is drawn from a fixed seed, so an encode is deterministic; the decoder's sketch is computed once per
decoding matrix (for a ratio's leading columns of a wider basis, once for the basis: a view of it serves).

Shapes: feat (n, L w) one stream's centred features; coefficients, per group, z_hat (n, k_g); decoders, per group,
(p_g, k_g) over the group's feature columns.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from kvtc.kernels.codec import outliers
from kvtc.kernels.codec.basis_product import project

SKETCH_ROWS = 32  # r: the estimate's relative spread is sqrt(2 / r)
CANDIDATE_SHARE = 0.5  # vectors estimated above this share of the threshold are measured exactly
SEED = 0x6B767463
BLOCK_BYTES = 1 << 25  # the float32 coefficients of one block of tokens: the stage's transient


def block_tokens(kept: int) -> int:
    """Tokens of one block whose coefficients (`kept` per token, every group) fit BLOCK_BYTES."""
    return max(1, BLOCK_BYTES // (4 * max(1, kept)))


_SKETCHES: dict[tuple, torch.Tensor] = {}


def layer_sketch(layers: int, width: int, device: torch.device, rows: int = SKETCH_ROWS) -> torch.Tensor:
    """S (layers, width, rows) float32, N(0, 1 / rows) entries from the fixed seed: the same on every machine."""
    key = (layers, width, rows, str(device))
    if key not in _SKETCHES:
        gen = torch.Generator().manual_seed(SEED)
        _SKETCHES[key] = (torch.randn(layers, width, rows, generator=gen) / math.sqrt(rows)).to(device)
    return _SKETCHES[key]


def _rows(cols: slice | torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.arange(cols.start, cols.stop, device=device) if isinstance(cols, slice) else cols.to(device)


class ErrorSketch:
    """One stream's decoders sketched for one codec on one device: per group its columns' layers and G_g (k_g, L r)."""

    def __init__(self, layers: int, width: int, cols: Sequence[slice | torch.Tensor], decoders: Sequence[torch.Tensor],
                 device: torch.device, rows: int = SKETCH_ROWS) -> None:
        self.layers, self.width, self.r = layers, width, rows
        self.s = layer_sketch(layers, width, device, rows)
        self.cols = [_rows(c, device) for c in cols]
        self.decoders = list(decoders)
        self.rows_of = [_layer_rows(c, width) for c in self.cols]  # per group {layer: (its rows, their places)}
        self.sketched = [_sketched(d, c, rows_of, self.s) for d, c, rows_of in zip(self.decoders, self.cols, self.rows_of)]

    def estimate(self, feat: torch.Tensor, coefficients: Sequence[torch.Tensor]) -> torch.Tensor:
        """feat (n, L w), z_hat per group -> estimated squared error of each (token, layer) vector (n, L) float32."""
        n = feat.shape[0]
        diff = torch.einsum("nlw,lwr->nlr", feat.float().reshape(n, self.layers, self.width), self.s)
        diff = diff.reshape(n, -1)
        for z, g in zip(coefficients, self.sketched):
            diff -= project(z, g[: z.shape[1]])
        return diff.reshape(n, self.layers, self.r).pow(2).sum(-1)

    def exact(self, feat: torch.Tensor, coefficients: Sequence[torch.Tensor], tokens: torch.Tensor, layer: int
              ) -> torch.Tensor:
        """The exact squared errors of layer `layer`'s vectors of `tokens` (m,) -> (m,) float32."""
        lo = layer * self.width
        rec = torch.zeros(len(tokens), self.width, dtype=torch.float32, device=feat.device)
        for z, d, rows_of in zip(coefficients, self.decoders, self.rows_of):
            if layer in rows_of:
                rows, places = rows_of[layer]
                rec[:, places] = z[tokens].float() @ d[rows, : z.shape[1]].float().T
        return (rec - feat[tokens, lo:lo + self.width].float()).pow(2).sum(-1)


def _layer_rows(cols: torch.Tensor, width: int) -> dict[int, tuple[slice | torch.Tensor, slice | torch.Tensor]]:
    """A group's feature columns -> {layer: (the decoder's rows in that layer, their places in the layer's
    features)}, each a slice where contiguous (a view of the decoder, not a copy)."""
    owner = torch.div(cols, width, rounding_mode="floor")
    out = {}
    for layer in torch.unique(owner).tolist():
        rows = torch.nonzero(owner == layer).flatten()
        places = cols[rows] - layer * width
        if len(rows) == int(rows[-1] - rows[0]) + 1:
            rows = slice(int(rows[0]), int(rows[-1]) + 1)
        if len(places) == int(places[-1] - places[0]) + 1 and bool((places[1:] > places[:-1]).all()):
            places = slice(int(places[0]), int(places[-1]) + 1)
        out[layer] = rows, places
    return out


def _sketched(decoder: torch.Tensor, cols: torch.Tensor, rows_of: dict, s: torch.Tensor) -> torch.Tensor:
    """G (k_full, L r) = the sketch's rows for `cols` (p_g, L r, block-diagonal by layer; `rows_of` their layers,
    `_layer_rows`) transposed times the decoder, for every column of the matrix `decoder` leads (cached on that
    matrix, in its dtype)."""
    root = decoder if decoder._base is None else decoder._base
    if not (root.dim() == 2 and root.shape[0] == decoder.shape[0] and root.stride() == decoder.stride()
            and root.storage_offset() == decoder.storage_offset()):
        root = decoder
    cache = root.__dict__.setdefault("_kvtc_error_sketch", {})
    key = (tuple(s.shape), str(s.device), tuple(cols.tolist()))
    if key not in cache:
        layers, _, r = s.shape
        g = torch.zeros(root.shape[1], layers * r, dtype=torch.float32, device=root.device)
        for layer, (rows, places) in rows_of.items():
            g[:, layer * r:(layer + 1) * r] = root[rows].float().T @ s[layer][places]
        cache[key] = g.to(root.dtype)
    return cache[key]


def vector_errors(sketch: ErrorSketch, feat: torch.Tensor, mean: torch.Tensor, coefficients, blocks, factor: float
                  ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per token block [a, b) of `blocks`, (squared error, squared norm) of each (token, layer) vector, both (n, L)
    float32 (outliers.errors' form): estimated, and exact wherever the estimate is above CANDIDATE_SHARE of the
    selection's threshold at `factor` (outliers.select). coefficients(a, b) -> z_hat per group of those tokens."""
    est, norms, kept = [], [], None
    for a, b in blocks:
        z = coefficients(a, b)
        kept = z if len(blocks) == 1 else None  # one block: its coefficients read once
        est.append(sketch.estimate(feat[a:b], z))
        norms.append(outliers.norms(feat[a:b], mean, sketch.layers))
    tiny = torch.finfo(torch.float32).tiny
    typical = float(sum(e.sum() for e in est) / max(float(sum(n.sum() for n in norms)), tiny))
    bar = CANDIDATE_SHARE * factor * factor * typical
    for (a, b), e, n in zip(blocks, est, norms):
        candidates = e > bar * n.clamp_min(tiny)
        if not bool(candidates.any()):
            continue
        z = kept or coefficients(a, b)
        for layer in torch.nonzero(candidates.any(0)).flatten().tolist():
            tokens = torch.nonzero(candidates[:, layer]).flatten()
            e[tokens, layer] = sketch.exact(feat[a:b], z, tokens, layer)
    return list(zip(est, norms))


def reference_errors(sketch: ErrorSketch, feat: torch.Tensor, mean: torch.Tensor, coefficients, blocks, factor: float
                     ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`vector_errors` in plain torch, every vector exact from each block's whole reconstruction (the stage before
    the sketch): the reference the tests and bench/outlier_sketch.py compare against. `factor` is unused."""
    out = []
    for a, b in blocks:
        rec = torch.zeros(b - a, feat.shape[1], dtype=torch.float32, device=feat.device)
        for cols, d, z in zip(sketch.cols, sketch.decoders, coefficients(a, b)):
            rec[:, cols] = z @ d[:, : z.shape[1]].float().T
        out.append(outliers.errors(feat[a:b], rec, mean, sketch.layers))
    return out
