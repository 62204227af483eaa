"""The `kvtc` commands, one module per command (or per family sharing options): each module's
`register(subparsers)` builds its parser, and its handler imports the domain module it runs
(kvtc.pipeline.job, .operations, .evaluation, kvtc.artifacts) only when called, calls it and prints.

Importing a command module imports no torch, Ray, transformers or matplotlib, so `kvtc --help`,
`kvtc list` and a refused argument stay fast (tests/pipeline/test_structure.py checks it). A parser whose
description is a domain module's docstring reads it with `module_doc`, without importing that module.
The domain modules hold no argument parsing and no printing of results.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import importlib.util
import sys
import tokenize
import warnings
from typing import Callable, Iterator


def module_doc(name: str) -> str | None:
    """The docstring of module `name`, read from its source file without importing the module."""
    loaded = sys.modules.get(name)
    if loaded is not None:
        return loaded.__doc__
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return importlib.import_module(name).__doc__  # no source to read (a compiled install)
    with tokenize.open(spec.origin) as f:
        for token in tokenize.generate_tokens(f.readline):
            if token.type in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE):
                continue
            if token.type != tokenize.STRING:
                return None
            import ast

            return ast.literal_eval(token.string)
    return None


@contextlib.contextmanager
def one_line_warnings(command: str) -> Iterator[None]:
    """Show each warning as one stderr line `kvtc COMMAND: warning: ...` (no source line)."""
    def show(message, category, filename, lineno, file=None, line=None) -> None:
        print(f"kvtc {command}: warning: {' '.join(str(message).split())}", file=sys.stderr)

    with warnings.catch_warnings():
        warnings.showwarning = show
        yield


def with_one_line_warnings(command: str, func: Callable[[argparse.Namespace], int]
                           ) -> Callable[[argparse.Namespace], int]:
    """`func` run inside one_line_warnings(command)."""
    @functools.wraps(func)
    def run(args: argparse.Namespace) -> int:
        with one_line_warnings(command):
            return func(args)
    return run
