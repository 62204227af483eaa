"""Artifact names, versions, aliases and refs: the words a registry turns into path segments, checked by one
rule wherever they enter (the command line, the registry, a manifest). Imports nothing but `re`, so the command
line checks them before numpy or pyarrow load."""
from __future__ import annotations

import re

NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # always fullmatch: "$" would accept "x\n"
DIGEST_PATTERN = re.compile(r"sha256:[0-9a-f]{64}")


def check_name(kind: str, value: str) -> str:
    """Names, versions and aliases become path segments: letters, digits, '.', '_', '-' only."""
    if not isinstance(value, str) or not NAME_PATTERN.fullmatch(value):
        raise ValueError(f"invalid {kind} {value!r}: use letters, digits, '.', '_', '-' (start with a letter or digit)")
    return value


def check_ref(ref: str) -> str:
    """A version id, an alias, or a content digest "sha256:<64 hex>"."""
    if isinstance(ref, str) and DIGEST_PATTERN.fullmatch(ref):
        return ref
    return check_name("ref", ref)


def split_ref(spec: str, ref: str | None = None) -> tuple[str, str]:
    """"name", "name@version", "name@alias" or "name@sha256:HEX" (+ optional explicit ref) -> (name, ref);
    default ref "latest"."""
    if not isinstance(spec, str):
        raise ValueError(f"an artifact reference is a string NAME[@REF], got {type(spec).__name__}")
    name, _, inline = spec.partition("@")
    if inline and ref not in (None, "latest", inline):
        raise ValueError(f"{spec!r} already names a ref; do not also pass ref={ref!r}")
    return check_name("artifact name", name), check_ref(inline or ref or "latest")
