"""Checks of the options the `kvtc` commands share, run before any command starts work.

A rule applies to an option wherever a command defines it (same destination name), so every
command refuses the same bad values the same way: empty URIs, counts below 1, non-finite or
out-of-range numbers, invalid names and refs, output paths that are files, key files that do
not exist, and a Ray address nobody answers at.
"""
from __future__ import annotations

import argparse
import math
import os

from kvtc.artifacts.blocks import check_ratios
from kvtc.artifacts.registry import split_ref
from kvtc.artifacts.schema import check_name
from kvtc.artifacts.signing import load_private_key
from kvtc.pipeline.env_checks import check_address, check_environment

COUNTS = ("workers", "threads_per_worker", "gpus_per_worker", "tp", "tokens", "eval_tokens", "seq_len", "seqs_per_shard",
          "drift_tokens", "max_runs", "heldout_rows", "accumulators", "continuation", "sequences")
NON_NEGATIVE_INTS = ("sinks", "window", "seed", "tokens_curve_points", "served_sequences")
NON_NEGATIVE_FLOATS = ("threshold", "if_drift", "tolerance")
POSITIVE_FLOATS = ("every", "timeout")
NON_EMPTY = ("registry", "store", "cache_dir", "to", "out")
REFS = ("ref", "target", "artifact")
KEY_FILES = ("key", "quality")
MAX_FEATURES = 1 << 24  # no model's p (layers x kv heads x head_dim) comes near this
CHEAPEST_BLOCK_BITS = 18  # one int2 component plus a 16-bit scale: the cheapest block any allocator pays for
RAY_COMMANDS = ("kvtc.pipeline.commands.calibrate", "kvtc.pipeline.commands.recalibrate")  # they start or join Ray


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def parse_ratios(text: str, flag: str = "--ratios") -> tuple[float, ...]:
    """"8,16,32" -> (8.0, 16.0, 32.0): finite, > 1, no duplicates, payable by some model."""
    try:
        ratios = tuple(float(x) for x in str(text).split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated numbers, got {text!r}") from None
    if not ratios:
        raise ValueError(f"{flag} is empty; pass e.g. {flag} 8,16,32")
    check_ratios(ratios, f"{flag}: ")
    for r in ratios:
        if 16 * MAX_FEATURES / r < CHEAPEST_BLOCK_BITS:
            raise ValueError(f"{flag}: compression ratio {r:g} leaves no model enough bits for one quantized "
                             f"component; use a ratio <= {16 * MAX_FEATURES / CHEAPEST_BLOCK_BITS:.0f} (8 to 64 is usual)")
    return ratios


def check_args(args: argparse.Namespace) -> None:
    """Raise ValueError (or ConnectionError) naming the first bad option of a parsed command line."""
    values = vars(args)
    for dest in NON_EMPTY:
        if isinstance(values.get(dest), str) and not values[dest].strip():
            raise ValueError(f"{_flag(dest)} is empty; pass a path or URI, or omit it for the default")
    for dest in COUNTS:
        if values.get(dest) is not None and values[dest] < 1:
            raise ValueError(f"{_flag(dest)} must be >= 1, got {values[dest]}")
    for dest in NON_NEGATIVE_INTS:
        if values.get(dest) is not None and values[dest] < 0:
            raise ValueError(f"{_flag(dest)} must be >= 0, got {values[dest]}")
    for dest in NON_NEGATIVE_FLOATS + POSITIVE_FLOATS:
        value = values.get(dest)
        if value is None:
            continue
        if not math.isfinite(value) or value < 0 or (dest in POSITIVE_FLOATS and value == 0):
            want = "> 0" if dest in POSITIVE_FLOATS else ">= 0"
            raise ValueError(f"{_flag(dest)} must be {want} and finite, got {value}")
    for dest, lo, hi in (("sample", 0.0, 1.0), ("holdout_fraction", 0.0, 1.0)):
        value = values.get(dest)
        if value is not None and not (lo < value <= hi if dest == "sample" else lo < value < hi):
            raise ValueError(f"{_flag(dest)} must be in ({lo:g}, {hi:g}{']' if dest == 'sample' else ')'}, got {value}")
    if isinstance(values.get("ratios"), str):
        parse_ratios(values["ratios"])
    if values.get("ratio") is not None:
        parse_ratios(str(values["ratio"]), "--ratio")
    if values.get("name"):
        check_name("artifact name (--name)", values["name"])
    if isinstance(values.get("alias"), str):
        check_name("alias", values["alias"])
    for alias in values.get("alias") or [] if isinstance(values.get("alias"), list) else []:
        check_name("--alias", alias)
    for dest in REFS:
        if isinstance(values.get(dest), str):
            split_ref(values[dest])
    for dest in ("to", "out", "store", "cache_dir"):
        path = values.get(dest)
        if path and "://" not in path and os.path.exists(path) and not os.path.isdir(path):
            raise ValueError(f"{_flag(dest)} {path} is an existing file; pass a directory (it is created if missing)")
    for dest in KEY_FILES:
        path = values.get(dest)
        if path and not os.path.isfile(path):
            raise ValueError(f"{_flag(dest)} {path} does not exist or is not a file")
    if values.get("require_signature") and not (values.get("key") or os.environ.get("KVTC_PUBLIC_KEY")):
        raise ValueError("--require-signature needs the signer's public key: pass --key PUBLIC.pem")
    if "seq_len" in values and os.environ.get("KVTC_SIGNING_KEY"):  # a publishing command: check the key now
        load_private_key(os.environ["KVTC_SIGNING_KEY"])
    if values.get("address") is not None:
        check_address(values["address"])
    check_environment(starts_ray="address" in values or getattr(values.get("func"), "__module__", "") in RAY_COMMANDS)
