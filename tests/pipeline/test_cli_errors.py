"""The `kvtc` CLI never leaks a traceback: every bad input ends in one line on stderr and a documented
exit code, before any model work; `--json` stdout holds only the JSON; signing from the command line."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvtc.artifacts import publish
from helpers.toy_artifacts import toy_content
from kvtc.pipeline import cli

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture()
def reg(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTC_CACHE", str(tmp_path / "cache"))
    root = tmp_path / "registry"
    publish(toy_content(), root)
    return str(root)


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _bad_inputs(reg: str, tmp: Path) -> list[tuple[list[str], int, str]]:
    (tmp / "afile").write_text("x")
    afile = str(tmp / "afile")
    return [
        (["show", "toy\n", "--registry", reg], 2, "invalid artifact name"),
        (["alias", "toy", "prod\n", "--registry", reg], 2, "invalid alias"),
        (["calibrate", "--name", "bad/name", "--model", "tiny:llama"], 2, "invalid artifact name"),
        (["calibrate", "--registry", "", "--model", "tiny:llama"], 2, "--registry is empty"),
        (["calibrate", "--workers", "0", "--model", "tiny:llama"], 2, "--workers must be >= 1"),
        (["calibrate", "--threads-per-worker", "0"], 2, "--threads-per-worker must be >= 1"),
        (["calibrate", "--served-sequences", "-1"], 2, "--served-sequences must be >= 0"),
        (["calibrate", "--ratios", "1e9"], 2, "even for the widest model, compression ratio 1e+09 leaves"),
        (["calibrate", "--ratios", "16,16"], 2, "lists a ratio twice"),
        (["calibrate", "--ratios", "8,nan"], 2, "must be > 1 and finite"),
        (["calibrate", "--address", "127.0.0.1:1"], 2, "nothing answers at 127.0.0.1:1"),
        (["drift", "toy", "--tokens", "0", "--registry", reg], 2, "--tokens must be >= 1"),
        (["drift", "toy", "--threshold", "nan", "--registry", reg], 2, "--threshold must be >= 0 and finite"),
        (["schedule", "--every", "inf", "--", "list"], 2, "--every must be > 0 and finite"),
        (["pull", "toy", "--to", afile, "--registry", reg], 2, "is an existing file"),
        (["report", "toy", "--out", afile, "--registry", reg], 2, "is an existing file"),
        (["list", "--registry", "ftp://127.0.0.1:1"], 2, "cannot be reached"),
        (["show", "nope", "--registry", reg], 2, "no artifact named 'nope'"),
        (["verify", "toy", "--require-signature", "--registry", reg], 2, "needs the signer's public key"),
        (["verify", "toy", "--key", afile, "--registry", reg], 2, "not a PEM public key"),
        (["show", "toy@sha256:" + "0" * 64, "--registry", reg], 2, "no version with manifest digest"),
    ]


def test_every_bad_input_is_one_line_and_exit_2(reg, tmp_path, capsys, monkeypatch):
    import kvtc.workers.models as models

    def no_model(*_args, **_kwargs):
        raise AssertionError("model work started before validation")

    monkeypatch.setattr(models, "load_model", no_model)
    cases = _bad_inputs(reg, tmp_path)
    for argv, code, message in cases:
        rc, out, err = _run(capsys, *argv)
        assert (rc, message in err) == (code, True), (argv, rc, err)
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1 and out == "", (argv, err)


def test_malformed_manifests_exit_6_and_list_survives(reg, capsys):
    version = os.listdir(f"{reg}/toy/versions")[0]
    manifest = Path(reg, "toy", "versions", version, "manifest.json")
    original = manifest.read_bytes()
    good = publish(toy_content(seed=1), reg).version
    shapes = [b"[]", b'{"files": [], "version": "x"}', json.dumps({**json.loads(original), "schema_version": "1"}).encode(),
              json.dumps({k: v for k, v in json.loads(original).items() if k != "calibration"}).encode(), b"\xff"]
    for data in shapes:
        manifest.write_bytes(data)
        rc, _, err = _run(capsys, "show", f"toy@{version}", "--registry", reg)
        assert rc == 6 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        rc, out, _ = _run(capsys, "list", "toy", "--registry", reg)
        assert rc == 0 and good in out and "UNREADABLE" in out
    manifest.unlink()
    manifest.mkdir()
    rc, _, err = _run(capsys, "verify", f"toy@{version}", "--registry", reg)
    assert rc in (2, 6) and "Traceback" not in err


def _replace_command(monkeypatch, name: str, func) -> None:
    parser = cli.build_parser()
    parser._subparsers._group_actions[0].choices[name].set_defaults(func=func)
    monkeypatch.setattr(cli, "build_parser", lambda: parser)


def test_unexpected_errors_are_one_line_unless_debug(reg, capsys, monkeypatch):
    def bug(_args):
        return 1 / 0

    _replace_command(monkeypatch, "list", bug)
    rc, _, err = _run(capsys, "list", "--registry", reg)
    assert rc == 1 and "internal error: ZeroDivisionError" in err and "--debug" in err and "Traceback" not in err
    rc, _, err = _run(capsys, "--debug", "list", "--registry", reg)
    assert rc == 1 and "Traceback" in err


def test_error_kinds_bad_input_bug_integrity(reg, capsys, monkeypatch):
    """Bad input exits 2 in one line; a RuntimeError (an allocator bug, a kernel failure) is a bug, not bad
    input: exit 1 pointing to --debug; an integrity failure has its own code."""
    from kvtc.artifacts.errors import InputError, IntegrityError

    for exc, code, words in ((InputError("the worker runs another dtype; pass --dtype"), 2, "error: the worker runs"),
                             (RuntimeError("allocator bug: ratio 8 costs 9 bits > budget 8"), 1, "internal error"),
                             (IntegrityError("manifest digest mismatch"), 6, "error: manifest digest")):
        def fail(_args, exc=exc):
            raise exc

        _replace_command(monkeypatch, "list", fail)
        rc, _, err = _run(capsys, "list", "--registry", reg)
        assert rc == code and words in err and len(err.strip().splitlines()) == 1, err
        assert ("--debug" in err) == (code == 1)


def test_json_stdout_holds_only_the_json(reg, capfd, monkeypatch):
    def noisy(args):
        worker = threading.Thread(target=lambda: print("(raylet) worker log line", flush=True))
        worker.start()
        worker.join()
        subprocess.run([sys.executable, "-c", "print('child process noise')"], check=True)
        os.write(1, b"raw fd 1 noise\n")
        print(json.dumps({"ok": True}))
        return 0

    _replace_command(monkeypatch, "list", noisy)
    assert cli.main(["list", "--registry", reg, "--json"]) == 0
    out, err = capfd.readouterr()
    assert json.loads(out) == {"ok": True}
    for noise in ("worker log line", "child process noise", "raw fd 1 noise"):
        assert noise in err


def test_sign_and_verify_from_the_command_line(reg, tmp_path, capfd):
    capsys = capfd  # --json writes to file descriptor 1
    pytest.importorskip("cryptography")
    prefix = str(tmp_path / "keys" / "signer")
    os.makedirs(tmp_path / "keys")
    assert _run(capsys, "keygen", "--out", prefix)[0] == 0
    rc, _, err = _run(capsys, "verify", "toy", "--key", f"{prefix}.pub.pem", "--require-signature", "--registry", reg)
    assert rc == 6 and "not signed" in err
    assert _run(capsys, "sign", "toy", "--key", f"{prefix}.pem", "--registry", reg)[0] == 0
    rc, out, _ = _run(capsys, "verify", "toy", "--key", f"{prefix}.pub.pem", "--require-signature", "--registry", reg,
                      "--json")
    assert rc == 0 and json.loads(out)["signature"] == "signature checked"
    assert _run(capsys, "keygen", "--out", prefix)[0] == 2  # never overwrites a key


def test_list_survives_a_corrupt_alias(reg, capsys):
    publish(toy_content(), reg, version="v2")
    Path(reg, "toy", "aliases", "broken").write_text("{not json")
    rc, out, err = _run(capsys, "list", "--registry", reg)
    assert rc == 0 and "toy" in out and "UNREADABLE ALIASES" in out
    rc, out, err = _run(capsys, "list", "toy", "--registry", reg)
    assert rc == 0 and "v2" in out and "warning" in err


def test_a_version_published_before_digests_is_refused_then_adopted(reg, capsys):
    version = os.listdir(f"{reg}/toy/versions")[0]
    digest_file = Path(reg, "toy", "versions", version, "manifest.sha256")
    digest_file.unlink()
    rc, _, err = _run(capsys, "verify", "toy", "--registry", reg)
    assert rc == 6 and "manifest.sha256 is missing" in err
    rc, out, _ = _run(capsys, "verify", "toy", "--adopt", "--registry", reg)
    assert rc == 0 and digest_file.is_file() and "ok:" in out
    digest_file.unlink()
    metrics = Path(reg, "toy", "versions", version, "metrics.parquet")
    metrics.write_bytes(metrics.read_bytes()[:-1])
    rc, _, err = _run(capsys, "verify", "toy", "--adopt", "--registry", reg)
    assert rc == 6 and not digest_file.exists()  # only what verifies is adopted


RAY_JSON = """
import json, sys, time
from kvtc.pipeline import cli

def noisy(args):
    import ray
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=True)

    @ray.remote
    def work():
        print("WORKER-LOG-LINE", flush=True)

    ray.get(work.remote())
    time.sleep(2)
    print(json.dumps({"ok": True}))
    ray.get(work.remote())  # and after the JSON
    time.sleep(1)
    return 0

parser = cli.build_parser()
parser._subparsers._group_actions[0].choices["list"].set_defaults(func=noisy)
cli.build_parser = lambda: parser
sys.exit(cli.main(["list", "--json"]))
"""


def test_json_stdout_with_real_ray_worker_logs(tmp_path):
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, "-c", RAY_JSON], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout) == {"ok": True}
    assert "WORKER-LOG-LINE" in proc.stderr


def test_report_of_a_manifest_naming_another_place_writes_nothing(reg, tmp_path, capsys, monkeypatch):
    from kvtc.artifacts.manifest import encode_manifest, listing_hash, manifest_digest

    version = os.listdir(f"{reg}/toy/versions")[0]
    folder = Path(reg, "toy", "versions", version)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["name"] = "../../escaped"
    manifest["content_sha256"] = listing_hash(manifest["files"])
    data = encode_manifest(manifest)
    (folder / "manifest.json").write_bytes(data)
    (folder / "manifest.sha256").write_text(manifest_digest(data) + "\n")
    work = tmp_path / "a" / "b"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    before = {p for p in tmp_path.rglob("*")}
    rc, _, err = _run(capsys, "report", f"toy@{version}", "--registry", reg)
    assert rc == 6 and "invalid name" in err
    assert {p for p in tmp_path.rglob("*")} - before == set()


def test_a_failed_cluster_is_not_reported_as_a_bug():
    from ray.exceptions import ActorDiedError, RayTaskError

    assert cli.exit_code(ActorDiedError()) == 2
    assert cli.exit_code(RayTaskError("f", "tb", ZeroDivisionError("x"))) is None  # a task's bug stays a bug
