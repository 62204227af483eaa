"""What per-rank bases cost: TP N (one basis per rank's KV heads) against TP 1 (one cross-head basis)
on the embedded SmolLM2 (3 KV heads: TP 3 gives each head its own basis), at the same ratios, in one run.

    python bench/tp_cost.py [--tokens 20480] [--tp 3] [--ratios 8,16,32] [--sequences 4] [--seqs-per-shard 4]

Both artifacts come from the same corpus shards, settings and held-out shards (the same seed); each
is calibrated in this process (the job's in-process mode). Printed per ratio, side by side:
held-out relative error of keys and values (the calibration's held-out rows, positions [4, T - 128),
whole p-vector, keys RoPE-removed; the ECSQ mode, the codec's default, and below the fixed-rate
mode), and from `kvtc eval` on the same held-out sequences: perplexity ratio and KL against the
uncompressed cache, the codec's stored bytes per middle token (both streams). Then each rank's codec
(`KVTCCodec.from_registry(..., rank=r)`) round-trips its own heads of a held-out cache and must
match the whole-cache codec on those heads. --root keeps (and on a rerun reuses) the artifacts.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def calibrate(tp: int, args: argparse.Namespace, root: str) -> dict:
    """{ratio: (keys, values) held-out relative error} of the TP `tp` artifact, calibrated here unless
    `root` already holds it (a rerun with --root reuses what an earlier run published)."""
    from kvtc import artifacts
    from kvtc.pipeline.job.calibrate import run
    from kvtc.pipeline.settings import JobSettings

    registry = os.path.join(root, "registry")
    try:
        art = artifacts.pull(f"smollm2-tp{tp}@latest", registry=registry)
    except Exception:
        cfg = JobSettings.of(tokens=args.tokens, ratios=args.ratios, tp=tp, name=f"smollm2-tp{tp}", eval_corpus=None,
                             seqs_per_shard=args.seqs_per_shard, tokens_curve_points=0, registry=registry,
                             store=os.path.join(root, "store"), heldout_rows=args.heldout_rows)
        t0 = time.perf_counter()
        summary = run(cfg, in_process=True)
        print(f"TP {tp}: calibrated in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        art = artifacts.pull(f"smollm2-tp{tp}@{summary['version']}", registry=registry)
    rows = {(m["ratio"], m["stream"], m["metric"]): m["value"] for m in art.metrics()
            if m["group"] is None and m["split"] == "heldout"}
    return {(r, mode): (rows[(r, "keys", metric)], rows[(r, "values", metric)]) for r in args.ratios
            for mode, metric in (("ecsq", "ecsq_rel_error"), ("fixed", "rel_error"))}


def quality(tp: int, args: argparse.Namespace, root: str) -> dict:
    from kvtc.pipeline.operations import quality as q

    settings = q.EvalSettings(ratios=args.ratios, continuation=args.continuation, sequences=args.sequences,
                              baselines=())
    t0 = time.perf_counter()
    result = q.run(f"smollm2-tp{tp}", os.path.join(root, "registry"), settings)
    print(f"TP {tp}: evaluated in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return {row["ratio"]: row for row in result["rows"] if row["ratio"] is not None}


def rank_round_trip(tp: int, args: argparse.Namespace, root: str) -> float:
    """Max abs difference between each rank's codec on its heads and the whole-cache codec."""
    import torch

    from kvtc import artifacts
    from kvtc.kernels import KVTCCodec
    from kvtc.pipeline.operations.quality import heldout_sequences
    from kvtc.workers.capture import raw_cache
    from kvtc.workers.models import load_model

    registry = os.path.join(root, "registry")
    art = artifacts.pull(f"smollm2-tp{tp}@latest", registry=registry)
    lm = load_model("smollm2-135m")
    seq = heldout_sequences(art, lm.tokenizer, None, 1, lm.max_positions)[0]
    keys, values = raw_cache(lm, torch.as_tensor(seq[:512]).reshape(1, -1))
    ratio = args.ratios[len(args.ratios) // 2]
    whole = KVTCCodec(art, ratio).decode(KVTCCodec(art, ratio).encode(keys, values))
    worst = 0.0
    for rank in range(tp):
        codec = KVTCCodec.from_registry(f"smollm2-tp{tp}@latest", ratio, registry=registry, rank=rank)
        h0, h1 = codec.spec.heads
        k, v = codec.decode(codec.encode(keys[:, h0:h1].contiguous(), values[:, h0:h1].contiguous()))
        worst = max(worst, float((k - whole[0][:, h0:h1]).abs().max()), float((v - whole[1][:, h0:h1]).abs().max()))
    return worst


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=20480)
    ap.add_argument("--tp", type=int, default=3)
    ap.add_argument("--ratios", default="8,16,32")
    ap.add_argument("--sequences", type=int, default=4)
    ap.add_argument("--continuation", type=int, default=64)
    ap.add_argument("--heldout-rows", type=int, default=8192)
    ap.add_argument("--seqs-per-shard", type=int, default=4, help="20 sequences of 1024: 4 training shards, 1 held out")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--root", default=None, help="registry and store go here (default: a temp dir, removed after)")
    args = ap.parse_args(argv)
    args.ratios = tuple(float(r) for r in args.ratios.split(","))

    import torch

    torch.set_num_threads(args.threads)
    root = args.root or tempfile.mkdtemp(prefix="kvtc-tp-")
    try:
        errors = {tp: calibrate(tp, args, root) for tp in (1, args.tp)}
        evals = {tp: quality(tp, args, root) for tp in (1, args.tp)}
        diff = rank_round_trip(args.tp, args, root)
    finally:
        if not args.root:
            shutil.rmtree(root, ignore_errors=True)
    n = args.tp
    print(f"\nSmolLM2-135M, {args.tokens} calibration tokens, held-out rows; eval: {args.sequences} held-out "
          f"sequences x {args.continuation} tokens scored\n")
    print(f"| CR | keys TP 1 | keys TP {n} | values TP 1 | values TP {n} | ppl ratio TP 1 | ppl ratio TP {n} "
          f"| KL TP 1 | KL TP {n} | bytes/token TP 1 | bytes/token TP {n} |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in args.ratios:
        (k1, v1), (kn, vn) = errors[1][(r, "ecsq")], errors[n][(r, "ecsq")]
        e1, en = evals[1][r], evals[n][r]
        print(f"| {r:g} | {100 * k1:.2f}% | {100 * kn:.2f}% | {100 * v1:.2f}% | {100 * vn:.2f}% "
              f"| {e1['ppl_ratio']:.4f} | {en['ppl_ratio']:.4f} | {e1['kl']:.4f} | {en['kl']:.4f} "
              f"| {e1['bytes_per_token']:.0f} | {en['bytes_per_token']:.0f} |")
    print("\nfixed-rate mode (DP allocation), held-out relative error keys / values: " + "; ".join(
        f"CR {r:g}: TP 1 {100 * errors[1][(r, 'fixed')][0]:.2f}% / {100 * errors[1][(r, 'fixed')][1]:.2f}%, "
        f"TP {n} {100 * errors[n][(r, 'fixed')][0]:.2f}% / {100 * errors[n][(r, 'fixed')][1]:.2f}%" for r in args.ratios))
    print(f"\nrank codecs (TP {n}) against the whole-cache codec on their heads: max abs difference {diff:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
