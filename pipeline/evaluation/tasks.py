"""Long-context retrieval tasks, generated deterministically for a model's tokenizer: the prompts `kvtc eval --tasks`
scores the codec on (kvtc.pipeline.evaluation.task_suite decodes them through each served path).

Tasks (TASKS), after RULER (Hsieh et al. 2024) and Lost in the Middle (Liu et al. 2023):

- niah        one needle, "One of the special magic numbers for {key} is: {7 digits}." (RULER niah_single_2);
- niah_words  the same with a word value, "{adjective}-{noun}";
- multikey    a needle with a UUID key and value among distractor needles of other UUID keys (niah_multikey_3);
- kv          a JSON object of UUID pairs and one key to look up, no haystack (Lost in the Middle key-value retrieval);
- vt          a chain of variable assignments "VAR A = 12345. VAR B = VAR A. ..." and every name to list (RULER vt);
- copy        a passage quoted under a code, to be repeated word for word from its distance to the question.

Every task but kv hides its needles in haystack text: any text source (an iterable of documents' texts: the corpus
interface, kvtc.pipeline.job.corpus.iter_documents, default Python's documentation prose `pydoc_data.topics`),
tokenized once into a pool (`Haystack`) whose windows fill each prompt to its target length. A sample is built for a
target length in tokens (the whole prompt: instruction, haystack, needles, question and answer prefix, in the
tokenizer's chat template where it has one) and a needle depth in [0, 1] (0: the haystack's first token, 1: right
before the question); needles are inserted at the nearest sentence or line boundary. Each sample's answer is checked
never to occur in the question, the instruction or the haystack outside its needle(s) (a draw that leaks is drawn
again). The same seed gives the same samples; this module loads no torch (the command line validates with it).
"""
from __future__ import annotations

import random
import re
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydoc_data.topics import topics

TASKS = ("niah", "niah_words", "multikey", "kv", "vt", "copy")
HAYSTACK_TASKS = tuple(t for t in TASKS if t != "kv")
DEFAULT_HAYSTACK = "pydoc"
HELDOUT_HAYSTACK = "heldout"  # an artifact's held-out text: what its calibration never saw (kvtc eval --tasks)
MIN_LENGTH = 256          # the shortest prompt a task is built for
MIN_LENGTHS = {"multikey": 512}  # UUID needles take 80 tokens each in SmolLM2's tokenizer: a distractor and the key's
MIN_HAYSTACK = 16         # haystack tokens a prompt must keep beside its needles
POOL_TOKENS = 1 << 17     # the haystack pool: the source's first tokens, at least twice the longest length
DRAWS = 64                # draws per sample before a leaking answer is an error
VT_HOPS = 4               # RULER vt: one chain of 4 hops (5 variables)
COPY_TOKENS = 32          # the copied passage's length in haystack tokens (whole words kept)
_SENTENCE = re.compile(r"[.!?:;]$")

_ADJECTIVES = ("amber", "brave", "calm", "crimson", "dusty", "eager", "fancy", "gentle", "hollow", "icy", "jolly",
               "keen", "lively", "mellow", "nimble", "olive", "proud", "quiet", "rusty", "silver", "tidy", "upbeat",
               "vivid", "witty", "young", "zesty", "bitter", "cosmic", "dreamy", "frosty", "golden", "humble",
               "lunar", "misty", "noble", "polar", "rapid", "sandy", "tawny", "velvet")
_NOUNS = ("otter", "harbor", "lantern", "meadow", "falcon", "orchard", "pebble", "canyon", "comet", "dolphin",
          "glacier", "hammock", "island", "jackal", "kettle", "lagoon", "marble", "nectar", "oyster", "parrot",
          "quartz", "raven", "saddle", "tulip", "urchin", "violin", "walrus", "yonder", "zephyr", "badger",
          "cactus", "ember", "fjord", "gazelle", "heron", "igloo", "juniper", "koala", "lemur", "mango")


@dataclass(frozen=True)
class TaskSettings:
    """Which samples to build.

    tasks: names from TASKS; lengths: target prompt lengths in tokens (each >= MIN_LENGTH, multikey >= 512); samples: samples per
    (task, length); depths: the needle depths in [0, 1] the samples take in turn (None: `samples` depths spread
    evenly over [0, 1]); seed: the generator's seed; chat: wrap each prompt in the tokenizer's chat template where
    it has one; distractors: multikey's distractor needles (None: one per 256 tokens less one, at least 1)."""

    tasks: tuple[str, ...] = ("niah", "multikey", "kv", "vt", "copy")
    lengths: tuple[int, ...] = (1024, 2048)
    samples: int = 8
    depths: tuple[float, ...] | None = None
    seed: int = 0
    chat: bool = True
    distractors: int | None = None

    def __post_init__(self) -> None:
        bad = [t for t in self.tasks if t not in TASKS]
        if bad or not self.tasks:
            raise ValueError(f"unknown task {bad[0] if bad else '(none)'!r}; choose from {','.join(TASKS)}")
        if len(set(self.tasks)) != len(self.tasks):
            raise ValueError(f"a task is named twice in {','.join(self.tasks)}")
        for n in self.lengths:
            if isinstance(n, bool) or not isinstance(n, int) or n < MIN_LENGTH:
                raise ValueError(f"length {n!r}: a task prompt needs an integer of at least {MIN_LENGTH} tokens")
            for task in self.tasks:
                if n < MIN_LENGTHS.get(task, MIN_LENGTH):
                    raise ValueError(f"length {n}: task {task} needs prompts of at least {MIN_LENGTHS[task]} tokens")
        if not self.lengths:
            raise ValueError("no length given")
        if isinstance(self.samples, bool) or not isinstance(self.samples, int) or self.samples < 1:
            raise ValueError(f"samples must be an integer >= 1, got {self.samples!r}")
        for d in self.depths or ():
            if not isinstance(d, (int, float)) or isinstance(d, bool) or not 0.0 <= float(d) <= 1.0:
                raise ValueError(f"depth {d!r} is outside [0, 1] (0: the haystack's start, 1: right before the "
                                 "question)")
        if self.depths is not None and not self.depths:
            raise ValueError("depths is empty; pass None to spread them evenly")
        if self.distractors is not None and (not isinstance(self.distractors, int) or self.distractors < 0):
            raise ValueError(f"distractors must be an integer >= 0, got {self.distractors!r}")

    def depth(self, index: int) -> float:
        """The needle depth of sample `index` (of `samples`)."""
        if self.depths:
            return float(self.depths[index % len(self.depths)])
        return 0.5 if self.samples == 1 else index / (self.samples - 1)

    def check_context(self, context: int | None, model: str) -> None:
        """ValueError naming the first length beyond the model's context (None: not known cheaply, unchecked)."""
        for n in self.lengths:
            if context is not None and n >= context:
                raise ValueError(f"length {n}: a task prompt of {n} tokens and its answer exceed model {model}'s "
                                 f"context of {context} positions; use lengths below {context}")

    def check_supply(self, texts: Iterable[str], source: str) -> None:
        """ValueError naming the first length the haystack `texts` cannot supply for certain: a token holds at least
        one byte, so a text of fewer bytes than a prompt's tokens cannot fill it (the exact count, in the model's
        tokens, is checked when the haystack is tokenized). Reads only as much text as the longest length needs."""
        if not set(self.tasks) & set(HAYSTACK_TASKS):
            return
        need, have = max(self.lengths), 0
        for text in texts:
            have += len(text.encode("utf-8", "replace"))
            if have >= need:
                return
        raise ValueError(f"length {need}: the haystack {source!r} holds {have} bytes of text, fewer than the "
                         f"{need} tokens a prompt needs; use a shorter length or a larger haystack")


@dataclass(frozen=True)
class TaskSample:
    """One prompt of a retrieval task, and what answers it.

    task: a name of TASKS; length: the target prompt length (tokens); depth: the needle depth asked, in [0, 1];
    index: the sample's number within its (task, length); prompt: token ids, (n,) with n <= length (n == length for
    the haystack tasks; kv stops at its last whole pair); answer: the expected answer string; parts: the strings a
    generation must all contain (vt: each variable name; else (answer,)); exact: whether the generation must start
    with the answer (copy) rather than contain it; needle: (start, end) token span in `prompt` of the needle holding
    the answer (vt: the assignment of the value; kv: the queried pair); context: (start, end) token span of the
    haystack with its needles; placed: where the needle sits, the context tokens before it over the context tokens
    outside the needles, in [0, 1]; max_new: tokens to generate for an answer."""

    task: str
    length: int
    depth: float
    index: int
    prompt: tuple[int, ...]
    answer: str
    parts: tuple[str, ...]
    exact: bool
    needle: tuple[int, int]
    context: tuple[int, int]
    placed: float
    max_new: int

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"unknown task {self.task!r}")
        if not 0.0 <= self.depth <= 1.0 or not 0.0 <= self.placed <= 1.0:
            raise ValueError(f"depth {self.depth} and placed {self.placed} must lie in [0, 1]")
        if not self.prompt or len(self.prompt) > self.length:
            raise ValueError(f"a prompt of {len(self.prompt)} tokens for a target length of {self.length}")
        c0, c1 = self.context
        n0, n1 = self.needle
        if not 0 <= c0 <= n0 < n1 <= c1 <= len(self.prompt):
            raise ValueError(f"needle {self.needle} outside the context {self.context} of a {len(self.prompt)}-token "
                             "prompt")
        if not self.answer or not self.parts or not all(self.parts) or self.max_new < 1:
            raise ValueError("a sample needs an answer, its parts and max_new >= 1")

    def correct(self, text: str) -> bool:
        """Whether a generation answers the sample, as RULER and Lost in the Middle score: every part contained
        (case-insensitive); copy: the generation, whitespace-normalised, starts with the passage."""
        if self.exact:
            return _norm(text).startswith(_norm(self.answer))
        low = text.lower()
        return all(p.lower() in low for p in self.parts)

    def settled(self, text: str) -> bool:
        """Whether more tokens can no longer change `correct(text)`: already correct, or (copy) already wrong."""
        if self.exact:
            got, want = _norm(text), _norm(self.answer)
            return len(got) >= len(want) or not want.startswith(got)
        return self.correct(text)


def _norm(text: str) -> str:
    return " ".join(text.split())


@dataclass(frozen=True)
class Haystack:
    """A text source tokenized once. ids: the pool of token ids, (n,), documents joined by a blank line; breaks:
    (n + 1,) whether a needle may go before token i (after a line, or after a sentence's end followed by a space;
    both ends always); source: what the text is, for messages."""

    ids: tuple[int, ...]
    breaks: tuple[bool, ...] = field(repr=False)
    source: str = DEFAULT_HAYSTACK

    def __post_init__(self) -> None:
        if len(self.breaks) != len(self.ids) + 1 or not (self.breaks[0] and self.breaks[-1]):
            raise ValueError(f"a haystack of {len(self.ids)} tokens needs {len(self.ids) + 1} breaks, both ends set")

    @classmethod
    def build(cls, tokenizer: Any, texts: Iterable[str] | None = None, source: str = DEFAULT_HAYSTACK,
              tokens: int = POOL_TOKENS) -> "Haystack":
        """The first `tokens` tokens of `texts` (None: pydoc_data.topics, one document per topic, by key)."""
        if texts is None:
            texts = pydoc_texts()
        sep = _encode(tokenizer, "\n\n")
        ids: list[int] = []
        for text in texts:
            if text.strip():
                ids += (sep if ids else []) + _encode(tokenizer, text)
            if len(ids) >= tokens:
                break
        return cls.of_ids(tokenizer, ids[:tokens], source)

    @classmethod
    def of_ids(cls, tokenizer: Any, ids: Sequence[int], source: str = DEFAULT_HAYSTACK) -> "Haystack":
        """Token ids already cut -> their Haystack."""
        ids = [int(i) for i in ids]
        words = {i: tokenizer.decode([i]) for i in set(ids)}
        # a break before token j: after a line, or after a sentence's end followed by a space
        breaks = [True] + [words[a].endswith("\n") or (bool(_SENTENCE.search(words[a])) and words[b][:1].isspace())
                           for a, b in zip(ids, ids[1:])]
        return cls(tuple(ids), tuple(breaks + [True] if ids else [True]), source)

    def spot(self, offset: int, size: int, target: int) -> int:
        """The break in the window [offset, offset + size) nearest `target` (0..size, window-relative)."""
        reach = max(8, size // 32)
        for d in range(reach + 1):
            for at in (target - d, target + d):
                if 0 <= at <= size and (at in (0, size) or self.breaks[offset + at]):
                    return at
        return target


def pydoc_texts() -> list[str]:
    """The default haystack: Python's documentation prose, one text per topic, by key."""
    return [topics[k] for k in sorted(topics)]


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


_MARK = "\u2063KVTC-USER-CONTENT\u2063"


def _template(tokenizer: Any, chat: bool) -> tuple[str, str]:
    """(text before, text after) the user's content: the tokenizer's chat template with a generation prompt, or a
    plain prompt."""
    if chat and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": _MARK}], tokenize=False,
                                             add_generation_prompt=True)
        if isinstance(text, str) and text.count(_MARK) == 1:
            head, tail = text.split(_MARK)
            return head, tail
    return "", "\n"


def _uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _word(rng: random.Random) -> str:
    return f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"


@dataclass(frozen=True)
class _Draw:
    """One draw of a sample's content: the needles (depth, text) with the answer's at `target`, the instruction,
    question and answer prefix, the answer and its parts, and the strings that must occur nowhere but in needles."""

    needles: tuple[tuple[float, str], ...]
    target: int
    instruction: str
    question: str
    prefix: str
    answer: str
    parts: tuple[str, ...]
    secret: tuple[str, ...]
    exact: bool = False


def _draw(task: str, rng: random.Random, depth: float, length: int, settings: TaskSettings, passage: str = "") -> _Draw:
    """One random draw of a haystack task's content (kv: see `_kv_sample`)."""
    read = "Read the text below and answer the question after it.\n\n"
    if task in ("niah", "niah_words"):
        kind, key = ("number", _word(rng)) if task == "niah" else ("word", _word(rng))
        value = str(rng.randrange(10**6, 10**7)) if task == "niah" else _word(rng)
        if value == key:
            value = _word(rng) + "s"
        return _Draw(((depth, f"One of the special magic {kind}s for {key} is: {value}."),), 0,
                     "Some special magic " + kind + "s are hidden within the following text. Make sure to memorize "
                     "them. I will quiz you about the " + kind + "s afterwards.\n\n",
                     f"\n\nWhat is the special magic {kind} for {key} mentioned in the provided text?",
                     f"The special magic {kind} for {key} mentioned in the provided text is", value, (value,),
                     (value,))
    if task == "multikey":
        count = settings.distractors if settings.distractors is not None else max(1, length // 256 - 1)
        pairs = [(_uuid(rng), _uuid(rng)) for _ in range(count + 1)]
        depths = [depth] + [rng.random() for _ in range(count)]
        key, value = pairs[0]
        return _Draw(tuple((d, f"One of the special magic uuids for {k} is: {v}.") for d, (k, v) in zip(depths, pairs)),
                     0, "Some special magic uuids are hidden within the following text. Make sure to memorize them. "
                     "I will quiz you about the uuids afterwards.\n\n",
                     f"\n\nWhat is the special magic uuid for {key} mentioned in the provided text?",
                     f"The special magic uuid for {key} mentioned in the provided text is", value, (value,), (value,))
    if task == "vt":
        value = str(rng.randrange(10**4, 10**5))
        names: list[str] = []
        while len(names) < VT_HOPS + 1:
            name = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
            if name not in names:
                names.append(name)
        texts = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
        depths = [depth + (1.0 - depth) * i / (VT_HOPS + 1) for i in range(VT_HOPS + 1)]
        return _Draw(tuple(zip(depths, texts)), 0,
                     "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n",
                     f"\n\nQuestion: Find all variables that are assigned the value {value} in the text above.",
                     f"Answer: According to the chain(s) of variable assignment in the text above, {VT_HOPS + 1} "
                     f"variables are assigned the value {value}, they are:", " ".join(names), tuple(names),
                     tuple(names))
    if task == "copy":
        key = _word(rng)
        return _Draw(((depth, f'The passage with code {key} is: "{passage}"'),), 0, read,
                     f"\n\nRepeat word for word the passage with code {key}.",
                     f'The passage with code {key} is: "', passage, (passage,), (passage, passage[:40]), exact=True)
    raise ValueError(f"unknown task {task!r}")


def _leaks(secret: Sequence[str], texts: Iterable[str]) -> bool:
    low = [s.lower() for s in secret]
    return any(s in t.lower() for t in texts for s in low)


def _passage(rng: random.Random, hay: Haystack, tokenizer: Any, avoid: tuple[int, int]) -> str | None:
    """A passage of COPY_TOKENS haystack tokens outside the window `avoid`, cut to whole words; None where the pool
    holds no room outside the window, "" where the drawn span holds fewer than 5 whole words (code, tables: draw
    again)."""
    n = len(hay.ids)
    free = [(0, avoid[0]), (avoid[1], n)]
    free = [(a, b) for a, b in free if b - a >= COPY_TOKENS + 2]
    if not free:
        return None
    a, b = rng.choice(free)
    start = rng.randrange(a, b - COPY_TOKENS - 1)
    words = tokenizer.decode(list(hay.ids[start:start + COPY_TOKENS + 2])).replace('"', "'").split()
    words = words[1:-1]  # the first and last words may be cut
    return " ".join(words) if len(words) >= 5 else ""


def make_sample(task: str, tokenizer: Any, hay: Haystack | None, length: int, depth: float, index: int,
                settings: TaskSettings) -> TaskSample:
    """One sample of `task` for a prompt of `length` tokens with its needle at `depth` (deterministic in the
    settings' seed, the task, the length and the index)."""
    rng = random.Random(f"kvtc-tasks:{settings.seed}:{task}:{length}:{index}")
    head_t, tail_t = _template(tokenizer, settings.chat)
    if task == "kv":
        return _kv_sample(rng, tokenizer, head_t, tail_t, length, depth, index)
    if hay is None or not hay.ids:
        raise ValueError(f"task {task} needs a haystack")
    for _ in range(DRAWS):
        passage = ""
        if task == "copy":
            size_guess = length  # the window is at most the prompt; the passage comes from outside it
            offset_guess = rng.randrange(0, max(1, len(hay.ids) - size_guess + 1))
            passage = _passage(rng, hay, tokenizer, (offset_guess, offset_guess + size_guess))
            if passage == "":
                continue  # too few words in the drawn span: draw again
            if passage is None:
                raise ValueError(f"length {length}: the haystack {hay.source!r} ({len(hay.ids)} tokens) leaves no "
                                 "passage to copy outside the prompt's window; use a shorter length or a larger "
                                 "haystack")
        d = _draw(task, rng, depth, length, settings, passage)
        head = _encode(tokenizer, head_t + d.instruction)
        tail = _encode(tokenizer, d.question + tail_t + d.prefix)
        needles = [_encode(tokenizer, "\n" + text + "\n") for _, text in d.needles]
        size = length - len(head) - len(tail) - sum(len(n) for n in needles)
        if size < MIN_HAYSTACK:
            raise ValueError(f"length {length}: a {task} prompt needs {length - size + MIN_HAYSTACK} tokens or more "
                             "here; use a longer length")
        if size > len(hay.ids):
            raise ValueError(f"length {length}: the haystack {hay.source!r} supplies {len(hay.ids)} tokens, fewer than "
                             f"the {size} this {task} prompt needs; use a shorter length or a larger haystack")
        offset = offset_guess if task == "copy" and offset_guess + size <= len(hay.ids) else \
            rng.randrange(0, len(hay.ids) - size + 1)
        window = list(hay.ids[offset:offset + size])
        others = [] if task == "vt" else [text for i, (_, text) in enumerate(d.needles) if i != d.target]  # vt: a chain
        if _leaks(d.secret, [tokenizer.decode(window), head_t + d.instruction, d.question + tail_t + d.prefix,
                             *others]):
            continue
        spots = [hay.spot(offset, size, round(dep * size)) for dep, _ in d.needles]
        order = sorted(range(len(needles)), key=lambda i: (spots[i], i))
        prompt, cut = list(head), 0
        needle = (0, 0)
        for i in order:
            prompt += window[cut:spots[i]]
            cut = spots[i]
            if i == d.target:
                needle = (len(prompt), len(prompt) + len(needles[i]))
            prompt += needles[i]
        prompt += window[cut:]
        context = (len(head), len(prompt))
        prompt += tail
        text = tokenizer.decode(prompt)
        wanted = sum(t.lower().count(s.lower()) for s in d.secret[:1] for _, t in d.needles)
        if text.lower().count(d.secret[0].lower()) != wanted:
            continue  # the answer formed across a join: draw again
        return TaskSample(task, length, float(depth), index, tuple(prompt), d.answer, d.parts, d.exact, needle,
                          context, spots[d.target] / size, _max_new(tokenizer, d.answer, d.exact))
    raise ValueError(f"task {task}, length {length}: every one of {DRAWS} draws leaked its answer into the haystack "
                     f"{hay.source!r}" + (" or drew a passage of fewer than 5 whole words" if task == "copy" else "")
                     + "; use another haystack")


def _max_new(tokenizer: Any, answer: str, exact: bool) -> int:
    """Tokens to generate: the answer's own (as a continuation) and a margin for what models say before it."""
    return len(_encode(tokenizer, " " + answer)) + (4 if exact else 12)


def _kv_sample(rng: random.Random, tokenizer: Any, head_t: str, tail_t: str, length: int, depth: float,
               index: int) -> TaskSample:
    """Lost in the Middle's key-value retrieval: as many UUID pairs as the length holds, the queried one at `depth`."""
    instruction = ("Extract the value corresponding to the specified key in the JSON object below.\n\n"
                   "JSON data:\n{")
    head = _encode(tokenizer, head_t + instruction)
    for _ in range(DRAWS):
        pairs: list[tuple[str, str]] = []
        pieces: list[list[int]] = []
        room = length - len(head) - len(_encode(tokenizer, f'}}\n\nKey: "{_uuid(rng)}"\nCorresponding value:'
                                                             + tail_t + '"'))
        while True:
            k, v = _uuid(rng), _uuid(rng)
            piece = _encode(tokenizer, f'{"," if pairs else ""}\n"{k}": "{v}"')
            if len(piece) > room:
                break
            pairs.append((k, v))
            pieces.append(piece)
            room -= len(piece)
        while True:  # the queried key's own tokens may outnumber the probe's: drop pairs from the end until it fits
            if len(pairs) < 2:
                raise ValueError(f"length {length}: too short for a key-value retrieval prompt; use a longer length")
            target = round(depth * (len(pairs) - 1))
            key, value = pairs[target]
            tail = _encode(tokenizer, f'}}\n\nKey: "{key}"\nCorresponding value:' + tail_t + '"')
            if len(head) + sum(len(p) for p in pieces) + len(tail) <= length:
                break
            pairs.pop()
            pieces.pop()
        if len({x for p in pairs for x in p}) != 2 * len(pairs):
            continue
        prompt = list(head)
        for i, piece in enumerate(pieces):
            if i == target:
                needle = (len(prompt), len(prompt) + len(piece))
            prompt += piece
        context = (len(head), len(prompt))
        prompt += tail
        if tokenizer.decode(prompt).count(value) != 1:
            continue
        return TaskSample("kv", length, float(depth), index, tuple(prompt), value, (value,), False, needle, context,
                          target / (len(pairs) - 1), _max_new(tokenizer, value, False))
    raise ValueError(f"length {length}: no key-value prompt could be drawn")


def generate(tokenizer: Any, settings: TaskSettings, texts: Iterable[str] | None = None,
             source: str = DEFAULT_HAYSTACK) -> list[TaskSample]:
    """Every sample of the settings, by task, length and index: `samples` per (task, length), depths by
    `settings.depth`. texts: the haystack's documents (None: pydoc_data.topics); tokenized once."""
    hay = None
    if set(settings.tasks) & set(HAYSTACK_TASKS):
        hay = Haystack.build(tokenizer, texts, source, max(POOL_TOKENS, 2 * max(settings.lengths)))
    return [make_sample(task, tokenizer, hay, length, settings.depth(i), i, settings)
            for task in settings.tasks for length in settings.lengths for i in range(settings.samples)]
