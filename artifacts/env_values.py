"""The environment words kvtc reads, or hands to Ray, each parsed by one function that the command line's
check and the code reading the variable both call, so the check accepts exactly what the reader reads.

Ray reads its `RAY_<setting>` numbers in C++ (a stream parse that must consume the whole word): an
underscore, a space or a non-ASCII digit that Python's `int()` and `float()` accept ends Ray with a
segmentation fault and no message. `ray_int` and `ray_float` accept only plain ASCII numbers, which both
parsers read alike. kvtc's own switches (`KVTC_REQUIRE_SIGNATURE`, `KVTC_REQUIRE_KERNELS`) are "1", "0" or
empty, nothing else: `" 0"` is neither on nor off, so it is refused rather than read as on by one reader and
off by another. Imports nothing heavy.
"""
from __future__ import annotations

import os
import re
from typing import Mapping

_INT = re.compile(r"-?[0-9]+", re.ASCII)
_FLOAT = re.compile(r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?", re.ASCII)
FLAG_WORDS = ("", "0", "1")


def ray_int(text: str) -> int:
    """An integer as Ray's C++ parser reads it: ASCII digits with an optional '-', nothing around them."""
    if not _INT.fullmatch(text):
        raise ValueError(f"must be an integer in plain ASCII digits (no spaces, underscores or other digits), got {text!r}")
    return int(text)


def ray_float(text: str) -> float:
    """A non-negative number as Ray's C++ parser reads it: ASCII digits, one '.', an optional exponent."""
    if not _FLOAT.fullmatch(text):
        raise ValueError(f"must be a number such as 0.95 in plain ASCII digits (no spaces, underscores or other digits), "
                         f"got {text!r}")
    return float(text)


def flag(text: str) -> bool:
    """A kvtc switch: "1" on, "0" or "" off; anything else (" 0", "yes", "true") is refused."""
    if text not in FLAG_WORDS:
        raise ValueError(f"must be 1 (on) or 0 (off), exactly, got {text!r}")
    return text == "1"


def env_flag(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """The switch `name` in the environment (unset: off); ValueError naming the variable when it is neither."""
    text = (os.environ if environ is None else environ).get(name, "")
    try:
        return flag(text)
    except ValueError as exc:
        raise ValueError(f"environment variable {name} {exc}; fix or unset it") from None
