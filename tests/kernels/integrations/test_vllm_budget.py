"""The vLLM offloading tier never holds more host memory than it charged, whatever a chunk's values: every
chunk's blob fits the units its slot was charged (SlotPlan, from the tier's chunk coder), in-domain or scaled
x1 to x1e9, Gaussian noise, a few huge spikes, Cauchy-distributed; and a budget filled with such chunks through
the tier's manager and worker holds at most `cpu_bytes_to_use`. The geometry is the embedded model's (3 KV
heads, head_dim 64, 4 sinks, CR 16, 256-token bf16 chunks) with fewer layers; bench/vllm_budget.py measures
all 30. ECSQ tables matched to the synthetic cache, so in-domain chunks are coded ECSQ."""
from __future__ import annotations

import pytest
import torch

from helpers.synthetic import synthetic_cache, synthetic_ecsq, synthetic_spec
from kvtc.kernels.codec.blob import read_blob
from kvtc.kernels.codec.kvtc_codec import KVTCCodec
from kvtc.kernels.integrations.vllm_offload import OBJECT_BYTES, ChunkCodec, OffloadSettings, SlotPlan

LAYERS, HEADS, DIM, SINKS, RATIO, TOKENS = 8, 3, 64, 4, 16.0, 256
KINDS = ("x1", "x1e3", "x1e6", "x1e9", "noise", "spikes", "cauchy")


def tier_spec(layers: int = LAYERS):
    """A synthetic ECSQ spec of the embedded model's geometry (SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64)."""
    return synthetic_ecsq(synthetic_spec(num_layers=layers, kv_heads=HEADS, head_dim=DIM, ratio=RATIO, sinks=SINKS,
                                         window=128))


def chunk_of(kind: str, spec, tokens: int, start: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """keys, values (L, H, T, D) bf16 of one kind: the spec's synthetic cache scaled "x<s>", Gaussian "noise" of
    unit variance, "spikes" (32 values of +-1e5 in an in-domain chunk) or "cauchy" (standard Cauchy samples)."""
    keys, values = synthetic_cache(spec, tokens, torch.float32, start=start, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    if kind.startswith("x"):
        keys, values = keys * float(kind[1:]), values * float(kind[1:])
    elif kind == "noise":
        keys, values = torch.randn(keys.shape, generator=g), torch.randn(values.shape, generator=g)
    elif kind == "spikes":
        for x in (keys, values):
            where = torch.randint(0, x.numel(), (32,), generator=g)
            x.view(-1)[where] = 1e5 * torch.sign(torch.randn(32, generator=g))
    elif kind == "cauchy":
        u = torch.rand((2, *keys.shape), generator=g, dtype=torch.float64)
        keys, values = torch.tan(torch.pi * (u - 0.5)).float()  # standard Cauchy (finite in float32 at these draws)
    else:
        raise ValueError(kind)
    return keys.to(torch.bfloat16), values.to(torch.bfloat16)


def charged(plan: SlotPlan, start: int) -> int:
    """Host bytes the tier's manager charges a chunk at `start` (one worker)."""
    return (plan.first_chunk_units if start < plan.sinks else plan.chunk_units) * plan.unit_bytes


@pytest.fixture(scope="module")
def tier():
    spec = tier_spec()
    codec = ChunkCodec(KVTCCodec(spec), list(range(LAYERS)))
    plan = SlotPlan.for_codec(OffloadSettings("synthetic", RATIO, 1 << 30), codec, TOKENS, torch.bfloat16, 1)
    return spec, codec, plan


@pytest.mark.parametrize("kind", KINDS)
def test_every_chunk_is_held_within_what_its_slot_was_charged(tier, kind):
    spec, codec, plan = tier
    for start in (0, TOKENS):  # a first chunk (its sinks raw, charged more) and a later one
        keys, values = chunk_of(kind, spec, TOKENS, start)
        blob = codec.encode(keys, values, start)
        held = len(blob) + OBJECT_BYTES
        assert held / charged(plan, start) <= 1.0, f"{kind} at {start}: {held} bytes held, {charged(plan, start)} charged"
        k, v = codec.decode(blob, torch.device("cpu"), start)
        assert k.shape == keys.shape and torch.isfinite(k.float()).all() and torch.isfinite(v.float()).all()
        if kind == "x1":  # in-domain chunks keep the mode; only what it cannot code within the slot falls back
            assert read_blob(blob)[0].mode == "ecsq"


def filled(spec, codec: ChunkCodec, kinds: tuple[str, ...], budget: int, chunks: int = 3, requests: int = 1) -> dict:
    """Requests of `chunks` 256-token chunks (each kind in turn, `requests` of each) stored through the tier's manager
    and worker (vllm_offload.py) within `budget` bytes -> {"chunk": the largest blob over what its slot was charged,
    "held": the largest bytes the worker held (blobs, OBJECT_BYTES each) over the budget after any store, "stored":
    chunks stored, "modes": blobs per mode}."""
    base = pytest.importorskip("vllm.v1.kv_offload.base", reason="vLLM 0.33 is not installed")
    from kvtc.kernels.integrations.vllm_offload import KVTCOffloadingManager, KVTCOffloadingWorker, PageFormat

    layers, block, per_chunk = spec.num_layers, 16, TOKENS // 16
    plan = SlotPlan.for_codec(OffloadSettings("synthetic", RATIO, budget), codec, TOKENS, torch.bfloat16, 1)
    manager = KVTCOffloadingManager(plan.units, TOKENS, chunk_units=plan.chunk_units,
                                    first_chunk_units=plan.first_chunk_units, sinks=plan.sinks)
    blocks = chunks * per_chunk
    tensors = [torch.zeros(blocks, block, HEADS, 2 * DIM, dtype=torch.bfloat16) for _ in range(layers)]
    views = [t.view(torch.int8).reshape(blocks, -1) for t in tensors]
    caches = base.CanonicalKVCaches(tensors=[base.CanonicalKVCacheTensor(v, v.shape[1]) for v in views],
                                    group_data_refs=[[base.CanonicalKVCacheRef(i, views[i].shape[1])
                                                      for i in range(layers)]])
    worker = KVTCOffloadingWorker(caches, codec, PageFormat(kv_heads=HEADS, tokens=block, head_dim=DIM,
                                                            dtype=torch.bfloat16), per_chunk)
    out = {"chunk": 0.0, "held": 0.0, "stored": 0, "modes": {}}
    for r, kind in enumerate(k for k in kinds for _ in range(requests)):
        for c in range(chunks):  # the request's prefix in the GPU blocks, logical [B, N, H, K|V]
            keys, values = chunk_of(kind, spec, TOKENS, c * TOKENS, seed=r)
            cells = torch.cat([keys, values], -1).permute(0, 2, 1, 3).reshape(layers, per_chunk, block, HEADS, 2 * DIM)
            for i in range(layers):
                tensors[i][c * per_chunk:(c + 1) * per_chunk] = cells[i]
        ctx = base.ReqContext(req_id=f"r{r}")
        keys = [base.make_offload_key(r.to_bytes(4, "little") + bytes([c]) * 4, 0) for c in range(chunks)]
        for c, k in enumerate(keys):
            ctx.set_offload_key_position(k, (c + 1) * TOKENS)
        store = manager.prepare_store(keys, ctx)
        assert store is not None, "the budget holds a request's chunks"
        worker.submit_store(r, base.GPULoadStoreSpec(list(range(blocks)), [blocks], [0]), store.store_spec)
        worker.wait({r})
        assert all(x.success for x in worker.get_finished())
        manager.complete_store(store.keys_to_store, ctx)
        out["stored"] += len(store.keys_to_store)
        for slot, start in zip(store.store_spec.slots.tolist(), store.store_spec.starts.tolist()):
            blob = worker.blob(slot)
            out["chunk"] = max(out["chunk"], (len(blob) + OBJECT_BYTES) / charged(plan, start))
            mode = read_blob(blob)[0].mode
            out["modes"][mode] = out["modes"].get(mode, 0) + 1
        held = sum(len(b) + OBJECT_BYTES for _, b in worker.blobs.values())
        out["held"] = max(out["held"], held / budget)
    worker.shutdown()
    return out


@pytest.mark.live  # vLLM's offloading interfaces
def test_a_budget_filled_with_any_chunks_holds_at_most_cpu_bytes_to_use(tier):
    spec, codec, plan = tier
    budget = 4 * plan.chunk_units * plan.unit_bytes  # room for 4 later chunks: a request of 3 evicts the last one
    got = filled(spec, codec, KINDS, budget)
    assert got["stored"] == 3 * len(KINDS)
    assert 0 < got["chunk"] <= 1.0 and 0 < got["held"] <= 1.0, got
