"""Additive calibration statistics: per stream and group, count, float64 sum, float64 Gram matrix.

Gram matrices live as their packed upper triangle (`kvtc.workers.triangle`), in memory and on disk:
p (p + 1) / 2 float64 values, half a full matrix. They are accumulated in row tiles against the
columns to their right, float32 per batch folded into float64. On CUDA, rows captured from a
bfloat16/float16 model are multiplied in TF32: its 10-bit mantissa holds bf16 cache values exactly
and rounds RoPE-removed keys by less than the bf16 cache already did.

Stored form: `kvtc.workers.stats_file` (raw arrays, JSON footer, sha256 per tensor, verified on read).
"""
from __future__ import annotations

import io
import os
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import fsspec
import numpy as np
import torch
from fsspec.implementations.local import LocalFileSystem

from kvtc.artifacts.local_files import atomic_write
from kvtc.artifacts.safe_io import open_untrusted
from kvtc.artifacts.groups import FeatureGroup, group_columns, groups_json, parse_groups, stream_dims
from kvtc.artifacts.schema import STREAMS
from kvtc.kernels.codec.layers import layers_of
from kvtc.workers.capture import CapturedKV, CaptureSettings
from kvtc.workers.stats_file import CorruptStats, DegenerateStats, read_footer, read_tensor, write_stats
from kvtc.workers.triangle import add_upper_rows, packed_len, row_offset, symmetric
from kvtc.kernels.codec.layers import cached_layers

FORMAT = "kvtc-stats/2"
_TILE_ROWS = 1024


@dataclass
class _Moments:
    n: int
    sum: torch.Tensor  # (p,) float64
    gram: torch.Tensor  # (p (p + 1) / 2,) float64, packed upper triangle


def _upper_gram_update(packed: torch.Tensor, x: torch.Tensor, tf32: bool = False) -> None:
    """packed (p(p+1)/2,) f64 += upper part of x^T x for x (N, p) float32, in row tiles."""
    p = x.shape[1]
    step = min(_TILE_ROWS, max(64, -(-p // 8)))
    xt = x.t()
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        for a in range(0, p, step):
            b = min(a + step, p)
            add_upper_rows(packed, p, a, xt[a:b] @ x[:, a:])
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


def _check_variances(name: str, tensor: str, packed: np.ndarray, p: int) -> None:
    """DegenerateStats unless every variance (the packed Gram's diagonal: sums of squares) is >= 0."""
    diagonal = packed[row_offset(p, np.arange(p))]
    if diagonal.size and float(diagonal.min()) < 0:
        raise DegenerateStats(name, tensor, f"holds a negative sum of squares at feature {int(diagonal.argmin())} "
                              f"({float(diagonal.min()):.3g})")


# A Fisher sum adds squares of float32 (or narrower) gradients, widened to float64: a nonzero diagonal entry is at
# least the square of float32's smallest subnormal (2^-149, halved by the RoPE pair mean) and at most the square of
# its largest finite value per token. Outside that no capture wrote it: forged, or damaged.
FISHER_LEAST = 2.0 ** -300
FISHER_MOST_PER_TOKEN = 2.0 ** 256


def _fisher_out_of_range(t: np.ndarray, diagonal: np.ndarray, tokens: int) -> str | None:
    """Where a Fisher sum (`t`, its `diagonal`) lies outside what any capture of `tokens` tokens can sum, or None."""
    most = FISHER_MOST_PER_TOKEN * max(int(tokens), 1)
    big = np.abs(t)
    if big.size and float(big.max()) > most:
        at = np.unravel_index(int(big.argmax()), big.shape)
        return (f"holds {float(t[at]):.3g} at (layer slot, KV head, ...) {tuple(int(i) for i in at)}, beyond any sum "
                f"of {tokens} squared float32 gradients ({most:.3g})")
    live = diagonal[diagonal != 0]
    if live.size and float(live.min()) < FISHER_LEAST:
        at = np.unravel_index(int(np.where(diagonal != 0, diagonal, np.inf).argmin()), diagonal.shape)
        return (f"holds {float(diagonal[at]):.3g} at (layer slot, KV head, ...) {tuple(int(i) for i in at)}, below the "
                f"square of float32's smallest gradient ({FISHER_LEAST:.3g})")
    return None


FISHER_SUMS = ("sensitivity_keys", "sensitivity_values", "probe_keys", "probe_values")
POSITION_COUNTS = ("fisher_positions", "probe_positions")  # (1,) each: the positions the fresh and probe sums hold


def _degenerate_metric(key: str, t: np.ndarray, tokens: int = 1) -> str | None:
    """What makes an attention-metric sum unusable, or None: every (layer, KV head) block needs a positive
    weight (keys: query second moments, values: the output projection's Gram, concentration) and no negative
    variance; the whitening divides by it. A Fisher sum (the KL sensitivity) needs no negative information and
    every value within what `tokens` tokens of float32 gradients can sum (`_fisher_out_of_range`)."""
    if key == "reach":  # zero where a head attends to its sinks only: a weight, never a divisor
        return "holds a negative energy" if t.size and float(t.min()) < 0 else None
    if key in POSITION_COUNTS:  # how many positions a Fisher sum holds: a count
        return None if t.size and float(t.min()) >= 0 else "holds a negative count of positions"
    if key in FISHER_SUMS:  # a Fisher information: a weight (kvtc.pipeline.fit.metric clamps it)
        diagonal = t if key in ("sensitivity_keys", "probe_keys") else np.diagonal(t, axis1=-2, axis2=-1)
        if diagonal.size and float(diagonal.min()) < 0:
            return "holds a negative Fisher information"
        return _fisher_out_of_range(t, diagonal, tokens)
    diagonal = t if key in ("keys", "concentration") else np.diagonal(t, axis1=-2, axis2=-1)
    weight = diagonal if key == "concentration" else diagonal.sum(axis=-1)
    if diagonal.size and float(diagonal.min()) < 0:
        at = np.unravel_index(int(diagonal.argmin()), diagonal.shape)
        return f"holds a negative variance at (layer slot, KV head, ...) {tuple(int(i) for i in at)}"
    if weight.size and float(weight.min()) <= 0:
        at = np.unravel_index(int(weight.argmin()), weight.shape)
        return f"is zero for (layer slot, KV head) {tuple(int(i) for i in at)}"
    return None


@dataclass
class CalibrationStats:
    """Moments of captured rows for one model fingerprint and one set of capture settings;
    `shard_ids` lists the shards folded in, in fold order."""

    fingerprint: dict[str, Any]
    settings: dict[str, Any]
    groups: list[FeatureGroup]
    dims: list[int]
    shard_ids: tuple[str, ...] = ()
    moments: dict[tuple[str, int], _Moments] = field(default_factory=dict)
    metric: dict[str, torch.Tensor] = field(default_factory=dict)  # attention objective: see attention_metric
    metric_tokens: int = 0

    @classmethod
    def new(cls, fingerprint: dict[str, Any], settings: CaptureSettings, shard_ids: tuple[str, ...] = ()) -> "CalibrationStats":
        """Empty statistics; group g has layers x its KV heads x head_dim features (`dims`: the keys stream's;
        an MLA model's values stream, its rope key, is narrower: see `stream_dims`)."""
        groups = settings.group_layers(layers_of(fingerprint), int(fingerprint["num_kv_heads"]))
        dims = [g.dim(int(fingerprint["num_kv_heads"]), int(fingerprint["head_dim"])) for g in groups]
        return cls(dict(fingerprint), settings.to_dict(), groups, dims, tuple(shard_ids))

    def stream_dims(self, stream: str) -> list[int]:
        """Per group, its features in `stream` (the keys' `dims`, or the values' own widths)."""
        if stream == "keys":
            return self.dims
        heads, dim = stream_dims(self.fingerprint)[stream]
        return [g.dim(heads, dim) for g in self.groups]

    def _get(self, stream: str, group: int, device: torch.device) -> _Moments:
        """The moments of (stream, group), created empty if absent, on `device` when updating."""
        if (stream, group) not in self.moments:
            p = self.stream_dims(stream)[group]
            with torch.inference_mode(False):  # normal tensors: updatable inside and outside inference mode
                self.moments[(stream, group)] = _Moments(
                    0, torch.zeros(p, dtype=torch.float64, device=device),
                    torch.zeros(packed_len(p), dtype=torch.float64, device=device),
                )
        return self.moments[(stream, group)]

    def update(self, captured: CapturedKV) -> None:
        """Fold captured rows (N, p) of both streams into every group."""
        for stream in STREAMS:
            x, want = getattr(captured, stream), sum(self.stream_dims(stream))
            if x.dim() != 2 or x.shape[1] != want:
                raise ValueError(f"captured {stream} must be (N, {want}), got {tuple(x.shape)}")
            x = x.to(torch.float32)
            tf32 = x.is_cuda and captured.source_dtype in ("bfloat16", "float16")
            for g, cols in enumerate(self._columns(stream)):
                m = self._get(stream, g, x.device)
                if m.gram.device != x.device:
                    m.sum, m.gram = m.sum.to(x.device), m.gram.to(x.device)
                xg = x[:, cols if isinstance(cols, slice) else torch.as_tensor(cols, device=x.device)]
                m.n += x.shape[0]
                m.sum += xg.sum(0, dtype=torch.float64)
                _upper_gram_update(m.gram, xg.contiguous(), tf32)
        if captured.metric is not None:
            self._add_metric(captured.metric, captured.metric_tokens)

    def _add_metric(self, metric: dict[str, torch.Tensor], tokens: int) -> None:
        """Add attention-metric sums (kvtc.workers.attention_metric) over `tokens` query tokens."""
        for name, t in metric.items():
            t = t.detach().to(device="cpu", dtype=torch.float64)
            if name in self.metric and self.metric[name].shape != t.shape:
                raise ValueError(f"attention-metric {name} sums of shape {tuple(t.shape)} do not add to "
                                 f"{tuple(self.metric[name].shape)}")
            self.metric[name] = self.metric[name] + t if name in self.metric else t.clone()
        self.metric_tokens += int(tokens)

    def _columns(self, stream: str = "keys") -> list:
        """Each group's columns in a captured row of `stream` (coded layers ascending, KV head, head_dim)."""
        return group_columns(self.groups, *stream_dims(self.fingerprint)[stream])

    def packed(self, stream: str, group: int = 0) -> tuple[int, np.ndarray, np.ndarray]:
        """-> (n, sum (p,) float64, packed upper-triangle Gram (p(p+1)/2,) float64), numpy views."""
        self._check_key(stream, group)
        m = self._get(stream, group, torch.device("cpu"))
        return m.n, m.sum.cpu().numpy(), m.gram.cpu().numpy()

    def stream(self, stream: str, group: int = 0) -> tuple[int, np.ndarray, np.ndarray]:
        """-> (n, sum (p,) float64, gram (p, p) float64 symmetric) as numpy arrays."""
        n, s, packed = self.packed(stream, group)
        return n, s, symmetric(packed, self.stream_dims(stream)[group])

    def _check_key(self, stream: str, group: int) -> None:
        if stream not in STREAMS or not 0 <= group < len(self.dims):
            raise ValueError(f"no stream {stream!r} group {group}; streams {STREAMS}, groups 0..{len(self.dims) - 1}")

    def _check_compatible(self, other: "CalibrationStats") -> None:
        mine = {k: v for k, v in self.fingerprint.items() if k != "spec"}
        theirs = {k: v for k, v in other.fingerprint.items() if k != "spec"}
        if mine != theirs:
            diff = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
            raise ValueError(f"cannot merge statistics of different models (fingerprints differ in {diff})")
        if self.settings != other.settings:
            raise ValueError(f"cannot merge statistics of different capture settings: {self.settings} vs {other.settings}")
        overlap = set(self.shard_ids) & set(other.shard_ids)
        if overlap:
            raise ValueError(f"shards {sorted(overlap)[:5]} would be counted twice; each shard must be merged once")

    def fold(self, other: "CalibrationStats") -> None:
        """Add `other` into this object in place (same model, same settings, disjoint shards)."""
        self._check_compatible(other)
        for key in sorted(other.moments):
            src = other.moments[key]
            dst = self._get(key[0], key[1], src.sum.device)
            dst.n += src.n
            dst.sum += src.sum.to(dst.sum.device)
            dst.gram += src.gram.to(dst.gram.device)
        if other.metric:
            self._add_metric(other.metric, other.metric_tokens)
        self.shard_ids = self.shard_ids + other.shard_ids

    def merge(self, other: "CalibrationStats") -> "CalibrationStats":
        """A new CalibrationStats holding the sum of both (same model, same settings, disjoint shards)."""
        self._check_compatible(other)
        out = CalibrationStats(dict(self.fingerprint), dict(self.settings), list(self.groups), list(self.dims))
        out.fold(self)
        out.fold(other)
        return out

    def metadata(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "fingerprint": self.fingerprint,
            "settings": self.settings,
            "groups": groups_json(self.groups),
            "dims": self.dims,
            "shard_ids": list(self.shard_ids),
            "counts": {f"{s}/{g}": m.n for (s, g), m in sorted(self.moments.items())},
            **({"metric": sorted(self.metric), "metric_tokens": self.metric_tokens} if self.metric else {}),
        }

    def write_to(self, f: BinaryIO, hmac_key: bytes | None = None) -> int:
        """Stream to an open binary file: per stream/group `sum` and packed `gram_triu`; returns bytes.
        hmac_key: the shard store's key, authenticating the object (see stats_file)."""
        tensors: dict[str, np.ndarray] = {}
        for (s, g), m in sorted(self.moments.items()):
            tensors[f"{s}/{g}/sum"] = m.sum.cpu().numpy()
            tensors[f"{s}/{g}/gram_triu"] = m.gram.cpu().numpy()
        for name, t in sorted(self.metric.items()):
            tensors[f"metric/{name}"] = t.cpu().numpy()
        return write_stats(f, tensors, self.metadata(), hmac_key)

    def to_bytes(self) -> bytes:
        buffer = io.BytesIO()
        self.write_to(buffer)
        return buffer.getvalue()

    def save(self, path_or_uri: str | os.PathLike) -> int:
        """Write to a local path (atomically) or an fsspec URI; returns the number of bytes written."""
        target = os.fspath(path_or_uri)
        if "://" not in target:
            return atomic_write(target, self.write_to)
        with fsspec.open(target, "wb") as f:
            return self.write_to(f)

    @staticmethod
    def read_metadata(f: BinaryIO, name: str, hmac_key: bytes | None = None) -> dict[str, Any]:
        """The metadata of a stored object (shard ids, counts, ...) without reading its arrays."""
        meta = read_footer(f, name, hmac_key)["metadata"]
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise CorruptStats(name, f"not a KVTC statistics object (expected format {FORMAT!r})")
        if not isinstance(meta.get("shard_ids"), list) or not all(isinstance(x, str) for x in meta["shard_ids"]):
            raise CorruptStats(name, "its shard list is not a list of shard ids")
        return meta

    @classmethod
    def read_from(cls, f: BinaryIO, name: str, keys: list[tuple[str, int]] | None = None,
                  hmac_key: bytes | None = None) -> "CalibrationStats":
        """Read an object (only the (stream, group) `keys` when given), verifying every checksum; any
        malformed content is a CorruptStats naming it."""
        footer = read_footer(f, name, hmac_key)
        try:
            return cls._from_footer(f, name, footer, keys)
        except CorruptStats:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
            raise CorruptStats(name, f"malformed metadata ({type(exc).__name__}: {exc})") from None

    @classmethod
    def _from_footer(cls, f: BinaryIO, name: str, footer: dict, keys: list[tuple[str, int]] | None
                     ) -> "CalibrationStats":
        meta = footer["metadata"]
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise CorruptStats(name, f"not a KVTC statistics object (expected format {FORMAT!r})")
        out = cls(meta["fingerprint"], meta["settings"], parse_groups(meta["groups"]), list(meta["dims"]),
                  tuple(meta["shard_ids"]))
        for key, n in meta["counts"].items():
            s, g = key.split("/")
            if keys is not None and (s, int(g)) not in keys:
                continue
            total = torch.from_numpy(read_tensor(f, footer, f"{s}/{g}/sum", name))
            gram = torch.from_numpy(read_tensor(f, footer, f"{s}/{g}/gram_triu", name))
            p = out.stream_dims(s)[int(g)]
            if gram.shape != (packed_len(p),) or total.shape != (p,) \
                    or gram.dtype != torch.float64 or total.dtype != torch.float64:
                raise CorruptStats(name, f"{key} sum {tuple(total.shape)} / Gram {tuple(gram.shape)} are not float64 "
                                   f"arrays for p={p}")
            _check_variances(name, f"{s}/{g}/gram_triu", gram.numpy(), p)
            out.moments[(s, int(g))] = _Moments(int(n), total, gram)
        if meta.get("metric"):
            out._read_metric(f, footer, name, meta)
        return out

    def _read_metric(self, f: BinaryIO, footer: dict, name: str, meta: dict) -> None:
        """The attention-metric sums, checked against the model's coded layers, KV heads and head_dim."""

        shape = (len(cached_layers(layers_of(self.fingerprint))), int(self.fingerprint["num_kv_heads"]),
                 int(self.fingerprint["head_dim"]))
        want = {"keys": shape, "values": shape + shape[-1:], "concentration": shape[:2], "reach": shape[:2],
                "sensitivity_keys": shape, "sensitivity_values": shape + shape[-1:], "fisher_positions": (1,),
                "probe_keys": shape, "probe_values": shape + shape[-1:], "probe_positions": (1,)}
        for later in [k for k in want if k not in ("keys", "values")]:
            if later not in meta["metric"]:
                del want[later]  # captured before the attention concentration (or the keys' reach, the positions'
                # counts, the copy probe) was, or with --sensitivity 0, or in totals without the job's probe shard
        for together in (("sensitivity_keys", "sensitivity_values"), ("probe_keys", "probe_values", "probe_positions")):
            if len({k in want for k in together}) > 1:
                raise CorruptStats(name, f"attention-metric entries {meta['metric']} hold some of {list(together)} "
                                   "without the others")
        if "probe_keys" in want and "fisher_positions" not in want:
            raise CorruptStats(name, f"attention-metric entries {meta['metric']} hold a copy probe without the count of "
                               "fresh positions it is weighed against")
        if sorted(meta["metric"]) != sorted(want) or not isinstance(meta.get("metric_tokens"), int) \
                or meta["metric_tokens"] < 1:
            raise CorruptStats(name, f"attention-metric entries {meta['metric']} / tokens {meta.get('metric_tokens')!r} "
                               f"are not {sorted(want)} over >= 1 token")
        for key, shp in want.items():
            t = torch.from_numpy(read_tensor(f, footer, f"metric/{key}", name))
            if t.shape != shp or t.dtype != torch.float64 or not bool(torch.isfinite(t).all()):
                raise CorruptStats(name, f"attention-metric {key} is {tuple(t.shape)} {t.dtype}, expected finite "
                                   f"float64 {shp}")
            problem = _degenerate_metric(key, t.numpy(), int(meta["metric_tokens"]))
            if problem:
                raise DegenerateStats(name, f"metric/{key}", problem)
            self.metric[key] = t
        self.metric_tokens = int(meta["metric_tokens"])

    @classmethod
    def from_bytes(cls, data: bytes, name: str = "<bytes>") -> "CalibrationStats":
        return cls.read_from(io.BytesIO(data), name)

    @classmethod
    def load(cls, path_or_uri: str | os.PathLike) -> "CalibrationStats":
        fs, path = fsspec.core.url_to_fs(os.fspath(path_or_uri))
        handle, _ = open_untrusted(fs, isinstance(fs, LocalFileSystem), path, "statistics file")  # no FIFO, no link
        with handle as f:
            return cls.read_from(f, os.fspath(path_or_uri))
