"""Outlier selection through the decoder's sketch against the full decode it replaced, at equal bytes, in one run.

The chunk path as served (kvtc.pipeline.evaluation.served.chunk_path) codes --sequences prefixes of --prefix tokens
of --corpus (text the default calibration did not see) at each ratio twice: selecting the outlier vectors from every
(token, layer) vector's exact error, reconstructed in full (the stage before kernels/codec/error_sketch.py), and
from the sketch's estimates, measured exactly where they may count (the codec today). Per ratio: the continuation's
perplexity ratio and KL against the raw cache (bf16, as servers hold it), the relative K and V errors, the stored
bytes, the outlier vectors each selects and how many both select, and the seconds of the whole chunk path.

    python bench/outlier_sketch.py [--registry registry] [--artifact smollm2-135m@latest] [--ratios 8,16,32]
        [--corpus stdlib] [--sequences 8] [--prefix 1024] [--continuation 64] [--threads 1]
"""
from __future__ import annotations

import argparse
import math
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--registry", default="registry")
    ap.add_argument("--artifact", default="smollm2-135m@latest")
    ap.add_argument("--ratios", default="8,16,32")
    ap.add_argument("--corpus", default="stdlib")
    ap.add_argument("--sequences", type=int, default=8)
    ap.add_argument("--prefix", type=int, default=1024)
    ap.add_argument("--continuation", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)

    from served_quality import sequences

    from kvtc.artifacts import pull
    from kvtc.kernels.codec import kvtc_codec, outliers
    from kvtc.kernels.codec.error_sketch import reference_errors
    from kvtc.kernels.codec.kvtc_codec import KVTCCodec
    from kvtc.pipeline.evaluation.model_quality import continuation_logprobs
    from kvtc.pipeline.evaluation.served import chunk_path, chunk_transform
    from kvtc.workers.capture import raw_cache
    from kvtc.workers.models import load_model

    torch.set_num_threads(args.threads)
    with open("/proc/loadavg") as f:
        print(f"load before: {f.read().split()[:3]}", flush=True)
    warnings.simplefilter("ignore")
    lm = load_model("smollm2-135m", device="cpu")
    art = pull(args.artifact, registry=args.registry)
    seqs = sequences(lm, args.corpus, args.sequences, args.prefix + args.continuation + 1)
    sketched = kvtc_codec.vector_errors
    chosen: list[set] = []
    select = outliers.select

    def recording(*a, **k):  # noqa: ANN002, ANN003, ANN202
        found = select(*a, **k)
        chosen.append(set(found.tolist()))
        return found

    kvtc_codec.outliers.select = recording
    rows = []
    for ratio in [float(r) for r in args.ratios.split(",")]:
        transform = chunk_transform(KVTCCodec(art, ratio))
        tally = {name: dict(nll=0.0, kl=0.0, tokens=0, bytes=0, k=0.0, v=0.0, s=0.0, found=[])
                 for name in ("full decode", "sketch")}
        for ids in seqs:
            ids = torch.tensor([ids])
            prefix, feed, target = ids[:, :args.prefix], ids[:, args.prefix:-1], ids[0, args.prefix + 1:]
            keys, values = raw_cache(lm, prefix)
            keys, values = keys.to(torch.bfloat16).float(), values.to(torch.bfloat16).float()
            ref = continuation_logprobs(lm.model, keys, values, feed)
            for name, stage in (("full decode", reference_errors), ("sketch", sketched)):
                kvtc_codec.vector_errors, chosen[:] = stage, []
                t0 = time.perf_counter()
                rec = chunk_path(art, ratio, keys, values, transform=transform)
                t = tally[name]
                t["s"] += time.perf_counter() - t0
                lp = continuation_logprobs(lm.model, rec.keys, rec.values, feed)
                t["nll"] += float((ref.gather(1, target[:, None]) - lp.gather(1, target[:, None])).sum())
                t["kl"] += float((ref.exp() * (ref - lp)).sum())
                t["tokens"] += len(target)
                t["bytes"] += rec.stored_bytes
                t["k"] += float((rec.keys - keys).norm() / keys.norm()) / len(seqs)
                t["v"] += float((rec.values - values).norm() / values.norm()) / len(seqs)
                t["found"].append([set(c) for c in chosen])
        full, sk = tally["full decode"]["found"], tally["sketch"]["found"]
        both = sum(len(a & b) for fa, fb in zip(full, sk) for a, b in zip(fa, fb))
        for name, t in tally.items():
            n = sum(len(c) for seq in t["found"] for c in seq)
            rows.append((ratio, name, math.exp(t["nll"] / t["tokens"]), t["kl"] / t["tokens"], t["k"], t["v"],
                         t["bytes"], n, both, t["s"]))
        kvtc_codec.vector_errors = sketched
    print(f"{args.sequences} x {args.prefix}-token prefixes of {args.corpus}, {args.continuation} scored tokens each, "
          f"chunk path as served, {args.threads} thread(s)")
    print("| CR | selection | ppl ratio | KL | K rel. err | V rel. err | stored bytes | outlier vectors | "
          "selected by both | chunk path s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]:g} | {r[1]} | {r[2]:.4f} | {r[3]:.5f} | {r[4]:.4f} | {r[5]:.4f} | {r[6]:,} | {r[7]:,} | "
              f"{r[8]:,} | {r[9]:.1f} |")
    with open("/proc/loadavg") as f:
        print(f"load after: {f.read().split()[:3]}")


if __name__ == "__main__":
    main()
