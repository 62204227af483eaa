"""The fold's memory plan: one shard worker's peak by sequence length, objective, dtype and batch, workers admitted
while their sum fits the node's budget, and a --seq-len that cannot fit one worker refused before model work."""
import re
from dataclasses import replace

import pytest

from kvtc.pipeline.job import fold_plan
from kvtc.pipeline.job.memory_plan import packed_bytes
from kvtc.pipeline.job.fold_plan import (FoldShape, FoldSizer, capture_bytes, forward_bytes, heldout_bytes,
                                         sensitivity_bytes)

GIB = 1 << 30
# SmolLM2-135M's geometry, float32
SMOL = FoldShape(weights=538_000_000, itemsize=4, layers=30, coded=30, kv_heads=3, head_dim=64, value_dim=64,
                 hidden=576, intermediate=1536, vocab=49152, heads=9, seq_len=8192, captured=8060)


def _sizer(shape: FoldShape = SMOL, **kw) -> FoldSizer:
    return FoldSizer(shape, (5760,), 4, **kw)


def test_the_working_set_grows_linearly_with_the_sequence_never_as_t_squared_or_t_times_vocab(monkeypatch):
    at = {t: capture_bytes(SMOL.at(t, t - 132)) for t in (2048, 4096, 8192, 16384)}
    assert at[16384] - at[8192] == pytest.approx(2 * (at[8192] - at[4096]), rel=0.25)
    assert at[8192] < 2 * GIB  # T x vocab float32 logits alone would be 1.5 GiB, one layer's T x T scores 2.3 GiB
    # the calibration points (fold_plan docstring): 8192 positions, training capture 1.26 GiB measured (the
    # sensitivity pass over all of them, as it ran before it measured only its first SENSITIVITY_TOKENS), held-out 1.46
    whole = replace(SMOL, seq_len=fold_plan.SENSITIVITY_TOKENS, captured=fold_plan.SENSITIVITY_TOKENS)
    assert sensitivity_bytes(SMOL) == sensitivity_bytes(whole) < forward_bytes(SMOL)
    monkeypatch.setattr(fold_plan, "SENSITIVITY_TOKENS", 1 << 20)
    assert max(forward_bytes(SMOL), sensitivity_bytes(SMOL)) == pytest.approx(1.26 * GIB, rel=0.1)
    assert heldout_bytes(SMOL) == pytest.approx(1.46 * GIB, rel=0.1)


def test_the_objective_dtype_and_batch_move_the_peak_as_they_should():
    mse = replace(SMOL, attention=False)
    assert sensitivity_bytes(mse) == 0 and sensitivity_bytes(replace(SMOL, sensitivity=0)) == 0
    assert forward_bytes(mse) < forward_bytes(SMOL)
    bf16 = replace(SMOL, itemsize=2)
    assert sensitivity_bytes(bf16) < sensitivity_bytes(SMOL) and forward_bytes(bf16) < forward_bytes(SMOL)
    assert forward_bytes(replace(SMOL, batch=4)) > 3 * forward_bytes(SMOL)
    # layers without a KV cache are not checkpointed: each keeps its activations through the backward
    assert sensitivity_bytes(replace(SMOL, layers=40)) > sensitivity_bytes(SMOL) + 9 * 5 * 1024 * 2112 * 4  # its tokens
    with pytest.raises(ValueError, match="fold shape"):
        replace(SMOL, coded=31)
    with pytest.raises(ValueError, match="fold shape"):
        replace(SMOL, seq_len=0)


def test_a_worker_holds_its_share_of_the_accumulators():
    sizer = _sizer()
    assert sizer.totals_bytes(1) - sizer.totals_bytes(2) == 2 * 2 * packed_bytes(5760)  # 4 totals against 2, 2 streams
    assert sizer.totals_bytes(4) == sizer.totals_bytes(8)  # a worker without an accumulator holds none
    assert sizer.worker_bytes(1) > sizer.worker_bytes(2)
    assert sizer.worker_bytes(2, 1024) < sizer.worker_bytes(2, 8192)


def test_workers_are_admitted_while_their_sum_fits_fewer_rather_than_killed():
    sizer = _sizer()
    two, one = sizer.worker_bytes(2), sizer.worker_bytes(1)
    plan = sizer.plan(2, 2 * two + 1, 24 * GIB, 2 * GIB)
    assert (plan.workers, plan.worker_bytes) == (2, two)
    assert "lowered" not in plan.line()
    plan = sizer.plan(2, one + (2 * two - one) // 2, 24 * GIB, 2 * GIB)
    assert plan.workers == 1 and plan.worker_bytes == one and plan.wanted == 2
    line = plan.line()
    assert re.search(r"fold plan: 1 worker x \d+\.\d\d GiB per worker \(seq-len 8192, objective attention\), "
                     r"node budget \d+\.\d GiB; lowered from 2 workers", line), line
    assert plan.to_dict()["workers"] == 1 and plan.to_dict()["worker_gib"] == pytest.approx(one / GIB, abs=1e-3)


def test_a_seq_len_that_cannot_fit_one_worker_is_refused_naming_the_longest_that_fits():
    sizer = _sizer(sensitivity="; --sensitivity 0 drops it")
    budget = sizer.worker_bytes(1, 3000)
    with pytest.raises(ValueError) as err:
        sizer.plan(2, budget, 16 * GIB, 3 * GIB)
    text = str(err.value)
    fits = int(re.search(r"the longest --seq-len that fits one worker here is (\d+)", text).group(1))
    assert sizer.worker_bytes(1, fits) <= budget < sizer.worker_bytes(1, fits + 1)
    assert fits >= 3000 and text.startswith("--seq-len 8192: one shard worker needs about")
    assert "16.0 GiB less 3.0 GiB in use" in text and "--sensitivity 0" in text
    assert float(re.search(r"capture (\d+\.\d) GiB with objective attention", text).group(1)) >= 1.3  # 8192 positions
    with pytest.raises(ValueError, match=r"no --seq-len fits one worker here \(at 133 one still needs about"):
        sizer.plan(1, sizer.worker_bytes(1, 200) - sizer.worker_bytes(1, 140), 16 * GIB, 3 * GIB)


def test_calibrate_refuses_a_seq_len_whose_fold_cannot_fit_before_model_work(tmp_path, monkeypatch):
    from kvtc.pipeline.job.calibrate import run
    from kvtc.pipeline.settings import JobSettings

    sizers = []
    real = fold_plan.job_sizer
    monkeypatch.setattr(fold_plan, "job_sizer", lambda *a, **k: sizers.append(real(*a, **k)) or sizers[-1])
    # a node where one worker fits just short of 2048 positions
    monkeypatch.setattr(fold_plan, "node_now", lambda reserve=0: (sizers[-1].worker_bytes(1, 2048) - 1, 8 * GIB, 5 * GIB))
    cfg = JobSettings.of(model="tiny:llama@4x2x64x8", corpus="pydoc", seq_len=2048, tokens=32 * 2048,
                         registry=str(tmp_path / "reg"), store=str(tmp_path / "store"), name="x")
    with pytest.raises(ValueError, match=r"--seq-len 2048: one shard worker needs about") as err:
        run(cfg, in_process=True)
    fits = int(re.search(r"the longest --seq-len that fits one worker here is (\d+)", str(err.value)).group(1))
    assert 512 <= fits < 2048 and sizers[-1].worker_bytes(1, fits) < sizers[-1].worker_bytes(1, 2048)
    assert sizers[-1].shape.seq_len == 2048 and not (tmp_path / "store").exists()


def test_the_plans_constants_are_the_workers():
    from kvtc.workers.attention_metric import QUERY_ROWS
    from kvtc.workers.sensitivity import LOGIT_BLOCK_BYTES, SENSITIVITY_TOKENS

    assert fold_plan.LOGIT_BLOCK_BYTES == LOGIT_BLOCK_BYTES and fold_plan.METRIC_QUERY_ROWS == QUERY_ROWS
    assert fold_plan.SENSITIVITY_TOKENS == SENSITIVITY_TOKENS


def test_a_cluster_admits_workers_per_node_by_its_ray_memory_and_refuses_what_no_node_holds():
    """Joined cluster: a node takes as many workers as its Ray `memory` and CPUs hold (each actor then asks for its
    peak); a dead node counts for nothing; no node holding one worker is refused, naming the --seq-len that fits."""
    sizer = _sizer()
    node = lambda cpus, gib, alive=True: {"Alive": alive, "Resources": {"CPU": cpus, "memory": int(gib * GIB)}}  # noqa: E731
    plan = fold_plan.admit_on_nodes(sizer, 8, 1, [node(8, 5), node(8, 10), node(64, 100, alive=False)])
    peak = sizer.worker_bytes(plan.workers)
    assert plan.worker_bytes == peak and 2 <= plan.workers == (5 * GIB) // peak + (10 * GIB) // peak < 8  # memory binds
    assert fold_plan.admit_on_nodes(sizer, 8, 4, [node(8, 100)]).workers == 2  # CPUs bind: 8 // 4
    with pytest.raises(ValueError, match=r"largest node's Ray memory \(3.5 GiB of 1 alive node\(s\)\); the longest "
                                         r"--seq-len one worker fits there is 6570"):
        fold_plan.admit_on_nodes(sizer, 2, 1, [node(8, 3.5)])

