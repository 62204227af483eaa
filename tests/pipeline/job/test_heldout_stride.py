"""A held-out (or second-domain) sequence longer than the held-out row cap keeps every stride-th position from 0:
the whole context measured, the reduce's fits and measurement on as many rows as the cap (an 8,192-token default
sequence, every other position: the rows of a 4,096-token one)."""
import numpy as np

from kvtc.pipeline.job.calibrate import calibrate_local
from kvtc.pipeline.job.shard_worker import held_stride
from kvtc.pipeline.settings import JobSettings


def test_the_stride_is_one_where_a_sequence_fits_else_the_least_that_fits():
    assert held_stride(4096, 4096) == 1 and held_stride(512, 4096) == 1
    assert held_stride(8192, 4096) == 2
    assert held_stride(8193, 4096) == 3
    assert held_stride(64, 0) == 64  # a zero cap keeps one row per sequence


def test_a_held_out_sequence_longer_than_the_cap_keeps_every_other_position(tmp_path):
    cfg = JobSettings.of(model="tiny:llama", corpus="pydoc", eval_corpus="stdlib", tokens=2048, seq_len=256,
                         seqs_per_shard=2, eval_tokens=256, heldout_rows=256, ratios=(4.0,), tokens_curve_points=0,
                         served_sequences=0, registry=str(tmp_path / "reg"), store=str(tmp_path / "store"),
                         name="stride")
    summary, context = calibrate_local(cfg)
    store, held = context["store"], [s for s in context["shards"] if s.role != "train"]
    assert {s.role for s in held} == {"heldout", "eval"}
    for shard in held:  # a cap of 128 rows per shard: each 256-token sequence at every other position
        arrays, meta = store.get(shard.id, "rows")
        assert meta["seq_len"] == 256
        np.testing.assert_array_equal(arrays["positions"], np.arange(0, 256, 2))
        assert arrays["keys"].shape[0] == arrays["values"].shape[0] == 128
    assert summary["ratios"][0]["keys"]["rel_error"] > 0
