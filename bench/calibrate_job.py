"""Pipeline figures on the embedded model, one run, printed side by side:

1. bare forward tokens/s (the model's usual forward, all cores, in-process) — the baseline;
2. the whole default job (`kvtc calibrate` with no options): wall time, pipeline tokens/s, ratio
   to (1), held-out errors at CR 16 against the reference table of KVTC.md section 7;
3. scaling: 1 worker vs 2 workers (one thread each) on the same shards, tokens/s, and the bytes
   of statistics stored and moved per shard.

    python bench/calibrate_job.py                 # everything (~15-20 min on 2 cores)
    python bench/calibrate_job.py --skip-default  # baseline + scaling only
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvtc.pipeline.settings import JobSettings  # noqa: E402
from kvtc.pipeline.job.calibrate import run  # noqa: E402
from kvtc.pipeline.job.shards import make_shards  # noqa: E402
from kvtc.workers.models import load_model  # noqa: E402

REFERENCE_CR16 = {"keys": 0.093, "values": 0.248}


def bare_forward_tokens_per_s(seqs: int, seq_len: int) -> float:
    torch.set_num_threads(os.cpu_count() or 1)
    lm = load_model("smollm2-135m")
    shards = make_shards("pydoc", lm.tokenizer, seq_len=seq_len, seqs_per_shard=1, max_tokens=(seqs + 1) * seq_len)
    ids = [torch.from_numpy(s.input_ids) for s in shards][:seqs]
    with torch.inference_mode():
        lm.model(ids[0])  # warm-up
        t0 = time.perf_counter()
        for x in ids:
            lm.model(x)
        dt = time.perf_counter() - t0
    return len(ids) * seq_len / dt


def scaling(tokens: int) -> dict:
    out = {}
    for workers in (1, 2):
        with tempfile.TemporaryDirectory() as tmp:
            cfg = JobSettings.of(tokens=tokens, eval_corpus=None, workers=workers, threads_per_worker=1, seqs_per_shard=2,
                                  tokens_curve_points=0,
                                  registry=f"{tmp}/reg", store=f"{tmp}/store", name="bench-scaling")
            summary = run(cfg)
            out[workers] = summary["run"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-default", action="store_true")
    ap.add_argument("--skip-scaling", action="store_true")
    ap.add_argument("--scaling-tokens", type=int, default=8 * 1024)
    args = ap.parse_args()

    bare = bare_forward_tokens_per_s(seqs=4, seq_len=1024)
    print(f"bare forward (SmolLM2, seq 1024, {os.cpu_count()} threads): {bare:.0f} tok/s")
    results = {"bare_forward_tok_s": bare}

    if not args.skip_default:
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            summary = run(JobSettings.of(registry=f"{tmp}/reg", store=f"{tmp}/store"))
            wall = time.perf_counter() - t0
        r = summary["run"]
        cr16 = next(row for row in summary["ratios"] if row["ratio"] == 16.0)
        print(f"default job: wall {wall:.0f} s, {r['tokens_run']} tokens, pool {r['pool_tokens_per_s']} tok/s "
              f"= {r['pool_tokens_per_s'] / bare:.2f}x bare forward (goal >= 0.8)")
        for stream in ("keys", "values"):
            e = cr16[stream]["fixed"]["rel_error"]  # the reference figures are fixed-rate
            print(f"  CR 16 {stream}: held-out rel. error {100 * e:.2f}% (reference {100 * REFERENCE_CR16[stream]:.1f}%,"
                  f" ratio {e / REFERENCE_CR16[stream]:.2f}); cross-domain {100 * cr16[stream].get('eval_rel_error', float('nan')):.2f}%")
        for row in summary["ratios"]:
            print(f"  CR {row['ratio']:g} {row['mode']}: keys {100 * row['keys']['rel_error']:.2f}%  values "
                  f"{100 * row['values']['rel_error']:.2f}%  (fixed-rate keys {100 * row['keys']['fixed']['rel_error']:.2f}%, "
                  f"values {100 * row['values']['fixed']['rel_error']:.2f}%)")
        results["default"] = {"wall_s": wall, "summary": summary}

    if args.skip_scaling:
        print(json.dumps(results, default=str)[:2000])
        return
    sc = scaling(args.scaling_tokens)
    one, two = sc[1]["pool_tokens_per_s"], sc[2]["pool_tokens_per_s"]
    print(f"scaling ({args.scaling_tokens} tokens): 1 worker {one} tok/s, 2 workers {two} tok/s, speed-up {two / one:.2f}x")
    print(f"statistics per shard: {sc[1]['stats_bytes_per_shard'] / 2**20:.1f} MiB stored and read once by the reducer "
          "(only a small dict of plain values crosses Ray)")
    results["scaling"] = sc
    print(json.dumps(results, default=str)[:2000])


if __name__ == "__main__":
    main()
