"""The main job's served check: before publishing, a few of the calibration's own held-out sequences are
scored through the offline codec and through the chunk path the servers use (kvtc.pipeline.evaluation.served),
so the report and the manifest's metrics say what serving will cost (splits "served-offline", "served-chunk":
perplexity ratio, KL, stored ratio per CR) and the --json summary carries them (`ratios[].served`). One more
sequence, the long window, is scored at the longest context the model, the held-out text and the driver's memory
allow, up to served_prep.LONG_TOKENS (4,096, half the default calibration's length: a bounded cost) (split "served-chunk-long" at
every ratio, "served-offline-long" at the middle one, with its "prefix" tokens; kvtc.pipeline.evaluation.long_context),
and its error by position through the codec extends charts/error_by_position.png across that context. That window also
carries the job's slice of the retrieval suite: served_prep.NEEDLES 7-digit needles planted at evenly spread depths of its
prefix (kvtc.pipeline.evaluation.needle_window), each asked after the prefix through the raw cache and the chunk
path at every ratio (metrics "needles", "needles_raw" and their Wilson interval in split "served-chunk-long"), for
a forward per question on caches the scoring restored anyway. Perplexity ratio and KL carry a 95% interval
(batch means over the scored tokens, kvtc.pipeline.evaluation.metrics.mean_interval)."""
from __future__ import annotations

import dataclasses
import gc
import math
import sys
import tempfile
import time
from typing import Any

import torch

from kvtc import artifacts
from kvtc.pipeline.evaluation.long_context import position_errors
from kvtc.pipeline.evaluation.eval_settings import EvalSettings
from kvtc.pipeline.evaluation.model_quality import Codecs, build_cache, evaluate_sequences
from kvtc.pipeline.evaluation.metrics import mean_interval
from kvtc.pipeline.evaluation.needle_window import answers
from kvtc.pipeline.evaluation.task_suite import wilson
from kvtc.pipeline.fit.basis_budget import model_parameters
from kvtc.pipeline.job.heldout_text import heldout_sequences
from kvtc.pipeline.job.served_prep import SERVED_TOKENS, LongRaw, ServedPrep, free_bytes

# the check's cost is coding each prefix (2 paths x every ratio), its statistic the tokens scored after it: one
# sequence scoring 128 tokens costs half of two scoring 64 each, for as many scored tokens
SERVED_CONTINUATION = 128
MAX_DRIVER_PARAMETERS = 2_000_000_000  # the check loads the model in the driver only below this, or with a GPU


def served_continuation(seq_len: int) -> int:
    """Tokens scored after each prefix: SERVED_CONTINUATION, a quarter of a short calibration's sequences."""
    return max(1, min(SERVED_CONTINUATION, seq_len // 4))


def job_prep(cfg: Any, model_config: Any) -> ServedPrep | None:
    """The job's served check's raw half (kvtc.pipeline.job.served_prep), to be handed the fold's held-out text, or
    None where the job runs no served check or the driver does not score its model."""
    if not cfg.reduce.served_sequences or driver_refusal(model_config):
        return None
    return ServedPrep(cfg.model.model, cfg.model.dtype, cfg.runtime.cache_dir, cfg.reduce.served_sequences,
                      served_continuation(cfg.plan.seq_len), cfg.plan.seq_len)


def metric_rows(rows: list[dict], suffix: str = "", prefix: int | None = None) -> list[dict]:
    """`kvtc eval` rows of the codec and the chunk path -> the manifest's metric rows (ratio, split, metric);
    suffix: appended to the splits ("-long"), prefix: the prefix tokens they were scored after, as a metric."""
    out = []
    for r in rows:
        method = str(r.get("method", ""))
        split = "served-chunk" if method.startswith("kvtc-chunk-") else "served-offline" \
            if method.startswith("kvtc-") else None
        if split is None or r.get("ratio") is None:
            continue
        split += suffix
        if prefix is not None:
            out.append({"ratio": float(r["ratio"]), "stream": None, "group": None, "split": split, "metric": "prefix",
                        "value": float(prefix)})
        figures = {m: r[m] for m in ("ppl_ratio", "kl", "cr")}
        for m in ("ppl_ratio", "kl"):  # the 95% interval of each (model_quality: batch means over scored tokens)
            if r.get(f"{m}_ci"):
                figures[f"{m}_ci_low"], figures[f"{m}_ci_high"] = r[f"{m}_ci"]
        for metric, value in figures.items():
            value = float(value)
            out.append({"ratio": float(r["ratio"]), "stream": None, "group": None, "split": split, "metric": metric,
                        "value": value if math.isfinite(value) else None})
    return out


def needle_metrics(needles: list[dict]) -> list[dict]:
    """The long window's needle rows (`needle_rows`) -> the manifest's metric rows of split "served-chunk-long":
    per ratio needles (accuracy), needles_ci_low, needles_ci_high, needles_samples, needles_raw (the raw cache's) and
    needles_nll_gap with its interval (needles_nll_gap_ci_low, _ci_high)."""
    raw = next((n["accuracy"] for n in needles if n["path"] == "raw"), None)
    out = []
    for n in needles:
        if n["path"] != "chunk":
            continue
        figures = {"needles": n["accuracy"], "needles_ci_low": n["ci_low"], "needles_ci_high": n["ci_high"],
                   "needles_samples": n["samples"], "needles_raw": raw, "needles_nll_gap": n.get("nll_gap"),
                   "needles_nll_gap_ci_low": n.get("nll_gap_ci_low"), "needles_nll_gap_ci_high": n.get("nll_gap_ci_high")}
        out += [{"ratio": float(n["ratio"]), "stream": None, "group": None, "split": "served-chunk-long",
                 "metric": metric, "value": None if value is None else float(value)} for metric, value in figures.items()]
    return out


# measured: the staged artifact's cache ~2.5x its bases, a ratio's codec ~1x, its chunk transform's ~1x; and while the
# chunk path runs, that transform's encoder and decoder converted to float32 once (basis_product.converted_blocks) ~2x
SERVED_COPIES = 7


def served_bytes(content: Any) -> int:
    """The check's peak beside the artifact the driver already holds: SERVED_COPIES float32 copies of its bases."""
    return SERVED_COPIES * sum(4 * int(b[2].shape[0]) * int(b[2].shape[1]) for b in content.bases.values())


def _say(text: str) -> None:
    """One progress line on the console: the check runs for minutes on a CPU after the reduce's last line."""
    print(f"served check: {text}", file=sys.stderr, flush=True)


def _free_bytes() -> int:
    return free_bytes()


def driver_refusal(model_config: Any) -> str | None:
    """Why the driver does not score the model itself (too large and no GPU), or None."""
    if model_config is not None and not torch.cuda.is_available():
        params = model_parameters(model_config)
        if params > MAX_DRIVER_PARAMETERS:
            return (f"served quality not measured in the job: the model has {params / 1e9:.1f}B parameters and "
                    "the driver has no GPU; run `kvtc eval NAME` on a GPU node (its kvtc-chunk rows)")
    return None


def served_quality(content: Any, model_spec: str, dtype: str | None, count: int, continuation: int,
                   model_config: Any = None, cache_dir: str | None = None, prep: ServedPrep | None = None
                   ) -> tuple[dict | None, str | None]:
    """Stage `content` in a temporary registry, load its model, score `count` of its held-out sequences through
    the offline codec and the chunk path -> (a `kvtc eval` result, None) or (None, why it was skipped). prep: the
    check's raw half (kvtc.pipeline.job.served_prep), started by the job while its fold ran, or holding the fold's
    held-out text; without one (or one of other held-out shards) the artifact's held-out text is rebuilt."""
    refused = driver_refusal(model_config)
    need = served_bytes(content)
    free = _free_bytes()
    if (refused or need > free) and prep is not None:
        prep.cancel()  # started beside the fold: its memory and cores go back
    if refused:
        return None, refused
    if need > free:
        return None, (f"served quality not measured in the job: scoring needs about {need / 2**30:.1f} GiB beside the "
                      f"artifact the driver holds, and {free / 2**30:.1f} GiB are free below the node's kill line; run "
                      "`kvtc eval NAME` (its kvtc-chunk rows) on a node with more memory")
    seconds: dict[str, float] = {}
    held = list((content.corpus or {}).get("heldout_shards") or [])
    own = prep is not None and bool(prep.heldout) and prep.shards == held
    if prep is not None and not own:
        prep.cancel()  # another job's held-out shards (or none): the artifact's are read below
    try:
        with tempfile.TemporaryDirectory(prefix="kvtc-served-") as tmp:
            t0 = time.perf_counter()
            if own:  # the model loads and the raw half runs while the content is staged, unless already done
                prep.start(torch.get_num_threads())
            # staged without its parent (it lives in the job's registry), read in place (no pull cache)
            ref = artifacts.publish(dataclasses.replace(content, parent=None), registry=tmp, alias_latest=False)
            art = artifacts.Artifact(ref.path)
            seconds["stage"] = time.perf_counter() - t0
            if not own:
                seq_len = int(art.manifest.get("calibration", {}).get("seq_len") or SERVED_TOKENS)
                prep = ServedPrep(model_spec, dtype, cache_dir, count, continuation, seq_len,
                                  source=lambda tok, positions, staged=art: heldout_sequences(
                                      staged, tok, None, max(count, -(-int(positions or seq_len) // seq_len)), positions))
            ready = prep.result(torch.get_num_threads())
            lm = ready.lm
            seconds.update(ready.seconds)
            seconds["raw_beside_fold"] = float(ready.early)
            seconds["wait"] = time.perf_counter() - t0 - seconds["stage"]
            t1 = time.perf_counter()
            settings = EvalSettings(ratios=tuple(art.ratios()), continuation=continuation, sequences=count,
                                    baselines=(), attention_errors=False)  # the manifest keeps ppl, KL, CR
            codecs = Codecs(art, settings.mode)  # built once, for the long window too
            seqs = ready.sequences
            ratios = "/".join(f"{r:g}" for r in settings.ratios)
            _say(f"{len(seqs)} held-out sequence(s) of {seqs[0].ids.shape[1]} tokens through the offline codec and "
                 f"the chunk path at CR {ratios}" + (" (their raw prefill ran beside the fold)" if ready.early else ""))
            rows = evaluate_sequences(lm, art, seqs, settings, codecs=codecs)
            seconds["score"] = time.perf_counter() - t1
            t2 = time.perf_counter()
            long = None if ready.long is None else _long_sequence(lm, art, settings, ready.long, codecs)
            if long is not None:
                seconds["long"] = time.perf_counter() - t2
            del lm, art, codecs, ready  # the staged bases, the codec and the model go before the real publish
    except (ValueError, RuntimeError, OSError) as exc:  # the artifact itself is sound: publish it without the figure
        return None, f"served quality not measured in the job ({type(exc).__name__}: {exc}); run `kvtc eval NAME`"
    finally:
        gc.collect()
    return {"artifact": f"{content.name} (held-out sequences of its own corpus)", "corpus": content.corpus.get("spec"),
            "settings": {"ratios": list(settings.ratios), "continuation": continuation, "sequences": len(seqs),
                         "prefix": seqs[0].prefix,
                         "paths": "kvtc-Nx: offline codec (sinks and window raw); kvtc-chunk-Nx: 256-token chunks, "
                                  "sinks raw, no window, as served"},
            "rows": rows, "long": long, "seconds": {k: round(v, 2) for k, v in seconds.items()}}, None


def _long_sequence(lm: Any, art: Any, settings: EvalSettings, prepared: LongRaw, codecs: Codecs | None = None
                   ) -> dict:
    """The held-out window at the longest context that fits (its raw half: served_prep.prepare), with its needles
    planted in its prefix (needle_window), scored through the chunk path at every ratio and through the offline codec
    at the middle one (coding 4K tokens costs about 10 s per ratio and path on a 2-core CPU), with the codec's error by
    position over it at that ratio, and each needle asked through the chunk path at every ratio (the raw cache's
    answers came with the raw half) -> {"prefix", "rows", "positions", "needles"}."""
    planted, raw = prepared.planted, prepared.raw
    sinks = int(art.manifest.get("calibration", {}).get("sinks") or 0)
    ratios = sorted(settings.ratios)
    middle = ratios[len(ratios) // 2]  # the chart's bold one
    _say(f"one held-out window of {prepared.length} tokens with {len(planted.depths) if planted else 0} needles, "
         f"through the chunk path at every ratio and the offline codec at CR {middle:g} (minutes on a CPU)")
    positions: list[dict] = []
    got: dict[str, tuple[float | None, list[tuple[bool, float]]]] = {}
    if planted is not None and prepared.answers is not None:
        got["uncompressed"] = None, prepared.answers

    def observe(method: str, keys: Any, values: Any, rec: Any, state: dict) -> None:
        if method == f"kvtc-{middle:g}x":  # the offline codec's reconstruction the scoring just made
            positions.extend(position_errors(keys, values, rec.keys, rec.values, middle, sinks))
        if planted and method.startswith("kvtc-chunk-"):  # what servers restore
            got[method] = float(method[len("kvtc-chunk-"):-1]), answers(
                lm, lambda: build_cache(lm.model, rec.keys, rec.values, **state), planted, packed=not state)

    rows = evaluate_sequences(lm, art, [raw], dataclasses.replace(settings, sequences=1, prefix=raw.prefix,
                                                                   offline_ratios=(middle,)), observe=observe,
                              codecs=codecs)
    needles = needle_rows(got, planted.depths if planted else ())
    return {"prefix": raw.prefix, "rows": rows, "positions": positions, "needles": needles}


def needle_rows(answers: dict[str, tuple[float | None, list[tuple[bool, float]]]], depths: tuple[float, ...]
                ) -> list[dict]:
    """Each path's (found, answer NLL) per needle (needle_window.answers) -> rows {path: "raw" | "chunk", ratio,
    correct, samples, accuracy, ci_low, ci_high (95% Wilson), missed_depths (the depths of the needles it missed),
    nll_gap, nll_gap_ci_low, nll_gap_ci_high (the answers' mean NLL in nats over the raw cache's on the same needles,
    a paired 95% Student t interval: the graded form of the same retrieval)}: the raw cache first."""
    raw = next((got for ratio, got in answers.values() if ratio is None), None)
    out = []
    for method, (ratio, got) in sorted(answers.items(), key=lambda kv: -1.0 if kv[1][0] is None else kv[1][0]):
        right = [found for found, _ in got]
        lo, hi = wilson(sum(right), len(right))
        gaps = torch.tensor([nll - base for (_, nll), (_, base) in zip(got, raw)] if raw else [])
        gap, (gap_lo, gap_hi) = (float(gaps.mean()), mean_interval(gaps, block=1)) if len(gaps) else (None, (None, None))
        out.append({"path": "raw" if ratio is None else "chunk", "ratio": ratio, "correct": sum(right),
                    "samples": len(right), "accuracy": sum(right) / len(right), "ci_low": lo, "ci_high": hi,
                    "missed_depths": [round(d, 3) for d, ok in zip(depths, right) if not ok],
                    "nll_gap": gap, "nll_gap_ci_low": gap_lo, "nll_gap_ci_high": gap_hi})
    return out
