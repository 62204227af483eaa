"""Test-wide environment. TRITON_INTERPRET must be set before any kernel module is imported."""
import os
import uuid

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


@pytest.fixture(scope="session", autouse=True)
def run_cache(tmp_path_factory):
    """The run's own $KVTC_CACHE, unless the caller set one: registry pulls are cached per registry location, and
    the tests' registries live in fresh temp folders, so in the user's ~/.cache/kvtc every run left hundreds of pulled
    copies (13 GB in two days) and a later install or run found the disk full. Under pytest-xdist the workers share
    one folder (their base temps' parent), so the embedded model is converted once per run; pytest keeps the last
    three runs' base temps and removes older ones, this folder with them."""
    if os.environ.get("KVTC_CACHE"):
        yield
        return
    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "kvtc-cache"
    folder.mkdir(exist_ok=True)
    os.environ["KVTC_CACHE"] = str(folder)
    yield
    os.environ.pop("KVTC_CACHE", None)


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """The test process's torch runs on one thread, as the job's Ray workers do (--threads-per-worker 1), and so do
    its in-process reduces (they would take every core: `kvtc.pipeline.fit.pca.cores`). The suite's tensors are
    small: on a 2-core machine shared with another job, two OpenMP threads made each small elementwise op cost
    milliseconds (a barrier waiting for a descheduled thread) instead of tens of microseconds, and the in-process
    calibrations' ECSQ fits several times slower. What the tests assert does not depend on the thread count."""
    import torch

    from kvtc.pipeline.fit import pca
    from kvtc.pipeline.job import reduce

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pca, "cores", lambda: 1)
        patch.setattr(reduce, "cores", lambda: 1)
        yield
    torch.set_num_threads(before)


def _wait_listening(port: int, timeout: float = 30.0) -> None:
    """The moto server's thread binds after start() returns; a loaded machine takes a while."""
    from helpers.multinode import wait_listening

    wait_listening(port, timeout)


@pytest.fixture(scope="module")
def s3_endpoint():
    """A moto S3 server on loopback (one per test module); its URL."""
    pytest.importorskip("s3fs")
    server_mod = pytest.importorskip("moto.server")
    with pytest.MonkeyPatch.context() as env:
        for key, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                           ("AWS_DEFAULT_REGION", "us-east-1")):
            env.setenv(key, value)
        # port 0: the server binds a free port itself (a port picked here and bound later can be taken between)
        server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        port = server.get_host_and_port()[1]
        _wait_listening(port)
        yield f"http://127.0.0.1:{port}"
        server.stop()


@pytest.fixture(params=["local", "s3"])
def registry(request, tmp_path, monkeypatch):
    """An empty registry on local disk, then on a moto S3 bucket (a module may define its own)."""
    from kvtc.artifacts import Registry

    monkeypatch.setenv("KVTC_CACHE", str(tmp_path / "cache"))
    if request.param == "local":
        return Registry(str(tmp_path / "root" / "registry"))
    monkeypatch.setenv("AWS_ENDPOINT_URL", request.getfixturevalue("s3_endpoint"))
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()  # an instance cached by another module points at its own server
    bucket = f"kvtc-{uuid.uuid4().hex[:12]}"
    reg = Registry(f"s3://{bucket}/reg")
    reg.fs.mkdir(bucket)
    return reg


_EXIT = {"status": None}


def pytest_sessionfinish(session, exitstatus):
    _EXIT["status"] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """After the last report, the test process leaves without the interpreter's finalization: the suite
    loads torch, Triton's interpreter, numba, Ray, vLLM and LMCache into one process, and on a fresh
    environment their C extensions' finalizers have crashed at exit (SIGSEGV after every test passed).
    Only when pytest is the program (`python -m pytest`, `pytest`), never inside a caller's process."""
    import sys

    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if _EXIT["status"] is None or not (getattr(spec, "name", "") in ("pytest", "pytest.__main__")
                                       or os.path.basename(sys.argv[0]) in ("pytest", "py.test")):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_EXIT["status"])
