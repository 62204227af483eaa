"""The served check's raw half: run beside the fold's last shards (a Ray pool with an idle worker), it gives the check
exactly the figures it gives when run after the reduce; the pool says when a worker is left idle."""
import contextlib
import io
import threading
import time

import pytest
import ray
import torch

from kvtc.pipeline.job import ray_pool
from kvtc.pipeline.job.calibrate import calibrate_local, run
from kvtc.pipeline.job.served_prep import ServedPrep, prepare
from kvtc.pipeline.settings import JobSettings
from kvtc.workers import models

TINY = dict(model="tiny:llama", corpus="pydoc", eval_corpus="stdlib", seq_len=128, window=16, tokens=1536,
            eval_tokens=256, seqs_per_shard=2, heldout_rows=1024, ratios=(4.0, 8.0), served_sequences=1)


@pytest.fixture(scope="module")
def ray_local():
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def served(summary: dict) -> dict:
    return {r["ratio"]: r["served"] for r in summary["ratios"]}


def test_the_raw_half_beside_the_fold_gives_the_figures_of_the_check_after_the_reduce(ray_local, tmp_path):
    with contextlib.redirect_stderr(io.StringIO()):
        local, _ = calibrate_local(JobSettings.of(**TINY, registry=str(tmp_path / "a"), store=str(tmp_path / "sa"),
                                                  name="tiny"))
    assert local["served_stages"]["raw_beside_fold"] == 0  # one process: no worker is left idle
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        pooled = run(JobSettings.of(**TINY, workers=2, registry=str(tmp_path / "b"), store=str(tmp_path / "sb"),
                                    name="tiny"))
    stages = pooled["served_stages"]
    assert stages["raw_beside_fold"] == 1 and stages["raw_long"] > 0 and stages["raw_score"] > 0
    assert "their raw prefill ran beside the fold" in err.getvalue()
    # the same bytes scored: every figure, its intervals and the needles
    assert served(pooled) == served(local) and served(local)[8.0]["chunk-long"]["needles_samples"] >= 2


def held_prep(seed: int, count: int):
    """Three random 128-token held-out sequences -> (the raw half run in place, its long window's, a ServedPrep of
    them for `count` scored sequences)."""
    lm = models.load_model("tiny:llama")
    gen = torch.Generator().manual_seed(seed)
    heldout = [torch.randint(5, 500, (128,), generator=gen).numpy() for _ in range(3)]
    want, want_long = prepare(lm, heldout, count, 12, 128, free=1 << 40)
    prep = ServedPrep("tiny:llama", None, None, count, 12, 128)
    for i, seq in enumerate(heldout):
        prep.add_heldout(f"h{i}", seq[None])
    return want, want_long, prep


def test_the_raw_half_in_a_thread_equals_it_run_in_place():
    want, want_long, prep = held_prep(3, 2)
    prep.start(1, early=True)
    got = prep.result(2)
    assert got.shards == ["h0", "h1", "h2"] and got.early and len(got.sequences) == 2
    for a, b in zip(got.sequences, want):
        assert torch.equal(a.ids, b.ids) and torch.equal(a.keys, b.keys) and torch.equal(a.ref, b.ref)
    assert got.long.length == want_long.length > 128 and got.long.answers == want_long.answers
    assert torch.equal(got.long.raw.keys, want_long.raw.keys) and torch.equal(got.long.raw.ref, want_long.raw.ref)


def test_the_raw_half_takes_up_the_threads_the_check_asks_for_at_its_next_layer():
    prep = ServedPrep("tiny:llama", None, None, 1, 12, 128)
    seen = []

    def body():
        torch.set_num_threads(1)
        prep._threads = 2  # what `result` asks for when the check waits
        prep._follow_threads()
        seen.append(torch.get_num_threads())

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert seen == [2]


def test_the_pool_says_once_when_a_worker_is_left_idle(ray_local):
    class Sleeper:  # defined here: Ray ships it by value (the workers cannot import a test module)
        def ready(self) -> str:
            return ""

        def process(self, payload: dict) -> dict:
            time.sleep(payload["s"])
            return {"i": payload["i"]}

    calls = []
    settings = ray_pool.PoolSettings(workers=2, env_inherited=True)
    payloads = [{"i": i, "s": 0.1 if i < 2 else 2.0} for i in range(3)]
    out = ray_pool.run_pool(Sleeper, {}, payloads, settings, on_idle=calls.append)
    assert sorted(r["i"] for r in out.results) == [0, 1, 2] and calls == [1]


def test_a_check_that_will_not_run_stops_its_raw_half(monkeypatch):
    from helpers.toy_artifacts import toy_content
    from kvtc.pipeline.job import served_check
    from kvtc.pipeline.job.served_prep import Cancelled

    prep = ServedPrep("tiny:llama", None, None, 1, 12, 128)
    prep.add_heldout("h0", torch.randint(5, 500, (1, 256)).numpy())
    prep.cancel()  # before its first layer: it stops there
    prep.start(1, early=True)
    with pytest.raises(Cancelled):
        prep.result(1)
    content = toy_content()
    monkeypatch.setattr(served_check, "_free_bytes", lambda: served_check.served_bytes(content) - 1)
    stopped = []
    prep = ServedPrep("tiny:llama", None, None, 1, 12, 128)
    monkeypatch.setattr(prep, "cancel", lambda: stopped.append(True))
    result, note = served_check.served_quality(content, "tiny:llama", None, 1, 12, prep=prep)
    assert result is None and "GiB" in note and stopped == [True]
    # a raw half of other held-out shards than the artifact's is stopped, and the artifact's own text read instead
    monkeypatch.undo()
    stopped.clear()
    prep = ServedPrep("tiny:llama", None, None, 1, 12, 128)
    prep.add_heldout("another-jobs-shard", torch.randint(5, 500, (1, 256)).numpy())
    monkeypatch.setattr(prep, "cancel", lambda: stopped.append(True))
    served_check.served_quality(content, "tiny:llama", None, 1, 12, prep=prep)
    assert stopped == [True]


def test_a_deferred_raw_half_gives_its_memory_back_and_runs_when_the_check_asks():
    want, want_long, prep = held_prep(4, 1)
    prep.defer()  # before its first layer, as the reduce does when its tasks need the memory
    prep.start(1, early=True)
    prep._thread.join()
    assert prep.reserved_bytes() == 0
    got = prep.result(2)
    assert not got.early and torch.equal(got.sequences[0].ref, want[0].ref)
    assert torch.equal(got.long.raw.keys, want_long.raw.keys) and got.long.answers == want_long.answers


def test_the_long_window_stops_at_long_tokens(monkeypatch):
    """The long window is the longest the model, the held-out text and memory allow, up to LONG_TOKENS: the check's
    cost is bounded whatever the model's context (the embedded model's 8K would double it)."""
    from kvtc.pipeline.job import served_prep

    lm = models.load_model("tiny:llama")
    gen = torch.Generator().manual_seed(5)
    heldout = [torch.randint(5, 500, (128,), generator=gen).numpy() for _ in range(3)]
    _, whole = prepare(lm, heldout, 1, 12, 128, free=1 << 40)
    assert whole.length == served_prep.long_limit(lm, heldout) == min(lm.max_positions, 384)
    monkeypatch.setattr(served_prep, "LONG_TOKENS", 256)
    _, capped = prepare(lm, heldout, 1, 12, 128, free=1 << 40)
    assert capped.length == 256 and capped.raw.prefix == 256 - 12 - 1
    assert capped.raw.keys.shape[2] == capped.raw.prefix < whole.raw.prefix
    monkeypatch.setattr(served_prep, "LONG_TOKENS", 128)  # not longer than the scored sequences: no long window
    assert prepare(lm, heldout, 1, 12, 128, free=1 << 40)[1] is None
