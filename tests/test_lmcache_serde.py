"""The kvtc chunk serde: its pure transform, and the LMCache plugin through LMCache's own serde factory,
async processor and filesystem L2 adapter (skipped where LMCache does not import)."""
from __future__ import annotations

import time

import pytest
import torch

from kvtc.kernels import KVTCCodec
from kvtc.kernels.blob import BlobError
from kvtc.kernels.chunk_serde import ChunkSerdeSettings, ChunkTransform
from kvtc.kernels.synthetic import synthetic_cache, synthetic_spec


def _chunk(spec, tokens: int, dtype=torch.bfloat16) -> torch.Tensor:
    keys, values = synthetic_cache(spec, tokens, dtype=dtype, seed=1)
    L, H, T, D = keys.shape
    return torch.stack([x.permute(0, 2, 1, 3).reshape(L, T, H * D) for x in (keys, values)])


def test_transform_round_trip_has_the_estimated_size_and_the_codecs_error():
    spec = synthetic_spec(3, 2, 8, 4.0, rope_theta=None, sinks=4, window=16)
    transform = ChunkTransform(KVTCCodec(spec))
    kv = _chunk(spec, 37)
    data = transform.serialize(kv)
    assert len(data) == transform.serialized_size(tuple(kv.shape), kv.dtype)
    assert len(data) < kv.numel() * 2 / 2  # well under bf16 size at CR 4
    out = torch.empty_like(kv)
    transform.deserialize(memoryview(data + bytes(100)), out)  # trailing padding is ignored
    direct = transform.codec.decode(transform.codec.encode(*kv.reshape(2, 3, 37, 2, 8).permute(0, 1, 3, 2, 4)))
    want = torch.stack([x.permute(0, 2, 1, 3).reshape(3, 37, 16) for x in direct])
    assert torch.equal(out, want)
    rel = float((out.float() - kv.float()).norm() / kv.float().norm())
    assert 0 < rel < 0.2
    with pytest.raises(BlobError):
        transform.deserialize(memoryview(data[:40]), out)


def test_transform_refuses_rope_removed_artifacts_and_other_shapes():
    with pytest.raises(ValueError, match="--keys rope-kept"):
        ChunkTransform(KVTCCodec(synthetic_spec(3, 2, 8, 4.0)))
    transform = ChunkTransform(KVTCCodec(synthetic_spec(3, 2, 8, 4.0, rope_theta=None)))
    with pytest.raises(ValueError, match="for this model"):
        transform.serialize(torch.zeros(2, 4, 5, 16))
    with pytest.raises(ValueError, match="tensor-parallel"):
        transform.serialized_size((2, 3, 5, 8), torch.float16)


@pytest.mark.parametrize("kwargs, message", [
    ({"ratio": 8}, "artifact"),
    ({"artifact": "x", "ratio": 1}, "ratio"),
    ({"artifact": "x", "ratio": 8, "window": 0}, "unknown kvtc serde option"),
])
def test_settings_refuse_bad_kwargs(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ChunkSerdeSettings.from_kwargs(kwargs)


def _published_rope_kept(tmp_path):
    from kvtc.artifacts import publish
    from kvtc.artifacts.testing import toy_content

    content = toy_content(num_layers=2, num_kv_heads=2, head_dim=8)
    content.calibration["keys"] = "rope-kept"
    return publish(content, tmp_path / "reg").registry


def _memory_obj(tensor: torch.Tensor):
    from lmcache.v1.memory_management import MemoryObjMetadata, TensorMemoryObj

    raw = tensor.contiguous().reshape(-1).view(torch.uint8).clone()
    meta = MemoryObjMetadata(shape=tensor.shape, dtype=tensor.dtype, address=0, phy_size=raw.numel(), ref_count=1)
    return TensorMemoryObj(raw, meta, None)


def _wait(query, task_id, timeout: float = 60.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        result = query(task_id)
        if result is not None:
            return result
        time.sleep(0.01)
    raise TimeoutError(f"task {task_id} did not finish")


def test_lmcache_fs_adapter_round_trip_with_kvtc_serde(tmp_path):
    pytest.importorskip("lmcache.v1.distributed.serde", reason="LMCache does not import here")
    import kvtc.kernels.lmcache_serde  # noqa: F401  (registers "kvtc")
    from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
    from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase, get_type_name_for_config
    from lmcache.v1.distributed.l2_adapters.factory import create_l2_adapter_from_registry
    from lmcache.v1.distributed.l2_adapters.fs_l2_adapter import FSL2AdapterConfig
    from lmcache.v1.distributed.serde import create_serde_processor, get_registered_serde_types

    assert "kvtc" in get_registered_serde_types()
    registry = _published_rope_kept(tmp_path)
    spec = {"type": "fs", "base_path": str(tmp_path / "l2"),
            "serde": {"type": "kvtc", "artifact": "toy@latest", "ratio": 4, "registry": registry}}
    adapter_cfg = FSL2AdapterConfig.from_dict(spec)
    serde_cfg = L2AdapterConfigBase._parse_serde_config(spec)
    assert get_type_name_for_config(adapter_cfg) == "fs" and serde_cfg.type == "kvtc"
    (tmp_path / "l2").mkdir()
    adapter = create_l2_adapter_from_registry(adapter_cfg)
    serde = create_serde_processor(serde_cfg)
    try:
        kv = torch.randn(2, 2, 256, 16, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
        size = serde.estimate_serialized_size(MemoryLayoutDesc(shapes=[kv.shape], dtypes=[kv.dtype]))
        assert size < kv.numel() * 2 / 3
        key = ObjectKey(chunk_hash=b"\x01" * 32, model_name="toy-model", kv_rank=0)
        src, temp = _memory_obj(kv), _memory_obj(torch.zeros(size, dtype=torch.uint8))
        assert _wait(serde.query_serialize_result, serde.submit_serialize([src], [temp], [key])) is True
        assert _wait(lambda t: adapter.pop_completed_store_tasks().get(t),
                     adapter.submit_store_task([key], [temp])) == size
        stored = list((tmp_path / "l2").rglob("*"))
        assert sum(p.stat().st_size for p in stored if p.is_file()) == size
        loaded = _memory_obj(torch.zeros(size, dtype=torch.uint8))
        assert _wait(adapter.query_load_result, adapter.submit_load_task([key], [loaded])).get_indices_list() == [0]
        dst = _memory_obj(torch.zeros_like(kv))
        assert _wait(serde.query_deserialize_result, serde.submit_deserialize([loaded], [dst], [key])) is True
        transform = ChunkTransform.from_settings(ChunkSerdeSettings.from_kwargs(
            {"artifact": "toy@latest", "ratio": 4, "registry": registry}))
        want = torch.empty_like(kv)
        transform.deserialize(memoryview(transform.serialize(kv)), want)
        assert torch.equal(dst.tensor, want) and not torch.equal(want, kv)
    finally:
        serde.close()
        adapter.close()


def test_lmcache_factory_refuses_an_unknown_ratio_at_construction(tmp_path):
    pytest.importorskip("lmcache.v1.distributed.serde", reason="LMCache does not import here")
    import kvtc.kernels.lmcache_serde  # noqa: F401
    from lmcache.v1.distributed.serde import SerdeConfig, create_serde_processor

    registry = _published_rope_kept(tmp_path)
    with pytest.raises((ValueError, KeyError), match="16"):
        create_serde_processor(SerdeConfig("kvtc", {"artifact": "toy", "ratio": 16, "registry": registry}))
