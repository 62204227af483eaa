"""The body of one calibration worker: load the model once, then turn shards into stored results.

Run as a Ray actor by kvtc.pipeline.job.ray_pool (or directly, in-process). A training shard becomes its
statistics, folded into the running total of its accumulator (`kvtc.pipeline.job.accumulators`),
which is checkpointed to the store after the shard; a held-out shard becomes a capped sample of
captured rows over every position, sinks and window included, for error tables and the
error-by-position curve. Results go to the shard store; `process` returns only plain values.

The actor keeps the totals of the accumulators routed to it in memory between shards; a restarted
actor (a killed worker) reloads them from their last checkpoint, and a retried shard that the
checkpoint already lists is skipped, so every shard is folded exactly once.
"""
from __future__ import annotations

import os
import time

import numpy as np
import torch

from kvtc.artifacts.errors import InputError
from kvtc.pipeline.job.fault_hooks import current_node, hold_if_asked
from kvtc.pipeline.job.shard_records import ShardResult
from kvtc.pipeline.job.shards import Shard
from kvtc.pipeline.job.store import ShardStore, capture_key
from kvtc.workers.capture import CaptureSettings, capture_kv
from kvtc.workers.malloc import release_large_frees
from kvtc.artifacts.fingerprint import model_id as fingerprint_id
from kvtc.workers.models import load_model
from kvtc.workers.objective import MSE
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
        fingerprint: dict | None = None,
        model_dtype: str | None = None,
        gpu_budgets: dict[int, int] | None = None,
    ) -> None:
        torch.set_num_threads(threads)
        release_large_frees()  # a long sequence's freed activations go back to the system (kvtc.workers.malloc)
        self.lm = load_model(model, dtype=dtype, cache_dir=cache_dir, gpu_budgets=gpu_budgets)
        if fingerprint is not None and fingerprint_id(fingerprint) != fingerprint_id(self.lm.fingerprint):
            raise InputError(f"the worker loaded {model!r} with another fingerprint than the driver's "
                               f"({fingerprint_id(self.lm.fingerprint)} vs {fingerprint_id(fingerprint)}); "
                               "check that every node has the same model files")
        loaded_dtype = str(self.lm.dtype).removeprefix("torch.")
        if model_dtype is not None and loaded_dtype != model_dtype:
            raise InputError(f"the worker runs {model!r} in {loaded_dtype}, the driver planned {model_dtype}; pass --dtype")
        self.settings = CaptureSettings.from_dict(capture)
        self.all_positions = CaptureSettings(**{**capture, "sinks": 0, "window": 0, "sample": 1.0,
                                                "objective": MSE})
        self.store = ShardStore(store_root, fingerprint_id(self.lm.fingerprint),
                                capture_key(self.settings.to_dict(), str(self.lm.dtype).removeprefix("torch.")))
        self.batch_size = batch_size
        self.rows_per_heldout_shard = rows_per_heldout_shard
        self.totals: dict[str, CalibrationStats] = {}
        self.placement = {"node": current_node(), "gpus": ",".join(map(str, _ray_gpu_ids())), "device": str(self.lm.device)}

    def ready(self) -> str:
        """The Ray node this worker runs on ("" outside Ray): the pool moves its work if that node is lost."""
        return current_node()

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
            nbytes, rows, split = self._fold(shard, payload["acc"], payload.get("after"), bool(payload.get("probe")))
            hold_if_asked("fold")  # a test removes this node here: checkpointed, the result not yet returned
            if rows is None:
                return ShardResult(shard.id, shard.index, role, 0, 0, 0, time.perf_counter() - t0, skipped=True,
                                   **self.placement).to_dict()
        else:
            nbytes, rows = self._store_rows(shard)
            split = {}
        return ShardResult(shard_id=shard.id, index=shard.index, role=role, tokens_run=int(shard.input_ids.size),
                           rows=rows, bytes=nbytes, seconds=time.perf_counter() - t0, **split, **self.placement).to_dict()

    def _total(self, name: str) -> CalibrationStats | None:
        if name not in self.totals:
            if self.store.acc_shards(name) is None:
                return None
            self.totals[name] = self.store.get_acc(name)
        return self.totals[name]

    def _fold(self, shard: Shard, name: str, after: str | None, probe: bool = False) -> tuple[int, int | None, dict]:
        """Fold a shard into accumulator `name` after shard `after`, then checkpoint it; `probe`: its first sequence
        also gives the job's copy probe.
        -> (bytes written, rows folded, seconds {capture_s, fold_s, checkpoint_s}), rows None when
        the total already holds the shard."""
        t0 = time.perf_counter()
        total = self._total(name)
        if total is not None and shard.id in total.shard_ids:
            return 0, None, {}
        last = total.shard_ids[-1] if total is not None and total.shard_ids else None
        if last != after:
            raise InputError(f"accumulator {self.store.acc_uri(name)} ends at shard {last} but shard {shard.id} "
                               f"must follow {after}; rerun the calibration (it resumes from the stored totals)")
        if total is None:
            total = self.totals[name] = CalibrationStats.new(self.lm.fingerprint, self.settings)
        rows, capture_s, fold_s = 0, 0.0, 0.0
        load_s = time.perf_counter() - t0
        sensitivity = self.settings.sensitivity  # the shard's first sequences: the same ones on every rerun
        try:
            for batch in self._batches(shard):
                t1 = time.perf_counter()
                captured = capture_kv(self.lm, batch, self.settings, min(sensitivity, int(batch.shape[0])), probe)
                sensitivity, probe = max(0, sensitivity - int(batch.shape[0])), False
                t2 = time.perf_counter()
                total.update(captured)
                fold_s += time.perf_counter() - t2
                capture_s += t2 - t1
                rows += captured.keys.shape[0]
            total.shard_ids = total.shard_ids + (shard.id,)
            t3 = time.perf_counter()
            nbytes = self.store.put_acc(name, total)
        except BaseException:
            self.totals.pop(name, None)  # half-folded: reload the last checkpoint next time
            raise
        return nbytes, rows, {"capture_s": capture_s, "fold_s": fold_s,
                              "checkpoint_s": load_s + time.perf_counter() - t3}

    def _store_rows(self, shard: Shard) -> tuple[int, int]:
        """Whole sequences until the row cap: keys, values, positions of every position, or of every `held_stride`-th
        from 0 where one sequence is longer than the cap (an 8,192-token sequence, every other position: the
        whole context measured, and the reduce's fits and measurement on as many rows as a 4,096-token one)."""
        keys, values, positions = [], [], []
        n = 0
        stride = held_stride(int(shard.input_ids.shape[1]), self.rows_per_heldout_shard)
        for batch in self._batches(shard):
            if n >= self.rows_per_heldout_shard:
                break
            cap = capture_kv(self.lm, batch, self.all_positions)
            keep = (cap.positions % stride == 0).cpu()
            keys.append(cap.keys.float().cpu()[keep].numpy())
            values.append(cap.values.float().cpu()[keep].numpy())
            positions.append(cap.positions.cpu()[keep].numpy())
            n += int(keep.sum())
        tensors = {
            "keys": np.concatenate(keys),
            "values": np.concatenate(values),
            "positions": np.concatenate(positions).astype(np.int64),
        }
        meta = {"shard_id": shard.id, "seq_len": int(shard.input_ids.shape[1])}
        return self.store.put(shard.id, "rows", tensors, meta), int(tensors["keys"].shape[0])


def held_stride(seq_len: int, cap: int) -> int:
    """Every how many positions a held-out or second-domain sequence of `seq_len` tokens is kept under a row cap of
    `cap`: 1 where one sequence fits, else the least stride that brings it within the cap."""
    return max(1, -(-int(seq_len) // max(1, int(cap))))


def _ray_gpu_ids() -> list:
    """The GPU ids Ray assigned this worker ([] outside Ray or without GPUs)."""
    try:
        import ray  # noqa: PLC0415 - only inside a Ray worker; an in-process job runs without Ray

        return list(ray.get_runtime_context().get_accelerator_ids().get("GPU", [])) if ray.is_initialized() else []
    except Exception:  # a Ray without accelerator ids here: nothing to report
        return []
