"""`ray job submit` against a Ray head started on loopback, as docs/calibrate.md shows for clusters: token
authentication on (Ray's default since 2.52), the submitting client given the head's token."""
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from kvtc import artifacts

pytestmark = pytest.mark.live

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_port(port: int, head: subprocess.Popen, log: Path, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert head.poll() is None, f"ray start exited with {head.returncode}: {log.read_text()[-3000:]}"
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.5)
    raise AssertionError(f"the Ray head's dashboard did not listen on port {port} within {seconds:g} s")


def _stop(head: subprocess.Popen) -> None:
    """Stop the head this test started, and only it: `ray start --block` stops the processes it started when
    it is terminated (never `ray stop`, which stops every Ray cluster on the host); what survives in its own
    process group is killed."""
    if head.poll() is None:
        head.send_signal(signal.SIGTERM)
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(head.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    head.wait(timeout=30)


@pytest.fixture()
def ray_head(tmp_path):
    head_home, client_home = tmp_path / "head-home", tmp_path / "client-home"
    head_home.mkdir()
    client_home.mkdir()
    # Ray's own folder: sessions, logs and sockets of this head alone (short: unix socket paths are limited)
    ray_temp = tempfile.mkdtemp(prefix="kvtc-ray-", dir="/tmp")
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_AUTH_MODE": "token", "HOME": str(head_home)}  # the head reads the cluster's token from ~/.ray/auth_token
    for name in ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        env.pop(name, None)
    token = secrets.token_hex(32)  # what `ray get-auth-token --generate` makes; `ray start` needs one to exist
    (head_home / ".ray").mkdir(mode=0o700)
    (head_home / ".ray" / "auth_token").write_text(token)
    dash = _free_port()
    log = tmp_path / "ray-head.log"
    output = log.open("w")
    head = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", "--block", f"--temp-dir={ray_temp}", "--node-ip-address=127.0.0.1",
         f"--port={_free_port()}", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", "--num-cpus=2",
         # ports Ray would otherwise take at fixed defaults, which another Ray on the host may hold (its job agent
         # then never registers: "No available agent to submit job")
         f"--dashboard-agent-listen-port={_free_port()}", f"--ray-client-server-port={_free_port()}",
         "--include-dashboard=true", "--disable-usage-stats"],
        env=env, cwd=tmp_path, stdout=output, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        _wait_for_port(dash, head, log, 180)
        # the submitting client: another home (no token file), the head's token in its environment
        client = {**env, "HOME": str(client_home), "RAY_AUTH_TOKEN": token}
        yield f"http://127.0.0.1:{dash}", client
    finally:
        _stop(head)
        output.close()
        shutil.rmtree(ray_temp, ignore_errors=True)


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
    deadline = time.monotonic() + 240  # the head's job agent registers after `ray start` returns: seconds, a loaded machine more
    while True:
        out = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
        if "No available agent to submit job" not in out.stdout + out.stderr or time.monotonic() > deadline:
            break
        time.sleep(5)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "succeeded" in (out.stdout + out.stderr).lower()
    reg = artifacts.Registry(str(registry))
    assert reg.names() == ["job-tiny"]
    art = artifacts.pull("job-tiny", registry=str(registry))
    assert art.manifest["model"]["model_type"] == "qwen2"
    assert sorted(art.ratios()) == [4.0, 8.0]
