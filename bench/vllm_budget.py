"""The vLLM offloading tier's host memory over its budget (issue 49): many short distinct prompts, each one
first chunk (start 0: its sinks raw), stored through vLLM 0.33's own factory, the tier's manager and worker
(kernels/integrations/vllm_offload.py) with the test suite's toy artifact (2 layers x 2 KV heads x 16 dims,
2 sinks, ratio 4, fixed-rate, bf16), until three times the slots have been offered. Reported: the blob bytes
of the stored chunks, every blob the worker holds, their Python allocations (tracemalloc) and the process's RSS growth, each over
`cpu_bytes_to_use`, at 16- and 256-token chunks.

    .venv/bin/python -P bench/vllm_budget.py [--budget BYTES] [--json]   (4 MiB at 16-token chunks, 16 MiB at 256)
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


def _tests():
    """tests/kernels/test_vllm_offload.py as a module (its toy artifact, config and cache builders)."""
    spec = importlib.util.spec_from_file_location("_vllm_offload_tests", ROOT / "tests" / "kernels" / "test_vllm_offload.py")
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=int, default=4 << 20, help="cpu_bytes_to_use at 16-token chunks (x4 at 256)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    t = _tests()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        _, registry = t._artifact(Path(tmp))
        for blocks in (4, 64):
            rows.append(measure(t, registry, blocks, args.budget * (1 if blocks == 4 else 4)))
    if args.json:
        print(json.dumps(rows))
        return
    print(f"{'chunk':>6} {'slots':>6} {'stored':>7} {'blobs/budget':>13} {'worker/budget':>14} {'traced/budget':>14} "
          f"{'RSS/budget':>11}")
    for r in rows:
        b = r["budget"]
        print(f"{r['chunk_tokens']:>6} {r['slots']:>6} {r['stored']:>7} {r['blob_bytes'] / b:>13.2f} "
              f"{r['worker_bytes'] / b:>14.2f} {r['traced'] / b:>14.2f} {r['rss'] / b:>11.2f}")


if __name__ == "__main__":
    main()
