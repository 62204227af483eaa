"""The kvtc chunk serde: its pure transform, and the LMCache plugin through LMCache's own argument parsing,
serde factory, serde wrapper, L1 manager and filesystem L2 adapter (skipped where LMCache does not import),
with a freshly calibrated rope-kept artifact that carries ECSQ tables."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch

from kvtc.kernels import KVTCCodec
from kvtc.kernels.blob import BlobError, read_blob
from kvtc.kernels.chunk_serde import ChunkSerdeSettings, ChunkTransform, RankedChunkTransforms, load_rank_codec
from helpers.synthetic import synthetic_spec

RATIO = 4


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """(registry, artifact ref, in-domain chunk (2, L, 256, H * D) bf16) of a tiny model calibrated here."""
    from kvtc.pipeline.job.calibrate import run
    from kvtc.pipeline.settings import JobSettings
    from kvtc.workers.capture import raw_cache
    from kvtc.workers.models import load_model

    root = tmp_path_factory.mktemp("serde")
    cfg = JobSettings.of(model="tiny:llama", corpus="pydoc", eval_corpus=None, seq_len=64, tokens=1024,
                         seqs_per_shard=4, heldout_rows=512, ratios=(float(RATIO),), tokens_curve_points=1,
                         sinks=0, window=0, keys="rope-kept", registry=str(root / "reg"), store=str(root / "store"),
                         name="tiny-kept")
    summary = run(cfg, in_process=True)
    lm = load_model("tiny:llama", device="cpu")
    text = "The interpreter reads the module, compiles it to bytecode and caches it next to the source. " * 30
    keys, values = raw_cache(lm, lm.tokenizer(text, return_tensors="pt").input_ids[:, :256])
    L, H, T, D = keys.shape
    kv = torch.stack([x.permute(0, 2, 1, 3).reshape(L, T, H * D) for x in (keys, values)]).to(torch.bfloat16)
    return summary["registry"], f"tiny-kept@{summary['version']}", kv


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
    return ChunkTransform.from_settings(ChunkSerdeSettings.from_kwargs(
        {"artifact": ref, "ratio": RATIO, "registry": registry, **kwargs}))


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
        fixed = transform.fixed
        _, L, T, HD = x.shape
        ref = fixed.decode(fixed.encode(*x.reshape(2, L, T, fixed.spec.kv_heads, -1).permute(0, 1, 3, 2, 4)))
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
    assert len(data) == 8 + len(exact.encode(kv)) < exact.serialized_size(tuple(kv.shape), kv.dtype)
    with pytest.raises(ValueError, match="mode"):
        ChunkSerdeSettings.from_kwargs({"artifact": "x", "ratio": 8, "mode": "zip"})


def test_transform_refuses_rope_removed_artifacts_other_shapes_and_nonfinite_chunks():
    with pytest.raises(ValueError, match="--keys rope-kept"):
        ChunkTransform(KVTCCodec(synthetic_spec(3, 2, 8, 4.0)))
    transform = ChunkTransform(KVTCCodec(synthetic_spec(3, 2, 8, 4.0, rope_theta=None)))
    with pytest.raises(ValueError, match="for this model"):
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
])
def test_settings_refuse_bad_kwargs(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ChunkSerdeSettings.from_kwargs(kwargs)


def test_ranks_pick_a_basis_per_kv_rank_and_single_rank_artifacts_refuse_others(calibrated):
    registry, ref, _ = calibrated
    built = []
    ranks = RankedChunkTransforms(lambda r: built.append(r) or _transform(calibrated))
    assert ranks(None) is ranks(0) and built == [0]
    codec = load_rank_codec(ref, RATIO, 0, registry=registry)
    assert codec.spec.ecsq is not None
    import inspect

    if "rank" not in inspect.signature(KVTCCodec.from_registry).parameters:
        with pytest.raises(ValueError, match="kv_rank 1.*--tp"):
            load_rank_codec(ref, RATIO, 1, registry=registry)
    with pytest.raises(ValueError, match="kv_rank"):
        ranks(-1)


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
    """The L2 adapter `lmcache server ARGV` builds (kvtc.kernels.lmcache_server.l2_adapter: LMCache's own
    argument parsing, L1 manager, adapter factory and serde wrapper), driven through its public interface."""

    def __init__(self, argv: list[str]) -> None:
        from kvtc.kernels.lmcache_server import l2_adapter

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
    from kvtc.kernels.lmcache_server import main as launcher
    from lmcache.v1.distributed.api import ObjectKey
    from lmcache.v1.distributed.serde import get_registered_serde_types

    registry, ref, kv = calibrated
    (tmp_path / "l2").mkdir()
    launcher_rc = launcher(["--help"])  # registers "kvtc", then hands the arguments to LMCache's server
    assert "kvtc" in get_registered_serde_types()
    assert launcher_rc in (0, 2)  # 2: LMCache's server dependencies are not installed here (said on stderr)
    server = _Server(_server_argv(str(tmp_path / "l2"), {"artifact": ref, "ratio": RATIO, "registry": registry}))
    transform = _transform(calibrated)
    try:
        cases = {"in-domain": kv, **{k: v.to(torch.bfloat16) for k, v in _out_of_distribution(kv).items()}}
        for i, (name, x) in enumerate(cases.items()):
            key = ObjectKey(chunk_hash=bytes([i + 1]) * 32, model_name="tiny", kv_rank=0)
            assert server.store(key, x), name
            files = [p for p in (tmp_path / "l2").rglob("*.data")]
            data = max(files, key=lambda p: p.stat().st_mtime_ns).read_bytes()
            assert data == transform.serialize(x), name  # the KVTC bytes, nothing else
            assert read_blob(data[8:8 + int.from_bytes(data[:8], "little")])[0].name == "tiny-kept"
            out = server.load(key, x)
            assert out is not None and torch.equal(out, _decoded(transform, data, x)), name
        assert len(list((tmp_path / "l2").rglob("*.data"))) == len(cases)  # every chunk offered is stored

        # bad input: another shape or rank is refused with a logged error, a corrupt chunk is a miss naming
        # its key; the adapter keeps serving
        capfd.readouterr()
        assert not server.store(ObjectKey(b"\x09" * 32, "tiny", 0), torch.zeros(2, 3, 256, 8, dtype=kv.dtype))
        assert not server.store(ObjectKey(b"\x0a" * 32, "tiny", 1), kv)
        assert not server.store(ObjectKey(b"\x0b" * 32, "tiny", 0), kv.double())  # dtype not coded
        victim = sorted((tmp_path / "l2").rglob("*.data"))[0]
        raw = bytearray(victim.read_bytes())
        raw[200] ^= 0xFF
        victim.write_bytes(bytes(raw))
        assert server.load(ObjectKey(_hash_of(victim), "tiny", 0), kv) is None
        logged = capfd.readouterr().err
        assert "kvtc serde cannot store chunk tiny/rank 0" in logged and "kv_rank 1" in logged
        assert "does not decode" in logged and _hash_of(victim).hex()[:16] in logged
        intact = next(bytes([i + 1]) * 32 for i in range(len(cases)) if bytes([i + 1]) * 32 != _hash_of(victim))
        assert server.load(ObjectKey(intact, "tiny", 0), kv) is not None
    finally:
        server.close()


def _hash_of(path) -> bytes:
    from lmcache.v1.distributed.l2_adapters.fs_l2_adapter import _filename_to_object_key

    return _filename_to_object_key(path.name).chunk_hash


def _decoded(transform: ChunkTransform, data: bytes, like: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(like)
    transform.deserialize(memoryview(data), out)
    return out


def test_factory_takes_both_conventions_and_serializers_take_key_or_not(calibrated):
    pytest.importorskip("lmcache.v1.distributed.serde", reason="LMCache does not import here")
    from kvtc.kernels.lmcache_serde import KVTCDeserializer, KVTCSerializer, create_kvtc_serde
    from lmcache.v1.distributed.api import MemoryLayoutDesc

    registry, ref, kv = calibrated
    serde = {"artifact": ref, "ratio": RATIO, "registry": registry}
    for kwargs in (serde, {"type": "kvtc", **serde}):
        processor = create_kvtc_serde(kwargs)
        size = processor.estimate_serialized_size(MemoryLayoutDesc(shapes=[kv.shape], dtypes=[kv.dtype]))
        processor.close()
    transforms = RankedChunkTransforms(lambda r: _transform(calibrated))
    ser, de = KVTCSerializer(transforms), KVTCDeserializer(transforms)
    buf = _memory_obj(torch.zeros(size, dtype=torch.uint8))
    assert ser.serialize(_memory_obj(kv), buf) == size  # no key: upstream's newer call
    out = _memory_obj(torch.zeros_like(kv))
    de.deserialize(buf, out)
    assert torch.equal(out.tensor, _decoded(transforms(0), bytes(buf.tensor.numpy()), kv))
    with pytest.raises(BlobError, match="chunk m/rank 0/0202"):
        from lmcache.v1.distributed.api import ObjectKey

        de.deserialize(_memory_obj(torch.zeros(size, dtype=torch.uint8)), out, ObjectKey(b"\x02" * 32, "m", 0))


def test_launcher_runs_lmcache_server_or_says_what_is_missing(tmp_path):
    pytest.importorskip("lmcache", reason="LMCache does not import here")
    from kvtc.kernels.lmcache_server import LauncherError, check_server

    try:
        check_server()
    except LauncherError as exc:  # LMCache installed without its server's compiled dependencies
        proc = subprocess.run([sys.executable, "-m", "kvtc.pipeline.cli", "lmcache-server", "--port", "0"],
                              capture_output=True, text=True, timeout=120,
                              env={"LMCACHE_DISABLE_BANNER": "1", "PATH": "/usr/bin:/bin"})
        assert proc.returncode == 2 and "kvtc lmcache-server: error: LMCache's server cannot start here" in proc.stderr
        pytest.skip(f"LMCache's server does not start here: {exc}")
    pytest.skip("LMCache's server imports here: the loopback start is run by bench/lmcache_serving.py")
