"""The served check's needles: planted where they say in a window that keeps its length and its continuation, values
that occur nowhere else, and answers read back through a cache (an identity path answers as the raw cache does)."""
from dataclasses import replace

import pytest
import torch

from kvtc.pipeline.evaluation.needle_window import NEEDLE, answers, ask, plant
from kvtc.pipeline.evaluation.tasks import pydoc_texts


@pytest.fixture(scope="module")
def tokenizer():
    from kvtc.workers.models import embedded_tokenizer

    return embedded_tokenizer()


@pytest.fixture(scope="module")
def window(tokenizer):
    ids = tokenizer("\n\n".join(pydoc_texts()[:12]), add_special_tokens=False)["input_ids"]
    return ids[:1500]


def test_needles_sit_at_even_depths_of_the_prefix_and_the_continuation_is_untouched(tokenizer, window):
    planted = plant(tokenizer, window, 1200, 6, seed=3)
    assert len(planted.ids) == len(window) and list(planted.ids[1200:]) == window[1200:]
    assert planted == plant(tokenizer, window, 1200, 6, seed=3)  # deterministic for a seed
    assert planted.answers != plant(tokenizer, window, 1200, 6, seed=4).answers
    for i, ((a, b), key, value, depth) in enumerate(zip(planted.spans, planted.keys, planted.answers, planted.depths)):
        assert b <= 1200
        text = tokenizer.decode(list(planted.ids[a:b]))
        assert text.strip() == NEEDLE.format(key=key, value=value).strip()
        assert abs(depth - (i + 0.5) / 6) < 0.05
    assert len(set(planted.keys)) == 6 and len(set(planted.answers)) == 6
    # no value occurs outside its needle, and no question gives one away
    outside = list(planted.ids)
    for a, b in reversed(planted.spans):
        del outside[a:b]
    rest = tokenizer.decode(outside) + "".join(tokenizer.decode(list(q)) for q in planted.questions)
    assert not any(v in rest for v in planted.answers)


def test_a_prefix_too_short_for_its_needles_is_refused(tokenizer, window):
    with pytest.raises(ValueError, match="cannot hold 6 needles"):
        plant(tokenizer, window, 40, 6)
    with pytest.raises(ValueError, match="cannot plant"):
        plant(tokenizer, window, 2000, 2)


def test_an_answer_is_right_where_greedy_decoding_would_say_it(tokenizer, window):
    from kvtc.pipeline.evaluation.model_quality import _forward, build_cache
    from kvtc.workers.capture import raw_cache
    from kvtc.workers.models import load_model

    lm = load_model("tiny:llama")
    planted = plant(tokenizer, window, 300, 2)
    for q, a, v in zip(planted.questions, planted.answer_tokens, planted.answers):
        assert tokenizer.decode(list(a)).strip() == v
    keys, values = raw_cache(lm, torch.tensor([planted.ids[:300]]))
    raw = ask(lm, lambda: build_cache(lm.model, keys, values), planted)
    assert ask(lm, lambda: build_cache(lm.model, keys.clone(), values.clone()), planted) == raw  # identity path
    # every question in one forward (a block mask, each at the positions after the prefix) = one forward each
    assert ask(lm, lambda: build_cache(lm.model, keys, values), planted, packed=False) == raw
    from kvtc.pipeline.evaluation.needle_window import _packed
    feeds = [list(q) + list(a[:-1]) for q, a in zip(planted.questions, planted.answer_tokens)]
    apart = [_forward(lm.model, torch.tensor([f]), build_cache(lm.model, keys, values))[0][0] for f in feeds]
    for one, many in zip(apart, _packed(lm, build_cache(lm.model, keys, values), feeds, 300)):
        torch.testing.assert_close(many, one, rtol=1e-4, atol=1e-4)
    # the teacher-forced check agrees with step-by-step greedy decoding: a random model says its own digits
    q, a = planted.questions[0], planted.answer_tokens[0]
    cache, feed, said = build_cache(lm.model, keys, values), torch.tensor([q]), []
    for _ in range(len(a)):
        logits, cache = _forward(lm.model, feed, cache)
        said.append(int(logits[0, -1].argmax()))
        feed = torch.tensor([[said[-1]]])
    forced = replace(planted, answer_tokens=(tuple(said),) + planted.answer_tokens[1:])
    assert ask(lm, lambda: build_cache(lm.model, keys, values), forced)[0] is True
    assert raw[0] is (said == list(a))


def test_the_answer_nll_is_the_teacher_forced_sum_and_an_identity_path_has_no_gap(tokenizer, window):
    from kvtc.pipeline.evaluation.model_quality import _forward, build_cache
    from kvtc.pipeline.job.served_check import needle_rows
    from kvtc.workers.capture import raw_cache
    from kvtc.workers.models import load_model

    lm = load_model("tiny:llama")
    planted = plant(tokenizer, window, 300, 2)
    keys, values = raw_cache(lm, torch.tensor([planted.ids[:300]]))
    raw = answers(lm, lambda: build_cache(lm.model, keys, values), planted)
    q, a = planted.questions[1], planted.answer_tokens[1]
    logits = _forward(lm.model, torch.tensor([list(q) + list(a[:-1])]), build_cache(lm.model, keys, values))[0][0]
    logp = torch.log_softmax(logits[len(q) - 1:].float(), -1)
    assert raw[1][1] == pytest.approx(-float(sum(logp[i, t] for i, t in enumerate(a))), rel=1e-4)
    noisy = answers(lm, lambda: build_cache(lm.model, keys + 0.5 * torch.randn_like(keys), values), planted)
    rows = needle_rows({"uncompressed": (None, raw), "kvtc-chunk-16x": (16.0, raw), "kvtc-chunk-32x": (32.0, noisy)},
                       planted.depths)
    assert [r["path"] for r in rows] == ["raw", "chunk", "chunk"]
    assert rows[1]["nll_gap"] == 0 and rows[1]["nll_gap_ci_low"] == rows[1]["nll_gap_ci_high"] == 0
    gaps = [n - b for (_, n), (_, b) in zip(noisy, raw)]
    assert rows[2]["nll_gap"] == pytest.approx(sum(gaps) / 2)
    assert rows[2]["nll_gap_ci_low"] <= rows[2]["nll_gap"] <= rows[2]["nll_gap_ci_high"]
