"""`kvtc lmcache-server ARGS` (or `python -m kvtc.kernels.lmcache_server ARGS`): LMCache's own server
(`lmcache server ARGS`) with the "kvtc" serde registered.

LMCache has no plugin entry points and builds its L2 adapters before any `--server-module` is
imported, so a `"serde": {"type": "kvtc", ...}` adapter needs the serde registered in the server's
process before LMCache parses its configuration. This does exactly that and nothing else: every
argument goes to LMCache unchanged, e.g.

    kvtc lmcache-server --host 127.0.0.1 --port 6555 --l1-size-gb 8 \\
        --l2-adapter '{"type": "fs", "base_path": "/cache", "serde": {"type": "kvtc",
                       "artifact": "llama-3.1-8b@production", "ratio": 16, "registry": "s3://bucket/kvtc"}}'
"""
from __future__ import annotations

import importlib
import sys
from typing import Any

SERVER_MODULES = ("lmcache.v1.distributed.storage_manager", "lmcache.v1.multiprocess.http_server")


class LauncherError(RuntimeError):
    """LMCache or its server's dependencies are missing."""


def check_server() -> None:
    """Import what `lmcache server` needs; LauncherError naming the missing module otherwise (LMCache's
    own command only warns and prints its help when its server dependencies are absent)."""
    try:
        import lmcache  # noqa: F401
    except ImportError as exc:
        raise LauncherError(f"LMCache is not installed ({exc}): pip install 'kvtc-calibration[lmcache]'") from exc
    for name in SERVER_MODULES:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise LauncherError(f"LMCache's server cannot start here: {name} needs {getattr(exc, 'name', exc)!r}, "
                                "which is not installed (install LMCache with its dependencies: pip install "
                                "lmcache)") from exc


def l2_adapter(argv: list[str], index: int = 0) -> tuple[Any, Any]:
    """The `index`-th L2 adapter `lmcache server ARGV` would build, with the kvtc serde registered, built
    by LMCache's own calls (its storage-manager argument parser and config, its L1 manager, `create_l2_adapter`
    and, for an adapter with a "serde", `SerdeL2AdapterWrapper` around `create_serde_processor`, as its
    StorageManager does) but without the request transport -> (adapter, l1_manager); close both after use.
    For checks and benchmarks where LMCache's server cannot start (its transport needs packages not installed)."""
    import argparse

    from lmcache.v1.distributed.config import add_storage_manager_args, parse_args_to_config
    from lmcache.v1.distributed.l1_manager import L1Manager
    from lmcache.v1.distributed.l2_adapters import create_l2_adapter
    from lmcache.v1.distributed.l2_adapters.serde_wrapper import SerdeL2AdapterWrapper
    from lmcache.v1.distributed.serde import create_serde_processor

    from kvtc.kernels.lmcache_serde import register

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
    """Register the kvtc serde, then run `lmcache server` with argv (default sys.argv[1:])."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args in (["-h"], ["--help"]):
        print(__doc__.strip())
    try:
        from kvtc.kernels.lmcache_serde import register

        register()
        check_server()
    except (ImportError, LauncherError) as exc:
        print(f"kvtc lmcache-server: error: {exc}", file=sys.stderr)
        return 2
    from lmcache.cli.main import main as lmcache_main

    try:
        lmcache_main(["server", *args])
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
