"""Model quality with compressed caches on the embedded model, against baselines at real bytes.

Needs a calibrated SmolLM2 artifact, e.g.
    kvtc calibrate --tokens 16384 --registry REG --store STORE --name smollm2-135m
    python bench/quality.py --registry REG --store STORE --out report-dir
Prints the quality table (held-out documentation prose, the calibration's held-out shards), the
gap to the Gaussian bound, and, with --store, the error-by-calibration-tokens curve; --out also
writes the charts and report.md. Goals (KVTC issue): at CR 16, perplexity within 2% of the
uncompressed cache; at equal bytes the codec beats every baseline on perplexity and KL at 8, 16, 32.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--registry", default=os.environ.get("KVTC_REGISTRY", "registry"))
    ap.add_argument("--name", default="smollm2-135m")
    ap.add_argument("--store", default=None, help="the calibration's shard store, for the error-by-tokens curve")
    ap.add_argument("--corpus", default=None, help="default: the calibration's held-out shards")
    ap.add_argument("--ratios", default="8,16,32")
    ap.add_argument("--sequences", type=int, default=4)
    ap.add_argument("--continuation", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="write charts, report.md and quality.json here")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from kvtc import artifacts
    from kvtc.pipeline.job.error_by_tokens import error_by_tokens
    from kvtc.pipeline.operations import quality
    from kvtc.pipeline.evaluation import report

    ratios = tuple(float(r) for r in args.ratios.split(","))
    t0 = time.perf_counter()
    settings = quality.EvalSettings(ratios=ratios, continuation=args.continuation, sequences=args.sequences)
    result = quality.run(args.name, args.registry, settings, args.corpus,
                          progress=lambda m: print(f"  {m} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr))
    print(f"{result['artifact']} on {result['corpus']}: {result['settings']['sequences']} sequences, "
          f"{args.continuation} tokens scored each, eval {time.perf_counter() - t0:.0f} s\n")
    print(report.quality_table(result["rows"]), "\n")
    print(report.limit_table(result["limit"]), "\n")

    art = artifacts.pull(f"{args.name}@latest", registry=args.registry)
    curves = {name: art.curve(name) for name in art.curves()}
    if args.store and "error_by_tokens" not in curves:
        from kvtc.pipeline.job.heldout_store import load_rows
        from kvtc.pipeline.operations.recalibrate import heldout_store

        m, rec = art.manifest, artifacts.CalibrationRecord.from_manifest(art.manifest)
        store = heldout_store(m, args.store)
        corpus = m["corpus"]
        held = load_rows(store, corpus["heldout_shards"], rec.heldout_rows_cap)
        evals = load_rows(store, corpus["eval_shards"], rec.heldout_rows_cap) if corpus["eval_shards"] else None
        ratio = ratios[len(ratios) // 2]
        k = max(art.allocation_info(ratio, s)["kept"] for s in ("keys", "values"))
        t1 = time.perf_counter()
        curves["error_by_tokens"] = error_by_tokens(store, corpus["accumulators"], held, evals, ratio, rec.sinks,
                                                    rec.window, points=3, k=k)
        print(f"error by calibration tokens at CR {ratio:g} ({time.perf_counter() - t1:.0f} s):")
        for r in curves["error_by_tokens"]:
            print(f"  {r['tokens']:>7} rows  {r['stream']:<6} {r['split']:<7} {100 * r['rel_error']:.2f}%")
    if args.out:
        files = report.build(art.metrics(), curves, art.allocations(), art.manifest["calibration"],
                             art.manifest["model"], f"KVTC report: {art.name}@{art.version}", result)
        files["quality.json"] = json.dumps(result, indent=2, sort_keys=True).encode()
        for rel, data in files.items():
            os.makedirs(os.path.dirname(os.path.join(args.out, rel)) or ".", exist_ok=True)
            with open(os.path.join(args.out, rel), "wb") as f:
                f.write(data)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
