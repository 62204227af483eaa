"""Pack a corpus into fixed-length token sequences, grouped into shards with content-derived ids.

Order: documents are shuffled with a seeded buffer of `shuffle_buffer` documents (a full shuffle
for corpora that fit in it), so the stream never has to be read whole.
Packing: each document's tokens are followed by the tokenizer's eos; the token stream is cut into
sequences of seq_len tokens, each starting with the tokenizer's bos when it has one; the incomplete
tail is dropped. Reading stops once max_tokens tokens (sequences x seq_len) have been packed.
Shards: `seqs_per_shard` consecutive sequences (the last shard may hold fewer); id = first 16 hex
digits of sha256(seq_len, little-endian int64 tokens).
Holdout: a shard is held out when int(sha256(id)) / 2**256 < holdout_fraction, so the choice of a
shard never changes when the corpus is extended. When the stream ends with fewer than
`min_holdout_shards` held out, the last shards not yet held out are held out too (latest first);
when it ends with none left for training, the last shard trains. To make that possible the
stream is yielded `max(min_holdout_shards, 1)` shards behind.
"""
from __future__ import annotations

import hashlib
import random
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtc.pipeline.job.corpus import ReadCounts, Document, iter_documents

if TYPE_CHECKING:
    from kvtc.pipeline.settings import JobSettings

ID_HEX_DIGITS = 16


@dataclass(frozen=True)
class ShardSettings:
    seq_len: int = 1024
    seqs_per_shard: int = 8
    max_tokens: int | None = None
    seed: int = 0
    holdout_fraction: float = 0.125
    min_holdout_shards: int = 1
    shuffle_buffer: int = 1024
    text_column: str | None = None

    def __post_init__(self) -> None:
        if self.seq_len < 2:
            raise ValueError(f"seq_len must be at least 2, got {self.seq_len}")
        if self.seqs_per_shard < 1:
            raise ValueError(f"seqs_per_shard must be at least 1, got {self.seqs_per_shard}")
        if self.max_tokens is not None and self.max_tokens < self.seq_len:
            raise ValueError(f"max_tokens={self.max_tokens} is below seq_len={self.seq_len}: not one sequence fits")
        if not 0.0 <= self.holdout_fraction < 1.0:
            raise ValueError(f"holdout_fraction must be in [0, 1), got {self.holdout_fraction}")
        if self.min_holdout_shards < 0:
            raise ValueError(f"min_holdout_shards must be >= 0, got {self.min_holdout_shards}")
        if self.shuffle_buffer < 1:
            raise ValueError(f"shuffle_buffer must be at least 1 (1 keeps the corpus order), got {self.shuffle_buffer}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, eq=False)
class Shard:
    """input_ids: (S, T) int64, S <= seqs_per_shard sequences of T = seq_len tokens."""

    id: str
    index: int
    input_ids: np.ndarray
    holdout: bool

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.size)

    def to_payload(self) -> dict[str, Any]:
        """Primitives only (safe to send through Ray or JSON-like channels without pickling this class)."""
        return {"id": self.id, "index": self.index, "holdout": self.holdout, "shape": list(self.input_ids.shape),
                "dtype": "<i8", "tokens": np.ascontiguousarray(self.input_ids, dtype="<i8").tobytes()}

    @classmethod
    def from_payload(cls, payload: dict[str, Any]) -> Shard:
        shape = tuple(int(n) for n in payload["shape"])
        if len(shape) != 2 or payload.get("dtype", "<i8") != "<i8":
            raise ValueError(f"shard payload must hold <i8 tokens of shape (S, T), got {payload.get('dtype')} {shape}")
        ids = np.frombuffer(payload["tokens"], dtype="<i8").astype(np.int64).reshape(shape)
        if shard_id(ids) != payload["id"]:
            raise ValueError(f"shard payload {payload['id']!r} is corrupt: its tokens hash to {shard_id(ids)!r}")
        return cls(id=payload["id"], index=int(payload["index"]), input_ids=ids, holdout=bool(payload["holdout"]))


def shard_id(input_ids: np.ndarray) -> str:
    """Short hex sha256 of seq_len and the little-endian int64 tokens of an (S, T) array."""
    digest = hashlib.sha256(f"seq_len={input_ids.shape[1]};".encode())
    digest.update(np.ascontiguousarray(input_ids, dtype="<i8").tobytes())
    return digest.hexdigest()[:ID_HEX_DIGITS]


def is_holdout(identifier: str, holdout_fraction: float) -> bool:
    return int(hashlib.sha256(identifier.encode()).hexdigest(), 16) / 2**256 < holdout_fraction


@dataclass
class PackCounts(ReadCounts):
    """ReadCounts plus packing counts; `forced` lists the ids whose holdout flag the end-of-stream rule set."""

    tokens_read: int = 0
    sequences: int = 0
    shards: int = 0
    holdout_shards: int = 0
    forced: list[str] = field(default_factory=list)


def make_shards(spec: str, tokenizer: Any, seq_len: int = 1024, seqs_per_shard: int = 8, max_tokens: int | None = None,
                seed: int = 0, text_column: str | None = None, holdout_fraction: float = 0.125, *,
                min_holdout_shards: int = 1, max_seq_len: int | None = None, shuffle_buffer: int = 1024,
                counts: PackCounts | None = None, pkgdocs: Sequence[str] | None = None) -> Iterator[Shard]:
    """Stream the shards of corpus `spec`; max_seq_len is the model's limit (e.g. LoadedModel.max_positions);
    pkgdocs: a recorded corpus's distributions (corpus.iter_documents)."""
    if max_seq_len is not None and seq_len > max_seq_len:
        raise ValueError(f"seq_len={seq_len} exceeds the model's maximum of {max_seq_len} positions; lower seq_len")
    settings = ShardSettings(seq_len, seqs_per_shard, max_tokens, seed, holdout_fraction, min_holdout_shards,
                             shuffle_buffer, text_column)
    if getattr(tokenizer, "eos_token_id", None) is None:
        raise ValueError("the tokenizer has no eos token to separate documents; set tokenizer.eos_token")
    counts = counts if counts is not None else PackCounts()
    documents = iter_documents(spec, text_column, counts, pkgdocs)
    return _holdout_stream(_shard_stream(_pack(shuffled(documents, seed, shuffle_buffer), tokenizer, settings, counts),
                                         settings, counts), settings, counts, spec)


def shuffled(documents: Iterable[Document], seed: int, buffer_size: int) -> Iterator[Document]:
    """Seeded buffer shuffle: each output is drawn at random from the next `buffer_size` pending documents."""
    rng, buffer = random.Random(seed), []
    for doc in documents:
        if len(buffer) < buffer_size:
            buffer.append(doc)
            continue
        j = rng.randrange(buffer_size)
        yield buffer[j]
        buffer[j] = doc
    rng.shuffle(buffer)
    yield from buffer


def _encode(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    try:
        return tokenizer(texts, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    except TypeError:
        return tokenizer(texts, add_special_tokens=False)["input_ids"]


def _pack(documents: Iterator[Document], tokenizer: Any, settings: ShardSettings,
          counts: PackCounts) -> Iterator[np.ndarray]:
    """Yield (T,) int64 sequences."""
    bos, eos = getattr(tokenizer, "bos_token_id", None), int(tokenizer.eos_token_id)
    prefix = [] if bos is None else [int(bos)]
    body = settings.seq_len - len(prefix)
    limit = None if settings.max_tokens is None else settings.max_tokens // settings.seq_len
    pending: list[int] = []
    batch, batch_chars = [], 0
    for doc in _end_marked(documents):
        if doc is not None:
            batch.append(doc.text)
            batch_chars += len(doc.text)
            # grow batches slowly so a small max_tokens does not tokenize much more than it needs
            if len(batch) < min(64, 1 + counts.sequences) and batch_chars < 200_000:
                continue
        if not batch:
            break
        for ids in _encode(tokenizer, batch):
            pending.extend(ids)
            pending.append(eos)
            counts.tokens_read += len(ids) + 1
        batch, batch_chars = [], 0
        start = 0
        while len(pending) - start >= body:
            yield np.asarray(prefix + pending[start:start + body], dtype=np.int64)
            start += body
            counts.sequences += 1
            if limit is not None and counts.sequences >= limit:
                return
        del pending[:start]
    if counts.sequences == 0:
        raise ValueError(f"the corpus yields no complete sequence of seq_len={settings.seq_len} tokens "
                         f"({counts.tokens_read} tokens read); lower seq_len or add documents")


def _end_marked(documents: Iterator[Document]) -> Iterator[Document | None]:
    yield from documents
    yield None


def _shard_stream(sequences: Iterator[np.ndarray], settings: ShardSettings, counts: PackCounts) -> Iterator[Shard]:
    rows: list[np.ndarray] = []
    for row in _end_marked(sequences):
        if row is not None:
            rows.append(row)
        if rows and (row is None or len(rows) == settings.seqs_per_shard):
            ids = np.stack(rows)
            identifier = shard_id(ids)
            yield Shard(identifier, counts.shards, ids, is_holdout(identifier, settings.holdout_fraction))
            counts.shards += 1
            rows = []


def _holdout_stream(shards: Iterator[Shard], settings: ShardSettings, counts: PackCounts, spec: str) -> Iterator[Shard]:
    lag = max(settings.min_holdout_shards, 1)
    pending: deque[Shard] = deque()
    chosen = 0
    for shard in shards:
        pending.append(shard)
        chosen += shard.holdout
        if len(pending) > lag:
            yield _counted(pending.popleft(), counts)
    total = counts.shards
    if total < settings.min_holdout_shards + 1:
        raise ValueError(f"corpus {spec!r} gives {total} shard(s) but needs at least {settings.min_holdout_shards + 1} "
                         f"(min_holdout_shards={settings.min_holdout_shards} plus one to train on); "
                         "raise max_tokens or lower seqs_per_shard")
    tail = list(pending)
    for i in reversed(range(len(tail))):
        if chosen < settings.min_holdout_shards and not tail[i].holdout:
            tail[i], chosen = replace(tail[i], holdout=True), chosen + 1
            counts.forced.append(tail[i].id)
    if chosen == total:
        tail[-1] = replace(tail[-1], holdout=False)
        counts.forced.append(tail[-1].id)
    for shard in tail:
        yield _counted(shard, counts)


def _counted(shard: Shard, counts: PackCounts) -> Shard:
    counts.holdout_shards += shard.holdout
    return shard


DEFAULT_EVAL_SEQS = 4  # sequences of the second domain when no eval token count is given,
DEFAULT_EVAL_MOST = 4096  # and no more tokens than this unless one sequence is longer


@dataclass(frozen=True)
class ShardPlan:
    """What a calibration cuts into shards: `tokens` of `corpus` (train and held-out shards) and
    `eval_tokens` (default DEFAULT_EVAL_SEQS sequences, DEFAULT_EVAL_MOST tokens at most unless one sequence is
    longer) of `eval_corpus` (eval shards)."""

    corpus: str
    tokens: int
    eval_corpus: str | None
    eval_tokens: int | None
    seq_len: int
    seqs_per_shard: int
    seed: int
    holdout_fraction: float
    text_column: str | None = None
    pkgdocs: tuple[str, ...] | None = None  # a recorded corpus's distributions (rebuilding its held-out text)

    def __post_init__(self) -> None:
        if self.tokens < self.seq_len:
            raise ValueError(f"tokens {self.tokens} is below one sequence of seq_len {self.seq_len}")
        if not 0 < self.holdout_fraction < 1:
            raise ValueError(f"holdout fraction must be in (0, 1), got {self.holdout_fraction}")

    @property
    def eval_budget(self) -> int:
        return self.eval_tokens or max(self.seq_len, min(DEFAULT_EVAL_SEQS * self.seq_len, DEFAULT_EVAL_MOST))

    @property
    def most_shards(self) -> int:
        """Shards this plan cuts at most (fewer where a corpus runs out): the progress bar's total."""
        per = self.seq_len * self.seqs_per_shard
        return -(-self.tokens // per) + (-(-self.eval_budget // per) if self.eval_corpus else 0)


def plan_shards(plan: ShardPlan, tokenizer: Any, max_seq_len: int | None = None,
                duplicates: list[str] | None = None) -> Iterator[tuple[str, Shard]]:
    """The one shard plan of a calibration: (role, shard) with role "train", "heldout" or "eval", in
    stream order, the training corpus first. A shard whose tokens repeat an earlier shard's is
    skipped (its id is appended to `duplicates`): identical tokens fold once."""
    seen: set[str] = set()
    domains = [(plan.corpus, plan.tokens, False)]
    if plan.eval_corpus:
        domains.append((plan.eval_corpus, plan.eval_budget, True))
    for spec, budget, is_eval in domains:
        for shard in make_shards(spec, tokenizer, seq_len=plan.seq_len, seqs_per_shard=plan.seqs_per_shard,
                                 max_tokens=budget, seed=plan.seed, text_column=plan.text_column,
                                 holdout_fraction=0.0 if is_eval else plan.holdout_fraction,
                                 min_holdout_shards=0 if is_eval else 1, max_seq_len=max_seq_len,
                                 pkgdocs=None if is_eval else plan.pkgdocs):
            if shard.id in seen:
                if duplicates is not None:
                    duplicates.append(shard.id)
                continue
            seen.add(shard.id)
            yield ("eval" if is_eval else "heldout" if shard.holdout else "train"), shard


def shard_plan(cfg: JobSettings, tokens: int, pkgdocs: Sequence[str] | None = None) -> ShardPlan:
    """The job's ShardPlan for `tokens` training-corpus tokens; pkgdocs: a recorded corpus's distributions."""
    p = cfg.plan
    return ShardPlan(corpus=p.corpus, tokens=tokens, eval_corpus=p.eval_corpus, eval_tokens=p.eval_tokens,
                     seq_len=p.seq_len, seqs_per_shard=p.seqs_per_shard, seed=cfg.capture.seed,
                     holdout_fraction=p.holdout_fraction, text_column=p.text_column,
                     pkgdocs=None if pkgdocs is None else tuple(pkgdocs))
