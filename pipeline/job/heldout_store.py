"""Held-out rows from the shard store: whole held-out (or second-domain) shards, in shard order."""
from __future__ import annotations

import numpy as np

from kvtc.pipeline.fit.heldout_rows import HeldOut
from kvtc.pipeline.job.store import ShardStore


def load_rows(store: ShardStore, shard_ids: list[str], cap: int) -> HeldOut | None:
    """Concatenate stored held-out rows in shard order, whole shards, until `cap` rows."""
    keys, values, positions, seq_len, n = [], [], [], 0, 0
    for sid in shard_ids:
        if n >= cap:
            break
        tensors, meta = store.get(sid, "rows")
        keys.append(tensors["keys"].astype(np.float32, copy=False))
        values.append(tensors["values"].astype(np.float32, copy=False))
        positions.append(tensors["positions"])
        seq_len = int(meta["seq_len"])
        n += len(tensors["positions"])
    if not keys:
        return None
    return HeldOut(np.concatenate(keys)[:cap], np.concatenate(values)[:cap], np.concatenate(positions)[:cap], seq_len)
