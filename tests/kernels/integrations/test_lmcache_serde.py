"""The kvtc chunk serde: its pure transform (ranks, pipeline stages, positions), and the LMCache plugin
through LMCache's own argument parsing, serde factory, serde wrapper, L1 manager and filesystem L2 adapter
(skipped where LMCache does not import), with freshly calibrated tiny artifacts (tests/helpers/lmcache_artifacts.py).
The whole server, started as docs/serving.md shows, is tests/kernels/integrations/test_lmcache_live.py."""
from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
import sys
import time

import pytest
import torch

from kvtc.kernels import KVTCCodec
from kvtc.kernels.codec.blob import BlobError, read_blob
from kvtc.kernels.codec.chunk_serde import FRAME_BYTES, ChunkTransform, Placement, place, stage_layers, unframe
from kvtc.kernels.integrations.lmcache_ranks import KVRank, RankedChunkTransforms, load_rank_codec
from kvtc.kernels.integrations.lmcache_settings import ChunkSerdeSettings
from helpers.synthetic import synthetic_spec
from helpers.lmcache_artifacts import RATIO, artifacts, chunk, model_cache


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """(registry, artifact ref, in-domain chunk (2, L, 256, H * D) bf16) of the tiny rope-kept artifact."""
    found = artifacts(tmp_path_factory.getbasetemp() / "lmcache-artifacts")
    _, keys, values = model_cache()
    return found["registry"], found["kept"], chunk(keys[:, :, :256], values[:, :, :256])


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    """(registry, ref) of the tiny --tp 2 --groups layer artifact, keys RoPE-removed."""
    found = artifacts(tmp_path_factory.getbasetemp() / "lmcache-artifacts")
    return found["registry"], found["tp2"]


class _LogLines(logging.Handler):
    """Every record of LMCache's loggers (and the root's), formatted with its exception, while attached."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []
        self.loggers = [logging.getLogger()] + [logging.getLogger(name) for name in list(logging.Logger.manager.loggerDict)
                                                if name.startswith("lmcache")]

    @classmethod
    def attach(cls) -> "_LogLines":
        handler = cls()
        for logger in handler.loggers:
            logger.addHandler(handler)
        return handler

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))

    def detach(self) -> list[str]:
        for logger in self.loggers:
            logger.removeHandler(self)
        return self.lines


def _kv_rank(world: int, rank: int) -> int:
    """LMCache's packed kv_rank, built by LMCache itself (as its MP server does for TP x PP ranks)."""
    api = pytest.importorskip("lmcache.v1.distributed.api", reason="LMCache does not import here")
    return api.ObjectKey.ComputeKVRank(world_size=world, global_rank=rank, local_world_size=world, local_rank=rank)


def _out_of_distribution(kv: torch.Tensor) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    x = kv.float()
    spiky = x.clone()
    spiky[..., ::7] *= 60
    heavy = x + torch.distributions.StudentT(1.5).sample(x.shape) * x.std()
    return {"scaled x1000": x * 1000, "heavy-tailed": heavy, "spiky channels": spiky}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _transform(calibrated, **kwargs) -> ChunkTransform:
    registry, ref, _ = calibrated
    return RankedChunkTransforms.from_settings(ChunkSerdeSettings.from_kwargs(
        {"artifact": ref, "ratio": RATIO, "registry": registry, **kwargs}))(None)


def test_codes_in_the_artifacts_ecsq_mode_within_a_true_bound_and_stores_every_chunk(calibrated):
    _, _, kv = calibrated
    transform = _transform(calibrated)
    assert transform.mode == "ecsq" and transform.spec.ecsq is not None
    size = transform.serialized_size(tuple(kv.shape), kv.dtype)
    raw = kv.numel() * kv.element_size()
    assert size < raw / (RATIO * 0.95)  # the ratio's budget, not a fixed-mode header's
    cases = {"in-domain": kv, **_out_of_distribution(kv)}
    modes = {}
    for name, x in cases.items():
        x = x.to(torch.bfloat16)
        data = transform.serialize(x)
        assert len(data) == size, name
        out = torch.empty_like(x)
        transform.deserialize(memoryview(data), out)
        modes[name] = read_blob(transform.encode(x))[0].mode
        codec = transform.codec
        _, L, T, HD = x.shape
        ref = codec.decode(codec.encode(*x.reshape(2, L, T, codec.spec.kv_heads, -1).permute(0, 1, 3, 2, 4),
                                        plan=transform.fallbacks[0]))
        ref = torch.stack([y.permute(0, 2, 1, 3).reshape(L, T, HD) for y in ref])
        assert _rel(out, x) <= max(0.2, 1.05 * _rel(ref, x)), name  # within the codec's error on that input
    assert modes["in-domain"] == "ecsq"
    assert modes["scaled x1000"] == "fixed"  # beyond any ECSQ step: stored fixed-rate, within the bound


def test_mode_is_an_option_and_unpadded_chunks_are_exactly_the_blob(calibrated):
    _, _, kv = calibrated
    fixed = _transform(calibrated, mode="fixed")
    assert fixed.mode == "fixed"
    assert len(fixed.serialize(kv)) == fixed.serialized_size(tuple(kv.shape), kv.dtype)
    exact = _transform(calibrated, pad=False)
    data = exact.serialize(kv)
    assert len(data) == FRAME_BYTES + len(exact.encode(kv)) < exact.serialized_size(tuple(kv.shape), kv.dtype)
    with pytest.raises(ValueError, match="mode"):
        ChunkSerdeSettings.from_kwargs({"artifact": "x", "ratio": 8, "mode": "zip"})


def test_transform_refuses_rope_removed_artifacts_without_positions_other_shapes_and_nonfinite_chunks():
    with pytest.raises(ValueError, match="--keys rope-kept"):
        ChunkTransform(KVTCCodec(synthetic_spec(3, 2, 8, 4.0)))
    with_positions = ChunkTransform(KVTCCodec(synthetic_spec(3, 2, 8, 4.0)), positions=True)
    with pytest.raises(ValueError, match="position is unknown"):
        with_positions.serialize(torch.zeros(2, 3, 5, 16))
    transform = ChunkTransform(KVTCCodec(synthetic_spec(3, 2, 8, 4.0, rope_theta=None)))
    with pytest.raises(ValueError, match="holds 4 layers.*codes 3"):
        transform.serialize(torch.zeros(2, 4, 5, 16))
    with pytest.raises(ValueError, match="--tp"):
        transform.serialized_size((2, 3, 5, 8), torch.float16)
    with pytest.raises(ValueError, match="dtype"):
        transform.serialized_size((2, 3, 5, 16), torch.int8)
    bad = torch.zeros(2, 3, 5, 16)
    bad[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        transform.serialize(bad)


@pytest.mark.parametrize("kwargs, message", [
    ({"ratio": 8}, "artifact"),
    ({"artifact": "x", "ratio": 1}, "ratio"),
    ({"artifact": "x", "ratio": 8, "window": 0}, "unknown kvtc serde option"),
    ({"type": "fp8", "artifact": "x", "ratio": 8}, "type"),
    ({"artifact": "x", "ratio": 8, "pad": "yes"}, "pad"),
    ({"artifact": "x", "ratio": 8, "outlier_factor": 2.5}, "'outlier_factor' is a research option"),
    ({"artifact": "x", "ratio": 8, "sink_budget": "extra"}, "'sink_budget' is a research option"),
    ({"artifact": "x", "ratio": 8, "sink_format": "cache"}, "'sink_format' is a research option"),
])
def test_settings_refuse_bad_kwargs(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ChunkSerdeSettings.from_kwargs(kwargs)


def test_kv_rank_is_decoded_from_lmcaches_packed_form_and_other_values_are_refused():
    for world, rank in ((1, 0), (2, 0), (2, 1), (8, 5), (16, 15)):
        kv = KVRank.decode(_kv_rank(world, rank))
        assert (kv.world_size, kv.rank, kv.local_world_size, kv.local_rank) == (world, rank, world, rank)
    assert KVRank.decode(None) == KVRank(1, 0, 1, 0)
    for bad in (0, 1, -1, 1 << 32, "0"):  # world size 0 (a bare rank), out of range, not an int
        with pytest.raises(ValueError, match="packed rank"):
            KVRank.decode(bad)


def test_pipeline_stages_follow_vllms_layer_partition():
    # vLLM's get_pp_indices: 61 layers over 2 stages [31, 30], over 4 [15, 15, 16, 15]; 3 over 2 [2, 1]
    assert [stage_layers(61, s, 2) for s in range(2)] == [(0, 31), (31, 61)]
    assert [stage_layers(61, s, 4) for s in range(4)] == [(0, 15), (15, 30), (30, 46), (46, 61)]
    assert [stage_layers(3, s, 2) for s in range(2)] == [(0, 2), (2, 3)]
    assert [stage_layers(20, s, 4, (4, 6, 6, 4)) for s in range(4)] == [(0, 4), (4, 10), (10, 16), (16, 20)]
    with pytest.raises(ValueError, match="does not split"):
        stage_layers(20, 0, 4, (5, 5, 5))
    with pytest.raises(ValueError, match="pp_partition"):
        ChunkSerdeSettings.from_kwargs({"artifact": "x", "ratio": 8, "pp_partition": "4,zero"})
    assert ChunkSerdeSettings.from_kwargs({"artifact": "x", "ratio": 8, "pp_partition": "2,1"}).pp_partition == (2, 1)


def test_single_rank_artifact_serves_world_size_one_and_refuses_other_ranks_naming_both(calibrated):
    registry, ref, kv = calibrated
    transforms = RankedChunkTransforms.from_settings(
        ChunkSerdeSettings.from_kwargs({"artifact": ref, "ratio": RATIO, "registry": registry}))
    assert transforms(_kv_rank(1, 0)) is transforms(None) is transforms.default
    codec = load_rank_codec(ref, RATIO, 0, registry=registry)
    assert codec.spec.ecsq is not None
    # world size 2 over a one-rank artifact would be two pipeline stages: its one basis spans every layer
    with pytest.raises(ValueError, match="rank 1 of world size 2.*--groups layer"):
        transforms(_kv_rank(2, 1))
    with pytest.raises(ValueError, match="rank 0 of world size 3.*--groups layer"):
        transforms(_kv_rank(3, 0))


def test_per_rank_artifact_serves_each_rank_its_heads_and_stages_their_layers(tp2):
    registry, ref = tp2
    settings = ChunkSerdeSettings.from_kwargs({"artifact": ref, "ratio": RATIO, "registry": registry})
    with pytest.raises(ValueError, match="RoPE removed.*kvtc lmcache-server"):
        RankedChunkTransforms.from_settings(settings)  # positions unknown: refused when built
    transforms = RankedChunkTransforms.from_settings(settings, positions=True)
    _, keys, values = model_cache()
    keys, values = keys[:, :, 256:512], values[:, :, 256:512]  # the second chunk: positions 256..511
    full = KVTCCodec.from_registry(ref, RATIO, registry=registry)
    for rank in (0, 1):
        t = transforms(_kv_rank(2, rank))
        assert t.spec.rank == rank and t.spec.heads == (rank, rank + 1) and t.needs_positions
        local = chunk(keys[:, rank:rank + 1], values[:, rank:rank + 1])
        data = t.serialize(local, start=256)
        assert read_blob(unframe(data)[1])[0].start == 256
        out = torch.empty_like(local)
        t.deserialize(memoryview(data), out, start=256)
        # the offline transform: the rank's codec (its own bases, RoPE removed at positions 256..) on its heads
        offline = KVTCCodec(full.spec.for_rank(rank))
        k, v = offline.decode(offline.encode(keys[:, rank:rank + 1], values[:, rank:rank + 1], start=256))
        assert _rel(out, local) < 0.5 and _rel(out, chunk(k, v)) < 0.05
        with pytest.raises(ValueError, match="position is unknown"):
            t.serialize(local)
        with pytest.raises(ValueError, match="holds 2 KV heads|rows hold 32 features"):
            t.serialize(chunk(keys, values), start=0)  # every head: the rank holds one
    for world in (1, 3):
        with pytest.raises(ValueError, match=f"rank 0 of world size {world}: artifact tiny-tp2@.* has 2 tensor-parallel"):
            transforms(_kv_rank(world, 0))
    # TP 2 x PP 2 over 3 layers: stage 0 holds layers 0-1, stage 1 layer 2 (vLLM's partition [2, 1]); each
    # stage's chunk decodes as those layers of the rank's whole-model transform do
    whole = transforms(_kv_rank(2, 1))
    local = chunk(keys[:, 1:2], values[:, 1:2])
    reference = torch.empty_like(local)
    whole.deserialize(memoryview(whole.serialize(local, start=256)), reference, start=256)
    for global_rank, layers in ((1, slice(0, 2)), (3, slice(2, 3))):
        t = transforms(_kv_rank(4, global_rank))
        assert t.label.endswith(f"layers {layers.start}-{layers.stop - 1} of 3") and t.spec.rank == 1
        piece = local[:, layers].contiguous()
        out = torch.empty_like(piece)
        t.deserialize(memoryview(t.serialize(piece, start=256)), out, start=256)
        assert torch.equal(out, reference[:, layers])
        with pytest.raises(ValueError, match=f"holds 3 layers.*codes {layers.stop - layers.start}"):
            t.serialize(local, start=256)
    custom = RankedChunkTransforms.from_settings(ChunkSerdeSettings.from_kwargs(
        {"artifact": ref, "ratio": RATIO, "registry": registry, "pp_partition": [1, 2]}), positions=True)
    assert custom(_kv_rank(4, 2)).spec.num_layers == 2
    # a storage layer sizes a chunk by its shape alone: the bound is the same whichever ranks were seen
    fresh = RankedChunkTransforms.from_settings(settings, positions=True)
    for shape in ((2, 3, 256, 16), (2, 2, 256, 16), (2, 1, 256, 16)):
        assert fresh.serialized_size(shape, torch.bfloat16) == transforms.serialized_size(shape, torch.bfloat16)
    with pytest.raises(ValueError, match="no placement|features"):
        fresh.serialized_size((2, 3, 256, 32), torch.bfloat16)
    assert place(full.spec, KVRank.decode(_kv_rank(4, 3))) == Placement(1, 2, 2, 3)


# ---------------------------------------------------------------- LMCache


def _memory_obj(tensor: torch.Tensor):
    from lmcache.v1.memory_management import MemoryObjMetadata, TensorMemoryObj

    raw = tensor.contiguous().reshape(-1).view(torch.uint8).clone()
    meta = MemoryObjMetadata(shape=tensor.shape, dtype=tensor.dtype, address=0, phy_size=raw.numel(), ref_count=1,
                             shapes=[tensor.shape], dtypes=[tensor.dtype])
    return TensorMemoryObj(raw, meta, None)


def _wait(query, task_id, timeout: float = 120.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        result = query(task_id)
        if result is not None:
            return result
        time.sleep(0.01)
    raise TimeoutError(f"task {task_id} did not finish")


class _Server:
    """The L2 adapter `lmcache server ARGV` builds (kvtc.kernels.integrations.lmcache_server.l2_adapter: LMCache's own
    argument parsing, L1 manager, adapter factory and serde wrapper), driven through its public interface."""

    def __init__(self, argv: list[str]) -> None:
        from kvtc.kernels.integrations.lmcache_server import l2_adapter

        self.adapter, self.l1 = l2_adapter(argv)

    def store(self, key, kv: torch.Tensor) -> bool:
        result = _wait(lambda t: self.adapter.pop_completed_store_tasks().get(t),
                       self.adapter.submit_store_task([key], [_memory_obj(kv)]))
        return bool(result.is_successful()) if hasattr(result, "is_successful") else bool(result[0])

    def load(self, key, like: torch.Tensor) -> torch.Tensor | None:
        dst = _memory_obj(torch.zeros_like(like))
        bitmap = _wait(self.adapter.query_load_result, self.adapter.submit_load_task([key], [dst]))
        return dst.tensor if bitmap.get_indices_list() == [0] else None

    def close(self) -> None:
        self.adapter.close()
        self.l1.close()


def _server_argv(l2: str, serde: dict) -> list[str]:
    spec = {"type": "fs", "base_path": l2, "serde": {"type": "kvtc", **serde}}
    return ["--l1-size-gb", "0.05", "--eviction-policy", "LRU", "--l2-adapter", json.dumps(spec)]


def test_lmcache_server_path_stores_every_chunk_and_disk_holds_the_kvtc_blob(calibrated, tmp_path, capfd):
    pytest.importorskip("lmcache.v1.distributed.l2_adapters.serde_wrapper", reason="LMCache does not import here")
    from kvtc.kernels.integrations.lmcache_serde import engine_of, key_binding
    from kvtc.kernels.integrations.lmcache_server import main as launcher
    from lmcache.v1.distributed.api import ObjectKey
    from lmcache.v1.distributed.serde import get_registered_serde_types

    registry, ref, kv = calibrated
    (tmp_path / "l2").mkdir()
    assert launcher(["--help"]) == 0  # registers "kvtc", then hands the arguments to LMCache's server
    assert "kvtc" in get_registered_serde_types()
    one = _kv_rank(1, 0)
    server = _Server(_server_argv(str(tmp_path / "l2"), {"artifact": ref, "ratio": RATIO, "registry": registry}))
    transform = _transform(calibrated)
    try:
        cases = {"in-domain": kv, **{k: v.to(torch.bfloat16) for k, v in _out_of_distribution(kv).items()}}
        for i, (name, x) in enumerate(cases.items()):
            key = ObjectKey(chunk_hash=bytes([i + 1]) * 32, model_name="tiny", kv_rank=one)
            assert server.store(key, x), name
            files = [p for p in (tmp_path / "l2").rglob("*.data")]
            data = max(files, key=lambda p: p.stat().st_mtime_ns).read_bytes()
            assert data == transform.serialize(x, key=key_binding(key), engine=engine_of(key)), name  # KVTC's bytes alone
            assert read_blob(unframe(data)[1])[0].name == "tiny-kept"
            out = server.load(key, x)
            assert out is not None and torch.equal(out, _decoded(transform, data, x, engine_of(key))), name
        assert len(list((tmp_path / "l2").rglob("*.data"))) == len(cases)  # every chunk offered is stored

        # bad input: another shape or rank is refused with a logged error, a corrupt chunk is a miss naming
        # its key; the adapter keeps serving
        capfd.readouterr()
        records = _LogLines.attach()  # LMCache's handlers may hold an earlier test's captured stream
        assert not server.store(ObjectKey(b"\x09" * 32, "tiny", one), torch.zeros(2, 3, 256, 8, dtype=kv.dtype))
        assert not server.store(ObjectKey(b"\x0a" * 32, "tiny", _kv_rank(2, 1)), kv)
        assert not server.store(ObjectKey(b"\x0b" * 32, "tiny", one), kv.double())  # dtype not coded
        assert not server.store(ObjectKey(b"\x0c" * 32, "tiny", 1), kv)  # a bare rank: not LMCache's packed form
        victim = sorted((tmp_path / "l2").rglob("*.data"))[0]
        raw = bytearray(victim.read_bytes())
        raw[200] ^= 0xFF
        victim.write_bytes(bytes(raw))
        assert server.load(ObjectKey(_hash_of(victim), "tiny", one), kv) is None
        # a chunk's file copied over another key's: a miss naming the key, never the other chunk's data
        first, second = sorted(p for p in (tmp_path / "l2").rglob("*.data") if p != victim)[:2]
        second.write_bytes(first.read_bytes())
        assert server.load(ObjectKey(_hash_of(second), "tiny", one), kv) is None
        assert server.load(ObjectKey(_hash_of(first), "tiny", one), kv) is not None
        logged = capfd.readouterr().err + "\n".join(records.detach())
        assert "written under another key" in logged and _hash_of(second).hex()[:16] in logged
        assert "kvtc serde cannot store chunk tiny/rank 0 of world size 1 (kv_rank 0x01000100)/0909" in logged
        assert "rows hold 8 features" in logged and "float64 is not supported" in logged
        assert "chunk tiny/rank 1 of world size 2 (kv_rank 0x02010201)/0a0a" in logged
        assert "kv_rank 1 (0x00000001) is not LMCache's packed rank" in logged
        assert "does not decode" in logged and _hash_of(victim).hex()[:16] in logged
        intact = _hash_of(first)
        assert server.load(ObjectKey(intact, "tiny", one), kv) is not None
    finally:
        server.close()


def test_a_tenants_chunk_is_a_miss_for_another_and_another_deployments_chunks_are_named_once(calibrated, tmp_path,
                                                                                            capfd):
    """LMCache's `cache_salt` keeps tenants apart in its keys; the frame's key binding holds it, so a chunk copied
    under another tenant's key is a miss. Chunks another deployment wrote (another artifact digest in the frame's
    identity) are misses, the reason named once in the log whatever the number of chunks."""
    pytest.importorskip("lmcache.v1.distributed.l2_adapters.serde_wrapper", reason="LMCache does not import here")
    from pathlib import Path

    from kvtc.kernels.codec.chunk_identity import WHAT
    from kvtc.kernels.integrations.lmcache_serde import engine_of
    from lmcache.v1.distributed.api import ObjectKey

    registry, ref, kv = calibrated
    transform = _transform(calibrated)
    name, version = ref.split("@")
    # the identity's artifact digest is the version's content address in its registry
    assert transform.identity.digest == (Path(registry) / name / "versions" / version / "manifest.sha256").read_text().strip()
    l2 = tmp_path / "l2"
    l2.mkdir()
    server = _Server(_server_argv(str(l2), {"artifact": ref, "ratio": RATIO, "registry": registry}))
    one = _kv_rank(1, 0)
    try:
        a = ObjectKey(b"\x01" * 32, "tiny", one, cache_salt="tenant-a")
        b = dataclasses.replace(a, cache_salt="tenant-b")
        assert server.store(a, kv)
        assert server.load(a, kv) is not None and server.load(b, kv) is None  # LMCache's own keys differ
        stored = next(l2.rglob("*@tenant-a.data"))
        stored.with_name(stored.name.replace("@tenant-a", "@tenant-b")).write_bytes(stored.read_bytes())
        capfd.readouterr()
        records = _LogLines.attach()
        assert server.load(b, kv) is None  # tenant a's bytes under tenant b's key: its binding holds a's salt
        assert server.load(a, kv) is not None
        other = dataclasses.replace(transform.identity, digest="sha256:" + "0" * 64)
        keys = [ObjectKey(bytes([i]) * 32, "tiny", one, cache_salt="tenant-a") for i in (2, 3)]
        for key in keys:
            assert server.store(key, kv)
            path = next(l2.rglob(f"*{key.chunk_hash.hex()}*"))
            data = bytearray(path.read_bytes())
            data[32:48] = other.encode("bfloat16", kv.shape[2], engine_of(key))
            path.write_bytes(bytes(data))
        assert all(server.load(key, kv) is None for key in keys)
        logged = capfd.readouterr().err + "\n".join(records.detach())
        assert "written under another key" in logged and "tenant-b" in logged
        assert logged.count(WHAT["artifact"]) == 1 and transform.identity.digest in logged
        assert logged.count("not this deployment's chunk") >= 2
    finally:
        server.close()


def _hash_of(path) -> bytes:
    from lmcache.v1.distributed.l2_adapters.fs_l2_adapter import _filename_to_object_key

    return _filename_to_object_key(path.name).chunk_hash


def _decoded(transform: ChunkTransform, data: bytes, like: torch.Tensor, engine=None) -> torch.Tensor:
    out = torch.empty_like(like)
    transform.deserialize(memoryview(data), out, engine=engine)
    return out


def test_factory_takes_both_conventions_and_serializers_take_key_or_not(calibrated):
    pytest.importorskip("lmcache.v1.distributed.serde", reason="LMCache does not import here")
    from kvtc.kernels.integrations.lmcache_serde import KVTCDeserializer, KVTCSerializer, create_kvtc_serde
    from lmcache.v1.distributed.api import MemoryLayoutDesc

    registry, ref, kv = calibrated
    serde = {"artifact": ref, "ratio": RATIO, "registry": registry}
    for kwargs in (serde, {"type": "kvtc", **serde}):
        processor = create_kvtc_serde(kwargs)
        size = processor.estimate_serialized_size(MemoryLayoutDesc(shapes=[kv.shape], dtypes=[kv.dtype]))
        processor.close()
    transforms = RankedChunkTransforms.from_settings(ChunkSerdeSettings.from_kwargs(serde))
    ser, de = KVTCSerializer(transforms), KVTCDeserializer(transforms)
    buf = _memory_obj(torch.zeros(size, dtype=torch.uint8))
    assert ser.serialize(_memory_obj(kv), buf) == size  # no key: upstream's newer call
    out = _memory_obj(torch.zeros_like(kv))
    de.deserialize(buf, out)
    assert torch.equal(out.tensor, _decoded(transforms(None), bytes(buf.tensor.numpy()), kv))
    with pytest.raises(BlobError, match="chunk m/rank 0 of world size 1 .*/0202"):
        from lmcache.v1.distributed.api import ObjectKey

        de.deserialize(_memory_obj(torch.zeros(size, dtype=torch.uint8)), out, ObjectKey(b"\x02" * 32, "m", _kv_rank(1, 0)))


@pytest.mark.parametrize("missing, says", [
    ("blake3", "LMCache's server needs the module 'blake3'"),  # LMCache's default chunk hash
    ("zmq", "needs the module 'zmq'"),
    ("lmcache", "LMCache is not installed"),
])
def test_launcher_names_a_missing_server_dependency_and_the_extra_in_one_line(tmp_path, missing, says):
    pytest.importorskip("lmcache", reason="LMCache does not import here")
    package = tmp_path / missing
    package.mkdir()
    (package / "__init__.py").write_text(f"raise ModuleNotFoundError('No module named ' + {missing!r}, name={missing!r})\n")
    env = {"LMCACHE_DISABLE_BANNER": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path)}
    run = [sys.executable, "-m", "kvtc.pipeline.cli", "lmcache-server"]
    proc = subprocess.run([*run, "--port", "0"], capture_output=True, text=True, timeout=300, env=env)
    errors = [line for line in proc.stderr.splitlines() if "kvtc lmcache-server: error" in line]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-3000:]
    assert says in errors[0] and "pip install 'kvtc-calibration[serve]'" in errors[0]
    if missing != "zmq":  # --help works whatever is missing
        helped = subprocess.run([*run, "--help"], capture_output=True, text=True, timeout=300, env=env)
        assert helped.returncode == 0 and "kvtc lmcache-server ARGS" in helped.stdout and says in helped.stderr


def _synthetic_chunk(spec, tokens: int, start: int) -> torch.Tensor:
    from helpers.synthetic import synthetic_cache

    k, v = synthetic_cache(spec, tokens, torch.float32, start=start)
    return chunk(k, v)


def test_a_first_chunk_keeps_its_sinks_raw_within_the_bound_and_every_chunk_is_bound_to_its_key_and_position():
    from helpers.ecsq_synthetic import synthetic_ecsq_spec
    from kvtc.kernels.codec.chunk_serde import binding

    spec = synthetic_ecsq_spec(2, 2, 8, 4.0, sinks=2, window=3)
    t = ChunkTransform(KVTCCodec(spec), positions=True, sink_budget="extra", sink_format="cache")
    assert t.sinks == 2 and t.spec.window == 0
    size = t.serialized_size((2, 2, 16, 16), torch.float32)
    assert size == FRAME_BYTES + max(t.mode_bound(16, torch.float32, 0), t.fixed_size(16, torch.float32, 0))
    assert t.mode_bound(16, torch.float32, 0) > t.mode_bound(16, torch.float32, 16)  # the raw sinks are counted
    for start in (0, 16):
        kv = _synthetic_chunk(spec, 16, start)
        data = t.serialize(kv, start=start, key=binding(b"chunk", start))
        assert len(data) == size
        header = read_blob(unframe(data)[1])[0]
        assert (header.start, header.head_raw, header.mode) == (start, 2 if start == 0 else 0, "ecsq")
        out = torch.empty_like(kv)
        t.deserialize(data, out, start=start, key=binding(b"chunk", start))
        if start == 0:
            assert torch.equal(out[:, :, :2], kv[:, :, :2])  # the sinks, exactly
        assert _rel(out, kv) < 0.2
        # bound to its key and its position: any other is a BlobError (a miss), the destination untouched
        untouched = torch.zeros_like(kv)
        for kwargs, message in ((dict(start=start + 16, key=binding(b"chunk", start)), "coded for position"),
                                (dict(start=start, key=binding(b"other", start)), "another key"),
                                (dict(start=None, key=None), "position is unknown")):
            with pytest.raises(BlobError, match=message):
                t.deserialize(data, untouched, **kwargs)
            assert not untouched.any()
    with pytest.raises(ValueError, match="position is unknown"):
        t.serialize(kv)
    # without positions (a content-hash store) a rope-kept artifact's sinks cannot be known: every token coded
    kept = ChunkTransform(KVTCCodec(dataclasses.replace(spec, rope=None)))
    assert kept.sinks == 0 and not kept.positional
    assert read_blob(kept.encode(_synthetic_chunk(spec, 16, 0)))[0].head_raw == 0


def test_a_finite_chunk_ecsq_cannot_code_is_stored_fixed_rate_and_non_finite_ones_are_named():
    from helpers.ecsq_synthetic import synthetic_ecsq_spec

    spec = synthetic_ecsq_spec(2, 2, 8, 4.0, sinks=2, window=3)
    t = ChunkTransform(KVTCCodec(spec), positions=True)
    kv = _synthetic_chunk(spec, 16, 16)
    kv[1, 0, 5, 3] = 1e10  # a spike far beyond any ECSQ step
    data = t.serialize(kv, start=16)
    assert len(data) == t.serialized_size(tuple(kv.shape), kv.dtype)
    assert read_blob(unframe(data)[1])[0].mode == "fixed"
    out = torch.empty_like(kv)
    t.deserialize(data, out, start=16)
    assert torch.isfinite(out).all()
    kv[0, 1, 7, 2] = float("inf")
    with pytest.raises(ValueError, match="position 16 holds 1 NaN or infinite value.*keys of layer 1, token 7"):
        t.serialize(kv, start=16)


def test_shared_sinks_fit_a_later_chunks_bound_and_still_come_back_raw():
    from helpers.ecsq_synthetic import synthetic_ecsq_spec

    spec = synthetic_ecsq_spec(2, 2, 8, 4.0, sinks=2, window=3)
    extra = ChunkTransform(KVTCCodec(spec), positions=True, sink_budget="extra", sink_format="cache")
    shared = ChunkTransform(KVTCCodec(spec), positions=True, sink_format="cache")  # shared: the default
    shape = (2, 2, 256, 16)
    size = shared.serialized_size(shape, torch.float32)
    assert size == FRAME_BYTES + max(shared.mode_bound(256, torch.float32, 256), shared.fixed_size(256, torch.float32, 256))
    assert size < extra.serialized_size(shape, torch.float32)  # padded chunks no longer pay the sinks
    kv = _synthetic_chunk(spec, 256, 0)
    data = shared.serialize(kv, start=0)
    assert len(data) == size
    header = read_blob(unframe(data)[1])[0]
    assert (header.mode, header.head_raw) == ("ecsq", 2)
    out = torch.empty_like(kv)
    shared.deserialize(data, out, start=0)
    assert torch.equal(out[:, :, :2], kv[:, :, :2]) and _rel(out, kv) < 0.3
    # a chunk whose budget cannot hold its raw sinks is coded whole, sinks included, within the same bound
    tiny = _synthetic_chunk(spec, 3, 0)
    data = shared.serialize(tiny, start=0)
    assert len(data) == shared.serialized_size(tuple(tiny.shape), torch.float32)
    out = torch.empty_like(tiny)
    shared.deserialize(data, out, start=0)
    assert read_blob(unframe(data)[1])[0].head_raw in (0, 2) and torch.isfinite(out).all()
    keys, values = kv.reshape(2, 2, 256, 2, 8).permute(0, 1, 3, 2, 4)
    for bad in (0, 1.5, float("nan"), True):
        with pytest.raises(ValueError, match="budget_scale"):
            shared.codec.encode(keys, values, start=0, plan=shared.codec.plan(budget_scale=bad))
    with pytest.raises(ValueError, match="at most the artifact's"):
        shared.codec.encode(keys, values, start=0, plan=dataclasses.replace(shared.codec.plan(), sinks=shared.sinks + 1))


def test_int8_sinks_by_default_keep_more_of_a_first_chunks_budget_and_a_short_chunk_falls_back_once_in_the_log(caplog,
                                                                                                             monkeypatch):
    from helpers.ecsq_synthetic import synthetic_ecsq_spec
    from kvtc.kernels.codec import chunk_serde

    monkeypatch.setattr(chunk_serde, "_TOLD", set())  # said once per process: this test's process-wide slate

    spec = synthetic_ecsq_spec(2, 2, 8, 4.0, sinks=2, window=3)
    cache = ChunkTransform(KVTCCodec(spec), positions=True, sink_format="cache")
    t = ChunkTransform(KVTCCodec(spec), positions=True)  # shared, int8: the defaults
    assert t._shared_scale(256, torch.float32, 0) > cache._shared_scale(256, torch.float32, 0)
    shape = (2, 2, 256, 16)
    assert t.serialized_size(shape, torch.float32) == cache.serialized_size(shape, torch.float32)  # a later chunk's
    kv = _synthetic_chunk(spec, 256, 0)
    kv[:, :, 0] *= 40  # a sink of large norm, as models make them
    data = t.serialize(kv, start=0)
    assert len(data) == t.serialized_size(shape, torch.float32)
    header = read_blob(unframe(data)[1])[0]
    assert (header.mode, header.head_raw, header.sink_format) == ("ecsq", 2, "int8")
    out = torch.empty_like(kv)
    t.deserialize(data, out, start=0)
    assert _rel(out[:, :, :2], kv[:, :, :2]) < 0.01 and _rel(out[:, :, 2:], kv[:, :, 2:]) < 0.3
    later = read_blob(unframe(t.serialize(_synthetic_chunk(spec, 256, 256), start=256))[1])[0]
    assert (later.head_raw, later.sink_format) == (0, "cache")  # no sinks: the blob as before
    # an 8-token first chunk cannot pay its sinks from its budget: stored with them on top, said once
    with caplog.at_level("INFO", logger="kvtc.chunk_serde"):
        for _ in range(3):
            small = _synthetic_chunk(spec, 8, 0)
            data = t.serialize(small, start=0)
            assert len(data) == t.serialized_size(tuple(small.shape), torch.float32)
    told = [r.getMessage() for r in caplog.records if "raw sinks come on top" in r.getMessage()]
    assert len(told) == 1 and "8 tokens" in told[0] and 'sink_budget "extra"' in told[0]


def test_a_first_chunk_ecsq_cannot_code_within_the_bound_is_coded_once_more_fixed_rate_with_the_most_raw_sinks_it_holds(
        monkeypatch):
    """Two codings at most: ECSQ with every sink raw, then fixed-rate (exact sizes) with every sink raw, the first
    token alone or none, the first whose size the bound holds (here none: the bound is the fixed-rate size of a
    later chunk; given room for one sink, the first token stays raw)."""
    from helpers.ecsq_synthetic import synthetic_ecsq_spec

    spec = synthetic_ecsq_spec(2, 2, 8, 4.0, sinks=3, window=3)
    kv = _synthetic_chunk(spec, 256, 0)
    kv[:, :, 0] *= 40
    for room in (None, 1):
        t = ChunkTransform(KVTCCodec(spec), positions=True)
        limit = t.blob_bound(256, torch.float32)
        if room is not None:  # a bound with room for one raw sink beside the fixed-rate codes
            limit = t._bound_at(t.fallbacks[1], 256, torch.float32, 0)
            monkeypatch.setattr(t, "chunk_bound", lambda *args: limit)
        codings = []
        def encode(*a, plan=None, **k):  # ECSQ beyond the bound; each fallback as it is
            if plan.mode.name == "ecsq":
                codings.append("ecsq")
                return bytes(limit + 1)
            codings.append(plan.sinks)
            return KVTCCodec.encode(t.codec, *a, plan=plan, **k)
        t.codec.encode = encode
        header = read_blob(t.encode(kv, start=0))[0]
        assert codings == ["ecsq", room or 0] and (header.mode, header.sinks, header.head_raw) == ("fixed", room or 0,
                                                                                                  room or 0)
    data = t.serialize(kv, start=0, size=limit + FRAME_BYTES)
    out = torch.empty_like(kv)
    t.deserialize(data, out, start=0)
    assert _rel(out[:, :, :1], kv[:, :, :1]) < 0.01 and _rel(out[:, :, 1:], kv[:, :, 1:]) < 0.4  # fixed-rate codes


def test_a_first_chunk_below_the_step_floor_codes_fewer_components_and_keeps_the_bound(caplog):
    """Every symbol 0 costs 82% of this spec's budget, and a 32-token first chunk's 4 sinks leave 65%: no step
    reaches it. The first chunk codes its groups' first components alone (the blob's truncated option), keeps all 4 sinks
    raw and is a later chunk's size, where it kept its sinks on top of the bound before."""
    from helpers.ecsq_synthetic import synthetic_ecsq_spec

    from kvtc.kernels.codec import ecsq
    from kvtc.kernels.codec.blob import FLAGS_BY_NAME, TAG_ECSQ, write_blob

    spec = synthetic_ecsq_spec(2, 2, 8, 4.0, sinks=4, window=3)
    t = ChunkTransform(KVTCCodec(spec), positions=True)
    assert t._shared_scale(32, torch.float32, 0) < 0.7 < ecsq.zero_token_bits(spec.ecsq["keys"][0]) / (16 * 32 / 4)
    kv = _synthetic_chunk(spec, 32, 0)
    with caplog.at_level("INFO", logger="kvtc.chunk_serde"):
        data = t.serialize(kv, start=0)
    assert not [r for r in caplog.records if "raw sinks come on top" in r.getMessage()]
    size = t.serialized_size(tuple(kv.shape), torch.float32)
    later = t.serialize(_synthetic_chunk(spec, 32, 32), start=32)
    assert len(data) == size == len(later)
    blob = unframe(data)[1]
    header, sections = read_blob(blob)
    assert header.head_raw == 4 and header.truncated and blob[7] & FLAGS_BY_NAME["truncated"].v2
    assert any(ecsq.is_truncated(s.stored) for s in sections if s.key.tag == TAG_ECSQ)
    out = torch.empty_like(kv)
    t.deserialize(data, out, start=0)
    assert _rel(out[:, :, :4], kv[:, :, :4]) < 0.01 and _rel(out[:, :, 4:], kv[:, :, 4:]) < 0.9
    # the flag and the sections must agree, both ways
    codec = KVTCCodec(t.spec)
    with pytest.raises(BlobError, match="truncated flag"):
        codec.decode(write_blob(dataclasses.replace(header, truncated=False), sections))
    plain = codec.encode(*synthetic_cache_pair(spec, 32, 32), start=32)
    h, secs = read_blob(plain)
    with pytest.raises(BlobError, match="truncated flag"):
        codec.decode(write_blob(dataclasses.replace(h, truncated=True), secs))


def synthetic_cache_pair(spec, tokens: int, start: int):
    from helpers.synthetic import synthetic_cache

    return synthetic_cache(spec, tokens, torch.float32, start=start)


def test_a_first_chunk_whose_mode_cannot_code_it_in_what_the_sinks_leave_keeps_its_sinks_on_top(caplog, monkeypatch):
    from kvtc.kernels.codec import chunk_serde

    monkeypatch.setattr(chunk_serde, "_TOLD", set())  # said once per process: this test's process-wide slate
    """A mode's floor bounds how far rate control can go. ECSQ's first chunks now code fewer components below it
    (the test above), so its floor is a few bytes; where a mode's floor lies above what the sinks leave (forced
    here), a first chunk keeps every sink on top of its budget, said once, never one raw sink (perplexity x15)."""
    from helpers.ecsq_synthetic import synthetic_ecsq_spec

    from kvtc.kernels.codec import ecsq
    from kvtc.kernels.codec.ecsq_mode import EcsqSizes

    spec = synthetic_ecsq_spec(2, 2, 8, 4.0, sinks=2, window=3)
    g = spec.ecsq["values"][0]
    words, escapes = ecsq.encode_group(torch.zeros(500, g.components.shape[1]), g, fmt="rans")
    assert ecsq.zero_token_bits(g) * 500 / 8 <= len(words) + len(escapes) <= ecsq.zero_token_bits(g) * 500 / 8 * 1.05 + 64
    shared = ChunkTransform(KVTCCodec(spec), positions=True)
    assert shared._shares(256, torch.float32)
    monkeypatch.setattr(EcsqSizes, "floor_bytes", lambda self, s, tokens: EcsqSizes.bound_bytes(self, s, tokens) * 95 // 100)
    t = ChunkTransform(KVTCCodec(spec), positions=True)
    with caplog.at_level("INFO", logger="kvtc.chunk_serde"):
        kv = _synthetic_chunk(spec, 256, 0)
        data = t.serialize(kv, start=0)
        t.serialize(kv, start=0)
    assert len(data) == t.serialized_size(tuple(kv.shape), torch.float32) > shared.serialized_size(tuple(kv.shape),
                                                                                                      torch.float32)
    assert read_blob(unframe(data)[1])[0].head_raw == 2  # every sink raw
    told = [r.getMessage() for r in caplog.records if "raw sinks come on top" in r.getMessage()]
    assert len(told) == 1 and "cannot code them below 95%" in told[0]
