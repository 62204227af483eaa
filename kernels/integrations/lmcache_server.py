"""`kvtc lmcache-server ARGS` (or `python -m kvtc.kernels.integrations.lmcache_server ARGS`): LMCache's own server
(`lmcache server ARGS`) with the "kvtc" serde registered and chunk positions recorded.

LMCache has no plugin entry points and builds its L2 adapters before any `--server-module` is
imported, so a `"serde": {"type": "kvtc", ...}` adapter needs the serde registered in the server's
process before LMCache parses its configuration. This does that, records the token position of each
chunk key the server resolves (for artifacts calibrated with RoPE removed) and nothing else: every
argument goes to LMCache unchanged, e.g.

    kvtc lmcache-server --host 127.0.0.1 --port 6555 --l1-size-gb 8 --eviction-policy LRU \\
        --l2-adapter '{"type": "fs", "base_path": "/cache", "serde": {"type": "kvtc",
                       "artifact": "llama-3.1-8b@production", "ratio": 16, "registry": "s3://bucket/kvtc"}}'

Install: pip install 'kvtc-calibration[serve]' (the server's start-up dependencies), then
pip install --no-deps lmcache==0.5.6 (see docs/serving.md, "LMCache's own pins": they include CUDA packages).
"""
from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
from typing import Any

from kvtc.kernels.integrations.lmcache_settings import ChunkSerdeSettings

EXTRA = "serve"
INSTALL = f"pip install 'kvtc-calibration[{EXTRA}]' (from a checkout: pip install -e '.[{EXTRA}]')"
# What `lmcache server` imports while it starts (module -> pip package), beyond kvtc's own dependencies:
# the `serve` extra installs them. Measured by starting the server (python -X importtime).
SERVER_DEPENDENCIES = {
    "msgspec": "msgspec", "zmq": "pyzmq", "fastapi": "fastapi", "uvicorn": "uvicorn", "httpx": "httpx",
    "blake3": "blake3", "cryptography": "cryptography", "sortedcontainers": "sortedcontainers", "numba": "numba",
    "cpuinfo": "py-cpuinfo", "cachetools": "cachetools", "aiofiles": "aiofiles", "aiofile": "aiofile",
    "prometheus_client": "prometheus_client", "opentelemetry.sdk": "opentelemetry-sdk", "yaml": "pyyaml",
    "aiohttp": "aiohttp",
}
SERVER_MODULES = ("lmcache.v1.distributed.storage_manager", "lmcache.v1.multiprocess.server",
                  "lmcache.v1.multiprocess.http_server", "lmcache.v1.multiprocess.token_hasher")


class LauncherError(RuntimeError):
    """LMCache or its server's dependencies are missing."""


def _missing(name: str, exc: ImportError, needed_by: str | None = None) -> LauncherError:
    missing = getattr(exc, "name", None) or name
    package = SERVER_DEPENDENCIES.get(missing, SERVER_DEPENDENCIES.get(missing.split(".")[0], missing.split(".")[0]))
    by = f" (imported by {needed_by})" if needed_by and needed_by != missing else ""
    return LauncherError(f"LMCache's server needs the module {missing!r}{by}, from the package {package!r}, which is "
                         f"not installed: {INSTALL}")


def check_server() -> None:
    """Import everything `lmcache server` imports while starting; LauncherError naming the first missing
    module and the extra that installs it (LMCache's own command only warns and prints its help)."""
    try:
        import lmcache  # noqa: F401, PLC0415 - optional: checked only when the server starts
    except ImportError as exc:
        if getattr(exc, "name", None) in (None, "lmcache"):
            raise LauncherError(f"LMCache is not installed: {INSTALL}, then pip install --no-deps "
                                "lmcache==0.5.6") from exc
        raise _missing("lmcache", exc, "lmcache") from exc
    for name in (*SERVER_DEPENDENCIES, *SERVER_MODULES):
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise _missing(name, exc, name) from exc


class ArgumentsError(ValueError):
    """A server argument LMCache or the kvtc serde refuses (named in one line, exit 2)."""


def check_adapters(argv: list[str]) -> None:
    """Every --l2-adapter value a JSON object, and each kvtc serde's settings and chunk key (ChunkSerdeSettings;
    the artifact is pulled when LMCache builds the adapter): ArgumentsError naming the first refused, before
    LMCache is imported (a bad command line is refused in well under 2 s)."""
    adapters = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--l2-adapter"]
    adapters += [a.split("=", 1)[1] for a in argv if a.startswith("--l2-adapter=")]
    for i, text in enumerate(adapters, 1):
        try:
            adapter = json.loads(text)
        except ValueError as exc:
            raise ArgumentsError(f"--l2-adapter #{i} is not JSON ({exc}): pass one JSON object, e.g. "
                                 """'{"type": "fs", "base_path": "/cache", "serde": {"type": "kvtc", ...}}'""") from None
        if not isinstance(adapter, dict):
            raise ArgumentsError(f"--l2-adapter #{i} must be a JSON object, got {type(adapter).__name__}")
        serde = adapter.get("serde")
        if isinstance(serde, dict) and serde.get("type") == "kvtc":
            try:
                ChunkSerdeSettings.from_kwargs(serde).chunk_key()
            except (ValueError, TypeError) as exc:
                raise ArgumentsError(f"--l2-adapter #{i}: {' '.join(str(exc).split())}") from None


def check_arguments(argv: list[str]) -> None:
    """The storage arguments as LMCache's own parser reads them (`add_storage_manager_args`,
    `parse_args_to_config`: --l1-size-gb, --eviction-policy, every --l2-adapter's fields), its log silenced:
    ArgumentsError naming the first refused, before LMCache starts anything."""
    from lmcache.v1.distributed.config import add_storage_manager_args, parse_args_to_config  # noqa: PLC0415 - LMCache, to run

    parser = argparse.ArgumentParser(prog="lmcache server", add_help=False)
    add_storage_manager_args(parser)
    logging.disable(logging.CRITICAL)
    try:
        known, _ = parser.parse_known_args(argv)
        parse_args_to_config(known)
    except SystemExit as exc:  # argparse's own message is already printed
        raise ArgumentsError("the arguments above are refused by LMCache's parser") from exc
    except (ValueError, TypeError, KeyError) as exc:
        raise ArgumentsError(" ".join(str(exc).split())) from None
    finally:
        logging.disable(logging.NOTSET)


def l2_adapter(argv: list[str], index: int = 0) -> tuple[Any, Any]:
    """The `index`-th L2 adapter `lmcache server ARGV` would build, with the kvtc serde registered, built
    by LMCache's own calls (its storage-manager argument parser and config, its L1 manager, `create_l2_adapter`
    and, for an adapter with a "serde", `SerdeL2AdapterWrapper` around `create_serde_processor`, as its
    StorageManager does) but without the request transport -> (adapter, l1_manager); close both after use.
    For checks and benchmarks of the adapter alone (tests/kernels/integrations/test_lmcache_live.py runs the whole server)."""
    # LMCache, and through the serde torch, load only when an adapter is built: this launcher stays light
    from lmcache.v1.distributed.config import add_storage_manager_args, parse_args_to_config  # noqa: PLC0415 - see above
    from lmcache.v1.distributed.l1_manager import L1Manager  # noqa: PLC0415 - see above
    from lmcache.v1.distributed.l2_adapters import create_l2_adapter  # noqa: PLC0415 - see above
    from lmcache.v1.distributed.l2_adapters.serde_wrapper import SerdeL2AdapterWrapper  # noqa: PLC0415 - see above
    from lmcache.v1.distributed.serde import create_serde_processor  # noqa: PLC0415 - see above

    from kvtc.kernels.integrations.lmcache_serde import register  # noqa: PLC0415 - see above

    register()
    parser = argparse.ArgumentParser(prog="lmcache server")
    add_storage_manager_args(parser)
    config = parse_args_to_config(parser.parse_args(argv))
    l1 = L1Manager(config.l1_manager_config)
    adapter_config = config.l2_adapter_config.adapters[index]
    adapter = create_l2_adapter(adapter_config, l1.get_l1_memory_desc())
    if adapter_config.serde_config is not None:
        adapter = SerdeL2AdapterWrapper(inner=adapter, serde=create_serde_processor(adapter_config.serde_config),
                                        l1_manager=l1)
    return adapter, l1


def main(argv: list[str] | None = None) -> int:
    """Register the kvtc serde and the position hook, then run `lmcache server` with argv (default
    sys.argv[1:]). Exit 2 with one line on stderr where LMCache or a server dependency is missing, or where
    LMCache's parser or the kvtc serde refuses a storage argument (a bad --l2-adapter JSON: check_arguments);
    `--help` prints this help (and that line, if any) and exits 0 even then."""
    args = list(sys.argv[1:] if argv is None else argv)
    wants_help = any(a in ("-h", "--help") for a in args)
    if wants_help:
        print(__doc__.strip())
        sys.stdout.flush()
    else:
        try:
            check_adapters(args)
        except ArgumentsError as exc:
            print(f"kvtc lmcache-server: error: {exc}", file=sys.stderr)
            return 2
    quiet = not wants_help and logging.getLogger().getEffectiveLevel() > logging.DEBUG
    if quiet:  # LMCache's import-time INFO lines; a refusal is then the one line below
        logging.disable(logging.INFO)
    try:
        check_server()
        from kvtc.kernels.integrations.lmcache_serde import install_position_hook, register  # noqa: PLC0415 - torch, LMCache

        register()
        install_position_hook()
    except LauncherError as exc:
        print(f"kvtc lmcache-server: error: {exc}", file=sys.stderr)
        return 0 if wants_help else 2
    except ImportError as exc:
        print(f"kvtc lmcache-server: error: {_missing(getattr(exc, 'name', None) or '?', exc)}", file=sys.stderr)
        return 0 if wants_help else 2
    finally:
        logging.disable(logging.NOTSET)
    if not wants_help:
        try:
            check_arguments(args)
        except ArgumentsError as exc:
            print(f"kvtc lmcache-server: error: {exc}", file=sys.stderr)
            return 2
    from lmcache.cli.main import main as lmcache_main  # noqa: PLC0415 - LMCache loads only to run the server

    try:
        lmcache_main(["server", *args])
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
