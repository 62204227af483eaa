"""The vLLM offloading tier's host memory over its budget (kernels/integrations/vllm_offload.py).

Prompts (issue 49): many short distinct prompts, each one first chunk (start 0: its sinks raw), stored through
vLLM 0.33's own factory, the tier's manager and worker with the test suite's toy artifact (2 layers x 2 KV heads x
16 dims, 2 sinks, ratio 4, fixed-rate, bf16), until three times the slots have been offered. Reported: the blob
bytes of the stored chunks, every blob the worker holds, their Python allocations (tracemalloc) and the process's
RSS growth, each over `cpu_bytes_to_use`, at 16- and 256-token chunks.

Values: chunks whatever their values, on the embedded model's geometry (SmolLM2-135M: 30 layers, 3 KV heads,
head_dim 64; a synthetic ECSQ artifact, 4 sinks, CR 16, 256-token bf16 chunks): the synthetic cache scaled x1 to
x1e9, Gaussian noise, 32 spikes of +-1e5 per stream, standard Cauchy samples. Per kind, `--requests` requests of 3
chunks (positions 0, 256, 512) stored through the tier's manager and worker within `--values-budget` bytes
(default: room for 5 later chunks, so later requests evict). Reported: the largest chunk's bytes (blob and
per-object slack) over what its slot was charged, and the largest bytes the worker held over `cpu_bytes_to_use`
(tests/kernels/integrations/test_vllm_budget.py checks both <= 1 on 8 layers).

    .venv/bin/python -P bench/vllm_budget.py [--part prompts|values|all] [--budget BYTES] [--values-budget BYTES]
        [--layers N] [--requests N] [--json]   (prompts: 4 MiB at 16-token chunks, 16 MiB at 256)
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the fixtures: tests/helpers


def _tests(name: str = "test_vllm_offload"):
    """tests/kernels/integrations/<name>.py as a module: test_vllm_offload's toy artifact, config and cache builders,
    test_vllm_budget's chunk kinds and budget filler."""
    spec = importlib.util.spec_from_file_location(f"_{name}", ROOT / "tests" / "kernels" / "integrations" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rss() -> int:
    with open("/proc/self/status") as f:
        return 1024 * next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def measure(t, registry: str, blocks_per_chunk: int, budget: int) -> dict:
    base = t.base
    spec = t.OffloadingSpecFactory.create_spec(t._config(registry, blocks_per_chunk=blocks_per_chunk,
                                                         cpu_bytes_to_use=budget))
    manager = spec.get_manager()
    caches, _ = t._kv_caches(blocks_per_chunk * 4)
    worker = spec.get_worker(caches)
    slots = manager.num_slots
    tokens = blocks_per_chunk * t.N
    rss0 = _rss()
    tracemalloc.start()
    traced0 = tracemalloc.get_traced_memory()[0]
    job = 0
    for i in range(3 * slots):  # distinct short prompts: one chunk each, at position 0
        ctx = base.ReqContext(req_id=f"r{i}")
        key = base.make_offload_key(i.to_bytes(8, "little"), 0)
        ctx.set_offload_key_position(key, tokens)
        out = manager.prepare_store([key], ctx)
        if out is None:
            continue
        job += 1
        src = [(i + b) % (blocks_per_chunk * 4) for b in range(blocks_per_chunk)]
        worker.submit_store(job, base.GPULoadStoreSpec(src, group_sizes=[blocks_per_chunk], block_indices=[0]),
                            out.store_spec)
        worker.wait({job})
        ok = all(r.success for r in worker.get_finished())
        manager.complete_store(out.keys_to_store, ctx, success=ok)
        manager.take_events()  # as vLLM's scheduler does every step
    held = [worker.blobs[e.slot][1] for e in manager._entries.values() if e.ready]
    every = sum(len(b) for _, b in worker.blobs.values())
    traced = tracemalloc.get_traced_memory()[0] - traced0
    tracemalloc.stop()
    rss = _rss() - rss0
    worker.shutdown()
    return {"chunk_tokens": tokens, "slots": slots, "stored": len(held), "blob_bytes": sum(map(len, held)),
            "worker_entries": len(worker.blobs), "worker_bytes": every, "traced": traced, "rss": rss, "budget": budget}


def values(layers: int, budget: int | None, requests: int) -> list[dict]:
    """Per kind of chunk: the largest chunk over its charge and the largest bytes held over the budget."""
    import torch

    from kvtc.kernels.codec.kvtc_codec import KVTCCodec
    from kvtc.kernels.integrations.vllm_offload import ChunkCodec, OffloadSettings, SlotPlan

    t = _tests("test_vllm_budget")
    spec = t.tier_spec(layers)
    codec = ChunkCodec(KVTCCodec(spec), list(range(layers)))
    plan = SlotPlan.for_codec(OffloadSettings("synthetic", t.RATIO, 1 << 40), codec, t.TOKENS, torch.bfloat16, 1)
    budget = budget or 5 * plan.chunk_units * plan.unit_bytes
    kinds = [f"x1e{k}" for k in range(10)] + ["noise", "spikes", "cauchy"]
    rows = []
    for kind in kinds:
        got = t.filled(spec, codec, (kind,), budget, requests=requests)
        rows.append({"kind": "x1" if kind == "x1e0" else kind, "budget": budget, "later_charge": t.charged(plan, t.TOKENS),
                     "first_charge": t.charged(plan, 0), **got})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("prompts", "values", "all"), default="all")
    ap.add_argument("--budget", type=int, default=4 << 20, help="prompts: cpu_bytes_to_use at 16-token chunks (x4 at 256)")
    ap.add_argument("--values-budget", type=int, default=None, help="values: cpu_bytes_to_use (default 5 later chunks)")
    ap.add_argument("--layers", type=int, default=30, help="values: layers of the synthetic artifact (SmolLM2's 30)")
    ap.add_argument("--requests", type=int, default=2, help="values: requests of 3 chunks per kind")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows, kinds = [], []
    if args.part in ("prompts", "all"):
        t = _tests()
        with tempfile.TemporaryDirectory() as tmp:
            _, registry = t._artifact(Path(tmp))
            for blocks in (4, 64):
                rows.append(measure(t, registry, blocks, args.budget * (1 if blocks == 4 else 4)))
    if args.part in ("values", "all"):
        kinds = values(args.layers, args.values_budget, args.requests)
    if args.json:
        print(json.dumps({"prompts": rows, "values": kinds}))
        return
    if rows:
        print(f"{'chunk':>6} {'slots':>6} {'stored':>7} {'blobs/budget':>13} {'worker/budget':>14} {'traced/budget':>14} "
              f"{'RSS/budget':>11}")
    for r in rows:
        b = r["budget"]
        print(f"{r['chunk_tokens']:>6} {r['slots']:>6} {r['stored']:>7} {r['blob_bytes'] / b:>13.2f} "
              f"{r['worker_bytes'] / b:>14.2f} {r['traced'] / b:>14.2f} {r['rss'] / b:>11.2f}")
    if kinds:
        k = kinds[0]
        print(f"values: {args.layers} layers x 3 KV heads x 64, CR {16:g}, 256-token bf16 chunks; budget {k['budget']:,} "
              f"bytes, a later chunk charged {k['later_charge']:,}, a first {k['first_charge']:,}")
        print(f"{'kind':>8} {'stored':>7} {'chunk/charged':>14} {'held/budget':>12}  modes")
    for k in kinds:
        modes = ", ".join(f"{m} {n}" for m, n in sorted(k["modes"].items()))
        print(f"{k['kind']:>8} {k['stored']:>7} {k['chunk']:>14.2f} {k['held']:>12.2f}  {modes}")


if __name__ == "__main__":
    main()
