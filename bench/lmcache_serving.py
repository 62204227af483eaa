"""The serving path: LMCache chunks through the L2 adapter its server builds and Dynamo's real sizes (default);
the live server (--live); perplexity through the chunk path (--ppl).

Needs a rope-kept artifact of the embedded model and LMCache (`pip install -e '.[lmcache]'`):
    kvtc calibrate --tokens 16384 --keys rope-kept --ratios 8,16,32 --sinks 0 --window 0 --registry REG \
        --name smollm2-kept
    python bench/lmcache_serving.py --registry REG --artifact smollm2-kept@latest

LMCache: real 256-token chunks of the embedded model (text it was not calibrated on, default `stdlib`),
(2, layers, 256, kv_heads x head_dim) bf16, stored and retrieved through the filesystem L2 adapter that
`kvtc lmcache-server ... --l2-adapter '{"type": "fs", ..., "serde": {...}}'` builds
(kvtc.kernels.integrations.lmcache_server.l2_adapter: LMCache's own argument parsing, L1 manager, adapter factory
and serde wrapper; LMCache's request transport is not started). Per serde: bytes on disk per chunk,
the ratio to bf16, store and retrieve milliseconds per chunk (serde + file I/O, one chunk per task),
relative error ||x - x_hat|| / ||x|| over the chunk. Serdes: kvtc ECSQ and fixed at each ratio,
LMCache's fp8 serde, no serde (raw), and CacheGen through LMCache's legacy `to_bytes` (its CPU kernels;
there is no CacheGen serde for the L2 adapters in LMCache 0.5.6). Then the out-of-distribution chunks
(x1000, heavy-tailed, spiky channels): chunks stored / offered. Then Dynamo: real bytes per token and
real ratio at each ratio (token-major export; Dynamo's per-row byte padding, min/max and range headers
over --dynamo-batch rows).

--live ART[:TP] ...: for each artifact, `kvtc lmcache-server` started on loopback (filesystem L2 with the
kvtc serde at --ratio), the embedded model's KV of unseen text (--corpus) in vLLM's paged layout, stored
through LMCache's own MP client in server-driven mode by TP workers (tests/helpers/lmcache_client.py), L1
cleared, looked up (prefetched from L2) and retrieved: chunks stored / returned, bytes per chunk on disk
against bf16, relative error, and per chunk: the STORE call, the time until the chunk is on disk
(serialize + write, after STORE), the lookup with its prefetch (read + deserialize) and the RETRIEVE.

--ppl KEPT RR: perplexity on unseen text through the chunk path (the transform the server's serde
applies, kvtc.kernels.codec.chunk_serde; the live test asserts the server's bytes are its bytes): each
sequence's --prefix-chunks 256-token chunks coded and decoded, then --continuation tokens scored against
the uncompressed (bf16) cache: a RoPE-kept artifact, a RoPE-removed one at the chunks' true positions
(as `kvtc lmcache-server` codes them) and the same at position 0 (what a store without positions would
do), at each --ratios.

    python bench/lmcache_serving.py --registry REG --live smollm2-kept@latest smollm2-rr@latest smollm2-tp3@latest:3
    python bench/lmcache_serving.py --registry REG --ppl smollm2-kept@latest smollm2-rr@latest --ratios 8,16
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
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))  # tests/helpers
os.environ.setdefault("LMCACHE_DISABLE_BANNER", "1")


def chunks_of_model(corpus: str, count: int, tokens: int = 256, model: str | None = None):
    """-> list of (2, L, tokens, H * D) bf16 chunks of one sequence of `model`'s cache (default: the
    embedded model), and the loaded model."""
    import torch

    from kvtc.pipeline.job.corpus import iter_documents
    from kvtc.workers.capture import raw_cache
    from kvtc.workers.models import load_model

    lm = load_model(model, device="cpu") if model else load_model(device="cpu")
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

    from kvtc.kernels.codec.chunk_serde import FRAME_BYTES, unframe
    from kvtc.kernels.integrations.lmcache_server import l2_adapter

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
    blobs = [FRAME_BYTES + len(unframe(p.read_bytes())[1]) if serde and serde.get("type") == "kvtc" else n
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


def _tokens(lm, corpus: str, count: int) -> list[int]:
    from kvtc.pipeline.job.corpus import iter_documents

    ids: list[int] = []
    for doc in iter_documents(corpus):
        ids += lm.tokenizer(doc.text).input_ids
        if len(ids) >= count:
            return ids[:count]
    raise ValueError(f"corpus {corpus} holds fewer than {count} tokens")


def live(registry: str, specs: list[str], ratio: float, corpus: str, chunks: int, model: str | None = None) -> list[dict]:
    """Each ART[:TP] through a live `kvtc lmcache-server` -> one row of figures per artifact."""
    import socket

    import torch

    from kvtc.kernels.codec.blob import read_blob
    from kvtc.kernels.codec.chunk_serde import FRAME_BYTES, unframe
    from helpers.lmcache_client import connect, server_process
    from kvtc.workers.capture import raw_cache
    from kvtc.workers.models import load_model

    def port() -> int:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return sock.getsockname()[1]

    lm = load_model(model, device="cpu") if model else load_model(device="cpu")
    n = chunks * 256
    ids = _tokens(lm, corpus, n)
    keys, values = (x.to(torch.bfloat16) for x in raw_cache(lm, torch.tensor([ids])))
    L, H, T, D = keys.shape
    blocks = list(range(T // 16))
    rows = []
    for spec in specs:
        ref, _, tp = spec.partition(":")
        tp = int(tp or 1)
        with tempfile.TemporaryDirectory() as tmp:
            l2, rpc = Path(tmp) / "l2", port()
            l2.mkdir()
            serde = {"type": "kvtc", "artifact": ref, "ratio": ratio, "registry": registry}
            args = ["--host", "127.0.0.1", "--port", str(rpc), "--http-host", "127.0.0.1", "--http-port", str(port()),
                    "--l1-size-gb", "1", "--eviction-policy", "LRU",
                    "--l2-adapter", json.dumps({"type": "fs", "base_path": str(l2), "serde": serde})]
            log = Path(tmp) / "server.log"
            with server_process(args, log) as proc:
                client = connect(proc, f"tcp://127.0.0.1:{rpc}", "bench", log=log, layers=L, kv_heads=H // tp,
                                 head_dim=D, tp=tp, num_blocks=len(blocks) + 16, block_size=16, timeout=1200.0)
                try:
                    per = H // tp
                    for r in range(tp):
                        client.write(r, blocks, keys[:, r * per:(r + 1) * per], values[:, r * per:(r + 1) * per])
                    t0 = time.perf_counter()
                    stored = client.store("store", ids, blocks)
                    t_store = time.perf_counter() - t0
                    client.end_session("store")
                    want = chunks * tp
                    while len(list(l2.glob("*.data"))) < want and proc.poll() is None \
                            and time.perf_counter() - t0 < 3600:
                        time.sleep(0.05)
                    t_disk = time.perf_counter() - t0
                    files = list(l2.glob("*.data"))
                    client.clear_l1()
                    for r in range(tp):
                        client.zero(r, blocks)
                    t0 = time.perf_counter()
                    hits = client.lookup("load", ids)
                    t_prefetch = time.perf_counter() - t0
                    t0 = time.perf_counter()
                    returned = client.retrieve("load", ids, blocks, hits)
                    t_retrieve = time.perf_counter() - t0
                    client.end_session("load")
                    got = [client.read(r, blocks) for r in range(tp)]
                finally:
                    client.close()
            data = [p.read_bytes() for p in files]
        k_hat = torch.cat([k for k, _ in got], dim=1)[:, :, :hits * 256].float()
        v_hat = torch.cat([v for _, v in got], dim=1)[:, :, :hits * 256].float()
        k, v = keys[:, :, :hits * 256].float(), values[:, :, :hits * 256].float()
        blob = [FRAME_BYTES + len(unframe(d)[1]) for d in data]
        starts = {read_blob(unframe(d)[1])[0].start for d in data}
        rows.append({"artifact": ref, "tp": tp, "ratio": ratio, "stored": len(files), "offered": want,
                     "store_ok": all(stored), "returned": hits * tp if all(returned) else 0,
                     "positions": sorted(starts),
                     "disk_bytes": sum(len(d) for d in data) / max(len(data), 1), "blob_bytes": sum(blob) / max(len(blob), 1),
                     "raw_bytes": 2 * L * 256 * (H // tp) * D * 2,
                     "store_ms": 1e3 * t_store / want, "disk_ms": 1e3 * t_disk / want,
                     "prefetch_ms": 1e3 * t_prefetch / max(hits * tp, 1), "retrieve_ms": 1e3 * t_retrieve / max(hits * tp, 1),
                     "k_err": float((k_hat - k).norm() / k.norm()) if hits else float("nan"),
                     "v_err": float((v_hat - v).norm() / v.norm()) if hits else float("nan")})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def print_live(rows: list[dict]) -> None:
    print(f"\n{'artifact':28} {'TP':>2} {'CR':>3} {'stored':>7} {'returned':>8} {'disk B/chunk':>12} {'x bf16':>6} "
          f"{'blob x':>6} {'STORE ms':>8} {'on disk ms':>10} {'prefetch ms':>11} {'RETRIEVE ms':>11} {'K err':>6} {'V err':>6}")
    for r in rows:
        print(f"{r['artifact']:28} {r['tp']:2d} {r['ratio']:3g} {r['stored']:>3}/{r['offered']:<3} {r['returned']:>4}/{r['offered']:<3} "
              f"{r['disk_bytes']:12.0f} {r['raw_bytes'] / max(r['disk_bytes'], 1):6.2f} "
              f"{r['raw_bytes'] / max(r['blob_bytes'], 1):6.2f} {r['store_ms']:8.1f} {r['disk_ms']:10.1f} "
              f"{r['prefetch_ms']:11.1f} {r['retrieve_ms']:11.1f} {r['k_err']:6.3f} {r['v_err']:6.3f}")


def ppl(registry: str, kept: str, removed: str, ratios: list[float], corpus: str, sequences: int,
        prefix_chunks: int, continuation: int) -> list[dict]:
    """Perplexity ratio and KL on unseen text with each sequence's prefix cache through the chunk path."""
    import math

    import torch

    from kvtc.kernels.codec.chunk_serde import FRAME_BYTES, unframe

    from kvtc.kernels.integrations.lmcache_settings import ChunkSerdeSettings

    from kvtc.kernels.integrations.lmcache_ranks import RankedChunkTransforms
    from kvtc.pipeline.evaluation.model_quality import continuation_logprobs
    from kvtc.workers.capture import raw_cache
    from kvtc.workers.models import load_model

    lm = load_model(device="cpu")
    P, n = prefix_chunks * 256, continuation
    ids = _tokens(lm, corpus, sequences * (P + n + 1))
    methods = []
    for ratio in ratios:
        for label, ref, positions in (("rope-kept", kept, True), ("rope-removed, true positions", removed, True),
                                      ("rope-removed, position 0", removed, False)):
            settings = ChunkSerdeSettings.from_kwargs({"artifact": ref, "ratio": ratio, "registry": registry})
            methods.append((label, ratio, positions, RankedChunkTransforms.from_settings(settings, positions=True)(None)))
    tally = {(m[0], m[1]): dict(nll=0.0, kl=0.0, tokens=0, k=0.0, kn=0.0, v=0.0, vn=0.0, blob=0, raw=0) for m in methods}
    for s in range(sequences):
        seq = torch.tensor([ids[s * (P + n + 1):(s + 1) * (P + n + 1)]])
        prefix, feed, target = seq[:, :P], seq[:, P:P + n], seq[0, P + 1:P + n + 1]
        keys, values = (x.to(torch.bfloat16) for x in raw_cache(lm, prefix))
        L, H, _, D = keys.shape
        ref_lp = continuation_logprobs(lm.model, keys.float(), values.float(), feed)
        ref_nll = -ref_lp.gather(1, target[:, None]).sum().item()
        for label, ratio, positions, t in methods:
            k_hat, v_hat = torch.empty_like(keys), torch.empty_like(values)
            for i in range(prefix_chunks):
                sl = slice(i * 256, (i + 1) * 256)
                c = torch.stack([x[:, :, sl].permute(0, 2, 1, 3).reshape(L, 256, H * D) for x in (keys, values)])
                data = t.serialize(c, start=i * 256 if positions else 0)
                out = torch.empty_like(c)
                t.deserialize(memoryview(data), out, start=i * 256 if positions else 0)
                k_hat[:, :, sl] = out[0].reshape(L, 256, H, D).permute(0, 2, 1, 3)
                v_hat[:, :, sl] = out[1].reshape(L, 256, H, D).permute(0, 2, 1, 3)
                a = tally[(label, ratio)]
                a["blob"] += FRAME_BYTES + len(unframe(data)[1])
                a["raw"] += c.numel() * c.element_size()
            lp = continuation_logprobs(lm.model, k_hat.float(), v_hat.float(), feed)
            a = tally[(label, ratio)]
            a["nll"] += -lp.gather(1, target[:, None]).sum().item() - ref_nll
            a["kl"] += float((ref_lp.exp() * (ref_lp - lp)).sum())
            a["tokens"] += n
            for key, x, xh in (("k", keys, k_hat), ("v", values, v_hat)):
                a[key] += float((xh.float() - x.float()).pow(2).sum())
                a[key + "n"] += float(x.float().pow(2).sum())
        print(f"sequence {s + 1}/{sequences} done", flush=True)
    rows = []
    for (label, ratio), a in tally.items():
        rows.append({"method": label, "ratio": ratio, "ppl_ratio": math.exp(a["nll"] / a["tokens"]),
                     "kl": a["kl"] / a["tokens"], "k_err": math.sqrt(a["k"] / a["kn"]), "v_err": math.sqrt(a["v"] / a["vn"]),
                     "x_bf16": a["raw"] / a["blob"], "tokens": a["tokens"]})
    print(f"\n{'keys':30} {'CR':>3} {'x bf16':>7} {'K err':>6} {'V err':>6} {'ppl ratio':>9} {'KL':>8}")
    for r in rows:
        print(f"{r['method']:30} {r['ratio']:3g} {r['x_bf16']:7.2f} {r['k_err']:6.3f} {r['v_err']:6.3f} "
              f"{r['ppl_ratio']:9.4f} {r['kl']:8.4f}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--registry", required=True)
    ap.add_argument("--artifact", default="smollm2-kept@latest")
    ap.add_argument("--ratios", default="8,16,32")
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--corpus", default="stdlib")
    ap.add_argument("--dynamo-batch", type=int, default=256)
    ap.add_argument("--cachegen-chunks", type=int, default=1, help="chunks for CacheGen (slow on a CPU)")
    ap.add_argument("--live", nargs="+", metavar="ART[:TP]", help="run the live server section for these artifacts")
    ap.add_argument("--ratio", type=float, default=16.0, help="--live: the serde's ratio")
    ap.add_argument("--ppl", nargs=2, metavar=("KEPT", "RR"), help="run the perplexity section: a RoPE-kept and a "
                    "RoPE-removed artifact")
    ap.add_argument("--sequences", type=int, default=4, help="--ppl: sequences of unseen text")
    ap.add_argument("--prefix-chunks", type=int, default=4, help="--ppl: 256-token chunks of prefix per sequence")
    ap.add_argument("--continuation", type=int, default=64, help="--ppl: tokens scored after the prefix")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: every core)")
    ap.add_argument("--model", default=None, help="--live: the model whose KV is stored (default: the embedded SmolLM2)")
    args = ap.parse_args()
    if args.live or args.ppl:
        import torch

        torch.set_num_threads(args.threads or max(1, os.cpu_count() or 1))
        if args.live:
            print(f"live: {args.chunks} chunks of 256 tokens of {args.corpus} per artifact, CR {args.ratio:g}")
            print_live(live(args.registry, args.live, args.ratio, args.corpus, args.chunks, args.model))
        if args.ppl:
            ppl(args.registry, args.ppl[0], args.ppl[1], [float(r) for r in args.ratios.split(",")], args.corpus,
                args.sequences, args.prefix_chunks, args.continuation)
        return
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
