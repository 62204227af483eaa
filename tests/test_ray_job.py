"""`ray job submit` against a Ray head started on loopback, as the README shows for clusters."""
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtc import artifacts

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture()
def ray_head(tmp_path):
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_AUTH_MODE": "disabled"}  # loopback-only test cluster
    env.pop("RAY_ADDRESS", None)
    dash = _free_port()
    subprocess.run(
        [str(BIN / "ray"), "start", "--head", "--node-ip-address=127.0.0.1", f"--port={_free_port()}",
         "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", "--num-cpus=2", "--include-dashboard=true",
         "--disable-usage-stats"],
        check=True, env=env, cwd=tmp_path, capture_output=True, timeout=180,
    )
    try:
        yield f"http://127.0.0.1:{dash}", env
    finally:
        subprocess.run([str(BIN / "ray"), "stop", "--force"], env=env, capture_output=True, timeout=120)


def test_ray_job_submit_publishes_artifact(ray_head, tmp_path):
    address, env = ray_head
    registry, store = tmp_path / "reg", tmp_path / "store"
    cmd = [
        str(BIN / "ray"), "job", "submit", "--address", address, "--working-dir", str(REPO), "--",
        "python", "-m", "kvtc.pipeline.calibrate_job", "--model", "tiny:qwen2", "--corpus", "pydoc", "--eval-corpus", "none",
        "--seq-len", "128", "--window", "16", "--tokens", "1536", "--seqs-per-shard", "2", "--ratios", "4,8",
        "--registry", str(registry), "--store", str(store), "--name", "job-tiny", "--json",
    ]
    for _attempt in range(6):  # the head's job agent registers a few seconds after `ray start` returns
        out = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
        if "No available agent to submit job" not in out.stderr:
            break
        time.sleep(5)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "succeeded" in (out.stdout + out.stderr).lower()
    reg = artifacts.Registry(str(registry))
    assert reg.names() == ["job-tiny"]
    art = artifacts.pull("job-tiny", registry=str(registry))
    assert art.manifest["model"]["model_type"] == "qwen2"
    assert sorted(art.ratios()) == [4.0, 8.0]
