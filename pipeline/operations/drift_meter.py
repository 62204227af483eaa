"""Measure a published artifact on raw KV rows: rebuild its bases and allocations, sample fresh
rows of a corpus in-process with the artifact's capture settings, and accumulate errors.

Shared by `kvtc drift` (fresh sample) and `kvtc recalibrate` (parent's held-out rows).
"""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from kvtc.artifacts.blocks import Block
from kvtc.artifacts.calibration import CalibrationRecord
from kvtc.artifacts.groups import group_columns, stream_dims
from kvtc.artifacts.schema import STREAMS
from kvtc.pipeline.evaluation.metrics import evaluate
from kvtc.pipeline.fit.allocator import Allocation
from kvtc.pipeline.fit.metric import Whitening, decode_root, metric_file
from kvtc.pipeline.fit.pca import Basis
from kvtc.pipeline.job.shards import make_shards
from kvtc.workers.capture import CaptureSettings, capture_kv, check_seq_len
from kvtc.workers.objective import MSE, recorded_objective


def total_variances(art) -> dict[tuple[str, int], float]:
    """{(stream, group): trace of the calibration covariance}, from the stored full spectrum."""
    out: dict[tuple[str, int], float] = {}
    if "spectrum" in art.curves():
        for row in art.curve("spectrum"):
            key = (row["stream"], int(row["group"]))
            out[key] = out.get(key, 0.0) + float(row["eigenvalue"])
    return out


def metric_whitenings(art) -> dict[tuple[str, int], Whitening]:
    """An --objective attention artifact's whitening per (stream, group) ({} for the cache's own error)."""
    if not recorded_objective(art.manifest["calibration"]).captures_metric:
        return {}
    dims = stream_dims(art.manifest["model"])
    return {(stream, g): decode_root(str(art.file(metric_file(stream, g))), int(art.basis(stream, g)[0].shape[0]),
                                     dims[stream][1])
            for stream in STREAMS for g in range(len(art.groups()))}


def artifact_models(art) -> dict[tuple[str, int], tuple[Basis, list[Allocation]]]:
    """{(stream, group): (Basis, allocations in ratio order)} rebuilt from a pulled Artifact; an attention
    artifact's bases in its metric's space (orthonormal there: rows are whitened before they meet them)."""
    tv = total_variances(art)
    rec = CalibrationRecord.from_manifest(art.manifest)
    n = rec.train_rows
    whitenings = metric_whitenings(art)
    out = {}
    for stream in STREAMS:
        for g in range(len(art.groups())):
            mean, eig, comp = art.basis(stream, g)
            eig64 = eig.astype(np.float64)
            mean, comp = mean.astype(np.float64), comp.astype(np.float64)
            if (stream, g) in whitenings:  # E = S U: back to U, and the mean to S mean
                w = whitenings[(stream, g)]
                mean, comp = w.apply(mean[None])[0], w.columns(comp, inverse=True)
            basis = Basis(mean, eig64, comp, max(tv.get((stream, g), 0.0), float(eig64.sum())), n)
            allocs = []
            for ratio in sorted(art.ratios()):
                info = art.allocation_info(ratio, stream, g)
                blocks = tuple(Block(int(s), int(z), str(q), int(b)) for s, z, q, b, *_ in info["blocks"])
                allocs.append(Allocation(float(ratio), int(info["budget_bits"]), blocks, int(info["cost_bits"]),
                                         int(info["kept"]), float(info.get("expected_error", 0.0)), basis.total_variance,
                                         rec.allocator["error_model"], 0,
                                         int(info.get("heldout_rows", 0))))
            out[(stream, g)] = (basis, allocs)
    return out


class Meter:
    """Running sums of squared error, squared norm and PCA residual per (ratio, stream, group)."""

    def __init__(self, art) -> None:
        self.models = artifact_models(art)
        self.whitenings = metric_whitenings(art)
        model = art.manifest["model"]
        self.cols = group_columns(art.groups(), int(model["num_kv_heads"]), int(model["head_dim"]))
        self.sums: dict[tuple[float, str, int], np.ndarray] = {}
        self.rows = 0

    def add(self, stream: str, x: np.ndarray) -> None:
        """x (N, p) raw rows of `stream` (keys RoPE-removed), positions already restricted."""
        if stream == STREAMS[0]:
            self.rows += int(x.shape[0])
        for g, sl in enumerate(self.cols):
            basis, allocs = self.models[(stream, g)]
            xg = np.ascontiguousarray(x[:, sl], dtype=np.float32)
            if (stream, g) in self.whitenings:
                xg = np.ascontiguousarray(self.whitenings[(stream, g)].apply(xg), dtype=np.float32)
            norm = float(np.square(xg, dtype=np.float64).sum())
            centered = float(np.square(xg.astype(np.float64) - basis.mean).sum())
            for a, ev in zip(allocs, evaluate(basis, allocs, xg)):
                s = self.sums.setdefault((a.ratio, stream, g), np.zeros(4))
                s += (ev.rel_error ** 2 * norm, norm, ev.pca_rel_error ** 2 * norm, centered)

    def stream_errors(self) -> tuple[dict[tuple[float, str], float], dict[tuple[float, str], float]]:
        """({(ratio, stream): relative error}, {(ratio, stream): explained variance of the rows})."""
        agg: dict[tuple[float, str], np.ndarray] = {}
        for (ratio, stream, _), s in self.sums.items():
            agg[(ratio, stream)] = agg.get((ratio, stream), np.zeros(4)) + s
        errors = {k: float(np.sqrt(s[0] / max(s[1], 1e-300))) for k, s in agg.items()}
        explained = {k: float(1.0 - s[2] / max(s[3], 1e-300)) for k, s in agg.items()}
        return errors, explained


def sample_rows(lm, manifest: dict, corpus: str, tokens: int, exclude: set[str],
                text_column: str | None = None) -> Iterator[tuple[np.ndarray, np.ndarray, int]]:
    """Capture sequences of `corpus` (shards not in `exclude`) until `tokens`, one at a time:
    yields (keys (n, p), values (n, p), tokens) float32 rows at positions [sinks, seq_len - window)."""
    rec = CalibrationRecord.from_manifest(manifest)
    seq_len = rec.seq_len
    # the rows only: an attention artifact's metric is its stored one
    settings = CaptureSettings(**{**rec.capture(), "objective": MSE})
    check_seq_len(lm, seq_len, settings)
    used = 0
    for shard in make_shards(corpus, lm.tokenizer, seq_len=seq_len, seqs_per_shard=rec.seqs_per_shard,
                             seed=rec.seed, text_column=text_column, holdout_fraction=0.0,
                             min_holdout_shards=0, max_seq_len=lm.max_positions):
        if shard.id in exclude:
            continue
        for seq in shard.input_ids:
            if used >= tokens:
                return
            cap = capture_kv(lm, torch.from_numpy(np.ascontiguousarray(seq[None])), settings)
            used += seq_len
            yield cap.keys.float().cpu().numpy(), cap.values.float().cpu().numpy(), seq_len


def measure_rows(art, keys: np.ndarray, values: np.ndarray, chunk: int = 4096) -> dict[tuple[float, str], float]:
    """{(ratio, stream): relative error} of `art` on raw rows keys, values (N, p)."""
    meter = Meter(art)
    for r in range(0, keys.shape[0], chunk):
        meter.add("keys", keys[r:r + chunk])
        meter.add("values", values[r:r + chunk])
    return meter.stream_errors()[0]
