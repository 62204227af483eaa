"""Served basis precision: does holding the basis in half precision (kernels/codec/held_basis.py) change the decoded
cache? The embedded model's bf16 prefix caches of held-out text go through the served chunk path
(pipeline/evaluation/served.py) with the artifact's float32 basis and with the basis held in float16 and bfloat16.
Per ratio: the codec's own error (float32 basis against the cache), the change half precision makes (half against
float32, both decoded, over the cache's norm), the continuation's perplexity ratio and KL per token against the
uncompressed cache, and the median time to serialize and deserialize one 256-token chunk.

    .venv/bin/python -P bench/basis_precision.py --registry ./registry --artifact smollm2-135m@latest --ratios 8,16,32
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from served_quality import sequences  # noqa: E402 - the bench folder's own helper

from kvtc import artifacts  # noqa: E402
from kvtc.kernels.codec.held_basis import served_codec  # noqa: E402
from kvtc.kernels.codec.kvtc_codec import KVTCCodec  # noqa: E402
from kvtc.pipeline.evaluation.model_quality import continuation_logprobs  # noqa: E402
from kvtc.pipeline.evaluation.served import CHUNK, chunk_transform, restore_through  # noqa: E402
from kvtc.workers.capture import raw_cache  # noqa: E402
from kvtc.workers.models import load_model  # noqa: E402

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def chunk_times(transform, keys: torch.Tensor, values: torch.Tensor) -> tuple[float, float]:
    """Median seconds to serialize and to deserialize one chunk of keys, values (L, H, T, D)."""
    L, H, T, D = keys.shape
    kv = torch.stack([x.to(torch.bfloat16).permute(0, 2, 1, 3).reshape(L, T, H * D) for x in (keys, values)])
    enc, dec = [], []
    for start in range(0, T, CHUNK):
        piece = kv[:, :, start:start + CHUNK].contiguous()
        t0 = time.perf_counter()
        data = transform.serialize(piece, start=start)
        t1 = time.perf_counter()
        transform.deserialize(data, torch.empty_like(piece), start=start)
        enc.append(t1 - t0)
        dec.append(time.perf_counter() - t1)
    return statistics.median(enc), statistics.median(dec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--registry", default="registry")
    ap.add_argument("--artifact", default="smollm2-135m@latest")
    ap.add_argument("--ratios", default="8,16,32")
    ap.add_argument("--corpus", default="stdlib")
    ap.add_argument("--sequences", type=int, default=2)
    ap.add_argument("--prefix", type=int, default=1024)
    ap.add_argument("--continuation", type=int, default=64)
    ap.add_argument("--dtypes", default="float32,float16,bfloat16")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    lm = load_model(device="cpu")
    P, n = args.prefix, args.continuation
    data = []
    for ids in sequences(lm, args.corpus, args.sequences, P + n + 1):
        seq = torch.tensor([ids])
        keys, values = (x.to(torch.bfloat16) for x in raw_cache(lm, seq[:, :P]))
        feed, target = seq[:, P:P + n], seq[0, P + 1:P + n + 1]
        ref_lp = continuation_logprobs(lm.model, keys.float(), values.float(), feed)
        data.append((keys, values, feed, target, ref_lp))
    art = artifacts.pull(args.artifact, registry=args.registry)
    print(f"{art.name}@{art.version}, {args.sequences} x {P} tokens of {args.corpus}, {n} scored; load "
          f"{open('/proc/loadavg').read().split()[0]}")
    print(f"{'CR':>3} {'basis':9} {'K err':>8} {'V err':>8} {'K vs f32':>9} {'V vs f32':>9} {'ppl ratio':>9} "
          f"{'KL':>8} {'enc ms':>7} {'dec ms':>7}")
    for ratio in [float(r) for r in args.ratios.split(",")]:
        base = KVTCCodec(art, ratio, basis_dtype=torch.float32)
        ref: list = []
        for name in args.dtypes.split(","):
            transform = chunk_transform(base if name == "float32" else
                                        served_codec(KVTCCodec(art, ratio), DTYPES[name]))
            sums = dict(k=0.0, v=0.0, kf=0.0, vf=0.0, kn=0.0, vn=0.0, nll=0.0, kl=0.0)
            times = []
            for i, (keys, values, feed, target, ref_lp) in enumerate(data):
                k, v, _ = restore_through(transform, keys, values)
                if name == "float32":
                    ref.append((k, v))
                for s, x, xh, x32 in (("k", keys, k, ref[i][0]), ("v", values, v, ref[i][1])):
                    sums[s] += float((xh - x.float()).pow(2).sum())
                    sums[s + "f"] += float((xh - x32).pow(2).sum())
                    sums[s + "n"] += float(x.float().pow(2).sum())
                lp = continuation_logprobs(lm.model, k, v, feed)
                sums["nll"] += float(-(lp.gather(1, target[:, None]).sum() - ref_lp.gather(1, target[:, None]).sum()))
                sums["kl"] += float((ref_lp.exp() * (ref_lp - lp)).sum())
                times.append(chunk_times(transform, keys, values))
            tokens = n * len(data)
            enc, dec = (statistics.median(t[j] for t in times) * 1e3 for j in (0, 1))
            print(f"{ratio:3g} {name:9} {math.sqrt(sums['k'] / sums['kn']):8.5f} {math.sqrt(sums['v'] / sums['vn']):8.5f} "
                  f"{math.sqrt(sums['kf'] / sums['kn']):9.2e} {math.sqrt(sums['vf'] / sums['vn']):9.2e} "
                  f"{math.exp(sums['nll'] / tokens):9.5f} {sums['kl'] / tokens:8.5f} {enc:7.1f} {dec:7.1f}", flush=True)


if __name__ == "__main__":
    main()
