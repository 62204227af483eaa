"""Fixtures of the hostile tests: bench/hostile.py loaded as a module, and a clean environment per test."""
import gc
import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def older_objects_frozen():
    """What the process held before the module (torch, vLLM, Ray, earlier modules' objects) is moved out of the
    garbage collector's sight (`gc.freeze`, after one full collection): bench/hostile.py's `measured` collects
    before every case to measure its peak RSS from a clean start, and in the suite's process a full collection
    walked every object the suite had made (about 0.1-0.5 s a case, hundreds of cases). A case still starts
    with its own garbage collected and its RSS measured from there; what the cases assert is unchanged.
    Unfrozen after the module, so nothing stays out of the collector's reach."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


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
