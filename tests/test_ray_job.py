"""`ray job submit` against a Ray head started on loopback, as the README shows for clusters: token
authentication on (Ray's default since 2.52), the submitting client given the head's token."""
import os
import secrets
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
    head_home, client_home = tmp_path / "head-home", tmp_path / "client-home"
    head_home.mkdir()
    client_home.mkdir()
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_AUTH_MODE": "token", "HOME": str(head_home)}  # the head reads the cluster's token from ~/.ray/auth_token
    for name in ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        env.pop(name, None)
    token = secrets.token_hex(32)  # what `ray get-auth-token --generate` makes; `ray start` needs one to exist
    (head_home / ".ray").mkdir(mode=0o700)
    (head_home / ".ray" / "auth_token").write_text(token)
    dash = _free_port()
    started = subprocess.run(
        [str(BIN / "ray"), "start", "--head", "--node-ip-address=127.0.0.1", f"--port={_free_port()}",
         "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", "--num-cpus=2", "--include-dashboard=true",
         "--disable-usage-stats"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=180,
    )
    assert started.returncode == 0, started.stderr[-3000:]
    try:
        # the submitting client: another home (no token file), the head's token in its environment
        client = {**env, "HOME": str(client_home), "RAY_AUTH_TOKEN": token}
        yield f"http://127.0.0.1:{dash}", client
    finally:
        subprocess.run([str(BIN / "ray"), "stop", "--force"], env=env, capture_output=True, timeout=120)


def test_ray_job_submit_publishes_artifact(ray_head, tmp_path):
    address, env = ray_head
    without = {k: v for k, v in env.items() if k != "RAY_AUTH_TOKEN"}
    refused = subprocess.run([str(BIN / "ray"), "job", "list", "--address", address], env=without, cwd=REPO,
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0, "a client without the head's token must be refused"
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
