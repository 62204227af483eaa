"""`kvtc` command line: one entry point, sub-commands registered by the command layer.

Each command is a module of kvtc.pipeline.commands (COMMAND_MODULES), exposing `register(subparsers)`:
it builds the command's parser and its handler imports the domain module it runs (the job, an
operation, a report, the registry) only when called. Importing a command module loads no torch, Ray,
transformers or matplotlib (tests/pipeline/test_structure.py checks it), so `kvtc --help`, `kvtc list` and a
refused argument stay fast. No command module imports this one back: a command that runs kvtc
commands (`kvtc schedule --in-process`) finds this module's `main` and `build_parser` in its parsed
arguments (`kvtc_main`, `kvtc_parser`).

One handler here turns every expected failure into one line on stderr and an exit code
(EXIT_CODES; a traceback only with --debug or KVTC_DEBUG=1), checks the options shared by the
commands before any of them starts work (kvtc.pipeline.checks), and keeps `--json` stdout pure: while a
command runs, file descriptor 1 and every thread but the main one write to stderr (Ray's worker
logs, child processes), and only what the command itself prints reaches stdout.
"""
from __future__ import annotations

import argparse
import importlib
import io
import os
import re
import sys
import threading
import traceback
from contextlib import contextmanager
from typing import Iterator, NoReturn

from kvtc.kernels.integrations.lmcache_server import main as lmcache_server
from kvtc.pipeline.checks.words import check_args

COMMAND_MODULES = (
    "kvtc.pipeline.commands.calibrate",
    "kvtc.pipeline.commands.recalibrate",
    "kvtc.pipeline.commands.drift",
    "kvtc.pipeline.commands.schedule",
    "kvtc.pipeline.commands.report",
    "kvtc.pipeline.commands.eval",
    "kvtc.pipeline.commands.registry",  # list, show, pull, verify, alias, sign, keygen
    "kvtc.pipeline.commands.export",
)

EXIT_OK, EXIT_INTERNAL, EXIT_ERROR, EXIT_INTEGRITY, EXIT_INTERRUPTED = 0, 1, 2, 6, 130
EXIT_CODES = {
    0: "success",
    1: "internal error (a bug: rerun with --debug and report the traceback)",
    2: "bad input: an invalid option, unknown name, unreachable or unwritable registry/cluster, missing file, "
       "a cluster that failed",
    3: "drift: the artifact drifted past --threshold",
    4: "drift/recalibrate: the model is not the artifact's",
    5: "recalibrate: the new version was not promoted",
    6: "integrity: a tampered, corrupt or unsigned artifact was refused",
    130: "interrupted",
}


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (`kvtc COMMAND: error: ...`, exit 2) instead of the full usage."""

    def error(self, message: str) -> NoReturn:
        message = _LONG_VALUE.sub(lambda m: f"{m.group(0)[:24]}...' ({len(m.group(0)) - 2} characters)", message)
        self.exit(EXIT_ERROR, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


_LONG_VALUE = re.compile(r"'[^'\n]{64,}'")  # a value argparse quotes back: shown by its head and length
_NEGATIVE = re.compile(r"^-[0-9.]+%?$")


def _join_negative_values(argv: list[str]) -> list[str]:
    """`--flag -3%` -> `--flag=-3%`: argparse takes a word starting with '-' for an option, so a negative
    or percent value would end in "expected one argument" instead of the option's own range check."""
    end = argv.index("--") if "--" in argv else len(argv)  # after '--' the words are a scheduled command's
    out: list[str] = []
    for word in argv[:end]:
        if out and _NEGATIVE.match(word) and out[-1].startswith("--") and "=" not in out[-1]:
            out[-1] = f"{out[-1]}={word}"
        else:
            out.append(word)
    return out + argv[end:]


def build_parser() -> argparse.ArgumentParser:
    codes = "\n".join(f"  {code:>3}  {meaning}" for code, meaning in EXIT_CODES.items())
    parser = _Parser(prog="kvtc", description="KV-cache transform coding: calibration service",
                                     epilog=f"exit codes:\n{codes}", formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debug", action="store_true", help="print tracebacks (also KVTC_DEBUG=1)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue
        module.register(sub)
    sub.add_parser("lmcache-server", add_help=False,  # handled in main(): every argument goes to LMCache
                   help="LMCache's own server (`lmcache server ARGS`) with the kvtc serde registered")
    # a command that runs kvtc commands (`kvtc schedule --in-process`) gets this entry point from here,
    # so no command module imports the CLI that loads it
    parser.set_defaults(kvtc_main=main, kvtc_parser=build_parser)
    return parser


def _split_debug(argv: list[str]) -> tuple[list[str], bool]:
    """Accept --debug anywhere before a '--' (after it, the words belong to a scheduled command)."""
    end = argv.index("--") if "--" in argv else len(argv)
    debug = "--debug" in argv[:end]
    return [a for i, a in enumerate(argv) if not (i < end and a == "--debug")], debug


class _MainThreadStdout(io.TextIOBase):
    """stdout for the main thread only; any other thread's writes (Ray's log monitor) go to stderr."""

    def __init__(self, out: io.TextIOBase, main: threading.Thread) -> None:
        self.out, self.main = out, main

    def _target(self) -> io.TextIOBase:
        return self.out if threading.current_thread() is self.main else sys.stderr

    def write(self, text: str) -> int:
        return self._target().write(text)

    def flush(self) -> None:
        self.out.flush()
        sys.stderr.flush()

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return 1  # now stderr: a child process handed this descriptor never writes into the JSON


@contextmanager
def _json_stdout() -> Iterator[None]:
    """Route fd 1 to stderr; the main thread's prints keep going to the real stdout."""
    previous = sys.stdout
    previous.flush()
    try:
        on_fd1 = previous.fileno() == 1
    except (AttributeError, OSError, ValueError):
        on_fd1 = False  # stdout is already a Python object (a capture): keep printing to it
    try:
        saved = os.dup(1)
    except OSError:
        yield
        return
    real = io.TextIOWrapper(os.fdopen(os.dup(saved), "wb"), encoding="utf-8", line_buffering=True) if on_fd1 else previous
    os.dup2(2, 1)
    sys.stdout = _MainThreadStdout(real, threading.current_thread())
    try:
        yield
    finally:
        ray = sys.modules.get("ray")
        if ray is not None and getattr(ray, "is_initialized", lambda: False)():
            ray.shutdown()  # its log thread must not print onto stdout once the JSON is out
        sys.stdout.flush()
        sys.stdout = previous
        os.dup2(saved, 1)
        os.close(saved)
        if real is not previous:
            real.close()


def exit_code(exc: BaseException) -> int | None:
    """The exit code of an expected failure, or None for a bug."""
    errors = sys.modules.get("kvtc.artifacts.errors")  # not imported yet: nothing could have raised its errors
    if errors is not None and isinstance(exc, errors.IntegrityError):
        return EXIT_INTEGRITY
    if isinstance(exc, (ValueError, LookupError, OSError, TimeoutError)):
        return EXIT_ERROR  # bad input (InputError is a ValueError); OSError: missing files, permissions, hosts
    boto = sys.modules.get("botocore.exceptions")  # an object store that failed (unreachable, refused credentials)
    if boto is not None and isinstance(exc, boto.BotoCoreError):
        return EXIT_ERROR
    ray = sys.modules.get("ray.exceptions")
    if ray is not None and isinstance(exc, ray.RayError) and not isinstance(exc, ray.RayTaskError):
        return EXIT_ERROR  # the cluster failed (a node or its raylet died, out of memory): not the job's bug
    return None  # RuntimeError, TypeError, AssertionError, ...: a bug


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 2000 else text[:2000] + " ..."


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["lmcache-server"]:
        return lmcache_server(argv[1:])
    argv, debug = _split_debug(argv)
    argv = _join_negative_values(argv)
    debug = debug or os.environ.get("KVTC_DEBUG", "") not in ("", "0")
    parser = build_parser()
    args = parser.parse_args(argv)
    name = next((a for a in argv if not a.startswith("-")), "")  # args.command may be a sub-command's own field
    try:
        check_args(args)
        if getattr(args, "json", False):
            with _json_stdout():
                return int(args.func(args) or 0)
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("kvtc: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:
        code = exit_code(exc)
        if debug:
            traceback.print_exc()
        if code is None:
            hint = "" if debug else " (a bug: rerun with --debug for the traceback)"
            print(f"kvtc {name}: internal error: {type(exc).__name__}: {_one_line(exc)}{hint}", file=sys.stderr)
            return EXIT_INTERNAL
        print(f"kvtc {name}: error: {_one_line(exc)}", file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
