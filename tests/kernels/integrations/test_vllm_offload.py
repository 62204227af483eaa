"""The kvtc vLLM offloading spec against vLLM 0.33's own interfaces, on CPU: vLLM's factory loads it by
module path from kv_connector_extra_config; its manager runs the scheduler's calls (positions from vLLM's
ReqContext); its worker reads and writes pages laid out as vLLM registers them (one (num_blocks, page
bytes) int8 view per layer) and a stored chunk comes back exactly as the rank's codec decodes it, keys
at their true positions; per-rank workers of a --tp 2 artifact code their own heads. The page transform
is tested without vLLM."""
from __future__ import annotations

import pytest
import torch

from kvtc.artifacts import publish, pull
from kvtc.artifacts.groups import parse_groups
from kvtc.artifacts.tensor_parallel import TensorParallelLayout
from helpers.toy_artifacts import toy_content
from kvtc.kernels.codec.blob import read_blob
from kvtc.kernels.codec.held_basis import served_codec
from kvtc.kernels.codec.kvtc_codec import KVTCCodec
from kvtc.kernels.integrations.vllm_offload import ChunkCodec, PageFormat, layer_index

N, H, D, L = 4, 2, 16, 2  # tokens per GPU block, KV heads, head_dim, layers


def _artifact(tmp_path, tp: int = 1):
    groups = None
    if tp > 1:
        layout = TensorParallelLayout(tp, H)
        groups = [{"layers": [layer], "heads": list(h)} for layer in range(L) for h in layout.shards]
    content = toy_content(num_layers=L, num_kv_heads=H, head_dim=D, groups=groups)
    content.calibration["sinks"], content.calibration["window"] = 2, 4
    content.model["rope"] = {"rope_type": "default", "theta": 10000.0, "head_dim": D, "rotary_dim": D,
                             "inv_freq": [10000.0 ** (-2 * i / D) for i in range(D // 2)], "attention_scaling": 1.0,
                             "layout": "half"}
    if tp > 1:
        content.calibration["tensor_parallel"] = layout.to_dict(parse_groups(groups))
    return pull("toy", registry=publish(content, tmp_path / "reg").registry), str(tmp_path / "reg")


@pytest.mark.parametrize("order", ["NHC", "HNC"])
def test_page_format_reads_and_writes_vllms_page_layout(order):
    page = PageFormat(kv_heads=H, tokens=N, head_dim=D, dtype=torch.bfloat16, order=order)
    blocks = torch.randn(5, N, H, 2 * D).to(torch.bfloat16)  # logical [B, N, H, K|V]
    physical = blocks if order == "NHC" else blocks.permute(0, 2, 1, 3).contiguous()
    pages = physical.view(torch.int8).reshape(5, page.page_bytes)
    ids = torch.tensor([3, 1])
    keys, values = page.read(pages, ids)
    want = blocks[ids].permute(2, 0, 1, 3).reshape(H, 2 * N, 2 * D)
    assert torch.equal(keys, want[..., :D]) and torch.equal(values, want[..., D:])
    out = torch.zeros_like(pages)
    page.write(out, torch.tensor([0, 4]), keys, values)
    assert torch.equal(out[0], pages[3]) and torch.equal(out[4], pages[1]) and not out[1:4].any()
    with pytest.raises(ValueError, match="not supported by the kvtc offloading spec"):
        PageFormat.for_layout("LHBNC", kv_heads=H, tokens=N, head_dim=D, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="no fp8 cache"):
        PageFormat(kv_heads=H, tokens=N, head_dim=D, dtype=torch.float8_e4m3fn)


def test_layer_names_and_pipeline_stages(tmp_path):
    art, _ = _artifact(tmp_path)
    assert layer_index("model.layers.7.self_attn.attn") == 7
    codec = KVTCCodec(art, 4)
    assert ChunkCodec(codec, [0, 1]).spec.window == 0
    with pytest.raises(ValueError, match="layers \\[5\\] it has no basis for"):
        ChunkCodec(codec, [0, 5])


# --- vLLM's interfaces ---

base = pytest.importorskip("vllm.v1.kv_offload.base", reason="vLLM 0.33 is not installed")
from vllm.v1.kv_offload.config import (OffloadingCacheConfig, OffloadingConfig, OffloadingGroupConfig,  # noqa: E402
                                       OffloadingModelConfig, OffloadingParallelConfig)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402

pytestmark = pytest.mark.live

PAGE = N * H * 2 * D * 2  # bf16 bytes of one layer's page


def _config(registry: str, blocks_per_chunk: int = 2, rank: int = 0, tp: int = 1, **extra) -> OffloadingConfig:
    extra = {"spec_name": "KVTCOffloadingSpec", "spec_module_path": "kvtc.kernels.integrations.vllm_offload",
             "kvtc_artifact": "toy@latest", "kvtc_ratio": 4, "kvtc_registry": registry, "kvtc_mode": "fixed",
             "cpu_bytes_to_use": 64 * PAGE * L, **extra}
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=N, layer_names=tuple(f"model.layers.{i}.self_attn.attn"
                                                                            for i in range(L)), group_id=0),),
        worker_kv_bytes_per_block=PAGE * L // tp, enable_kv_cache_events=True, extra_config=extra, engine_id="e0",
        model=OffloadingModelConfig(name="toy", dtype="bfloat16", max_model_len=256),
        cache=OffloadingCacheConfig(tokens_per_hash=N, blocks_per_chunk=blocks_per_chunk),
        parallel=OffloadingParallelConfig(rank=rank, world_size=tp, tp_size=tp, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
                                          is_parallelism_agnostic=False),
        kv_cache_layout="LBNHC")


def _kv_caches(num_blocks: int, heads: int = H, seed: int = 0):
    """Per-layer caches as vLLM registers them: (num_blocks, page bytes) int8 views of [B, N, H, K|V] bf16."""
    g = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(num_blocks, N, heads, 2 * D, generator=g).to(torch.bfloat16) for _ in range(L)]
    views = [t.view(torch.int8).reshape(num_blocks, -1) for t in tensors]
    caches = base.CanonicalKVCaches(
        tensors=[base.CanonicalKVCacheTensor(v, v.shape[1]) for v in views],
        group_data_refs=[[base.CanonicalKVCacheRef(i, views[i].shape[1]) for i in range(L)]])
    return caches, tensors


def _cache_of(tensors, ids) -> tuple[torch.Tensor, torch.Tensor]:
    """(L, H, tokens, D) keys and values of the given blocks, in order."""
    x = torch.stack([t[ids] for t in tensors])  # L, n, N, H, 2D
    x = x.permute(0, 3, 1, 2, 4).reshape(L, x.shape[3], len(ids) * N, 2 * D)
    return x[..., :D], x[..., D:]


def _request(keys_per_chunk: int, chunks: int):
    ctx = base.ReqContext(req_id="r0")
    keys = [base.make_offload_key(bytes([i]) * 8, 0) for i in range(chunks)]
    for i, k in enumerate(keys):
        ctx.set_offload_key_position(k, (i + 1) * keys_per_chunk)
    return ctx, keys


def test_vllm_loads_the_spec_by_module_path_and_a_chunk_round_trips(tmp_path):
    art, registry = _artifact(tmp_path)
    spec = OffloadingSpecFactory.create_spec(_config(registry))
    assert type(spec).__name__ == "KVTCOffloadingSpec" and spec.tokens_per_chunk == 2 * N
    manager = spec.get_manager()
    caches, tensors = _kv_caches(12)
    worker = spec.get_worker(caches)
    ctx, keys = _request(2 * N, 3)
    manager.on_new_request(ctx)
    assert all(manager.lookup(k, ctx) == base.LookupResult.MISS for k in keys)
    out = manager.prepare_store(keys, ctx)
    assert out.keys_to_store == keys and out.store_spec.starts.tolist() == [0, 8, 16]
    src = [5, 2, 7, 9, 1, 3]  # GPU blocks of the request's 3 chunks, 2 blocks each
    assert worker.submit_store(1, base.GPULoadStoreSpec(src, group_sizes=[6], block_indices=[0]), out.store_spec)
    worker.wait({1})
    (result,) = worker.get_finished()
    assert result.job_id == 1 and result.success and 0 < result.transfer_size < 3 * 2 * L * PAGE
    manager.complete_store(keys, ctx)
    assert [e.removed for e in manager.take_events()] == [False]
    assert all(manager.lookup(k, ctx) == base.LookupResult.HIT for k in keys)
    # load chunks 1 and 2 (tokens 8..24) into fresh blocks, starting mid-chunk as vLLM may (block index 3)
    load = manager.prepare_load(keys[1:], ctx)
    dst = [10, 11, 0]
    assert worker.submit_load(2, load, base.GPULoadStoreSpec(dst, group_sizes=[3], block_indices=[3]))
    worker.wait({2})
    assert [r.success for r in worker.get_finished()] == [True]
    manager.complete_load(keys[1:], ctx)
    codec = served_codec(KVTCCodec(art, 4, mode="fixed"))  # the basis as the tier holds it
    chunk = ChunkCodec(codec, [0, 1])
    for c, blocks, start in ((1, src[2:4], 8), (2, src[4:6], 16)):
        k, v = _cache_of(tensors, blocks)
        want_k, want_v = chunk.codec.decode(chunk.encode(k, v, start))
        first = 1 if c == 1 else 0  # block index 3 = the second block of chunk 1
        got = dst[:1] if c == 1 else dst[1:]
        gk, gv = _cache_of(tensors, got)
        assert torch.equal(gk, want_k[:, :, first * N:]) and torch.equal(gv, want_v[:, :, first * N:])
        assert torch.isfinite(gk.float()).all()  # (toy bases: the error itself is measured in bench/)
        # positions matter: keys coded at another start decode differently (RoPE removed at the true one)
        other_k, _ = chunk.codec.decode(chunk.encode(k, v, start + 4))
        assert not torch.equal(other_k, want_k)
    # chunk 0 starts at position 0: its first `sinks` tokens stay raw
    raw_k, _ = _cache_of(tensors, src[:2])
    blob = worker.blob(int(out.store_spec.slots[0]))
    k0, _ = chunk.codec.decode(blob)
    sinks = raw_k[:, :, :2].double()  # int8, decoded to bf16: half a step, then bf16 rounding
    assert read_blob(blob)[0].sink_format == "int8"
    assert ((k0[:, :, :2].double() - sinks).abs() <= sinks.abs().amax(-1, keepdim=True) / 254 + sinks.abs() / 128).all()


def test_the_manager_evicts_least_recently_used_and_refuses_when_pinned(tmp_path):
    _, registry = _artifact(tmp_path)
    spec = OffloadingSpecFactory.create_spec(_config(registry, blocks_per_chunk=1, cpu_bytes_to_use=1))
    assert spec.num_slots == 0
    from kvtc.kernels.integrations.vllm_offload import KVTCOffloadingManager

    manager = KVTCOffloadingManager(2, N, enable_events=True)
    ctx, keys = _request(N, 4)
    out = manager.prepare_store(keys[:2], ctx)
    manager.complete_store(out.keys_to_store, ctx)
    manager.touch([keys[0]], ctx)  # keys[1] is now the least recently used
    pinned = manager.prepare_load([keys[0]], ctx)
    assert pinned.slots.size == 1
    out = manager.prepare_store([keys[2]], ctx)
    assert out.evicted_keys == [keys[1]] and manager.lookup(keys[1], ctx) == base.LookupResult.MISS
    manager.complete_store([keys[2]], ctx, success=False)  # a failed store frees its slot
    assert manager.lookup(keys[2], ctx) == base.LookupResult.MISS
    assert manager.prepare_store([keys[2], keys[3]], ctx) is None  # keys[0] is pinned: no room for two
    events = list(manager.take_events())
    assert [e.removed for e in events] == [False, True]


def test_each_tensor_parallel_rank_codes_its_own_heads(tmp_path):
    art, registry = _artifact(tmp_path, tp=2)
    for rank in range(2):
        spec = OffloadingSpecFactory.create_spec(_config(registry, blocks_per_chunk=1, rank=rank, tp=2))
        caches, tensors = _kv_caches(4, heads=1, seed=rank)
        worker = spec.get_worker(caches)
        assert worker.codec.spec.heads == (rank, rank + 1)
        manager = spec.get_manager()
        ctx, keys = _request(N, 1)
        out = manager.prepare_store(keys, ctx)
        worker.submit_store(1, base.GPULoadStoreSpec([2], group_sizes=[1], block_indices=[0]), out.store_spec)
        worker.wait({1})
        manager.complete_store(keys, ctx)
        worker.submit_load(2, manager.prepare_load(keys, ctx), base.GPULoadStoreSpec([3], [1], [0]))
        worker.wait({2})
        k, v = _cache_of(tensors, [2])
        want = served_codec(KVTCCodec(art, 4, mode="fixed", rank=rank))
        wk, wv = ChunkCodec(want, [0, 1]).codec.decode(ChunkCodec(want, [0, 1]).encode(k, v, 0))
        gk, gv = _cache_of(tensors, [3])
        assert torch.equal(gk, wk) and torch.equal(gv, wv)
    # a single-rank artifact at TP 2, or the other rank's pages, is refused when the worker is built
    one, registry1 = _artifact(tmp_path / "one")
    spec = OffloadingSpecFactory.create_spec(_config(registry1, rank=0, tp=2))
    with pytest.raises(ValueError, match="one basis over all KV heads \\(TP 1\\).*--tp 2"):
        spec.get_worker(_kv_caches(4, heads=1)[0])
    spec = OffloadingSpecFactory.create_spec(_config(registry1))
    with pytest.raises(ValueError, match="vLLM's page holds 256 bytes.*at this TP size"):
        spec.get_worker(_kv_caches(4, heads=1)[0])


def test_bad_settings_name_the_key(tmp_path):
    _, registry = _artifact(tmp_path)
    with pytest.raises(ValueError, match="kvtc_artifact"):
        OffloadingSpecFactory.create_spec(_config(registry, kvtc_artifact=None))
    with pytest.raises(ValueError, match="cpu_bytes_to_use"):
        OffloadingSpecFactory.create_spec(_config(registry, cpu_bytes_to_use=None))
    bad = _config(registry)
    bad = OffloadingConfig(**{**bad.__dict__, "groups": bad.groups * 2})
    with pytest.raises(ValueError, match="one full-attention KV cache group"):
        OffloadingSpecFactory.create_spec(bad)


@pytest.mark.parametrize("extra, key", [
    ({"cpu_bytes_to_use": 0}, "cpu_bytes_to_use"), ({"cpu_bytes_to_use": float("inf")}, "cpu_bytes_to_use"),
    ({"cpu_bytes_to_use": -5}, "cpu_bytes_to_use"), ({"cpu_bytes_to_use": float("nan")}, "cpu_bytes_to_use"),
    ({"kvtc_ratio": float("inf")}, "kvtc_ratio"), ({"kvtc_ratio": 0}, "kvtc_ratio"), ({"kvtc_ratio": -4}, "kvtc_ratio"),
    ({"kvtc_transfer_threads": 0}, "kvtc_transfer_threads"), ({"kvtc_mode": "zip"}, "kvtc_mode"),
])
def test_bad_numbers_in_the_extra_config_are_a_value_error_naming_the_key(tmp_path, extra, key):
    _, registry = _artifact(tmp_path)
    with pytest.raises(ValueError, match=key):
        OffloadingSpecFactory.create_spec(_config(registry, **extra))


def test_slots_grow_with_what_is_stored_not_with_the_host_bytes(tmp_path):
    import tracemalloc

    _, registry = _artifact(tmp_path)
    tracemalloc.start()
    spec = OffloadingSpecFactory.create_spec(_config(registry, cpu_bytes_to_use=10 ** 12))
    manager = spec.get_manager()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert spec.num_slots > 10 ** 7 and peak < 4 << 20  # a terabyte of room costs nothing up front
    ctx, keys = _request(2 * N, 3)
    out = manager.prepare_store(keys, ctx)
    assert out.store_spec.slots.tolist() == [0, 1, 2]


def test_a_refused_store_loses_nothing_and_positions_are_never_clamped(tmp_path, caplog):
    from kvtc.kernels.integrations.vllm_offload import KVTCOffloadingManager

    manager = KVTCOffloadingManager(2, N)
    ctx, keys = _request(N, 4)
    out = manager.prepare_store(keys[:2], ctx)
    manager.complete_store(out.keys_to_store, ctx)
    bad = base.make_offload_key(b"z" * 8, 0)
    ctx.set_offload_key_position(bad, N - 1)  # ends before a whole chunk: no position to code it at
    with caplog.at_level("WARNING"):
        assert manager.prepare_store([keys[2], bad], ctx) is None
        assert manager.prepare_store([bad], ctx) is None
    assert all(manager.lookup(k, ctx) == base.LookupResult.HIT for k in keys[:2])  # nothing evicted
    assert sum("end position 3" in r.message for r in caplog.records) == 1  # named once
    unknown = base.make_offload_key(b"u" * 8, 0)
    assert manager.prepare_store([unknown], ctx) is None
    assert all(manager.lookup(k, ctx) == base.LookupResult.HIT for k in keys[:2])


def test_transfers_run_off_the_engine_thread_and_a_swapped_blob_is_never_loaded(tmp_path, monkeypatch):
    import threading

    _, registry = _artifact(tmp_path)
    spec = OffloadingSpecFactory.create_spec(_config(registry, blocks_per_chunk=1))
    manager = spec.get_manager()
    caches, tensors = _kv_caches(8)
    worker = spec.get_worker(caches)
    gate, threads = threading.Event(), []
    encode = worker.codec.encode

    def slow_encode(*args, **kwargs):
        threads.append(threading.current_thread().name)
        gate.wait(30)
        return encode(*args, **kwargs)

    monkeypatch.setattr(worker.codec, "encode", slow_encode)
    ctx, keys = _request(N, 2)
    out = manager.prepare_store(keys, ctx)
    t0 = __import__("time").perf_counter()
    assert worker.submit_store(1, base.GPULoadStoreSpec([1, 2], group_sizes=[2], block_indices=[0]), out.store_spec)
    assert __import__("time").perf_counter() - t0 < 1.0 and worker.get_finished() == []  # submit did not wait
    gate.set()
    worker.wait({1})
    (result,) = worker.get_finished()
    assert result.success and threads and all(t.startswith("kvtc-offload") for t in threads)
    manager.complete_store(keys, ctx)
    # chunk 1's blob copied into chunk 0's slot: the load is refused (failed job), the GPU blocks untouched
    s0, s1 = out.store_spec.slots.tolist()
    worker.blobs[s0] = worker.blobs[s1]
    before = tensors[0][5].clone()
    worker.submit_load(2, manager.prepare_load(keys[:1], ctx), base.GPULoadStoreSpec([5], [1], [0]))
    worker.wait({2})
    (result,) = worker.get_finished()
    assert not result.success and torch.equal(tensors[0][5], before)
    worker.shutdown()


def test_an_attention_artifact_through_the_tier_decodes_with_its_decoder_and_keeps_the_sinks_raw(tmp_path_factory):
    from helpers.lmcache_artifacts import artifacts, model_cache

    found = artifacts(tmp_path_factory.getbasetemp() / "lmcache-artifacts")
    _, keys, values = model_cache(256)
    layers, heads, tokens, dim = keys.shape
    block, per_chunk = 16, 4
    config = _config(found["registry"], blocks_per_chunk=per_chunk, kvtc_artifact=found["attn"], kvtc_mode=None,
                     cpu_bytes_to_use=1 << 24, kvtc_transfer_threads=2)
    page_bytes = block * heads * 2 * dim * 2
    config = OffloadingConfig(**{**config.__dict__, "worker_kv_bytes_per_block": page_bytes * layers, "groups": (
        OffloadingGroupConfig(tokens_per_block=block, layer_names=tuple(f"model.layers.{i}.self_attn.attn"
                                                                        for i in range(layers)), group_id=0),)})
    spec = OffloadingSpecFactory.create_spec(config)
    blocks = tokens // block
    pages = [torch.zeros(2 * blocks, block, heads, 2 * dim, dtype=torch.bfloat16) for _ in range(layers)]
    for i in range(layers):  # the prefix in blocks 0.., logical [B, N, H, K|V]
        pages[i][:blocks] = torch.cat([keys[i], values[i]], -1).permute(1, 0, 2).reshape(blocks, block, heads, 2 * dim)
    views = [t.view(torch.int8).reshape(2 * blocks, -1) for t in pages]
    caches = base.CanonicalKVCaches(tensors=[base.CanonicalKVCacheTensor(v, v.shape[1]) for v in views],
                                    group_data_refs=[[base.CanonicalKVCacheRef(i, views[i].shape[1])
                                                      for i in range(layers)]])
    worker, manager = spec.get_worker(caches), spec.get_manager()
    assert any(g.decoder is not None for g in worker.codec.spec.streams["keys"])
    ctx, chunk_keys = _request(block * per_chunk, tokens // (block * per_chunk))
    out = manager.prepare_store(chunk_keys, ctx)
    worker.submit_store(1, base.GPULoadStoreSpec(list(range(blocks)), [blocks], [0]), out.store_spec)
    worker.wait({1})
    manager.complete_store(chunk_keys, ctx)
    worker.submit_load(2, manager.prepare_load(chunk_keys, ctx),
                       base.GPULoadStoreSpec(list(range(blocks, 2 * blocks)), [blocks], [0]))
    worker.wait({2})
    assert [r.success for r in worker.get_finished()] == [True, True]
    got = torch.stack([p[blocks:].reshape(tokens, heads, 2 * dim).permute(1, 0, 2) for p in pages])
    codec = served_codec(KVTCCodec.from_registry(found["attn"], 4, registry=found["registry"]))
    chunk = ChunkCodec(codec, list(range(layers)))
    n = block * per_chunk
    for start in range(0, tokens, n):
        k, v = chunk.codec.decode(chunk.encode(keys[:, :, start:start + n], values[:, :, start:start + n], start))
        assert torch.equal(got[:, :, start:start + n, :dim], k) and torch.equal(got[:, :, start:start + n, dim:], v)
    sinks = keys[:, :, :4].double()  # the sinks as int8, decoded to bf16: half a step, then bf16 rounding
    assert ((got[:, :, :4, :dim].double() - sinks).abs() <= sinks.abs().amax(-1, keepdim=True) / 254
            + sinks.abs() / 128).all()
    rel = float((got[..., :dim].float() - keys.float()).norm() / keys.float().norm())
    assert rel < 0.5
    worker.shutdown()
