"""Each refusal decided once, at the earliest point it can be: what a word or an environment value decides, in the
command line before torch, transformers or Ray load, by the same parser that later reads the value. Every case is
a fresh `kvtc` process (the way a user meets it), timed, with the heavy modules it had loaded when it refused."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers.toy_artifacts import toy_content
from kvtc.artifacts import publish
from kvtc.artifacts.env_values import env_flag, ray_float, ray_int

HEAVY = ("torch", "transformers", "ray")
PROBE = r"""
import contextlib, io, json, sys, time
t0 = time.perf_counter()
from kvtc.pipeline.cli import main
err = io.StringIO()
with contextlib.redirect_stderr(err):
    try:
        rc = main(json.loads(sys.argv[1]))
    except SystemExit as exc:  # argparse's own refusals
        rc = exc.code
print(json.dumps({"rc": rc, "seconds": time.perf_counter() - t0, "stderr": err.getvalue(),
                  "heavy": [m for m in %r if m in sys.modules]}))
""" % (HEAVY,)


def kvtc(argv: list[str], **env: str) -> dict:
    done = subprocess.run([sys.executable, "-P", "-c", PROBE, json.dumps(argv)], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def refused(result: dict, *words: str) -> None:
    """Exit 2, one line naming `words`, under 2 s (on a loaded CI machine: 5), nothing heavy loaded."""
    lines = result["stderr"].strip().splitlines()
    assert result["rc"] == 2 and len(lines) == 1, result
    assert all(w in lines[0] for w in words), (words, lines[0])
    assert result["heavy"] == [] and result["seconds"] < 5, result


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    root = tmp_path_factory.mktemp("refusals") / "registry"
    publish(toy_content(), root)
    return str(root)


@pytest.mark.parametrize("name, value", [("RAY_task_oom_retries", "1_0"), ("RAY_task_oom_retries", "\u0665"),
                                         ("RAY_task_oom_retries", " 0"), ("RAY_memory_usage_threshold", "0.95 "),
                                         ("RAY_memory_usage_threshold", "0_9")])
def test_ray_numbers_are_read_as_ray_reads_them(name, value):
    """Python's int() and float() accept underscores, spaces and non-ASCII digits that Ray's C++ parser does not:
    such a value passed the old check and Ray then died with a segmentation fault."""
    refused(kvtc(["calibrate", "--model", "tiny:llama"], **{name: value}), name, repr(value))
    with pytest.raises(ValueError):
        (ray_int if name.endswith("retries") else ray_float)(value)
    assert ray_int("-1") == -1 and ray_float("0.9") == 0.9 and ray_float("1e-1") == 0.1


def test_the_memory_threshold_reader_uses_the_checks_parser(monkeypatch):
    from kvtc.pipeline.job.reduce_plan import kill_threshold

    monkeypatch.setenv("RAY_memory_usage_threshold", "0.8")
    assert kill_threshold() == 0.8
    monkeypatch.setenv("RAY_memory_usage_threshold", "0_8")  # refused by the command line; the reader: Ray's default
    assert kill_threshold() == 0.95


@pytest.mark.parametrize("name", ["KVTC_REQUIRE_SIGNATURE", "KVTC_REQUIRE_KERNELS"])
def test_switches_are_one_word_for_the_check_and_every_reader(name, registry, monkeypatch):
    """' 0' passed the check (which stripped it) and `kvtc pull` then read the raw value as on."""
    refused(kvtc(["list", "--registry", registry], **{name: " 0"}), name, "' 0'")
    monkeypatch.setenv(name, " 0")
    with pytest.raises(ValueError, match=name):
        env_flag(name)
    for word, on in (("1", True), ("0", False), ("", False)):
        monkeypatch.setenv(name, word)
        assert env_flag(name) is on


@pytest.mark.parametrize("store, words", [("memory://x", ("--store memory://x", "this process's memory")),
                                          ("nosuchproto://x", ("--store nosuchproto://x", "unknown storage protocol")),
                                          ("simplecache::nosuchproto://x", ("--store", "'nosuchproto'"))])
def test_a_store_the_uri_alone_refuses_is_refused_before_ray(store, words):
    refused(kvtc(["calibrate", "--store", store]), *words)


def test_an_unreachable_object_store_is_named_with_its_endpoint_before_ray():
    refused(kvtc(["calibrate", "--store", "s3://bucket/x"], AWS_ENDPOINT_URL="http://127.0.0.1:9"),
            "--store s3://bucket/x", "http://127.0.0.1:9")


def test_eval_prefixes_the_manifest_and_header_refuse_before_the_model_loads(registry):
    """--prefix 10 leaves no coded middle (it ended in the kivi baseline after minutes); --prefix 10^12 is beyond
    the model's context, read from its GGUF header (it was refused after the model loaded)."""
    base = ["eval", "toy", "--registry", registry, "--model", "smollm2-135m"]
    refused(kvtc(base + ["--prefix", "10"]), "--prefix 10 leaves nothing to code", "--prefix 133")
    refused(kvtc(base + ["--prefix", str(10**12)]), f"--prefix {10**12}", "limit of 8192")


def test_the_chunk_key_file_is_never_waited_on(tmp_path):
    """A FIFO as the key hung `kvtc lmcache-server` at start-up; an old empty key is named as empty at once."""
    fifo, empty = tmp_path / "key.fifo", tmp_path / "empty.key"
    os.mkfifo(fifo)
    empty.write_bytes(b"")
    os.chmod(empty, 0o600)
    os.utime(empty, (0, 0))

    def server(key: str) -> list[str]:
        return ["lmcache-server", "--l2-adapter", json.dumps({"type": "fs", "base_path": str(tmp_path / "c"), "serde": {
            "type": "kvtc", "artifact": "toy", "ratio": 8, "key_file": key}})]

    refused(kvtc(server(str(fifo))), "is a FIFO, not a regular file")
    refused(kvtc(server(str(empty))), "is empty")


def test_an_overlong_word_is_shown_by_its_head_and_length():
    result = kvtc(["calibrate", "--workers", "9" * 5000])
    refused(result, "--workers", "(5000 characters)")
    assert len(result["stderr"]) < 300


def test_whether_a_job_joins_a_cluster_is_told_in_one_place(monkeypatch):
    from kvtc.pipeline.checks.machine import Machine
    from kvtc.pipeline.settings import RuntimeSettings

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert RuntimeSettings().cluster_address is None and not Machine.of(RuntimeSettings()).cluster
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert RuntimeSettings().cluster_address == "10.0.0.1:6379" and Machine.of(RuntimeSettings()).cluster
    assert RuntimeSettings(address="ray://h:10001").cluster_address == "ray://h:10001"
