"""`kvtc calibrate`: its options (one per settings field), its handler and the summary it prints.
The job itself is kvtc.pipeline.job.calibrate, imported by the handler once the settings are valid."""
from __future__ import annotations

import argparse
import json
import warnings

from kvtc.pipeline.commands import module_doc
from kvtc.pipeline.json_stdout import stdout_to_stderr
from kvtc.pipeline.checks.machine import Machine, check_job
from kvtc.pipeline.settings_args import add_settings_arguments, settings_from_args
from kvtc.pipeline.checks.header import check_calibration

JOB = "kvtc.pipeline.job.calibrate"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_settings_arguments(p)
    p.add_argument("--json", action="store_true", help="print a machine-readable summary")


def print_summary(summary: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(summary, indent=2, sort_keys=True))
        return
    print(f"published {summary['name']}@{summary['version']} to {summary['registry']}")
    print("  held-out relative error, in the codec's default mode (kept components) | the other mode")
    for row in summary["ratios"]:
        other = "fixed" if row["mode"] == "ecsq" else "ecsq"
        k, v = row["keys"], row["values"]
        beside = (f"  | {other}: keys {100 * k[other]['rel_error']:.2f}%  values {100 * v[other]['rel_error']:.2f}%"
                  if "rel_error" in k.get(other, {}) and "rel_error" in v.get(other, {}) else "")
        print(f"  CR {row['ratio']:>5g} {row['mode']}: keys {100 * k['rel_error']:.2f}%  values {100 * v['rel_error']:.2f}%"
              f"  ({k.get('kept')}/{v.get('kept')}){beside}")
    run = summary.get("run", {})
    if run:
        print(f"  tokens run {run['tokens_run']} in {run['pool_seconds']} s ({run['pool_tokens_per_s']} tok/s), wall "
              f"{run['wall_seconds']} s; stages (s): " + ", ".join(f"{k} {v:g}" for k, v in run.get("stages", {}).items()))


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    return f"kvtc calibrate: warning: {message}\n"


def _handler(args: argparse.Namespace) -> int:
    cfg = settings_from_args(args)  # settings refused here, before the job (torch, Ray) is imported
    facts = check_calibration(cfg)  # the model spec, corpus files and what its header tells, before any load
    check_job(cfg, Machine.of(cfg.runtime), facts.context)  # resources too, in well under a second
    from kvtc.pipeline.job import calibrate as job

    warnings.formatwarning = _one_line_warning  # the message, not the source line that raised it
    with stdout_to_stderr(args.json):  # --json: stdout holds the summary alone
        summary = job.run(cfg)
    print_summary(summary, args.json)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("calibrate", help="calibrate a model and publish an artifact", description=module_doc(JOB),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=_handler)
