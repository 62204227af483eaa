"""`kvtc lmcache-server` live: docs/serving.md's command ("In LMCache") started on loopback (its values swapped for the test's
ports, paths and tiny artifacts), a real model's KV stored in vLLM's paged layout through LMCache 0.5.6's
own multiprocess client in server-driven transfer mode (tests/helpers/lmcache_client.py), L1 cleared, the
chunks looked up, prefetched from L2 and retrieved, and compared with the offline transform; the bytes on
disk are the KVTC blobs. At TP 1 (a rope-kept artifact) and TP 2 (a --tp 2 artifact, keys RoPE-removed at
the positions the server resolves), with bad input that must fail a store or miss, never stop the server; two
tenants (`cache_salt`) whose chunks are misses for each other.
Skipped where LMCache's server cannot start (`pip install -e '.[serve]'` and LMCache: docs/serving.md, "In LMCache")."""
from __future__ import annotations

import json
import re
import shlex
import socket
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from kvtc.kernels.codec.blob import read_blob
from kvtc.kernels.codec.chunk_serde import unframe
from kvtc.kernels.integrations.lmcache_settings import ChunkSerdeSettings
from kvtc.kernels.integrations.lmcache_ranks import RankedChunkTransforms
from helpers.lmcache_artifacts import RATIO, artifacts, chunk, model_cache
from helpers.lmcache_client import connect, server_process

ROOT = Path(__file__).resolve().parents[3]
CHUNK = 256  # docs/serving.md's server runs LMCache's default chunk size
TOKENS = 512
START_TIMEOUT = 240.0  # seconds for the server to answer (imports and the artifact pull, on a loaded 2-core CPU)
pytestmark = [pytest.mark.timeout(900), pytest.mark.live]


@pytest.fixture(scope="module")
def live():
    try:
        from kvtc.kernels.integrations.lmcache_server import check_server

        check_server()
    except Exception as exc:  # noqa: BLE001 - whatever keeps LMCache's server from starting here
        pytest.skip(f"LMCache's server cannot start here: {exc}")


@pytest.fixture(scope="module")
def found(tmp_path_factory, live):
    return artifacts(tmp_path_factory.getbasetemp() / "lmcache-artifacts")


def readme_command(**values) -> list[str]:
    """docs/serving.md's `kvtc lmcache-server ...` arguments (its section "In LMCache"), parsed as a
    shell would, with `values` replacing its flags' values (port, http_port, l1_size_gb) and its L2 adapter's
    base_path and serde fields."""
    text = (ROOT / "docs" / "serving.md").read_text()
    start = text.index("kvtc lmcache-server --host")
    end, quoted = start, False
    while end < len(text):  # the command ends at a newline outside quotes that no backslash continues
        c = text[end]
        if c == "'":
            quoted = not quoted
        elif c == "\n" and not quoted and text[end - 1] != "\\":
            break
        end += 1
    argv = shlex.split(text[start:end].replace("\\\n", " "))
    assert argv[:2] == ["kvtc", "lmcache-server"]
    flags = {"--port": "port", "--http-port": "http_port", "--l1-size-gb": "l1_size_gb"}
    for i, arg in enumerate(argv):
        if arg in flags:
            argv[i + 1] = str(values[flags[arg]])
        elif arg == "--l2-adapter":
            adapter = json.loads(argv[i + 1])
            adapter["base_path"] = str(values["base_path"])
            adapter["serde"].update(values["serde"])
            argv[i + 1] = json.dumps(adapter)
    assert set(flags) | {"--host", "--l2-adapter"} <= set(argv), "docs/serving.md's command lost a flag this test sets"
    return argv[2:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Live:
    def __init__(self, proc: subprocess.Popen, url: str, l2: Path, log: Path) -> None:
        self.proc, self.url, self.l2, self.log = proc, url, l2, log

    def client(self, model: str, *, layers: int = 3, kv_heads: int = 2, tp: int = 1, base: int = 7000):
        """An MPClient of this server, retried until the server answers (its log if it exits)."""
        return connect(self.proc, self.url, model, start_timeout=START_TIMEOUT, log=self.log, layers=layers,
                       kv_heads=kv_heads, head_dim=16, tp=tp, num_blocks=64, block_size=16, instance_base=base)

    def alive(self) -> None:
        assert self.proc.poll() is None, f"the server exited ({self.proc.returncode}):\n{self.text()[-4000:]}"

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def files(self, model: str) -> list[Path]:
        return sorted(self.l2.glob(f"{model}@*.data"))

    def wait_for(self, predicate, what: str, timeout: float = 120.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.alive()
            out = predicate()
            if out:
                return out
            time.sleep(0.1)
        raise TimeoutError(f"{what} within {timeout:g} s; the server's log ends:\n{self.text()[-4000:]}")


@contextmanager
def running(tmp_path: Path, ref: str, registry: str, serde: dict | None = None, log_name: str = "server.log"):
    """docs/serving.md's server on `tmp_path`/l2 (kept between servers of one test: a restart reads what it holds)."""
    l2 = tmp_path / "l2"
    l2.mkdir(exist_ok=True)
    port = _free_port()
    args = readme_command(port=port, http_port=_free_port(), l1_size_gb=0.1, base_path=l2,
                          serde={"artifact": ref, "ratio": RATIO, "registry": registry, **(serde or {})})
    log = tmp_path / log_name
    with server_process(args, log) as proc:
        yield Live(proc, f"tcp://127.0.0.1:{port}", l2, log)


def _blob(data: bytes):
    return read_blob(unframe(data)[1])[0]


def _kv_rank_of(path: Path) -> int:
    return int(path.name.split("@")[1], 16)


def _binding_of(path: Path) -> bytes:
    """The key binding a chunk stored in this file must carry: its LMCache key's (from the file name)."""
    from kvtc.kernels.integrations.lmcache_serde import key_binding
    from lmcache.v1.distributed.l2_adapters.fs_l2_adapter import _filename_to_object_key

    return key_binding(_filename_to_object_key(path.name))


def _engine_of(path: Path):
    """What the key of a chunk stored in this file says of the engine (its chunk's identity, beside the artifact's)."""
    from kvtc.kernels.integrations.lmcache_serde import engine_of
    from lmcache.v1.distributed.l2_adapters.fs_l2_adapter import _filename_to_object_key

    return engine_of(_filename_to_object_key(path.name))


def _round_trip(client, live: Live, model: str, ids: list[int], heads: list[slice], keys, values) -> None:
    """Write each rank's heads into its paged cache, STORE, wait for L2, clear L1 and zero the cache, LOOKUP
    (prefetch from L2), RETRIEVE."""
    blocks = list(range(TOKENS // 16))
    for rank, h in enumerate(heads):
        client.write(rank, blocks, keys[:, h], values[:, h])
    assert client.store("store-" + model, ids, blocks) == [True] * len(heads)
    client.end_session("store-" + model)
    want = TOKENS // CHUNK * len(heads)
    live.wait_for(lambda: len(live.files(model)) >= want, f"{want} chunks of {model} on disk")
    client.clear_l1()
    for rank in range(len(heads)):
        client.zero(rank, blocks)
    assert client.lookup("load-" + model, ids) == TOKENS // CHUNK  # found in L2 and prefetched into L1
    assert client.retrieve("load-" + model, ids, blocks) == [True] * len(heads)
    client.end_session("load-" + model)


def test_tp1_chunks_round_trip_through_the_live_server_as_kvtc_blobs_and_bad_input_never_stops_it(found, tmp_path):
    registry, ref = found["registry"], found["kept"]
    ids, keys, values = model_cache(TOKENS)
    transform = RankedChunkTransforms.from_settings(
        ChunkSerdeSettings.from_kwargs({"artifact": ref, "ratio": RATIO, "registry": registry}))(None)
    chunks = [chunk(keys[:, :, i:i + CHUNK], values[:, :, i:i + CHUNK]) for i in range(0, TOKENS, CHUNK)]
    expected = [transform.serialize(c) for c in chunks]
    with running(tmp_path, ref, registry) as live:
        client = live.client("tiny")
        try:
            _round_trip(client, live, "tiny", ids, [slice(None)], keys, values)
            on_disk = [p.read_bytes() for p in live.files("tiny")]
            # the KVTC bytes, nothing else, each bound to the key it is stored under
            assert sorted(bytes(unframe(d)[1]) for d in on_disk) == sorted(bytes(unframe(e)[1]) for e in expected)
            assert all(unframe(p.read_bytes())[0] == _binding_of(p) for p in live.files("tiny"))
            assert {_blob(d).name for d in on_disk} == {"tiny-kept"} and {_kv_rank_of(p) for p in live.files("tiny")} \
                == {0x01000100}  # LMCache's packed rank 0 of world size 1
            got = chunk(*client.read(0, list(range(TOKENS // 16))))
            offline = []
            for c, data in zip(chunks, expected):
                out = torch.empty_like(c)
                transform.deserialize(memoryview(data), out)
                offline.append(out)
            assert torch.equal(got, torch.cat(offline, dim=2))  # exactly the offline transform
            raw = chunks[0].numel() * chunks[0].element_size()
            assert len(on_disk[0]) < raw / (RATIO * 0.9)

            # a corrupt chunk on disk is a miss, logged with its key; the server keeps serving the others
            victim = next(p for p in live.files("tiny") if unframe(p.read_bytes())[1] == unframe(expected[1])[1])
            data = bytearray(victim.read_bytes())
            data[100] ^= 0xFF
            victim.write_bytes(bytes(data))
            client.clear_l1()
            assert client.lookup("corrupt", ids) < 2  # LMCache 0.5.6 fails the prefetch batch it is in: 0
            client.end_session("corrupt")
            live.wait_for(lambda: "does not decode" in live.text(), "the corrupt chunk logged")
            assert victim.name.split("@")[-1][:16] in live.text()
            assert client.lookup("intact", ids[:CHUNK]) == 1  # the intact first chunk alone
            client.end_session("intact")
        finally:
            client.close()

        # bad input: two ranks of a one-rank artifact (two pipeline stages of a one-basis model), then
        # another layer count; each store fails with its chunk and the mismatch named, nothing is stored
        for model, options, says in (
                ("tiny-pp", dict(kv_heads=2, tp=2), "rank 1 of world size 2 (kv_rank 0x02010201)"),
                ("tiny-2l", dict(layers=2), "the chunk holds 2 layers, artifact tiny-kept@")):
            bad = live.client(model, base=8000 if model == "tiny-pp" else 9000, **options)
            try:
                blocks = list(range(TOKENS // 16))
                assert all(bad.store("store-" + model, ids, blocks))  # L1 takes it; L2's serde refuses it
                bad.end_session("store-" + model)
                live.wait_for(lambda: says in live.text(), f"{model} refused with {says!r}")
                assert f"kvtc serde cannot store chunk {model}/" in live.text() and not live.files(model)
            finally:
                bad.close()
        assert "--groups layer" in live.text()
        live.alive()


def test_tp2_ranks_round_trip_with_their_own_bases_and_keys_coded_at_their_positions(found, tmp_path):
    registry, ref = found["registry"], found["tp2"]
    ids, keys, values = model_cache(TOKENS)
    transforms = RankedChunkTransforms.from_settings(
        ChunkSerdeSettings.from_kwargs({"artifact": ref, "ratio": RATIO, "registry": registry}), positions=True)
    heads = [slice(0, 1), slice(1, 2)]
    with running(tmp_path, ref, registry) as live:
        client = live.client("tiny", kv_heads=1, tp=2)
        try:
            _round_trip(client, live, "tiny", ids, heads, keys, values)
            files = live.files("tiny")
            assert {_kv_rank_of(p) for p in files} == {0x02000200, 0x02010201}  # ranks 0 and 1 of world size 2
            for path in files:
                data = path.read_bytes()
                header = _blob(data)
                assert header.start in (0, CHUNK) and header.kv_heads == 1  # the chunk's true position
                rank = (_kv_rank_of(path) >> 16) & 0xFF
                h, s = heads[rank], slice(header.start, header.start + CHUNK)
                t = transforms(_kv_rank_of(path))
                assert data == t.serialize(chunk(keys[:, h, s], values[:, h, s]), start=header.start,
                                           key=_binding_of(path), engine=_engine_of(path))
            blocks = list(range(TOKENS // 16))
            for rank, h in enumerate(heads):
                got = chunk(*client.read(rank, blocks))
                t = transforms(0x02000200 | (rank << 16) | rank)
                offline = []
                for start in range(0, TOKENS, CHUNK):
                    c = chunk(keys[:, h, start:start + CHUNK], values[:, h, start:start + CHUNK])
                    out = torch.empty_like(c)
                    t.deserialize(memoryview(t.serialize(c, start=start)), out, start=start)
                    offline.append(out)
                assert torch.equal(got, torch.cat(offline, dim=2))
                assert float((got.float() - chunk(keys[:, h], values[:, h]).float()).norm()
                             / chunk(keys[:, h], values[:, h]).float().norm()) < 0.5
        finally:
            client.close()
        assert not re.search(r"Traceback|kvtc serde cannot", live.text())
        live.alive()


def test_attention_artifact_served_live_keeps_the_sinks_raw_and_a_chunk_copied_between_keys_is_a_miss(found, tmp_path):
    registry, ref = found["registry"], found["attn"]
    ids, keys, values = model_cache(TOKENS)
    transform = RankedChunkTransforms.from_settings(
        ChunkSerdeSettings.from_kwargs({"artifact": ref, "ratio": RATIO, "registry": registry}), positions=True)(None)
    assert transform.sinks == 4 and any(g.decoder is not None for g in transform.spec.streams["values"])
    with running(tmp_path, ref, registry) as live:
        client = live.client("tiny")
        try:
            _round_trip(client, live, "tiny", ids, [slice(None)], keys, values)
            files = live.files("tiny")
            heads = {_blob(p.read_bytes()).start: _blob(p.read_bytes()) for p in files}
            assert sorted(heads) == [0, CHUNK] and heads[0].head_raw == 4 and heads[CHUNK].head_raw == 0
            got = chunk(*client.read(0, list(range(TOKENS // 16))))
            assert torch.equal(got, _offline(transform, keys, values))  # exactly the offline chunk transform
            sinks = chunk(keys, values)[:, :, :4].double()  # int8 sinks, in bf16: half a step, then bf16's rounding
            assert ((got[:, :, :4].double() - sinks).abs() <= sinks.abs().amax(-1, keepdim=True) / 254
                    + sinks.abs() / 128).all()
            # the chunk at 256 copied over the chunk at 0: not loaded (its key and position differ)
            by_start = {_blob(p.read_bytes()).start: p for p in files}
            by_start[0].write_bytes(by_start[CHUNK].read_bytes())
            client.clear_l1()
            assert client.lookup("swapped", ids) == 0
            client.end_session("swapped")
            live.wait_for(lambda: "written under another key" in live.text(), "the swapped chunk logged")
        finally:
            client.close()
        live.alive()


def test_chunks_stored_before_a_restart_load_after_it_and_a_keyed_store_refuses_forged_chunks(found, tmp_path):
    """Issue 49: a RoPE-removed artifact's chunks, stored by one server, hit on a second one started on the same
    L2 folder (which has recorded no position: each comes from its blob, bound to its key by the keyed frame);
    a chunk rewritten without the deployment's key is a miss."""
    from kvtc.kernels.codec.chunk_serde import FRAME_MAGIC, KEYED_MAGIC
    from kvtc.kernels.integrations.lmcache_settings import load_chunk_key

    registry, ref = found["registry"], found["attn"]
    ids, keys, values = model_cache(TOKENS)
    serde = {"key_file": str(tmp_path / "chunk-key")}
    transform = RankedChunkTransforms.from_settings(ChunkSerdeSettings.from_kwargs(
        {"artifact": ref, "ratio": RATIO, "registry": registry, **serde}), positions=True)(None)
    assert transform.needs_positions and transform.chunk_key == load_chunk_key(tmp_path / "chunk-key")
    offline = _offline(transform, keys, values)
    with running(tmp_path, ref, registry, serde) as live:
        client = live.client("tiny")
        try:
            _round_trip(client, live, "tiny", ids, [slice(None)], keys, values)
        finally:
            client.close()
    files = sorted((tmp_path / "l2").glob("tiny@*.data"))
    assert len(files) == TOKENS // CHUNK and all(p.read_bytes()[:8] == KEYED_MAGIC for p in files)
    with running(tmp_path, ref, registry, serde, log_name="restarted.log") as live:
        client = live.client("tiny", base=7100)
        try:
            blocks = list(range(TOKENS // 16))
            client.zero(0, blocks)
            assert client.lookup("after-restart", ids) == TOKENS // CHUNK  # every chunk, no position recorded
            assert client.retrieve("after-restart", ids, blocks) == [True]
            client.end_session("after-restart")
            assert torch.equal(chunk(*client.read(0, blocks)), offline)
            assert "position is unknown" not in live.text()
            # a writer of the L2 folder without the key: the second chunk re-framed unkeyed under its own key
            victim = next(p for p in files if _blob(p.read_bytes()).start == CHUNK)
            data = bytearray(victim.read_bytes())
            data[:8], data[8:24] = FRAME_MAGIC, _binding_of(victim)
            victim.write_bytes(bytes(data))
            client.clear_l1()
            assert client.lookup("forged", ids) < TOKENS // CHUNK
            client.end_session("forged")
            live.wait_for(lambda: "unkeyed frame" in live.text(), "the forged chunk logged")
        finally:
            client.close()
        live.alive()


def test_a_tenants_chunks_hit_for_itself_miss_for_another_and_another_deployments_are_named_once(found, tmp_path):
    """Two tenants (LMCache's `cache_salt`) of one model: tenant a's chunks are a hit for a and a miss for b, even
    copied under b's keys (the key binding holds the salt); chunks another deployment wrote (another artifact digest in
    the frame's identity) or an earlier release (a version-1 frame) are misses, each reason named once in the log."""
    from dataclasses import replace

    from kvtc.kernels.codec.chunk_identity import WHAT

    registry, ref = found["registry"], found["kept"]
    ids, keys, values = model_cache(TOKENS)
    transform = RankedChunkTransforms.from_settings(
        ChunkSerdeSettings.from_kwargs({"artifact": ref, "ratio": RATIO, "registry": registry}))(None)
    blocks = list(range(TOKENS // 16))
    with running(tmp_path, ref, registry) as live:
        client = live.client("tiny")
        try:
            client.write(0, blocks, keys, values)
            assert client.store("store-a", ids, blocks, salt="tenant-a") == [True]
            client.end_session("store-a")
            live.wait_for(lambda: len(live.files("tiny")) >= TOKENS // CHUNK, "tenant a's chunks on disk")
            files = live.files("tiny")
            assert all(p.name.endswith("@tenant-a.data") for p in files)
            client.clear_l1()
            client.zero(0, blocks)

            def hits(request: str, salt: str) -> int:
                client.clear_l1()
                found = client.lookup(request, ids, salt=salt)
                client.end_session(request)
                return found

            assert hits("b", "tenant-b") == 0  # LMCache's key: tenant b has no chunk of its own
            assert client.lookup("a", ids, salt="tenant-a") == TOKENS // CHUNK
            assert client.retrieve("a", ids, blocks, salt="tenant-a") == [True]
            client.end_session("a")
            assert torch.equal(chunk(*client.read(0, blocks)), _offline(transform, keys, values))
            # a writer of the store copies tenant a's chunks under tenant b's keys: the frames bind a's salt
            for p in files:
                p.with_name(p.name.replace("@tenant-a.data", "@tenant-b.data")).write_bytes(p.read_bytes())
            assert hits("b-copied", "tenant-b") == 0
            live.wait_for(lambda: "written under another key" in live.text(), "the copied chunk logged")
            assert hits("a-again", "tenant-a") == TOKENS // CHUNK

            # another deployment's chunks (another artifact digest) in a's files: misses, named once for every chunk
            other = replace(transform.identity, digest="sha256:" + "0" * 64)
            for p in files:
                data = bytearray(p.read_bytes())
                data[32:48] = other.encode("bfloat16", CHUNK, _engine_of(p))
                p.write_bytes(bytes(data))
            assert hits("other-1", "tenant-a") == 0 and hits("other-2", "tenant-a") == 0
            live.wait_for(lambda: live.text().count("not this deployment's chunk") >= 2, "both misses logged")
            assert live.text().count(WHAT["artifact"]) == 1 and transform.identity.digest in live.text()
            # an earlier release's frame (version 1: no identity): a miss, named once too
            for p in files:
                data = p.read_bytes()
                p.write_bytes(b"KVTCCHK1" + data[8:32] + data[48:] + bytes(16))  # the same size: the bound
            assert hits("v1-1", "tenant-a") == 0 and hits("v1-2", "tenant-a") == 0
            live.wait_for(lambda: live.text().count("not this deployment's chunk") >= 4, "the version-1 misses logged")
            assert live.text().count("earlier kvtc release") == 1
        finally:
            client.close()
        live.alive()


def _offline(transform, keys, values) -> torch.Tensor:
    """The offline chunk transform of every CHUNK of the cache, decoded and concatenated along the tokens."""
    out = []
    for start in range(0, TOKENS, CHUNK):
        c = chunk(keys[:, :, start:start + CHUNK], values[:, :, start:start + CHUNK])
        decoded = torch.empty_like(c)
        transform.deserialize(transform.serialize(c, start=start), decoded, start=start)
        out.append(decoded)
    return torch.cat(out, dim=2)

