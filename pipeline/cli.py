"""`kvtc` command line: one entry point, sub-commands registered by the modules that own them.

Each command module exposes `register(subparsers)`; it must import only light modules at
import time (argparse, json, ...) and load torch, Ray or transformers inside its handlers,
so that `kvtc list` stays fast.
"""
from __future__ import annotations

import argparse
import importlib
import sys

COMMAND_MODULES = (
    "kvtc.pipeline.job.calibrate",
    "kvtc.pipeline.operations.recalibrate",
    "kvtc.pipeline.operations.drift",
    "kvtc.pipeline.operations.schedule",
    "kvtc.pipeline.evaluation.report",
    "kvtc.pipeline.evaluation.quality",
    "kvtc.artifacts.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvtc", description="KV-cache transform coding: calibration service")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError, PermissionError, RuntimeError) as exc:
        print(f"kvtc {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
