"""`kvtc eval NAME[@REF]`: its options, its handler and the tables it prints. The evaluation is
kvtc.pipeline.operations.quality (model quality with compressed caches), imported by the handler."""
from __future__ import annotations

import argparse
import json
import sys

from kvtc.pipeline.commands import module_doc
from kvtc.pipeline.evaluation.eval_settings import BASELINES  # light: no torch

OPERATION = "kvtc.pipeline.operations.quality"


def _handler(args: argparse.Namespace) -> int:
    from kvtc.pipeline.checks.header import check_artifact_model

    check_artifact_model(args.artifact, args.registry, args.model, args.prefix, args.continuation)  # before torch loads
    from kvtc.pipeline.evaluation.report import limit_table, quality_table
    from kvtc.pipeline.operations.quality import EvalSettings, run

    try:
        ratios = tuple(float(x) for x in args.ratios.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--ratios must be comma-separated numbers, got {args.ratios!r}") from None
    base = () if args.baselines == "none" else BASELINES if args.baselines == "all" else tuple(args.baselines.split(","))
    settings = EvalSettings(ratios=ratios, continuation=args.continuation, sequences=args.sequences, baselines=base,
                            mode=args.mode, prefix=args.prefix)
    result = run(args.artifact, args.registry, settings, args.corpus, args.model, args.dtype,
                 progress=lambda msg: print(f"kvtc eval: {msg}", file=sys.stderr))
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
    else:
        print(f"{result['artifact']} on {result['corpus']}: {result['settings']['sequences']} sequences, "
              f"{settings.continuation} tokens scored each after {result['settings']['prefix']} prefix tokens; bytes "
              "are per middle token (both streams)\n")
        print(quality_table(result["rows"]))
        print()
        print(limit_table(result["limit"]))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="model quality with compressed caches, and baselines at equal bytes",
                       description=module_doc(OPERATION), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("artifact", help="NAME[@REF] (default ref: latest)")
    p.add_argument("--registry", default=None, help="registry root: a path or fsspec URI (default $KVTC_REGISTRY or ./registry)")
    p.add_argument("--corpus", default=None, help="text to score (default: the calibration's held-out shards)")
    p.add_argument("--ratios", default="8,16,32", help="codec ratios, comma separated (default 8,16,32)")
    p.add_argument("--continuation", type=int, default=64, help="tokens scored per sequence (default 64)")
    p.add_argument("--sequences", type=int, default=4, help="held-out sequences (default 4)")
    p.add_argument("--prefix", type=int, default=None,
                   help="prefix tokens scored after (default: the calibration's --seq-len); longer prefixes read long "
                        "windows of the text, up to the model's context")
    p.add_argument("--baselines", default="all", help=f"all (default), none, or a comma list of {','.join(BASELINES)}")
    p.add_argument("--model", default=None, help="model spec (default: the one the artifact was calibrated on)")
    p.add_argument("--dtype", default=None, help="float32 (CPU default), bfloat16 or float16")
    p.add_argument("--mode", choices=("ecsq", "fixed"), default=None,
                   help="codec mode: ecsq (entropy-coded; the default where the artifact has its tables) or fixed")
    p.add_argument("--json", action="store_true", help="print a machine-readable result")
    p.set_defaults(func=_handler)
