"""Every resource argument is bounded before anything starts: against this machine (a local run), hard caps
and then the joined cluster's alive nodes, the shards the run plans and the model's context; the command
line refuses them with exit 2 without importing torch or Ray."""
from __future__ import annotations

import json
import struct
import subprocess
import sys

import pytest

from kvtc.pipeline.checks.machine import MAX_WORKERS, Machine, check_cluster, check_job
from kvtc.pipeline.settings import JobSettings, RuntimeSettings
from kvtc.workers.model_limits import context_limit, gguf_context_length

TWO_CPUS = Machine(cpus=2, gpus=0)
GPU_NODE = Machine(cpus=16, gpus=8)
CLUSTER = Machine(cpus=2, gpus=0, cluster=True)


def _refused(machine: Machine, message: str, limit: int | None = None, **flat) -> str:
    with pytest.raises(ValueError, match=message) as exc:
        check_job(JobSettings.of(**flat), machine, limit)
    return str(exc.value)


def test_defaults_and_what_fits_are_accepted():
    for machine in (TWO_CPUS, GPU_NODE, CLUSTER):
        check_job(JobSettings.of(), machine, 8192)
    check_job(JobSettings.of(workers=2), TWO_CPUS)
    check_job(JobSettings.of(workers=4, gpus_per_worker=2, threads_per_worker=4), GPU_NODE)
    check_job(JobSettings.of(workers=4000, threads_per_worker=64), CLUSTER)  # the cluster's nodes decide, once joined
    check_job(JobSettings.of(tokens=20000), TWO_CPUS)  # 3 shards, the default 4 accumulators: accepted
    check_job(JobSettings.of(seq_len=8192), TWO_CPUS, 8192)


def test_workers_threads_and_gpus_against_this_machine():
    assert "room for 2 worker(s)" in _refused(TWO_CPUS, "--workers 3", workers=3)
    assert "--workers 4 or fewer" in _refused(GPU_NODE, "--workers 5", workers=5, gpus_per_worker=2)
    _refused(TWO_CPUS, "--threads-per-worker 3: this machine has 2 CPUs", threads_per_worker=3)
    _refused(TWO_CPUS, "--gpus-per-worker 1: this machine has no GPU torch can see", gpus_per_worker=1)
    _refused(GPU_NODE, "--gpus-per-worker 9", gpus_per_worker=9)


def test_hostile_values_hit_hard_caps_even_on_a_cluster():
    for flat in (dict(workers=1_000_000), dict(threads_per_worker=1_000_000), dict(gpus_per_worker=1_000),
                 dict(accumulators=1_000_000), dict(tokens=10**15)):
        flag = "--" + next(iter(flat)).replace("_", "-")
        assert "check the value" in _refused(CLUSTER, flag, **flat)
    assert MAX_WORKERS >= 1024  # room for real clusters


def test_shards_accumulators_and_seq_len_against_the_plan_and_model():
    text = _refused(TWO_CPUS, "--seqs-per-shard 100000000", seqs_per_shard=100_000_000, seq_len=1024)
    assert "use --seqs-per-shard 79 or less" in text  # 80 sequences of the default 81,920 tokens
    text = _refused(TWO_CPUS, "--accumulators 50", 8192, accumulators=50)
    assert "plans 10 shards" in text and "--accumulators 10 or less" in text  # 20 default sequences of 4,096, 2 each
    text = _refused(TWO_CPUS, "--seqs-per-shard 1000", 2048, seqs_per_shard=1000)
    assert "40 sequence(s) of 2048" in text  # a shorter limit: the default sequence is the model's limit
    check_job(JobSettings.of(seqs_per_shard=1000), TWO_CPUS)  # the limit not told yet: the plan stage checks it
    assert "--seq-len 8192 or less" in _refused(TWO_CPUS, "--seq-len 100000", 8192, seq_len=100_000)


def _nodes(*resources: dict, dead: dict | None = None) -> list[dict]:
    out = [{"Alive": True, "Resources": r} for r in resources]
    return out + ([{"Alive": False, "Resources": dead}] if dead else [])


def test_the_joined_cluster_places_every_worker():
    nodes = _nodes({"CPU": 8}, {"CPU": 4}, dead={"CPU": 64, "GPU": 8})  # a dead node's resources do not count
    check_cluster(RuntimeSettings(workers=3, threads_per_worker=4), nodes)
    with pytest.raises(ValueError, match="room for 3 worker"):
        check_cluster(RuntimeSettings(workers=4, threads_per_worker=4), nodes)
    with pytest.raises(ValueError, match="largest node has 8 CPUs"):
        check_cluster(RuntimeSettings(threads_per_worker=9), nodes)
    gpus = _nodes({"CPU": 16, "GPU": 4}, {"CPU": 16, "GPU": 2})
    check_cluster(RuntimeSettings(workers=3, gpus_per_worker=2), gpus)
    with pytest.raises(ValueError, match="largest node has 4 GPU"):
        check_cluster(RuntimeSettings(gpus_per_worker=8), gpus)
    with pytest.raises(ValueError, match="room for 6 worker"):
        check_cluster(RuntimeSettings(workers=7), gpus)


def test_the_embedded_model_context_is_read_from_its_gguf_header():
    assert context_limit("smollm2-135m") == 8192
    assert context_limit("tiny:llama") is None  # the plan stage reads it from the config


def _gguf(*fields: bytes, count: int | None = None) -> bytes:
    head = b"GGUF" + struct.pack("<IQQ", 3, 0, len(fields) if count is None else count)
    return head + b"".join(fields)


def _field(key: str, kind: int, payload: bytes) -> bytes:
    return struct.pack("<Q", len(key)) + key.encode() + struct.pack("<I", kind) + payload


def test_malformed_gguf_headers_are_refused_naming_the_file(tmp_path):
    arch = _field("general.architecture", 8, struct.pack("<Q", 5) + b"llama")
    good = _gguf(arch, _field("llama.context_length", 4, struct.pack("<I", 4096)))
    cases = {"magic_only.gguf": b"GGUF" + struct.pack("<I", 3), "not.gguf": b"PK\x03\x04" + bytes(64),
             "array_past_end.gguf": _gguf(arch, _field("tokens", 9, struct.pack("<IQ", 4, 1 << 40))),
             "cut.gguf": good[:-2], "many_fields.gguf": _gguf(count=1 << 40)}
    (tmp_path / "good.gguf").write_bytes(good)
    assert gguf_context_length(tmp_path / "good.gguf") == 4096
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ValueError, match=f"{name} is not a valid GGUF file"):
            context_limit(str(tmp_path / name))


HOSTILE = [["--workers", "1000000"], ["--threads-per-worker", "1000000"], ["--gpus-per-worker", "1000000"],
           ["--accumulators", "1000000"], ["--seqs-per-shard", "100000000"], ["--tokens", "1000000000000000"],
           ["--seq-len", "100000"], ["--workers", "3"]]
PROBE = """
import json, sys
from kvtc.pipeline import cli
codes = [cli.main(["calibrate", *argv]) for argv in json.loads(sys.argv[1])]
print(json.dumps({"codes": codes, "loaded": sorted(m for m in ("torch", "ray", "transformers") if m in sys.modules)}))
"""


def test_the_command_line_refuses_them_without_torch_or_ray(tmp_path):
    args = [[*argv, "--registry", str(tmp_path / "reg"), "--store", str(tmp_path / "store")] for argv in HOSTILE]
    out = subprocess.run([sys.executable, "-P", "-c", PROBE, json.dumps(args)], capture_output=True, text=True,
                         timeout=120, env={"PATH": "/usr/bin:/bin", "KVTC_CACHE": str(tmp_path / "cache")})
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"codes": [2] * len(HOSTILE), "loaded": []}, out.stderr
    assert len(out.stderr.strip().splitlines()) == len(HOSTILE) and "Traceback" not in out.stderr
