"""The serving path in one run: LMCache chunks through the L2 adapter its server builds, and Dynamo's real sizes.

Needs a rope-kept artifact of the embedded model and LMCache (`pip install -e '.[lmcache]'`):
    kvtc calibrate --tokens 16384 --keys rope-kept --ratios 8,16,32 --sinks 0 --window 0 --registry REG \
        --name smollm2-kept
    python bench/lmcache_serving.py --registry REG --artifact smollm2-kept@latest

LMCache: real 256-token chunks of the embedded model (text it was not calibrated on, default `stdlib`),
(2, layers, 256, kv_heads x head_dim) bf16, stored and retrieved through the filesystem L2 adapter that
`kvtc lmcache-server ... --l2-adapter '{"type": "fs", ..., "serde": {...}}'` builds
(kvtc.kernels.lmcache_server.l2_adapter: LMCache's own argument parsing, L1 manager, adapter factory
and serde wrapper; LMCache's request transport is not started). Per serde: bytes on disk per chunk,
the ratio to bf16, store and retrieve milliseconds per chunk (serde + file I/O, one chunk per task),
relative error ||x - x_hat|| / ||x|| over the chunk. Serdes: kvtc ECSQ and fixed at each ratio,
LMCache's fp8 serde, no serde (raw), and CacheGen through LMCache's legacy `to_bytes` (its CPU kernels;
there is no CacheGen serde for the L2 adapters in LMCache 0.5.6). Then the out-of-distribution chunks
(x1000, heavy-tailed, spiky channels): chunks stored / offered. Then Dynamo: real bytes per token and
real ratio at each ratio (token-major export; Dynamo's per-row byte padding, min/max and range headers
over --dynamo-batch rows).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("LMCACHE_DISABLE_BANNER", "1")


def chunks_of_model(corpus: str, count: int, tokens: int = 256):
    """-> list of (2, L, tokens, H * D) bf16 chunks of the embedded model's cache, and the model's config dir."""
    import torch

    from kvtc.pipeline.job.corpus import iter_documents
    from kvtc.workers.capture import raw_cache
    from kvtc.workers.models import load_model

    lm = load_model(device="cpu")
    ids: list[int] = []
    for doc in iter_documents(corpus):
        ids += lm.tokenizer(doc.text).input_ids
        if len(ids) >= count * tokens:
            break
    keys, values = raw_cache(lm, torch.tensor([ids[:count * tokens]]))
    L, H, T, D = keys.shape
    kv = torch.stack([x.permute(0, 2, 1, 3).reshape(L, T, H * D) for x in (keys, values)]).to(torch.bfloat16)
    return [kv[:, :, i * tokens:(i + 1) * tokens].contiguous() for i in range(count)], lm


def out_of_distribution(kv):
    import torch

    torch.manual_seed(0)
    x = kv.float()
    spiky = x.clone()
    spiky[..., ::7] *= 60
    heavy = x + torch.distributions.StudentT(1.5).sample(x.shape) * x.std()
    return {"x1000": x * 1000, "heavy-tailed": heavy, "spiky": spiky}


def memory_obj(tensor):
    from lmcache.v1.memory_management import MemoryObjMetadata, TensorMemoryObj

    raw = tensor.contiguous().reshape(-1).view(__import__("torch").uint8).clone()
    meta = MemoryObjMetadata(shape=tensor.shape, dtype=tensor.dtype, address=0, phy_size=raw.numel(), ref_count=1,
                             shapes=[tensor.shape], dtypes=[tensor.dtype])
    return TensorMemoryObj(raw, meta, None)


def wait(query, task, timeout=600.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        out = query(task)
        if out is not None:
            return out
        time.sleep(0.001)
    raise TimeoutError(task)


def run_adapter(serde: dict | None, chunks: list, root: Path, label: str) -> dict:
    """Store then load every chunk through the adapter -> bytes/chunk, ms store, ms load, rel error, stored."""
    import torch
    from lmcache.v1.distributed.api import ObjectKey

    from kvtc.kernels.lmcache_server import l2_adapter

    base = root / label
    base.mkdir(parents=True)
    spec = {"type": "fs", "base_path": str(base), **({"serde": serde} if serde else {})}
    adapter, l1 = l2_adapter(["--l1-size-gb", "0.2", "--eviction-policy", "LRU", "--l2-adapter", json.dumps(spec)])
    stored, t_store, t_load, errors = 0, [], [], []
    try:
        for i, kv in enumerate(chunks):
            key = ObjectKey(chunk_hash=i.to_bytes(4, "little") * 8, model_name="smollm2", kv_rank=0)
            t0 = time.perf_counter()
            result = wait(lambda t: adapter.pop_completed_store_tasks().get(t),
                          adapter.submit_store_task([key], [memory_obj(kv)]))
            t_store.append(time.perf_counter() - t0)
            if not result.is_successful():
                continue
            stored += 1
            dst = memory_obj(torch.zeros_like(kv))
            t0 = time.perf_counter()
            bitmap = wait(adapter.query_load_result, adapter.submit_load_task([key], [dst]))
            t_load.append(time.perf_counter() - t0)
            if bitmap.get_indices_list() == [0]:
                errors.append(float((dst.tensor.float() - kv.float()).norm() / kv.float().norm()))
    finally:
        adapter.close()
        l1.close()
    files = list(base.rglob("*.data"))
    sizes = [p.stat().st_size for p in files]
    # a kvtc chunk is "<Q" blob length + blob (+ padding up to the bound): what "pad": false would store
    blobs = [8 + int.from_bytes(p.read_bytes()[:8], "little") if serde and serde.get("type") == "kvtc" else n
             for p, n in zip(files, sizes)]
    return {"stored": stored, "offered": len(chunks), "bytes": sum(sizes) / max(1, len(sizes)),
            "blob": sum(blobs) / max(1, len(blobs)),
            "store_ms": 1e3 * sum(t_store) / len(t_store), "load_ms": 1e3 * sum(t_load) / max(1, len(t_load)),
            "rel_error": sum(errors) / max(1, len(errors)) if errors else float("nan")}


def cachegen(chunks: list, model_dir: str) -> dict:
    """LMCache's CacheGen codec (legacy to_bytes/from_bytes, CPU kernels) on the same chunks."""
    import torch
    from lmcache.storage_backend.serde.cachegen_decoder import CacheGenDeserializer
    from lmcache.storage_backend.serde.cachegen_encoder import CacheGenSerializer
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata

    _, L, T, HD = chunks[0].shape
    D = 64
    cfg = LMCacheEngineConfig.from_defaults(chunk_size=T)
    meta = LMCacheMetadata(model_name=model_dir, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                           kv_dtype=torch.bfloat16, kv_shape=(L, 2, T, HD // D, D))
    ser, de = CacheGenSerializer(cfg, meta), CacheGenDeserializer(cfg, meta, torch.bfloat16)
    sizes, t_store, t_load, errors = [], [], [], []
    for kv in chunks:
        x = kv.reshape(2, L, T, HD // D, D).permute(1, 0, 2, 3, 4).contiguous()
        t0 = time.perf_counter()
        data = ser.to_bytes(x)
        t_store.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        y = de.from_bytes(data)
        t_load.append(time.perf_counter() - t0)
        sizes.append(len(data))
        errors.append(float((y.float() - x.float()).norm() / x.float().norm()))
    return {"stored": len(chunks), "offered": len(chunks), "bytes": sum(sizes) / len(sizes),
            "blob": sum(sizes) / len(sizes), "store_ms": 1e3 * sum(t_store) / len(t_store),
            "load_ms": 1e3 * sum(t_load) / len(t_load),
            "rel_error": sum(errors) / len(errors)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--registry", required=True)
    ap.add_argument("--artifact", default="smollm2-kept@latest")
    ap.add_argument("--ratios", default="8,16,32")
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--corpus", default="stdlib")
    ap.add_argument("--dynamo-batch", type=int, default=256)
    ap.add_argument("--cachegen-chunks", type=int, default=1, help="chunks for CacheGen (slow on a CPU)")
    args = ap.parse_args()
    import torch

    from kvtc.artifacts import pull
    from kvtc.artifacts.export import DynamoExportOptions, export_dynamo

    torch.set_num_threads(max(1, (os.cpu_count() or 1)))
    ratios = [float(r) for r in args.ratios.split(",")]
    chunks, lm = chunks_of_model(args.corpus, args.chunks)
    raw = chunks[0].numel() * chunks[0].element_size()
    ood = [x.to(torch.bfloat16) for kv in chunks[:1] for x in out_of_distribution(kv).values()]
    print(f"{args.chunks} chunks of {chunks[0].shape[2]} tokens, {tuple(chunks[0].shape)} bf16 = {raw} bytes each; "
          f"artifact {args.artifact}; corpus {args.corpus}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for ratio in ratios:
            for mode in ("ecsq", "fixed"):
                serde = {"type": "kvtc", "artifact": args.artifact, "ratio": ratio, "registry": args.registry,
                         "mode": mode}
                row = run_adapter(serde, chunks, root, f"kvtc-{mode}-{ratio:g}")
                row["ood"] = run_adapter(serde, ood, root, f"ood-{mode}-{ratio:g}")
                rows.append((f"kvtc {mode} CR {ratio:g}", row))
        rows.append(("LMCache fp8 serde", run_adapter({"type": "fp8"}, chunks, root, "fp8")))
        rows.append(("no serde (raw bf16)", run_adapter(None, chunks, root, "raw")))
        try:
            rows.append(("LMCache CacheGen (legacy to_bytes)", cachegen(chunks[:args.cachegen_chunks], str(lm.model.name_or_path))))
        except Exception as exc:  # CacheGen needs the model's config and LMCache's kernels
            print(f"CacheGen did not run: {type(exc).__name__}: {exc}")
    print(f"\n{'serde':38} {'disk B/chunk':>12} {'x bf16':>7} {'blob B':>9} {'x bf16':>7} {'store ms':>9} "
          f"{'load ms':>8} {'rel err':>8} {'stored':>7} {'OOD stored':>11}")
    for name, r in rows:
        o = r.get("ood")
        print(f"{name:38} {r['bytes']:12.0f} {raw / max(r['bytes'], 1):7.2f} {r['blob']:9.0f} "
              f"{raw / max(r['blob'], 1):7.2f} {r['store_ms']:9.1f} {r['load_ms']:8.1f} "
              f"{r['rel_error']:8.4f} {r['stored']:>3}/{r['offered']:<3} "
              f"{(str(o['stored']) + '/' + str(o['offered'])) if o else '-':>11}")
    art = pull(args.artifact.split("@")[0], args.artifact.split("@")[1] if "@" in args.artifact else "latest",
               registry=args.registry)
    print(f"\nDynamo (token-major export, {args.dynamo_batch}-row calls; real ratio against bf16 keys + values)")
    print(f"{'CR':>4} {'bytes/token':>12} {'real ratio':>11} {'zero cols':>10}")
    with tempfile.TemporaryDirectory() as tmp:
        for ratio in ratios:
            doc = json.loads(export_dynamo(art, ratio, Path(tmp) / f"d{ratio:g}",
                                           DynamoExportOptions(layout="token-major", batch=args.dynamo_batch)
                                           ).read_text())
            zero = sum(c["zero_columns"] for c in doc["configs"])
            print(f"{ratio:4g} {doc['dynamo_bytes_per_token']:12.1f} {doc['dynamo_ratio']:11.3f} {zero:10d}")


if __name__ == "__main__":
    main()
