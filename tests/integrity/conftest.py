"""Fixtures of the hostile tests: bench/hostile.py loaded as a module, and a clean environment per test."""
import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def hostile():
    spec = importlib.util.spec_from_file_location("kvtc_bench_hostile", REPO / "bench" / "hostile.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


@pytest.fixture
def tmp(tmp_path, monkeypatch):
    """tmp_path with its own KVTC_CACHE, and no key, signature or Ray setting of the caller's environment."""
    monkeypatch.setenv("KVTC_CACHE", str(tmp_path / "cache"))
    for name in ("KVTC_PUBLIC_KEY", "KVTC_REQUIRE_SIGNATURE", "RAY_memory_usage_threshold", "RAY_ADDRESS"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path
