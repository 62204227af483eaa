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
"""
from __future__ import annotations

from kvtc import artifacts
from kvtc.pipeline.evaluation.eval_settings import EvalSettings
from kvtc.pipeline.evaluation.long_context import long_bytes, longest_window
from kvtc.pipeline.evaluation.model_quality import evaluate_sequences
from kvtc.pipeline.evaluation.report import limit_rows
from kvtc.pipeline.job import fold_plan
from kvtc.pipeline.job.heldout_text import heldout_sequences
from kvtc.workers import models


def run(name: str, registry: str | None, settings: EvalSettings, corpus: str | None = None, model: str | None = None,
        dtype: str | None = None, progress=None) -> dict:
    """Pull the artifact, load its model, evaluate; returns {"artifact", "settings", "rows", "limit"}."""
    ref = name if "@" in name else f"{name}@latest"
    art = artifacts.pull(ref, registry=registry)
    fp = art.manifest["model"]
    lm = models.load_model(model or fp["spec"], dtype=dtype)
    if lm.fingerprint.get("weights_sha256") != fp.get("weights_sha256"):
        raise ValueError(f"model {model or fp['spec']!r} is not the model {art.name}@{art.version} was calibrated "
                         "on (weights differ); pass --model with the calibrated model")
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
