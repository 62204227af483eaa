"""Additive calibration statistics: per stream and group, count, float64 sum, float64 Gram matrix.

Gram matrices are accumulated on their upper triangle only (row tiles against the columns to their
right, float32 per batch folded into float64) and stored on disk as the packed upper triangle.
On CUDA, rows captured from a bfloat16/float16 model are multiplied in TF32: its 10-bit mantissa
holds bf16 cache values exactly and rounds RoPE-removed keys by less than the bf16 cache already did.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvtc.artifacts.schema import STREAMS
from kvtc.workers.capture import CapturedKV, CaptureSettings

FORMAT = "kvtc-stats/1"
_TILES = 8


@dataclass
class _Moments:
    n: int
    sum: torch.Tensor  # (p,) float64
    gram: torch.Tensor  # (p, p) float64, upper triangle valid (lower part holds zeros or garbage)


def _triu_mask(p: int, device: torch.device) -> torch.Tensor:
    return torch.ones(p, p, dtype=torch.bool, device=device).triu()


def _upper_gram_update(gram: torch.Tensor, x: torch.Tensor, tf32: bool = False) -> None:
    """gram (p,p) f64 += upper part of x^T x for x (N, p) float32, in ~_TILES row tiles."""
    p = x.shape[1]
    step = max(64, -(-p // _TILES))
    xt = x.t()
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        for a in range(0, p, step):
            b = min(a + step, p)
            gram[a:b, a:].add_(xt[a:b] @ x[:, a:])
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


@dataclass
class CalibrationStats:
    """Moments of captured rows for one model fingerprint and one set of capture settings."""

    fingerprint: dict[str, Any]
    settings: dict[str, Any]
    groups: list[tuple[int, int]]
    dims: list[int]
    shard_ids: tuple[str, ...] = ()
    moments: dict[tuple[str, int], _Moments] = field(default_factory=dict)

    @classmethod
    def new(cls, fingerprint: dict[str, Any], settings: CaptureSettings, shard_ids: tuple[str, ...] = ()) -> "CalibrationStats":
        """Empty statistics; group g has (b - a) * kv_heads * head_dim features for its layers [a, b)."""
        groups = settings.group_layers(int(fingerprint["num_layers"]))
        width = int(fingerprint["num_kv_heads"]) * int(fingerprint["head_dim"])
        dims = [(b - a) * width for a, b in groups]
        return cls(dict(fingerprint), settings.to_dict(), groups, dims, tuple(shard_ids))

    def _get(self, stream: str, group: int, device: torch.device) -> _Moments:
        """The moments of (stream, group), created empty if absent, on `device` when updating."""
        if (stream, group) not in self.moments:
            p = self.dims[group]
            with torch.inference_mode(False):  # normal tensors: updatable inside and outside inference mode
                self.moments[(stream, group)] = _Moments(
                    0, torch.zeros(p, dtype=torch.float64, device=device),
                    torch.zeros(p, p, dtype=torch.float64, device=device),
                )
        return self.moments[(stream, group)]

    def update(self, captured: CapturedKV) -> None:
        """Fold captured rows (N, p) of both streams into every group."""
        for stream in STREAMS:
            x = getattr(captured, stream)
            if x.dim() != 2 or x.shape[1] != sum(self.dims):
                raise ValueError(f"captured {stream} must be (N, {sum(self.dims)}), got {tuple(x.shape)}")
            x = x.to(torch.float32)
            tf32 = x.is_cuda and captured.source_dtype in ("bfloat16", "float16")
            start = 0
            for g, p in enumerate(self.dims):
                m = self._get(stream, g, x.device)
                if m.gram.device != x.device:
                    m.sum, m.gram = m.sum.to(x.device), m.gram.to(x.device)
                xg = x[:, start : start + p]
                m.n += x.shape[0]
                m.sum += xg.sum(0, dtype=torch.float64)
                _upper_gram_update(m.gram, xg, tf32)
                start += p

    def stream(self, stream: str, group: int = 0) -> tuple[int, np.ndarray, np.ndarray]:
        """-> (n, sum (p,) float64, gram (p, p) float64 symmetric) as numpy arrays."""
        if stream not in STREAMS or not 0 <= group < len(self.dims):
            raise ValueError(f"no stream {stream!r} group {group}; streams {STREAMS}, groups 0..{len(self.dims) - 1}")
        m = self._get(stream, group, torch.device("cpu"))
        upper = m.gram.triu()
        full = upper + upper.triu(1).t()
        return m.n, m.sum.cpu().numpy(), full.cpu().numpy()

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

    def merge(self, other: "CalibrationStats") -> "CalibrationStats":
        """A new CalibrationStats holding the sum of both (same model, same settings, disjoint shards)."""
        self._check_compatible(other)
        out = CalibrationStats(dict(self.fingerprint), dict(self.settings), list(self.groups), list(self.dims),
                               self.shard_ids + other.shard_ids)
        for key in set(self.moments) | set(other.moments):
            parts = [s.moments[key] for s in (self, other) if key in s.moments]
            dev = parts[0].sum.device
            out.moments[key] = _Moments(
                sum(m.n for m in parts),
                sum(m.sum.to(dev) for m in parts),
                sum(m.gram.triu().to(dev) for m in parts),
            )
        return out

    def metadata(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "fingerprint": self.fingerprint,
            "settings": self.settings,
            "groups": [list(g) for g in self.groups],
            "dims": self.dims,
            "shard_ids": list(self.shard_ids),
            "counts": {f"{s}/{g}": m.n for (s, g), m in sorted(self.moments.items())},
        }

    def to_bytes(self) -> bytes:
        """safetensors bytes: per stream/group `sum` and packed upper-triangle `gram_triu`, JSON metadata."""
        from safetensors.torch import save

        tensors = {}
        for (s, g), m in sorted(self.moments.items()):
            gram = m.gram.cpu()
            tensors[f"{s}/{g}/sum"] = m.sum.cpu().contiguous()
            tensors[f"{s}/{g}/gram_triu"] = gram[_triu_mask(gram.shape[0], gram.device)].contiguous()
        return save(tensors, metadata={"kvtc_stats": json.dumps(self.metadata(), sort_keys=True)})

    def save(self, path_or_uri: str | os.PathLike) -> int:
        """Write to a local path (atomically) or an fsspec URI; returns the number of bytes written."""
        import fsspec

        data = self.to_bytes()
        target = os.fspath(path_or_uri)
        if "://" not in target:
            os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)
            tmp = f"{target}.tmp-{os.getpid()}"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, target)
        else:
            with fsspec.open(target, "wb") as f:
                f.write(data)
        return len(data)

    @classmethod
    def from_bytes(cls, data: bytes) -> "CalibrationStats":
        from safetensors.torch import load

        (header_len,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + header_len])
        meta = json.loads(header.get("__metadata__", {}).get("kvtc_stats", "null") or "null")
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise ValueError(f"not a KVTC statistics file (expected format {FORMAT!r})")
        tensors = load(data)
        out = cls(meta["fingerprint"], meta["settings"], [tuple(g) for g in meta["groups"]], list(meta["dims"]),
                  tuple(meta["shard_ids"]))
        for key, n in meta["counts"].items():
            s, g = key.split("/")
            p = out.dims[int(g)]
            gram = torch.zeros(p, p, dtype=torch.float64)
            gram[_triu_mask(p, gram.device)] = tensors[f"{s}/{g}/gram_triu"]
            out.moments[(s, int(g))] = _Moments(int(n), tensors[f"{s}/{g}/sum"], gram)
        return out

    @classmethod
    def load(cls, path_or_uri: str | os.PathLike) -> "CalibrationStats":
        import fsspec

        with fsspec.open(os.fspath(path_or_uri), "rb") as f:
            return cls.from_bytes(f.read())
