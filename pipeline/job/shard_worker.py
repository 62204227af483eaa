"""The body of one calibration worker: load the model once, then turn shards into stored results.

Run as a Ray actor by kvtc.pipeline.job.ray_pool (or directly, in-process). A training shard becomes its
statistics (count, sum, Gram per stream and group); a held-out shard becomes a capped sample of
captured rows over every position, sinks and window included, for error tables and the
error-by-position curve. Results go to the shard store; `process` returns only plain values.
"""
from __future__ import annotations

import os
import time

import numpy as np
import torch

from kvtc.pipeline.job.shards import Shard
from kvtc.pipeline.job.store import ShardStore, capture_key
from kvtc.workers.capture import CaptureSettings, capture_kv
from kvtc.workers.models import fingerprint_id, load_model
from kvtc.workers.stats import CalibrationStats

KILL_ENV = "KVTC_TEST_KILL_ON_SHARD"  # test hook: "<shard index>:<marker file>" kills this process once


class ShardWorker:
    def __init__(
        self,
        model: str,
        capture: dict,
        store_root: str,
        dtype: str | None = None,
        cache_dir: str | None = None,
        threads: int = 1,
        batch_size: int = 1,
        rows_per_heldout_shard: int = 4096,
    ) -> None:
        torch.set_num_threads(threads)
        self.lm = load_model(model, dtype=dtype, cache_dir=cache_dir)
        self.settings = CaptureSettings(**capture)
        self.all_positions = CaptureSettings(**{**capture, "sinks": 0, "window": 0, "sample": 1.0})
        self.store = ShardStore(store_root, fingerprint_id(self.lm.fingerprint),
                                capture_key(self.settings.to_dict(), str(self.lm.dtype).removeprefix("torch.")))
        self.batch_size = batch_size
        self.rows_per_heldout_shard = rows_per_heldout_shard

    def ready(self) -> bool:
        return True

    def _maybe_die(self, shard: Shard) -> None:
        spec = os.environ.get(KILL_ENV)
        if not spec:
            return
        index, marker = spec.split(":", 1)
        if int(index) == shard.index and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), 9)

    def _batches(self, shard: Shard):
        ids = torch.from_numpy(shard.input_ids)
        for i in range(0, ids.shape[0], self.batch_size):
            yield ids[i : i + self.batch_size].to(self.lm.device)

    def process(self, payload: dict) -> dict:
        t0 = time.perf_counter()
        shard = Shard.from_payload(payload["shard"])
        role = payload["role"]
        self._maybe_die(shard)
        if role == "train":
            stats = CalibrationStats.new(self.lm.fingerprint, self.settings, shard_ids=(shard.id,))
            rows = 0
            for batch in self._batches(shard):
                captured = capture_kv(self.lm, batch, self.settings)
                stats.update(captured)
                rows += captured.keys.shape[0]
            nbytes = self.store.put_bytes(shard.id, "stats", stats.to_bytes())
        else:
            nbytes, rows = self._store_rows(shard)
        return {
            "shard_id": shard.id,
            "index": shard.index,
            "role": role,
            "tokens_run": int(shard.input_ids.size),
            "rows": rows,
            "bytes": nbytes,
            "seconds": time.perf_counter() - t0,
        }

    def _store_rows(self, shard: Shard) -> tuple[int, int]:
        """Whole sequences, every position, until the row cap: keys, values, positions."""
        keys, values, positions = [], [], []
        n = 0
        for batch in self._batches(shard):
            if n >= self.rows_per_heldout_shard:
                break
            cap = capture_kv(self.lm, batch, self.all_positions)
            keys.append(cap.keys.float().cpu().numpy())
            values.append(cap.values.float().cpu().numpy())
            positions.append(cap.positions.cpu().numpy())
            n += cap.keys.shape[0]
        tensors = {
            "keys": np.concatenate(keys),
            "values": np.concatenate(values),
            "positions": np.concatenate(positions).astype(np.int64),
        }
        meta = {"shard_id": shard.id, "seq_len": int(shard.input_ids.shape[1])}
        return self.store.put(shard.id, "rows", tensors, meta), int(tensors["keys"].shape[0])
