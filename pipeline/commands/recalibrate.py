"""`kvtc recalibrate NAME[@REF]`: its options (the settings, defaulting to the parent's), its handler and
the result it prints. The recalibration is kvtc.pipeline.operations.recalibrate, imported by the handler."""
from __future__ import annotations

import argparse
import json
import sys

from kvtc.pipeline.commands import module_doc
from kvtc.pipeline.json_stdout import stdout_to_stderr
from kvtc.pipeline.operations.drift_settings import EXIT_MODEL, ModelMismatchError
from kvtc.pipeline.settings_args import add_settings_arguments, settings_options

OPERATION = "kvtc.pipeline.operations.recalibrate"


def print_result(result, as_json: bool) -> None:
    """Print a kvtc.pipeline.operations.recalibrate.Result."""
    if as_json:
        print(json.dumps(vars(result), indent=2, sort_keys=True, default=str))
        return
    name = result.parent.split("@")[0]
    head = {"up_to_date": f"{result.parent} is up to date", "no_drift": f"{result.parent} has not drifted",
            "promoted": f"published {name}@{result.version} (parent {result.parent}); aliases: {', '.join(result.aliases) or 'none'}",
            "kept_unaliased": f"published {name}@{result.version} but kept it unaliased: worse than {result.parent}"}
    print(head[result.status])
    for row in result.validation:
        new = "missing" if row["new"] is None else f"{100 * row['new']:.3f}%"
        print(f"  CR {row['ratio']:>5g} {row['stream']:<6}: parent {100 * row['parent']:.3f}%  new {new}")
    for line in result.reasons + [f"note: {n}" for n in result.notes]:
        print(f"  {line}")


def _handler(args: argparse.Namespace) -> int:
    from kvtc.pipeline.checks.header import check_recalibration

    check_recalibration(args.target, settings_options(args))  # the settings it will run, before torch loads
    from kvtc.pipeline.operations import recalibrate as operation

    given = settings_options(args)
    try:
        with stdout_to_stderr(args.json):  # --json: stdout holds the result alone
            result = operation.recalibrate(args.target, given, args.if_drift, args.drift_tokens, tuple(args.alias),
                                           args.tolerance, args.force)
    except ModelMismatchError as exc:
        print(f"kvtc recalibrate: {exc}", file=sys.stderr)
        return EXIT_MODEL
    print_result(result, args.json)
    return operation.EXIT_KEPT if result.status == "kept_unaliased" else operation.EXIT_OK


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("recalibrate", help="recalibrate an artifact on new data; promote it only if no worse",
                       description=module_doc(OPERATION), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", metavar="NAME[@REF]", help="the parent artifact (default ref latest)")
    add_settings_arguments(p, parent_defaults=True)  # unset options fall back to the parent's settings
    p.add_argument("--json", action="store_true", help="print a machine-readable summary")
    p.add_argument("--if-drift", type=float, default=None, metavar="THRESHOLD",
                   help="recalibrate only when `kvtc drift` finds a relative error increase above THRESHOLD (e.g. 0.10)")
    p.add_argument("--drift-tokens", type=int, default=None, help="tokens to sample for the drift check")
    p.add_argument("--alias", action="append", default=[], help="also move this alias when promoted (repeatable)")
    p.add_argument("--tolerance", type=float, default=0.0,
                   help="relative error increase still counted as 'not worse' (default 0)")
    p.add_argument("--force", action="store_true", help="recalibrate even when nothing changed")
    p.set_defaults(func=_handler)
