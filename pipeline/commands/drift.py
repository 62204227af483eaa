"""`kvtc drift NAME[@REF]`: its options, its handler and the report it prints (exit 3 when drifted).
The check is kvtc.pipeline.operations.drift, imported by the handler; its defaults and exit codes are read here
from the light kvtc.pipeline.operations.drift_settings."""
from __future__ import annotations

import argparse
import json
import sys

from kvtc.pipeline.commands import module_doc
from kvtc.pipeline.operations.drift_settings import (DEFAULT_THRESHOLD, DEFAULT_TOKENS, MIN_SEQUENCES, EXIT_DRIFT, EXIT_MODEL, EXIT_OK,
                                                     ModelMismatchError)

OPERATION = "kvtc.pipeline.operations.drift"


def print_report(report, as_json: bool) -> None:
    """Print a kvtc.pipeline.operations.drift.DriftReport."""
    if as_json:
        print(json.dumps(report.to_dict(), indent=2, sort_keys=True))
        return
    state = "DRIFTED" if report.drifted else "ok"
    print(f"{report.artifact} on {report.corpus}: {state} (threshold +{100 * report.threshold:.1f}%, "
          f"{report.rows} rows from {report.tokens} tokens)")
    for c in report.comparisons:
        ev = "" if c.explained_variance is None else f"  explained variance {100 * c.explained_variance:.1f}%"
        if c.recorded_explained_variance is not None:
            ev += f" (calibration {100 * c.recorded_explained_variance:.1f}%)"
        flag = "  DRIFT" if c.drifted else ""
        print(f"  CR {c.ratio:>5g} {c.stream:<6}: recorded {100 * c.recorded:.2f}%  now {100 * c.measured:.2f}%"
              f"  ({100 * c.change:+.1f}%){ev}{flag}")
    for note in report.notes:
        print(f"  note: {note}")


def add_drift_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD,
                   help="allowed relative increase of any ratio/stream error (default 0.10 = 10%% worse)")


def _handler(args: argparse.Namespace) -> int:
    from kvtc.pipeline.checks.header import check_artifact_model

    check_artifact_model(args.target, args.registry, args.model)  # a bad spec refused before torch loads
    from kvtc.pipeline.operations.drift import check_drift

    try:
        report = check_drift(args.target, args.corpus, args.registry, args.tokens, args.threshold, args.model,
                             text_column=args.text_column, cache_dir=args.cache_dir)
    except ModelMismatchError as exc:
        print(f"kvtc drift: {exc}", file=sys.stderr)
        return EXIT_MODEL
    print_report(report, args.json)
    return EXIT_DRIFT if report.drifted else EXIT_OK


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("drift", help="check a published artifact against fresh data (exit 3 when drifted)",
                       description=module_doc(OPERATION), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", metavar="NAME[@REF]", help="artifact name, name@version or name@alias (default ref latest)")
    p.add_argument("--corpus", default=None, help="corpus spec to sample (default: the artifact's calibration corpus)")
    p.add_argument("--tokens", type=int, default=None, help=f"tokens to sample (default {DEFAULT_TOKENS:,}, at least "
                   f"{MIN_SEQUENCES} of the artifact's sequences)")
    p.add_argument("--model", default=None, help="model spec (default: the artifact's manifest model spec)")
    p.add_argument("--registry", default=None, help="registry root (default $KVTC_REGISTRY or ./registry)")
    p.add_argument("--text-column", default=None)
    p.add_argument("--cache-dir", default=None, help="model cache dir (default $KVTC_CACHE)")
    p.add_argument("--json", action="store_true", help="print a machine-readable report")
    add_drift_arguments(p)
    p.set_defaults(func=_handler)
