"""The environment variables kvtc reads, or hands to Ray, checked before any command starts work.

Ray parses its own `RAY_<setting>` variables in C++ when it starts: a word where it wants a number crashes it
(`RAY_memory_usage_threshold=abc` ends the job with a segmentation fault, no message). kvtc reads some of them
too (the reduce's memory budget, the task retry count it sets) and its own `KVTC_*` switches and paths. Each is
checked here, in the command line, before torch, transformers or Ray load; a bad value is one line naming the
variable and what it must be (exit 2). An unset variable means its default, as before; so does an empty one,
except Ray's numbers and switches, which Ray itself would fail to parse.
"""
from __future__ import annotations

import math
import os
import socket
from dataclasses import dataclass
from typing import Callable, Mapping
from urllib.parse import urlsplit

from kvtc.artifacts.env_values import flag, ray_float, ray_int

ADDRESS_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class EnvRule:
    """One variable: its check (raises ValueError with what it must be), whether only commands that start Ray (the
    calibration, recalibration) read it, and whether an empty value means its default."""

    name: str
    check: Callable[[str], None]
    ray: bool = False
    empty_ok: bool = True  # set but empty means the default (False: Ray's C++ parser reads "" as a bad number)


def _fraction(low: float, high: float) -> Callable[[str], None]:
    def check(text: str) -> None:
        value = ray_float(text)  # Ray's own reading of the word (kvtc.artifacts.env_values), which kvtc reads too
        if not (math.isfinite(value) and low <= value <= high):
            raise ValueError(f"must be a number in [{low:g}, {high:g}] (the share of a node's memory above which "
                             f"Ray kills tasks; Ray's default 0.95), got {text!r}")
    return check


def _integer(low: int) -> Callable[[str], None]:
    def check(text: str) -> None:
        if ray_int(text) < low:
            raise ValueError(f"must be an integer >= {low}, got {text!r}")
    return check


def _bit(text: str) -> None:
    if text not in ("0", "1"):
        raise ValueError(f"must be 0 or 1 (Ray reads nothing else), got {text!r}")


def _address(text: str) -> None:
    try:
        check_address(text)
    except (ValueError, OSError) as exc:
        raise ValueError(str(exc).replace(f"--address {text!r} is", "is").replace(f"--address {text}: ", "")) from None


def check_address(address: str, timeout: float = ADDRESS_TIMEOUT_S) -> None:
    """Refuse a Ray address whose host:port does not accept a TCP connection within `timeout`."""
    if address in ("auto", "local") or not address.strip():
        if not address.strip():
            raise ValueError("--address is empty; omit it to start a local Ray, or pass HOST:PORT")
        return
    parts = urlsplit(address if "://" in address else f"ray://{address}")
    try:
        host, port = parts.hostname, parts.port
    except ValueError:
        host, port = None, None
    if not host or not port:
        raise ValueError(f"--address {address!r} is not HOST:PORT, ray://HOST:PORT, auto or local")
    failed = unanswered(host, port, timeout)
    if failed:
        raise ConnectionError(f"--address {address}: nothing answers at {host}:{port} within {timeout:g} s ({failed}); "
                              "start the cluster (`ray start --head`) or fix the address")


def unanswered(host: str, port: int, timeout: float) -> str | None:
    """Why `host:port` does not accept a TCP connection within `timeout` seconds, or None when it does."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except OSError as exc:
        return exc.strerror or type(exc).__name__


def _file(text: str) -> None:
    if not os.path.isfile(os.path.expanduser(text)):
        raise ValueError(f"names {text!r}, which does not exist or is not a file")


def _folder(text: str) -> None:
    path = os.path.expanduser(text)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"names {text!r}, an existing file; give a directory (it is created if missing)")


def _hook(fields: int) -> Callable[[str], None]:
    def check(text: str) -> None:
        parts = text.split(":", fields - 1)
        if len(parts) != fields or not all(parts) or (fields == 2 and not parts[0].isdigit()):
            form = "<shard index>:<marker file>" if fields == 2 else "<stage>:<node id>:<marker file>"
            raise ValueError(f"must be {form} (a test hook), got {text!r}")
    return check


RULES = (
    EnvRule("RAY_memory_usage_threshold", _fraction(0.1, 1.0), ray=True, empty_ok=False),
    EnvRule("RAY_task_oom_retries", _integer(-1), ray=True, empty_ok=False),
    EnvRule("RAY_USAGE_STATS_ENABLED", _bit, ray=True, empty_ok=False),
    EnvRule("RAY_ADDRESS", _address, ray=True),
    EnvRule("KVTC_REQUIRE_SIGNATURE", flag),
    EnvRule("KVTC_REQUIRE_KERNELS", flag),
    EnvRule("KVTC_PUBLIC_KEY", _file),
    EnvRule("KVTC_CACHE", _folder),
    EnvRule("KVTC_TEST_KILL_ON_SHARD", _hook(2), ray=True),
    EnvRule("KVTC_TEST_HOLD_ON_NODE", _hook(3), ray=True),
)


def check_environment(starts_ray: bool, environ: Mapping[str, str] | None = None) -> None:
    """ValueError naming the first variable set to a value kvtc or Ray cannot use (`RULES`); the Ray ones only
    for a command that starts or joins Ray (`starts_ray`)."""
    env = os.environ if environ is None else environ
    for rule in RULES:
        text = env.get(rule.name)
        if text is None or (not text and rule.empty_ok) or (rule.ray and not starts_ray):
            continue
        try:
            rule.check(text)
        except (ValueError, OSError) as exc:  # OSError: RAY_ADDRESS where nothing answers
            raise ValueError(f"environment variable {rule.name} {exc}; fix or unset it") from None
