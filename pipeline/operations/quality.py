"""`kvtc eval`: model quality with compressed caches, against baselines at their real bytes.

For each held-out sequence of T tokens: prefill the first T - n tokens (n = --continuation),
compress and restore that cache with each method, then feed tokens [T - n - 1, T - 1) on the
restored cache and score the next-token distributions of the last n tokens. Reported per method:
perplexity relative to the uncompressed cache (exp of the mean NLL difference), the mean
KL(uncompressed || method) of the next-token distributions, key and value relative errors and
the stored bytes per middle token (see kvtc.pipeline.evaluation.baselines for what each method stores).
Held-out text: with the artifact's own corpus, the shards the calibration held out (rebuilt with
its settings and matched by id); with another corpus, its first sequences.
"""
from __future__ import annotations

import argparse
import json
import sys

from kvtc.pipeline.evaluation.model_quality import (BASELINES, KIVI_CONFIGS, EvalSettings,  # noqa: F401 - the API
                                                    continuation_logprobs, evaluate_sequences)
from kvtc.pipeline.evaluation.report import limit_rows, limit_table, quality_table
from kvtc.pipeline.job.heldout_text import heldout_sequences
def run(name: str, registry: str | None, settings: EvalSettings, corpus: str | None = None, model: str | None = None,
        dtype: str | None = None, progress=None) -> dict:
    """Pull the artifact, load its model, evaluate; returns {"artifact", "settings", "rows", "limit"}."""
    from kvtc import artifacts
    from kvtc.workers.models import load_model

    ref = name if "@" in name else f"{name}@latest"
    art = artifacts.pull(ref, registry=registry)
    fp = art.manifest["model"]
    lm = load_model(model or fp["spec"], dtype=dtype)
    if lm.fingerprint.get("weights_sha256") != fp.get("weights_sha256"):
        raise ValueError(f"model {model or fp['spec']!r} is not the model {art.name}@{art.version} was calibrated "
                         "on (weights differ); pass --model with the calibrated model")
    seqs = heldout_sequences(art, lm.tokenizer, corpus, settings.sequences, lm.max_positions)
    rows = evaluate_sequences(lm, art, seqs, settings, progress)
    return {"artifact": f"{art.name}@{art.version}", "corpus": corpus or art.manifest.get("corpus", {}).get("spec"),
            "settings": {"ratios": list(settings.ratios), "continuation": settings.continuation,
                         "sequences": len(seqs), "baselines": list(settings.baselines),
                         "mode": settings.mode or ("ecsq" if art.ecsq_ratios() else "fixed")},
            "rows": rows, "limit": limit_rows(art.metrics())}


def _handler(args: argparse.Namespace) -> int:
    try:
        ratios = tuple(float(x) for x in args.ratios.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--ratios must be comma-separated numbers, got {args.ratios!r}") from None
    base = () if args.baselines == "none" else BASELINES if args.baselines == "all" else tuple(args.baselines.split(","))
    settings = EvalSettings(ratios=ratios, continuation=args.continuation, sequences=args.sequences, baselines=base,
                            mode=args.mode)
    result = run(args.artifact, args.registry, settings, args.corpus, args.model, args.dtype,
                 progress=lambda msg: print(f"kvtc eval: {msg}", file=sys.stderr))
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
    else:
        print(f"{result['artifact']} on {result['corpus']}: {result['settings']['sequences']} sequences, "
              f"{settings.continuation} tokens scored each; bytes are per middle token (both streams)\n")
        print(quality_table(result["rows"]))
        print()
        print(limit_table(result["limit"]))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="model quality with compressed caches, and baselines at equal bytes",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("artifact", help="NAME[@REF] (default ref: latest)")
    p.add_argument("--registry", default=None, help="registry root: a path or fsspec URI (default $KVTC_REGISTRY or ./registry)")
    p.add_argument("--corpus", default=None, help="text to score (default: the calibration's held-out shards)")
    p.add_argument("--ratios", default="8,16,32", help="codec ratios, comma separated (default 8,16,32)")
    p.add_argument("--continuation", type=int, default=64, help="tokens scored per sequence (default 64)")
    p.add_argument("--sequences", type=int, default=4, help="held-out sequences (default 4)")
    p.add_argument("--baselines", default="all", help=f"all (default), none, or a comma list of {','.join(BASELINES)}")
    p.add_argument("--model", default=None, help="model spec (default: the one the artifact was calibrated on)")
    p.add_argument("--dtype", default=None, help="float32 (CPU default), bfloat16 or float16")
    p.add_argument("--mode", choices=("ecsq", "fixed"), default=None,
                   help="codec mode: ecsq (entropy-coded; the default where the artifact has its tables) or fixed")
    p.add_argument("--json", action="store_true", help="print a machine-readable result")
    p.set_defaults(func=_handler)
