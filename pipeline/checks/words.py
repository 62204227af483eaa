"""Checks of the options the `kvtc` commands share, run before any command starts work.

A rule applies to an option wherever a command defines it (same destination name), so every
command refuses the same bad values the same way: empty URIs, counts below 1, non-finite or
out-of-range numbers, invalid names and refs, output paths that are files, key files that do
not exist, a Ray address nobody answers at, and a store or registry URI its word refuses (`check_uri`).
"""
from __future__ import annotations

import argparse
import math
import os
from urllib.parse import urlsplit

from fsspec.core import split_protocol
from fsspec.registry import known_implementations, registry

from kvtc.artifacts.blocks import QTYPES, check_payable, check_ratios
from kvtc.artifacts.errors import IntegrityError
from kvtc.artifacts.names import check_name, split_ref
from kvtc.artifacts.safe_io import open_regular
from kvtc.artifacts.signing import load_private_key
from kvtc.pipeline.checks.environment import check_address, check_environment, unanswered

COUNTS = ("prefix", "workers", "threads_per_worker", "gpus_per_worker", "tp", "tokens", "eval_tokens", "seq_len", "seqs_per_shard",
          "drift_tokens", "max_runs", "heldout_rows", "accumulators", "continuation", "sequences")
NON_NEGATIVE_INTS = ("sinks", "window", "seed", "tokens_curve_points", "served_sequences")
NON_NEGATIVE_FLOATS = ("threshold", "if_drift", "tolerance")
POSITIVE_FLOATS = ("every", "timeout")
NON_EMPTY = ("registry", "store", "cache_dir", "to", "out")
REFS = ("ref", "target", "artifact")
KEY_FILES = ("key", "quality")
MAX_FEATURES = 1 << 24  # no model's p (layers x kv heads x head_dim) comes near this
URIS = ("store", "registry")  # where a word names storage: its protocol, its process, its endpoint
PROCESS_PROTOCOLS = ("memory",)  # held by one process: no Ray worker, on any node, reaches it
S3_ENDPOINT_ENV = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")  # botocore's own order
DEFAULT_S3_ENDPOINT = "https://s3.amazonaws.com"
ENDPOINT_TIMEOUT_S = 1.5
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
    check_payable(ratios, MAX_FEATURES, QTYPES, (1,), f"{flag}: even for the widest model, ")  # any allocator's cheapest
    return ratios


def check_uri(flag: str, uri: str, starts_ray: bool, probe_timeout: float = ENDPOINT_TIMEOUT_S) -> None:
    """A store or registry URI as its word tells it: a protocol fsspec knows, not memory:// where the job's Ray
    workers are other processes, and for an object store an endpoint that accepts a TCP connection within
    `probe_timeout` (ConnectionError naming `flag` and the endpoint). A plain path is left to its use."""
    last = uri.split("::")[-1]
    protocol = split_protocol(last)[0]
    if protocol is None:
        return
    known = sorted(set(known_implementations) | set(registry))
    for part in uri.split("::"):
        name = split_protocol(part)[0]
        if name is not None and name not in known:
            raise ValueError(f"{flag} {uri}: unknown storage protocol {name!r}; pass a path or an fsspec URI "
                             f"({', '.join(p for p in ('file', 's3', 'gs', 'az', 'hdfs') if p in known)}, ...)")
    if protocol in PROCESS_PROTOCOLS and starts_ray:
        raise ValueError(f"{flag} {uri} lives in this process's memory, and the job's Ray workers are other processes; "
                         "pass a path or an fsspec URI every node reaches (e.g. s3://bucket/kvtc-cache)")
    endpoint = _endpoint(protocol, last)
    if endpoint is None:
        return
    parts = urlsplit(endpoint)
    try:
        host, port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        host, port = None, 0
    if not host:
        raise ValueError(f"{flag} {uri}: its endpoint {endpoint!r} is not a URL (scheme://host[:port]); fix "
                         "$AWS_ENDPOINT_URL")
    failed = unanswered(host, port, probe_timeout)
    if failed:
        raise ConnectionError(f"{flag} {uri}: its endpoint {endpoint} does not answer within {probe_timeout:g} s "
                              f"({failed}); start the object store or fix the endpoint ($AWS_ENDPOINT_URL for s3://)")


def _endpoint(protocol: str, uri: str) -> str | None:
    """The URL an object-store URI is served from, where its word and the environment tell it."""
    if protocol in ("http", "https"):
        return uri
    if protocol in ("s3", "s3a"):
        named = next((os.environ[v] for v in S3_ENDPOINT_ENV if os.environ.get(v)), None)
        return named or (None if _configured_endpoint() else DEFAULT_S3_ENDPOINT)
    return None


def _configured_endpoint() -> bool:
    """Whether botocore's own configuration file may name an endpoint (then botocore reads it; its errors: exit 2)."""
    path = os.path.expanduser(os.environ.get("AWS_CONFIG_FILE") or "~/.aws/config")
    try:
        with os.fdopen(open_regular(path, "AWS config file", links="follow"), "rb") as f:
            return b"endpoint_url" in f.read(1 << 20)
    except (OSError, IntegrityError):
        return False


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
    starts_ray = "address" in values or getattr(values.get("func"), "__module__", "") in RAY_COMMANDS
    for dest in URIS:
        if isinstance(values.get(dest), str):
            check_uri(_flag(dest), values[dest], dest == "store" and starts_ray)
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
    check_environment(starts_ray=starts_ray)
