"""`kvtc eval`: model quality with compressed caches, against baselines at their real bytes.

For each held-out sequence of T tokens: prefill the first T - n tokens (n = --continuation),
compress and restore that cache with each method, then feed tokens [T - n - 1, T - 1) on the
restored cache and score the next-token distributions of the last n tokens. Reported per method:
perplexity relative to the uncompressed cache (exp of the mean NLL difference), the mean
KL(uncompressed || method) of the next-token distributions, key and value relative errors and
the stored bytes per middle token (see kvtc.pipeline.evaluation.baselines for what each method stores).
Held-out text: with the artifact's own corpus, the shards the calibration held out (rebuilt with
its settings and matched by id); with another corpus, its first sequences. `--prefix N` (EvalSettings.prefix)
scores after N prefix tokens instead of the calibration's sequence length: long windows of the held-out text
(its sequences joined in plan order) or of the other corpus, up to the model's context.

`--tasks niah,multikey,kv,vt,copy` (`run_tasks`) judges the codec the way users judge a KV codec instead:
generated long-context retrieval tasks (kvtc.pipeline.evaluation.tasks: single needles, multi-key UUID needles,
key-value retrieval, variable tracking, copying a passage) at each of --lengths tokens, --samples per task and
length with their needles spread over the depths. Each prompt is prefilled once by the raw model; its answer is
greedy-decoded from the raw cache and from each served path's cache (offline codec, the chunk path as
`kvtc lmcache-server` stores it, the live KVTCCache) at each ratio, and scored by exact match
(kvtc.pipeline.evaluation.task_suite). Reported per task x length x path x ratio: correct/samples, the accuracy
with its 95% Wilson interval and the raw cache's accuracy beside it; a cell where the raw model is below 50% says
"raw model cannot do this". `--chart PATH` draws accuracy against context length, one panel per task.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvtc import artifacts
from kvtc.artifacts.blocks import check_ratios
from kvtc.kernels.codec.layers import is_uniform
from kvtc.pipeline.evaluation.eval_settings import EvalSettings
from kvtc.pipeline.evaluation.long_context import long_bytes, longest_window
from kvtc.pipeline.evaluation.model_quality import evaluate_sequences
from kvtc.pipeline.evaluation.report import limit_rows
from kvtc.pipeline.evaluation.task_suite import PATHS, score_tasks, served_paths, task_rows
from kvtc.pipeline.evaluation.tasks import DEFAULT_HAYSTACK, HELDOUT_HAYSTACK, POOL_TOKENS, TaskSettings, generate
from kvtc.pipeline.job.corpus import iter_documents
from kvtc.pipeline.job import fold_plan
from kvtc.pipeline.job.heldout_text import heldout_sequences, heldout_tokens
from kvtc.workers import models


def run(name: str, registry: str | None, settings: EvalSettings, corpus: str | None = None, model: str | None = None,
        dtype: str | None = None, progress=None) -> dict:
    """Pull the artifact, load its model, evaluate; returns {"artifact", "settings", "rows", "limit"}."""
    art, lm = _artifact_model(name, registry, model, dtype)
    fp = art.manifest["model"]
    settings.check_context(lm.max_positions, model or fp["spec"])
    check_memory(lm, settings)
    seqs = heldout_sequences(art, lm.tokenizer, corpus, settings.sequences, lm.max_positions, settings.length)
    rows = evaluate_sequences(lm, art, seqs, settings, progress)
    return {"artifact": f"{art.name}@{art.version}", "corpus": corpus or art.manifest.get("corpus", {}).get("spec"),
            "settings": {"ratios": list(settings.ratios), "continuation": settings.continuation,
                         "prefix": len(seqs[0]) - settings.continuation - 1,
                         "sequences": len(seqs), "baselines": list(settings.baselines),
                         "mode": settings.mode or ("ecsq" if art.ecsq_ratios() else "fixed")},
            "rows": rows, "limit": limit_rows(art.metrics())}


def check_memory(lm, settings: EvalSettings) -> None:
    """ValueError before scoring where one sequence of --prefix tokens would not fit this node's memory beside the
    model (its cache, decoded copies and logits: long_context.long_bytes), naming the longest prefix that would."""
    if settings.length is None:
        return
    need, free = long_bytes(lm, settings.length), max(0, fold_plan.node_now()[0])
    if need <= free:
        return
    fits = longest_window(lm, settings.length, free, settings.continuation + 1)
    hint = f"lower --prefix to at most {fits - settings.continuation - 1}" if fits else "no --prefix fits here"
    raise ValueError(f"--prefix {settings.prefix}: scoring one sequence of {settings.length} tokens needs about "
                     f"{need / 2**30:.1f} GiB beside the model, and {free / 2**30:.1f} GiB are free below this node's "
                     f"kill line; {hint}, or run on a node with more memory")


def _artifact_model(name: str, registry: str | None, model: str | None, dtype: str | None):
    """The artifact pulled and its model loaded (`model` overrides the spec; its weights must be the calibrated
    ones) -> (artifact, LoadedModel)."""
    ref = name if "@" in name else f"{name}@latest"
    art = artifacts.pull(ref, registry=registry)
    fp = art.manifest["model"]
    lm = models.load_model(model or fp["spec"], dtype=dtype)
    if lm.fingerprint.get("weights_sha256") != fp.get("weights_sha256"):
        raise ValueError(f"model {model or fp['spec']!r} is not the model {art.name}@{art.version} was calibrated "
                         "on (weights differ); pass --model with the calibrated model")
    return art, lm


def haystack_texts(haystack: str | None, art: Any = None, lm: Any = None):
    """The haystack's documents' texts: None (pydoc_data.topics, read by the task generator), "heldout" (the
    artifact's held-out sequences joined, as one text: what its calibration never saw) or a corpus spec's documents
    in order (kvtc.pipeline.job.corpus)."""
    if haystack is None or haystack == DEFAULT_HAYSTACK:
        return None
    if haystack == HELDOUT_HAYSTACK:
        return [lm.tokenizer.decode(heldout_tokens(art, lm.tokenizer, lm.max_positions, POOL_TOKENS))]
    return (doc.text for doc in iter_documents(haystack))


def run_tasks(name: str, registry: str | None, settings: TaskSettings, ratios: Sequence[float] = (8.0, 16.0, 32.0),
              paths: Sequence[str] = PATHS, haystack: str | None = None, model: str | None = None,
              dtype: str | None = None, mode: str | None = None, progress: bool | None = None,
              all_cells: bool = False) -> dict:
    """The retrieval task suite on an artifact (module docstring): pull it, load its model, generate the samples
    on `haystack` (a corpus spec, "heldout": the artifact's held-out text; None: Python's documentation prose), decode each through the raw cache and each
    of `paths` at each ratio (only in the cells the raw model can do unless `all_cells`: task_suite.score_tasks) -> {"artifact", "model", "haystack", "settings", "rows" (task_suite.task_rows),
    "records" (one per sample and path: its generation and whether it is correct)}."""
    check_ratios(tuple(ratios), "kvtc eval: ")
    art, lm = _artifact_model(name, registry, model, dtype)
    spec = model or art.manifest["model"]["spec"]
    settings.check_context(lm.max_positions, spec)
    samples = generate(lm.tokenizer, settings, haystack_texts(haystack, art, lm), haystack or DEFAULT_HAYSTACK)
    uniform = not lm.layers or is_uniform(lm.layers)
    cache_paths = served_paths(art, [float(r) for r in ratios], paths, mode, uniform)
    records = score_tasks(lm, samples, cache_paths, progress, all_cells=all_cells)
    return {"artifact": f"{art.name}@{art.version}", "model": spec, "haystack": haystack or DEFAULT_HAYSTACK,
            "settings": {"tasks": list(settings.tasks), "lengths": list(settings.lengths),
                         "samples": settings.samples, "depths": None if settings.depths is None else
                         list(settings.depths), "seed": settings.seed, "ratios": [float(r) for r in ratios],
                         "paths": sorted({p.name for p in cache_paths}, key=list(PATHS).index),
                         "mode": mode or ("ecsq" if art.ecsq_ratios() else "fixed"), "all_cells": all_cells},
            "rows": task_rows(records), "records": records}
