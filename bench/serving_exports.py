"""The engine routes in one run: SGLang per-rank exports, Dynamo block rows, and the vLLM offloading tier.

Needs artifacts of one model in one registry (small budgets are enough for the byte counts), e.g.
    M=tiny:llama@4x4x64x8; A="--tokens 2048 --seq-len 256 --ratios 8,16 --tokens-curve-points 0 --registry REG"
    kvtc calibrate --model $M $A --groups model --name tiny-tp1
    kvtc calibrate --model $M $A --groups model --tp 2 --name tiny-tp2
    kvtc calibrate --model $M $A --groups layer --keys rope-kept --name tiny-kept-layer
    python bench/serving_exports.py --registry REG --model $M --sglang tiny-tp1,tiny-tp2 \
        --dynamo tiny-kept-layer --vllm tiny-tp1

1. SGLang: per worker `tp_<r>_pp_0`, bytes per token and the real ratio (fp16 scale and offset per
   quantized group per token) for the TP 1 and TP 3 artifacts at each ratio.
2. Dynamo (rope-kept, per-layer groups): the real ratio with token rows and with block rows of 16 tokens
   (one KVBM block region per row), the projection's bytes, and the relative error of Dynamo's math
   (IntX min/max per row and range, emulated in numpy) on real 256-token chunks of text the artifact was
   not calibrated on, keys and values, ||x - x_hat|| / ||x||.
3. vLLM offloading tier: 256-token chunks laid out as vLLM pages (bf16, 16-token blocks) through
   PageFormat and ChunkCodec at their true positions (RoPE removed, chunk 0 with raw sinks): bytes per
   chunk, ratio to bf16, store / load milliseconds per chunk on this CPU, relative error.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/: the chunk reader of lmcache_serving

from lmcache_serving import chunks_of_model  # noqa: E402


def sglang(registry: str, names: list[str], ratios: list[float]) -> None:
    from kvtc.artifacts import pull
    from kvtc.artifacts.export_sglang import export_sglang

    print("SGLang export (per worker: bytes per token, real ratio)")
    for name in names:
        art = pull(f"{name}@latest", registry=registry)
        for ratio in ratios:
            with tempfile.TemporaryDirectory() as tmp:
                doc = json.loads(export_sglang(art, ratio, tmp).with_suffix(".json").read_text())
            rows = ", ".join(f"{w['worker']} {w['bytes_per_token']:.1f} B {w['sglang_ratio']}x" for w in doc["workers"])
            print(f"  {name} TP {doc['tp']} CR {ratio:g}: {rows}")


def _intx(c: np.ndarray, bits: int) -> np.ndarray:
    lo, hi = c.min(axis=1, keepdims=True), c.max(axis=1, keepdims=True)
    scale = np.where(hi - lo < 1e-10, 1.0, (hi - lo) / (2 ** bits - 1))
    return lo + np.clip(np.rint((c - lo) / scale), 0, 2 ** bits - 1) * scale


def dynamo(registry: str, name: str, ratios: list[float], chunks) -> None:
    from kvtc.artifacts import pull
    from kvtc.artifacts.export import DynamoExportOptions, export_dynamo

    art = pull(f"{name}@latest", registry=registry)
    print(f"Dynamo export of {name} (rope-kept, per-layer groups); error on {len(chunks)} unseen 256-token chunks")
    for ratio in ratios:
        for layout, tokens in (("token", 1), ("block", 16)):
            with tempfile.TemporaryDirectory() as tmp:
                doc = json.loads(export_dynamo(art, ratio, tmp, DynamoExportOptions(
                    layout=layout, tokens_per_block=16)).read_text())
                err = {"keys": [0.0, 0.0], "values": [0.0, 0.0]}
                for config in doc["configs"]:
                    mean = np.fromfile(Path(tmp) / config["mean"]["file"], dtype="<f4")
                    P = np.fromfile(Path(tmp) / config["projection"]["file"], dtype="<f4").reshape(
                        config["features"], config["pca_components"])
                    dec = P if "decoder" not in config else np.fromfile(  # a basis that is not orthonormal
                        Path(tmp) / config["decoder"]["file"], dtype="<f4").reshape(P.shape)
                    layer = config["layers"][0] if isinstance(config["layers"], list) and \
                        isinstance(config["layers"][0], int) else config["layers"]["layers"][0]
                    si = 0 if config["stream"] == "keys" else 1
                    for kv in chunks:
                        x = kv[si, layer].float().numpy().reshape(-1, config["features"])  # token-major rows
                        c = (x - mean) @ P
                        c_hat = np.concatenate([_intx(c[:, r["start_idx"]:r["end_idx"]], r["int_bits"])
                                                for r in config["ranges"]], axis=1)
                        x_hat = c_hat @ dec.T + mean
                        err[config["stream"]][0] += float(((x - x_hat) ** 2).sum())
                        err[config["stream"]][1] += float((x ** 2).sum())
                proj = sum(c["projection_bytes"] for c in doc["configs"])
            rel = {s: (e[0] / e[1]) ** 0.5 for s, e in err.items()}
            print(f"  CR {ratio:g} {layout:5s} rows: {doc['dynamo_ratio']}x ({doc['dynamo_bytes_per_token']} bytes per "
                  f"token), projections {proj / 2**20:.1f} MiB, rel. error keys {rel['keys']:.4f} values "
                  f"{rel['values']:.4f}")


def vllm_tier(registry: str, name: str, ratios: list[float], chunks) -> None:
    import torch

    from kvtc.kernels.codec.kvtc_codec import KVTCCodec
    from kvtc.kernels.integrations.vllm_offload import ChunkCodec, PageFormat

    print(f"vLLM offloading tier ({name}, keys RoPE-removed at their positions), 256-token chunks, 16-token blocks")
    for ratio in ratios:
        for mode in ("ecsq", "fixed"):
            base = KVTCCodec.from_registry(f"{name}@latest", ratio, registry=registry, mode=mode)
            chunk = ChunkCodec(base, base.spec.coded_layers)
            L, H, D = chunk.spec.num_layers, chunk.spec.kv_heads, chunk.spec.head_dim
            page = PageFormat(kv_heads=H, tokens=16, head_dim=D, dtype=torch.bfloat16)
            sizes, store, load, num, den = [], 0.0, 0.0, {0: 0.0, 1: 0.0}, {0: 0.0, 1: 0.0}
            for c, kv in enumerate(chunks):
                T = kv.shape[2]
                x = kv.reshape(2, L, T, H, D)
                blocks = torch.cat([x[0], x[1]], dim=-1).reshape(L, T // 16, 16, H, 2 * D)
                pages = [blocks[i].contiguous().view(torch.int8).reshape(T // 16, page.page_bytes) for i in range(L)]
                ids = torch.arange(T // 16)
                t0 = time.perf_counter()
                read = [page.read(p, ids) for p in pages]
                k, v = torch.stack([a for a, _ in read]), torch.stack([b for _, b in read])
                blob = chunk.encode(k, v, c * T)
                t1 = time.perf_counter()
                dk, dv = chunk.decode(blob, torch.device("cpu"), c * T)
                out = [torch.zeros_like(p) for p in pages]
                for i, p in enumerate(out):
                    page.write(p, ids, dk[i], dv[i])
                t2 = time.perf_counter()
                sizes.append(len(blob))
                store, load = store + t1 - t0, load + t2 - t1
                for si, (a, b) in enumerate(((k, dk), (v, dv))):
                    num[si] += float((a.float() - b.float()).pow(2).sum())
                    den[si] += float(a.float().pow(2).sum())
            raw = chunks[0].shape[2] * L * H * D * 2 * 2
            print(f"  CR {ratio:g} {mode:5s}: {np.mean(sizes):.0f} bytes per chunk ({raw / np.mean(sizes):.2f}x below bf16), "
                  f"store {1e3 * store / len(chunks):.0f} ms, load {1e3 * load / len(chunks):.0f} ms per chunk (CPU), "
                  f"rel. error keys {(num[0] / den[0]) ** 0.5:.4f} values {(num[1] / den[1]) ** 0.5:.4f}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--registry", required=True)
    ap.add_argument("--sglang", default="smol-tp1,smol-tp3")
    ap.add_argument("--dynamo", default="smol-kept-layer")
    ap.add_argument("--vllm", default="smol-tp1")
    ap.add_argument("--ratios", default="8,16")
    ap.add_argument("--corpus", default="stdlib")
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--model", default=None, help="the artifacts' model (default: the embedded SmolLM2)")
    ap.add_argument("--vllm-registry", default=None, help="registry of the --vllm artifact (default --registry)")
    args = ap.parse_args()
    ratios = [float(r) for r in args.ratios.split(",")]
    if args.sglang:
        sglang(args.registry, args.sglang.split(","), ratios)
    chunks = chunks_of_model(args.corpus, args.chunks, model=args.model)[0]
    if args.dynamo:
        dynamo(args.registry, args.dynamo, ratios, chunks)
    if args.vllm:
        vllm_tier(args.vllm_registry or args.registry, args.vllm, ratios, chunks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
