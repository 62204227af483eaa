"""The job settings as command-line options: `kvtc calibrate` and `kvtc recalibrate` declare one
option per settings field (kvtc.pipeline.settings) and read them back into settings."""
from __future__ import annotations

import argparse
from dataclasses import MISSING

from kvtc.pipeline.settings import COMPUTATIONAL, JobSettings, options


def add_settings_arguments(parser: argparse.ArgumentParser, parent_defaults: bool = False) -> None:
    """The `kvtc calibrate` options, one per settings field (kvtc.pipeline.settings), in argument
    groups by concern. Options not given stay out of the namespace (argparse.SUPPRESS), so the
    settings' own defaults apply, or with `parent_defaults` (recalibrate) the parent's."""
    sections: dict[str, argparse._ArgumentGroup] = {}
    for group, name, opt, default in options():
        section = sections.get(group) or sections.setdefault(group, parser.add_argument_group(f"{group} settings"))
        shown = "" if default is MISSING or default is None else \
            f" (default {opt.show(default) if opt.show else default})"
        suffix = " [default: the parent's]" if parent_defaults and group in COMPUTATIONAL else shown
        flag = "--" + name.replace("_", "-")
        if opt.kind is bool:
            section.add_argument(flag, dest=name, action="store_true", default=argparse.SUPPRESS, help=opt.help)
            continue
        section.add_argument(flag, dest=name, type=opt.kind, choices=opt.choices, default=argparse.SUPPRESS,
                             help=f"{opt.help}{suffix}")


def settings_options(args: argparse.Namespace) -> dict:
    """The settings options given on a parsed command line: {flat field name: word as typed}."""
    names = {name for _, name, _, _ in options()}
    return {k: v for k, v in vars(args).items() if k in names}


def settings_from_args(args: argparse.Namespace) -> JobSettings:
    """JobSettings from a parsed `kvtc calibrate` command line (kvtc.pipeline.settings.JobSettings.of)."""
    return JobSettings.of(**settings_options(args))
