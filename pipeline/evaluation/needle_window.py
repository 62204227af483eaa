"""Needles planted in a long window of held-out text: the main job's slice of the retrieval suite
(kvtc.pipeline.evaluation.tasks), paid for by the served check's own prefill and coding.

The served check already prefills its longest held-out window once and codes that cache through every path to
score perplexity after it. `plant` hides `count` RULER-style needles ("One of the special magic numbers for
{key} is: {7 digits}.") in the window's prefix at evenly spread depths (at sentence or line breaks), dropping as
many tokens from the window's start so that its length, and the continuation scored after the prefix, are
unchanged. `ask` then branches each question off a prefix cache (the raw one, or one a path restored) and tells
whether greedy decoding would answer it with the needle's value, in one teacher-forced forward. A question is only
a few dozen tokens over the cache the check holds anyway, so the slice costs a forward per question, not a prefill.
Every value is checked never to occur in the window's own text; keys are distinct.
"""
from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvtc.pipeline.evaluation.model_quality import _forward
from kvtc.pipeline.evaluation.tasks import Haystack, _encode, _word

NEEDLE = " One of the special magic numbers for {key} is: {value}."
QUESTION = ("\n\nQuestion: What is the special magic number for {key} mentioned in the text above?\n"
            "Answer: The special magic number for {key} is:")
DIGITS = 7


@dataclass(frozen=True)
class PlantedWindow:
    """A window with needles in its prefix.

    ids: the window's tokens, as many as the window given; prefix: the tokens before the continuation (the needles
    lie in ids[:prefix]); keys, answers: each needle's key and value; spans: each needle's (start, end) in ids;
    depths: each needle's start over the prefix, in [0, 1]; questions: each key's question tokens, asked right
    after the prefix; answer_tokens: each value's tokens as the question's continuation (a space, then the value)."""

    ids: tuple[int, ...]
    prefix: int
    keys: tuple[str, ...]
    answers: tuple[str, ...]
    spans: tuple[tuple[int, int], ...]
    depths: tuple[float, ...]
    questions: tuple[tuple[int, ...], ...]
    answer_tokens: tuple[tuple[int, ...], ...]


def plant(tokenizer: Any, window: Sequence[int], prefix: int, count: int, seed: int = 0) -> PlantedWindow:
    """`count` needles in the first `prefix` tokens of `window` (module docstring). ValueError where the prefix
    cannot hold them beside a haystack of at least as many tokens."""
    window = [int(t) for t in window]
    if not 0 < prefix <= len(window) or count < 1:
        raise ValueError(f"cannot plant {count} needles in a {prefix}-token prefix of a {len(window)}-token window")
    text = tokenizer.decode(window)
    rng = random.Random(seed)
    keys: list[str] = []
    answers: list[str] = []
    while len(keys) < count:
        key, value = _word(rng), str(rng.randrange(10 ** (DIGITS - 1), 10 ** DIGITS))
        if key in keys or value in answers or value in text or key in text:
            continue
        keys.append(key)
        answers.append(value)
    needles = [_encode(tokenizer, NEEDLE.format(key=k, value=v)) for k, v in zip(keys, answers)]
    spent = sum(len(n) for n in needles)
    if prefix - spent < spent:
        raise ValueError(f"a {prefix}-token prefix cannot hold {count} needles of {spent} tokens beside their haystack")
    hay = window[spent:prefix]
    found = Haystack.of_ids(tokenizer, hay)
    cuts = sorted(found.spot(0, len(hay), round((i + 0.5) / count * len(hay))) for i in range(count))
    ids: list[int] = []
    spans, last = [], 0
    for cut, needle in zip(cuts, needles):
        ids += hay[last:cut]
        spans.append((len(ids), len(ids) + len(needle)))
        ids += needle
        last = cut
    ids += hay[last:] + window[prefix:]
    questions = tuple(tuple(_encode(tokenizer, QUESTION.format(key=k))) for k in keys)
    answer_tokens = []
    for k, v, q in zip(keys, answers, questions):
        whole = _encode(tokenizer, QUESTION.format(key=k) + " " + v)
        answer_tokens.append(tuple(whole[len(q):] if tuple(whole[:len(q)]) == q else _encode(tokenizer, " " + v)))
    return PlantedWindow(tuple(ids), prefix, tuple(keys), tuple(answers), tuple(spans),
                         tuple(s / prefix for s, _ in spans), questions, tuple(answer_tokens))


def ask(lm: Any, make_cache: Any, planted: PlantedWindow, packed: bool = True) -> list[bool]:
    """Whether greedy decoding after a prefix cache answers each question with its needle's value (`answers`)."""
    return [found for found, _ in answers(lm, make_cache, planted, packed)]


def answers(lm: Any, make_cache: Any, planted: PlantedWindow, packed: bool = True) -> list[tuple[bool, float]]:
    """Each question's (found, nll) after a prefix cache: whether greedy decoding answers it with its needle's value,
    and the answer's negative log-likelihood in nats (summed over its tokens: a graded measure of the same retrieval,
    which tells a codec from the raw cache on far fewer needles than exact match). make_cache: () -> a fresh
    transformers Cache of the prefix (a forward extends the cache it is given).

    Teacher-forced: a question and its answer's tokens fed at once, and greedy decoding would give the answer
    exactly where the argmax at every answer position is the answer's next token (the question ends in "... is:",
    so the answer is the first thing a right generation says). `packed`: every question in one forward, each at the
    positions right after the prefix and attending to the prefix and itself alone (a block mask); else one forward
    per question (models whose layers differ: a sliding layer's cache holds fewer positions than the mask)."""
    feeds = [list(q) + list(a[:-1]) for q, a in zip(planted.questions, planted.answer_tokens)]
    if not packed:
        logits = [_forward(lm.model, torch.tensor([f], dtype=torch.long, device=lm.device), make_cache())[0][0]
                  for f in feeds]
    else:
        logits = _packed(lm, make_cache(), feeds, planted.prefix)
    out = []
    for row, q, a in zip(logits, planted.questions, planted.answer_tokens):
        tail = row[len(q) - 1:].float()
        target = torch.tensor(a, device=tail.device)
        nll = -torch.log_softmax(tail, -1).gather(-1, target[:, None]).sum()
        out.append((tail.argmax(-1).tolist() == list(a), float(nll)))
    return out


def _packed(lm: Any, cache: Any, feeds: list[list[int]], prefix: int) -> list[torch.Tensor]:
    """Every feed in one forward after a prefix cache of `prefix` tokens -> each feed's logits (n_i, V)."""
    dtype = next(lm.model.parameters()).dtype
    n = sum(len(f) for f in feeds)
    mask = torch.full((n, prefix + n), torch.finfo(dtype).min, dtype=dtype, device=lm.device)
    mask[:, :prefix] = 0
    positions, at = [], 0
    for f in feeds:
        m = len(f)
        block = torch.triu(torch.full((m, m), torch.finfo(dtype).min, dtype=dtype, device=lm.device), diagonal=1)
        mask[at:at + m, prefix + at:prefix + at + m] = block
        positions += range(prefix, prefix + m)
        at += m
    ids = torch.tensor([[t for f in feeds for t in f]], dtype=torch.long, device=lm.device)
    logits, _ = _forward(lm.model, ids, cache, mask[None, None], torch.tensor([positions], device=lm.device))
    logits, at, rows = logits[0], 0, []
    for f in feeds:
        rows.append(logits[at:at + len(f)])
        at += len(f)
    return rows
