"""The retrieval task suite (kvtc.pipeline.evaluation.tasks) scored the way users judge a KV codec: the raw model
prefills each prompt once; its cache then reaches greedy decoding through each path (`CachePath`) and the answer is
scored as RULER and Lost in the Middle score it (`TaskSample.correct`), the raw cache beside every served one.

Paths (`served_paths`), each at every ratio of an artifact:

- offline  the whole prompt cache through the offline codec `KVTCCodec` (sinks and the last window raw), as
           `kvtc eval` scores it;
- chunk    256-token chunks as `kvtc lmcache-server` and the vLLM tier store them (`ChunkTransform`,
           kvtc.pipeline.evaluation.served.chunk_path: bf16, the first chunk's sinks raw, no recent window);
- cache    the live `KVTCCache` (kvtc.kernels.integrations.kvtc_cache) given the prompt's cache as one prefill: it
           codes all but its recent window and keeps coding while the answer is generated (`hold_decoded`: its
           coded tokens decoded once per coding instead of at every step, the same answers).

Decoding feeds the prompt's last token on the restored cache, then each argmax, up to the sample's `max_new`
tokens; it stops early at an end-of-sequence token or once the answer is settled (`TaskSample.settled`): correct,
or (copy) wrong beyond repair. `task_rows` reports per task x length x path x ratio the correct count, the accuracy,
its 95% Wilson interval and the raw cache's accuracy beside it, and the graded form of the same retrieval: the
answer's NLL teacher-forced through each path over the raw cache's on the same samples (`answer_nll`, a paired
interval that separates paths on far fewer samples than exact match); a cell whose raw accuracy is below 50% carries the
note "raw model cannot do this" (its served figure says nothing of the codec, so by default no path codes such a
cell: `score_tasks` answers each cell from the raw cache first, coding is most of the suite's cost). `task_chart` draws accuracy against
context length, one panel per task, one line per path and ratio and the raw cache (RULER's figure).
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm

from kvtc.kernels.codec.kvtc_codec import KVTCCodec
from kvtc.pipeline.evaluation import charts
from kvtc.pipeline.evaluation.metrics import mean_interval
from kvtc.pipeline.evaluation.model_quality import _forward, build_cache, prefix_state
from kvtc.pipeline.evaluation.served import chunk_path, chunk_transform
from kvtc.pipeline.evaluation.tasks import TaskSample
from kvtc.workers.capture import raw_cache

PATHS = ("offline", "chunk", "cache")
RAW = "raw"
CANNOT = "raw model cannot do this"
Z95 = 1.959963984540054
NOT_SCORED = "served paths not scored"
KEEP_BYTES = 1 << 31  # prefilled caches a cell keeps for its paths


@dataclass(frozen=True)
class CachePath:
    """How a prompt's cache reaches decoding.

    name: the path ("offline", "chunk", "cache", or a caller's own; not "raw"); ratio: its target compression ratio
    (None: not a codec); restore: keys, values (L, H, T, D) as the raw prefill cached them (keys with RoPE, model
    dtype) -> (keys, values) of the same shapes as the path gives them back; live: (model config, keys, values) -> a
    transformers Cache holding them that codes as it is used (KVTCCache). Exactly one of restore and live."""

    name: str
    ratio: float | None
    restore: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None
    live: Callable[[Any, torch.Tensor, torch.Tensor], Any] | None = None

    def __post_init__(self) -> None:
        if not self.name or self.name == RAW:
            raise ValueError(f"a path needs a name other than {RAW!r}, got {self.name!r}")
        if (self.restore is None) == (self.live is None):
            raise ValueError(f"path {self.name}: give exactly one of restore and live")
        if self.ratio is not None and not self.ratio > 0:
            raise ValueError(f"path {self.name}: ratio must be > 0, got {self.ratio!r}")


def served_paths(artifact: Any, ratios: Sequence[float], names: Sequence[str] = PATHS, mode: str | None = None,
                 uniform: bool = True) -> list[CachePath]:
    """The artifact's served paths at each ratio (module docstring), in `names` order then ratio order; chunk is
    left out where the artifact is not served by chunks, cache where the model's layers differ (`uniform` False)."""
    bad = [n for n in names if n not in PATHS]
    if bad:
        raise ValueError(f"unknown path {bad[0]!r}; choose from {','.join(PATHS)}")
    out, codecs = [], {}
    for name in names:
        for r in ratios:
            if r not in codecs:  # one codec per ratio for every path (its bases are read and held once)
                codecs[r] = KVTCCodec(artifact, float(r), mode=mode)
            codec = codecs[r]
            if name == "offline":
                out.append(CachePath(name, float(r), restore=_offline(codec)))
            elif name == "chunk":
                transform = chunk_transform(codec)
                if transform is not None:
                    out.append(CachePath(name, float(r), restore=_chunk(artifact, float(r), transform)))
            elif uniform:
                out.append(CachePath(name, float(r), live=_live(codec)))
    return out


def _offline(codec: Any) -> Callable:
    def restore(keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = codec.decode(codec.encode(keys, values, start=0), device=keys.device)
        return k.to(keys.dtype), v.to(values.dtype)

    return restore


def _chunk(artifact: Any, ratio: float, transform: Any) -> Callable:
    def restore(keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rec = chunk_path(artifact, ratio, keys, values, transform=transform)
        return rec.keys.to(keys.dtype), rec.values.to(values.dtype)

    return restore


def _live(codec: Any) -> Callable:
    def build(config: Any, keys: torch.Tensor, values: torch.Tensor) -> Any:
        from kvtc.kernels.integrations.kvtc_cache import KVTCCache  # noqa: PLC0415 - the integration on first use

        cache = KVTCCache(codec, config=config, hold_decoded=True)  # decoded once per coding, not per step
        for layer in range(keys.shape[0]):  # one prefill: every layer's update, the last one codes
            cache.update(keys[layer][None].contiguous(), values[layer][None].contiguous(), layer)
        return cache

    return build


def _cache(model: Any, keys: torch.Tensor, values: torch.Tensor, state: dict) -> Any:
    """keys, values (L, H, T, D) -> a Cache holding them (`state`: prefix_cache, coded for models whose layers differ)."""
    return build_cache(model, keys, values, **state)


def _eos(lm: Any) -> set[int]:
    ids = set()
    for source in (getattr(lm.tokenizer, "eos_token_id", None),
                   getattr(getattr(lm.model, "generation_config", None), "eos_token_id", None)):
        ids |= set(source) if isinstance(source, (list, tuple)) else {source} if isinstance(source, int) else set()
    return ids


def greedy(lm: Any, cache: Any, last: int, sample: TaskSample, eos: set[int]) -> tuple[list[int], str]:
    """Greedy decoding from a cache of the prompt less its last token: feed `last`, then each argmax, up to
    `sample.max_new` tokens, stopping at `eos` or once the answer is settled -> (token ids, text)."""
    out: list[int] = []
    feed = torch.tensor([[last]], device=lm.device)
    text = ""
    for _ in range(sample.max_new):
        logits, cache = _forward(lm.model, feed, cache)
        token = int(logits[0, -1].argmax())
        if token in eos:
            break
        out.append(token)
        text = lm.tokenizer.decode(out, skip_special_tokens=True)
        if sample.settled(text):
            break
        feed = torch.tensor([[token]], device=lm.device)
    return out, text


def answer_nll(lm: Any, cache: Any, sample: TaskSample) -> float:
    """The sample's answer teacher-forced after a cache of the prompt less its last token -> its negative
    log-likelihood in nats, summed over its tokens (the answer as the prompt's answer prefix continues it: copy's
    passage right after its opening quote, others after a space). A graded form of the same retrieval: paired with
    the raw cache's, it tells a codec from the raw cache on far fewer samples than exact match."""
    target = list(lm.tokenizer(sample.answer if sample.exact else " " + sample.answer,
                               add_special_tokens=False)["input_ids"])
    feed = torch.tensor([[sample.prompt[-1], *target[:-1]]], dtype=torch.long, device=lm.device)
    logits, _ = _forward(lm.model, feed, cache)
    logp = torch.log_softmax(logits[0].double(), dim=-1)
    return float(-logp.gather(-1, torch.tensor(target, device=logp.device)[:, None]).sum())


def score_tasks(lm: Any, samples: Sequence[TaskSample], paths: Sequence[CachePath], progress: bool | None = None,
                all_cells: bool = False, keep_bytes: int = KEEP_BYTES) -> list[dict]:
    """Each sample decoded from the raw cache and through each path -> one record per (sample, path): task, length,
    index, depth, placed, path ("raw" for the raw cache), ratio, tokens (generated ids), text, correct, answer_nll
    (`answer_nll`; None for a live path, whose cache the decoding extends), seconds (the path's restore, answer NLL
    and decoding; raw: the prefill too). progress: a tqdm bar (None: on a terminal).

    Cell by cell (task x length, in the samples' order): the raw cache answers every sample first; the paths then
    answer the cell's samples only where the raw model can do it (raw accuracy >= 50%) unless `all_cells`: elsewhere
    a served answer says nothing about the codec, and coding is most of the suite's cost. Prefilled caches of a cell
    are kept for its paths up to `keep_bytes` in all; a sample past it is prefilled again."""
    eos = _eos(lm)
    records: list[dict] = []
    cells: dict[tuple[str, int], list[TaskSample]] = {}
    for s in samples:
        if len(s.prompt) + s.max_new > lm.max_positions:
            raise ValueError(f"length {s.length}: a {s.task} prompt of {len(s.prompt)} tokens and its {s.max_new} "
                             f"answer tokens exceed the model's context of {lm.max_positions} positions")
        cells.setdefault((s.task, s.length), []).append(s)
    bar = tqdm(total=len(samples) * (1 + len(paths)), desc="kvtc eval: tasks", unit="decode",
               disable=None if progress is None else not progress)

    def prefill(s: TaskSample) -> tuple:
        ids = torch.tensor([s.prompt[:-1]], dtype=torch.long, device=lm.device)
        keys, values = raw_cache(lm, ids)
        return keys, values, prefix_state(lm, ids, keys, values)  # sliding / no-KV layers: from the model's own cache

    try:
        for (task, length), group in cells.items():
            kept: dict[int, tuple] = {}
            held = 0
            raw_correct = 0
            for s in group:
                t0 = time.perf_counter()
                keys, values, state = prefill(s)
                tokens, text = greedy(lm, _cache(lm.model, keys, values, state), s.prompt[-1], s, eos)
                ok = s.correct(text)
                raw_correct += ok
                records.append({**_base(s), "path": RAW, "ratio": None, "tokens": tokens, "text": text,
                                "correct": ok, "answer_nll": answer_nll(lm, _cache(lm.model, keys, values, state), s),
                                "seconds": time.perf_counter() - t0})
                size = 2 * (keys.nbytes + values.nbytes)  # the state of models whose layers differ: as much again
                if paths and held + size <= keep_bytes:
                    kept[id(s)], held = (keys, values, state), held + size
                bar.update()
                bar.set_postfix_str(f"{task} {length} raw")
            if not paths:
                continue
            if not (all_cells or raw_correct >= 0.5 * len(group)):
                bar.total -= len(group) * len(paths)
                bar.refresh()
                continue
            for s in group:
                keys, values, state = kept.pop(id(s), None) or prefill(s)
                for p in paths:
                    t0 = time.perf_counter()
                    nll = None
                    if p.restore is not None:
                        k, v = p.restore(keys, values)
                        cache = _cache(lm.model, k, v, state)
                        nll = answer_nll(lm, _cache(lm.model, k, v, state), s)
                    else:
                        cache = p.live(lm.model.config, keys, values)
                    tokens, text = greedy(lm, cache, s.prompt[-1], s, eos)
                    records.append({**_base(s), "path": p.name, "ratio": p.ratio, "tokens": tokens, "text": text,
                                    "correct": s.correct(text), "answer_nll": nll,
                                    "seconds": time.perf_counter() - t0})
                    bar.update()
                bar.set_postfix_str(f"{task} {length} served")
    finally:
        bar.close()
    return records


def _base(s: TaskSample) -> dict:
    return dict(task=s.task, length=s.length, index=s.index, depth=s.depth, placed=s.placed)


def wilson(correct: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a proportion correct/n ((0, 1) for n = 0)."""
    if n <= 0:
        return 0.0, 1.0
    p = correct / n
    centre, half = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    scale = 1 + z * z / n
    return max(0.0, (centre - half) / scale), min(1.0, (centre + half) / scale)


def task_rows(records: Sequence[dict]) -> list[dict]:
    """Records -> one row per task x length x path x ratio (the raw cache first in each task x length): task,
    length, path, ratio, correct, samples, accuracy, ci_low, ci_high (95% Wilson), raw_accuracy, raw_can (the raw
    model's accuracy >= 50%), nll_gap, nll_gap_ci_low, nll_gap_ci_high (the answers' mean NLL in nats over the raw
    cache's on the same samples, a paired 95% Student t interval; None for the raw cache and live paths), note
    ("raw model cannot do this" where it is not; on the raw row, "served paths not
    scored" where no path answered the cell: `score_tasks` without all_cells), seconds (per sample)."""
    cells: dict[tuple, list[dict]] = {}
    for r in records:
        cells.setdefault((r["task"], r["length"], r["path"], r["ratio"]), []).append(r)
    served = {(t, n) for (t, n, p, _) in cells if p != RAW}
    raw_nll = {(r["task"], r["length"], r["index"]): r.get("answer_nll") for r in records if r["path"] == RAW}
    raw = {(t, n): sum(r["correct"] for r in rs) / len(rs) for (t, n, p, _), rs in cells.items() if p == RAW}
    order = {t: i for i, t in enumerate(dict.fromkeys(r["task"] for r in records))}
    paths = {p: i for i, p in enumerate(dict.fromkeys(r["path"] for r in records))}
    rows = []
    for (task, length, path, ratio), rs in sorted(cells.items(), key=lambda kv: (
            order[kv[0][0]], kv[0][1], kv[0][3] is not None, kv[0][3] or 0.0, paths[kv[0][2]])):
        k, n = sum(bool(r["correct"]) for r in rs), len(rs)
        lo, hi = wilson(k, n)
        gaps = [r["answer_nll"] - raw_nll[(task, length, r["index"])] for r in rs if path != RAW and
                r.get("answer_nll") is not None and raw_nll.get((task, length, r["index"])) is not None]
        gap, (gap_lo, gap_hi) = ((sum(gaps) / len(gaps), mean_interval(torch.tensor(gaps), block=1)) if gaps
                                 else (None, (None, None)))
        base = raw.get((task, length))
        can = base is not None and base >= 0.5
        rows.append({"task": task, "length": length, "path": path, "ratio": ratio, "correct": k, "samples": n,
                     "accuracy": k / n, "ci_low": lo, "ci_high": hi, "raw_accuracy": base, "raw_can": can,
                     "nll_gap": gap, "nll_gap_ci_low": gap_lo, "nll_gap_ci_high": gap_hi,
                     "note": "" if can else CANNOT if path != RAW or (task, length) in served else
                     f"{CANNOT}: {NOT_SCORED}", "seconds": sum(r["seconds"] for r in rs) / n})
    return rows


def task_table(rows: Sequence[dict]) -> str:
    """The rows as a fixed-width table: one line per cell, the raw cache's accuracy beside each."""
    head = (f"{'task':10} {'length':>6} {'path':8} {'ratio':>5} {'correct':>8} {'acc':>5} {'95% CI':>13} "
            f"{'raw acc':>7} {'NLL gap, nats [95% CI]':>24} {'s/sample':>8}  note")
    lines = [head, "-" * len(head)]
    for r in rows:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:g}"
        raw = "-" if r["raw_accuracy"] is None else f"{r['raw_accuracy']:.2f}"
        gap = "-" if r.get("nll_gap") is None else \
            f"{r['nll_gap']:+.3f} [{r['nll_gap_ci_low']:+.2f}, {r['nll_gap_ci_high']:+.2f}]"
        lines.append(f"{r['task']:10} {r['length']:6d} {r['path']:8} {ratio:>5} {r['correct']:>4d}/{r['samples']:<3d} "
                     f"{r['accuracy']:5.2f} [{r['ci_low']:.2f}, {r['ci_high']:.2f}] {raw:>7} {gap:>24} "
                     f"{r['seconds']:8.2f}  {r['note']}")
    return "\n".join(lines)


def task_chart(rows: Sequence[dict], title: str = "") -> bytes:
    """PNG: accuracy against context length, one panel per task; one line per path and ratio (colour by ratio,
    style by path) and the raw cache (black); cells where the raw model cannot do the task (raw < 50%) shaded."""
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    plt, fig, axes = charts.figure(len(tasks), per_row=3)
    ratios = sorted({r["ratio"] for r in rows if r["ratio"] is not None})
    colours = plt.get_cmap("viridis")
    styles = {"offline": "-", "chunk": "--", "cache": ":"}
    lengths = sorted({r["length"] for r in rows})
    for ax, task in zip(axes, tasks):
        mine = [r for r in rows if r["task"] == task]
        at = sorted({r["length"] for r in mine})
        for line in dict.fromkeys((r["path"], r["ratio"]) for r in mine):
            got = {r["length"]: r["accuracy"] for r in mine if (r["path"], r["ratio"]) == line}
            pts = [(n, got.get(n, math.nan)) for n in at]  # a length the path did not score breaks its line
            if line[0] == RAW:
                ax.plot(*zip(*pts), "k-o", lw=2, ms=5, label="raw cache", zorder=5)
                continue
            colour = colours(ratios.index(line[1]) / max(1, len(ratios) - 1) * 0.85) if line[1] is not None else "grey"
            ax.plot(*zip(*pts), styles.get(line[0], "-."), marker="s", ms=4, color=colour,
                    label=f"{line[0]} {line[1]:g}x" if line[1] is not None else line[0])
        for r in mine:
            if r["path"] == RAW and not r["raw_can"]:
                ax.axvspan(r["length"] / 2 ** 0.25, r["length"] * 2 ** 0.25, color="0.85", zorder=0)
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [f"{n // 1024}K" if n % 1024 == 0 else str(n) for n in lengths])
        ax.set_ylim(-0.03, 1.03)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("accuracy (exact match)")
        ax.set_title(task, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, loc="lower left")
    note = "grey: lengths where the raw model is below 50% (raw model cannot do this)"
    with charts.caption(f"{title}; {note}" if title else note):
        return charts.png(plt, fig)
