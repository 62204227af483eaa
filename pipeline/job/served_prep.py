"""The served check's raw half, which needs the model and the held-out text but not the artifact: the model loaded
in the driver, each scored sequence's prefix run through it once (its raw cache and the raw cache's log-probabilities
of the continuation, model_quality.RawPrefix), and the long window chosen, its needles planted, its prefix run and
its needles asked through the raw cache. The main job starts it while its fold still runs, once the shards are all
handed out and a worker on this node has none left (`ray_pool.run_pool`'s on_idle): the fold's last shards leave
cores idle there, and the raw half is about a third of the check. Where none is idle, the check runs it after the
reduce as before, beside staging the artifact (`served_check.served_quality`)."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from kvtc.kernels.codec import rans
from kvtc.pipeline.evaluation.long_context import long_bytes, longest_window
from kvtc.pipeline.evaluation.model_quality import RawPrefix, build_cache, raw_prefix
from kvtc.pipeline.evaluation.needle_window import PlantedWindow, answers, plant
from kvtc.pipeline.job import fold_plan
from kvtc.workers import models

NEEDLES = 8  # needles planted in the long window, each asked through the raw cache and the chunk path at every ratio
SERVED_TOKENS = 1024  # the scored sequences' tokens (prefix, continuation, one): a longer calibration's first ones
# the long window's most tokens: half the default calibration's sequence length. The window is coded through every path at
# every ratio, a cost linear in its tokens (the embedded model's whole 8K context: 81 s of a 2-core CPU, 4K: 42 s);
# `kvtc eval --prefix` and `--tasks --lengths` measure any longer context
LONG_TOKENS = 4096


class Cancelled(Exception):
    """The raw half stopped by `ServedPrep.cancel`."""


@dataclass
class LongRaw:
    """The long window's raw half: its tokens, the needles planted in its prefix (None: none fit), its RawPrefix and
    each needle's (found, answer NLL) through the raw cache."""

    length: int
    planted: PlantedWindow | None
    raw: RawPrefix
    answers: list[tuple[bool, float]] | None


@dataclass
class Prepared:
    """What the check scores through the codec: the loaded model, the scored sequences' RawPrefix, the long window's
    (None where no window is longer than they are), the held-out shards they came from, seconds per stage."""

    lm: Any
    sequences: list[RawPrefix]
    long: LongRaw | None
    shards: list[str]
    seconds: dict[str, float] = field(default_factory=dict)
    early: bool = False  # run beside the fold


def free_bytes() -> int:
    return max(0, fold_plan.node_now()[0])


def scored_tokens(seq_len: int) -> int:
    """Tokens of each scored sequence: the calibration's first SERVED_TOKENS."""
    return min(int(seq_len or SERVED_TOKENS), SERVED_TOKENS)


def long_limit(lm: Any, heldout: list[np.ndarray]) -> int:
    """The long window's most tokens: the model's context, the held-out text and LONG_TOKENS, whichever is least."""
    return min(int(lm.max_positions or LONG_TOKENS), sum(len(s) for s in heldout), LONG_TOKENS)


def plant_needles(tokenizer: Any, held: list[int], length: int, prefix: int) -> PlantedWindow | None:
    """NEEDLES needles planted in the first `prefix` tokens of held[:length], halving where a short window (a tiny
    model's) holds fewer -> the planted window, or None where none fits."""
    count = NEEDLES
    while count:
        try:
            return plant(tokenizer, held[:length], prefix, count)
        except ValueError:
            count //= 2
    return None


def prepare(lm: Any, heldout: list[np.ndarray], count: int, continuation: int, seq_len: int,
            free: int | None = None, seconds: dict | None = None) -> tuple[list[RawPrefix], LongRaw | None]:
    """The raw half for the held-out sequences `heldout` (in plan order): the first `count`, each cut to
    `scored_tokens(seq_len)`, and the long window (long_context.longest_window of at most LONG_TOKENS, within `free`
    bytes, default the node's now) -> (their RawPrefix, the long window's LongRaw or None)."""
    seconds = {} if seconds is None else seconds
    t0 = time.perf_counter()
    length = scored_tokens(seq_len)
    seqs = [raw_prefix(lm, s[:length], continuation) for s in heldout[:count]]
    if not seqs:
        raise ValueError(f"the held-out text holds no sequence of {length} tokens to score")
    seconds["raw_score"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    held = [int(t) for s in heldout for t in s][:long_limit(lm, heldout)]
    window = longest_window(lm, len(held), free_bytes() if free is None else free, length)
    if window is None:
        return seqs, None
    planted = plant_needles(lm.tokenizer, held, window, window - continuation - 1)
    raw = raw_prefix(lm, list(planted.ids) if planted else held[:window], continuation)
    got = None if planted is None else answers(lm, lambda: build_cache(lm.model, raw.keys, raw.values, **raw.state),
                                                 planted, packed=not raw.state)
    seconds["raw_long"] = time.perf_counter() - t1
    return seqs, LongRaw(window, planted, raw, got)


class ServedPrep:
    """The raw half of one job's served check, started early in a thread of the driver (`start`) or run when the
    check asks for it (`result`). The fold hands it the held-out sequences as it plans them (`add_heldout`)."""

    def __init__(self, model_spec: str, dtype: str | None, cache_dir: str | None, count: int, continuation: int,
                 seq_len: int, source: Callable[[Any, int | None], list] | None = None) -> None:
        """source: (tokenizer, the model's context) -> the held-out sequences, read once the model is loaded, for a
        check whose held-out text is an artifact's (else the fold's, `add_heldout`)."""
        self.model_spec, self.dtype, self.cache_dir = model_spec, dtype, cache_dir
        self.count, self.continuation, self.seq_len = count, continuation, seq_len
        self.source = source
        self.heldout: list[np.ndarray] = []
        self.shards: list[str] = []
        self._thread: threading.Thread | None = None
        self._done: Prepared | BaseException | None = None
        self._threads = 1  # the torch threads the raw half should run on now (`result` raises it when it waits)
        self._stop: str | None = None  # "cancel": the check will not run; "defer": the check runs it later
        self._reserved = 0  # bytes an early raw half may still take (long_context.long_bytes of its window)

    def add_heldout(self, shard_id: str, input_ids: np.ndarray) -> None:
        """A held-out shard's sequences (S, T), in plan order."""
        self.shards.append(shard_id)
        self.heldout.extend(np.asarray(s) for s in input_ids)

    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self, threads: int, early: bool = False) -> None:
        """Run the raw half in a thread on `threads` torch threads (early: beside the fold, where it stops after the
        model's load when the node's memory now holds a shorter long window than the whole context: the check then
        runs the rest later). Once."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, args=(threads, early), name="kvtc-served-prep", daemon=True)
        self._thread.start()

    def cancel(self) -> None:
        """Stop the raw half at its next layer (a check that will not run: its memory and cores go back now)."""
        self._halt("cancel")

    def defer(self) -> None:
        """Stop an early raw half at its next layer, its memory given back; the check runs it when it asks (`result`)."""
        self._halt("defer")

    def _halt(self, how: str) -> None:
        self._stop = how
        if self._thread is not None:
            self._thread.join()

    def reserved_bytes(self) -> int:
        """Bytes a running early raw half may still take beside what the node already counts as used (0 once done)."""
        return self._reserved if self._thread is not None and self._thread.is_alive() else 0

    def _follow_threads(self, *_: Any) -> None:
        """A decoder layer's pre-hook in the raw half's thread: torch's thread count is per thread, so the thread
        itself takes up the count `result` asks for (all the driver's cores once the check waits for it); a
        cancelled or deferred raw half stops here."""
        if self._stop is not None:
            raise Cancelled("the served check does not run" if self._stop == "cancel" else "deferred")
        if torch.get_num_threads() != self._threads:
            torch.set_num_threads(self._threads)

    def _run(self, threads: int, early: bool) -> None:
        before = torch.get_num_threads()
        self._threads = max(1, threads)
        torch.set_num_threads(self._threads)
        hooks: list = []
        try:
            t0 = time.perf_counter()
            lm = models.load_model(self.model_spec, dtype=self.dtype, cache_dir=self.cache_dir)
            hooks = [m.register_forward_pre_hook(self._follow_threads) for m in lm.model.modules()
                     if type(m).__name__.endswith("DecoderLayer")]
            done = Prepared(lm, [], None, list(self.shards), {"model": time.perf_counter() - t0}, early)
            t1 = time.perf_counter()
            rans.warm_up()  # the coded half's entropy coder, compiled here (seconds in a fresh environment) not there
            done.seconds["compile"] = time.perf_counter() - t1
            if self.source is not None:
                self.heldout = [np.asarray(s) for s in self.source(lm.tokenizer, lm.max_positions)]
            whole = long_limit(lm, self.heldout)
            if early and whole:
                self._reserved = long_bytes(lm, whole)
                if self._reserved > free_bytes():
                    self._done = done  # the raw half waits for the memory the fold holds now
                    return
            try:
                done.sequences, done.long = prepare(lm, self.heldout, self.count, self.continuation, self.seq_len,
                                                    seconds=done.seconds)
            except Cancelled:
                if self._stop != "defer":
                    raise
                done.sequences, done.long = [], None  # the check runs it after the reduce
            self._done = done
        except BaseException as exc:  # noqa: BLE001 - handed to the check, which reports it (or raises it) in the driver
            self._done = exc
        finally:
            self._reserved = 0
            for h in hooks:
                h.remove()
            torch.set_num_threads(before)

    def result(self, threads: int | None = None) -> Prepared:
        """The raw half: waited for where it was started, else run now (on `threads`, default torch's)."""
        if self._stop == "defer":
            self._stop = None
        if self._thread is None:
            self.start(threads or torch.get_num_threads())
        self._threads = max(self._threads, threads or torch.get_num_threads())
        self._thread.join()
        done = self._done
        if isinstance(done, BaseException):
            raise done
        if not done.sequences:  # stopped after the model's load (start's early), or never ran
            before = torch.get_num_threads()
            if threads:
                torch.set_num_threads(threads)
            try:
                done.sequences, done.long = prepare(done.lm, self.heldout, self.count, self.continuation, self.seq_len,
                                                    seconds=done.seconds)
            finally:
                torch.set_num_threads(before)
            done.early = False
        return done
