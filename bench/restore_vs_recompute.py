"""Restore against recompute: is a stored prefix worth restoring from its chunks rather than prefilled again?

    python bench/restore_vs_recompute.py --registry REG --artifacts smollm2-attn@latest smollm2-budget@latest \
        --ratios 8,16,32 --prefixes 1024,4096,7936 --repeats 3

1. the embedded model on this CPU: the time to restore a prefix of each of --prefixes tokens from its 256-token chunks (each
   chunk deserialized as `kvtc lmcache-server` and the vLLM tier do: frame and key checks, entropy decoding,
   dequantization, the projection back, RoPE; the first chunk's raw sinks) against recomputing it (one prefill
   of the model over the same tokens), best of --repeats, at the machine's torch threads; per artifact (a full
   basis, a `--basis-budget` one) and ratio, with the components each keeps;
2. the 8B geometry (Llama 3.1 8B: 32 layers x 8 KV heads x head_dim 128, p = 32,768 per stream, 8.03e9
   parameters): the projection's FLOPs per token and direction (2 p kept per stream, kept at the share of p the
   embedded model's artifact keeps at that ratio) against the model's forward FLOPs per token (2 x parameters,
   attention over the prefix left out: a floor on the model's side).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHUNK = 256
LLAMA_8B = dict(layers=32, kv_heads=8, head_dim=128, parameters=8.03e9)


def best(fn, repeats: int) -> float:
    out = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out = min(out, time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--registry", required=True)
    ap.add_argument("--artifacts", nargs="+", required=True)
    ap.add_argument("--ratios", default="8,16,32")
    ap.add_argument("--prefixes", default="1024", help="prefix tokens, comma separated (multiples of 256)")
    ap.add_argument("--corpus", default="stdlib")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()

    from kvtc.artifacts import pull
    from kvtc.pipeline.job.corpus import iter_documents
    from kvtc.workers.models import load_model

    lm = load_model(device="cpu")
    prefixes = [int(p) for p in a.prefixes.split(",")]
    ids: list[int] = []
    for doc in iter_documents(a.corpus):
        ids += lm.tokenizer(doc.text).input_ids
        if len(ids) >= max(prefixes):
            break
    arts = [(ref, pull(ref, registry=a.registry)) for ref in a.artifacts]
    shares: dict[float, float] = {}
    for prefix in prefixes:
        restore_at(lm, arts, ids[:prefix], a, shares)
    geometry(shares)


def restore_at(lm, arts, ids: list[int], a, shares: dict) -> None:
    """One prefix: its prefill time, then each artifact and ratio's restore from chunks beside it."""
    import torch

    from kvtc.kernels.codec.chunk_serde import ChunkTransform
    from kvtc.kernels.codec.kvtc_codec import KVTCCodec
    from kvtc.workers.capture import raw_cache

    seq = torch.tensor([ids])
    keys, values = raw_cache(lm, seq)
    L, H, T, D = keys.shape
    kv = torch.stack([x.permute(0, 2, 1, 3).reshape(L, T, H * D) for x in (keys, values)]).to(torch.bfloat16)
    chunks = [kv[:, :, i:i + CHUNK].contiguous() for i in range(0, T, CHUNK)]

    def prefill() -> None:
        with torch.inference_mode():
            lm.model(seq, use_cache=True)

    t_prefill = best(prefill, a.repeats)
    print(f"\nembedded model, {T}-token prefix of {a.corpus}, {torch.get_num_threads()} torch threads: prefill "
          f"{t_prefill:.2f} s (best of {a.repeats})")
    print(f"{'artifact':26} {'CR':>3} {'kept K/V of p':>16} {'restore s':>9} {'per chunk ms':>12} {'restore/prefill':>15}")
    for ref, art in arts:
        for ratio in (float(r) for r in a.ratios.split(",")):
            t = ChunkTransform(KVTCCodec(art, ratio), positions=True)
            stored = [t.serialize(c, start=i * CHUNK) for i, c in enumerate(chunks)]
            outs = [torch.empty_like(c) for c in chunks]

            def restore() -> None:
                for i, (data, out) in enumerate(zip(stored, outs)):
                    t.deserialize(data, out, start=i * CHUNK)

            restore()  # bases to the device, once
            t_restore = best(restore, a.repeats)
            p = t.spec.stream_features("keys")
            kept = {st: sum(g.kept for g in (t.spec.ecsq or t.spec.streams)[st]) for st in ("keys", "values")}
            shares.setdefault(ratio, (kept["keys"] + kept["values"]) / (2 * p))
            print(f"{ref:26} {ratio:3g} {kept['keys']:>7}/{kept['values']:<5} of {p:<5} {t_restore:9.2f} "
                  f"{1e3 * t_restore / len(chunks):12.0f} {t_restore / t_prefill:15.2f}", flush=True)


def geometry(shares: dict) -> None:
    """The 8B geometry's projection FLOPs at the kept shares the embedded model's artifacts keep."""
    g = LLAMA_8B
    p = g["layers"] * g["kv_heads"] * g["head_dim"]
    model = 2 * g["parameters"]
    print(f"\n8B geometry (p = {p} per stream): the model's forward >= {model / 1e9:.1f} GFLOP per token")
    print(f"{'CR':>3} {'kept share':>10} {'projection GFLOP/token/direction':>33} {'of the model':>12}")
    for ratio, share in sorted(shares.items()):
        flops = 2 * 2 * p * share * p  # two streams, 2 p kept each
        print(f"{ratio:3g} {share:10.2f} {flops / 1e9:33.2f} {flops / model:12.1%}")


if __name__ == "__main__":
    main()
