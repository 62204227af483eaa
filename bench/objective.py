"""`--objective mse` against `--objective attention`, side by side: perplexity ratio, KL and the held-out
errors in both metrics (the cache's own squared error and the attention's), per CR, on domains the
calibration did not see; and what the extra statistics cost (model-work seconds, store bytes).

    # calibrate both (fresh stores; same settings otherwise), then evaluate them
    python bench/objective.py --calibrate "--tokens 81920" --root runs/objective --domains stdlib,licenses=DIR
    # or evaluate artifacts already published
    python bench/objective.py --registry REG --names mse=NAME1,attention=NAME2 --domains stdlib,DIR

--domains: corpus specs (`kvtc eval --corpus`), each optionally labelled LABEL=SPEC. Scoring is `kvtc eval`'s:
each sequence's prefix is compressed and restored, the last --continuation tokens are scored on it.
Writes objective.json and objective.png (perplexity ratio against CR per domain) under --out.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = Path(sys.executable).parent
OBJECTIVES = ("mse", "attention")


def calibrate(objective: str, extra: list[str], root: Path, name: str) -> dict:
    cmd = [str(BIN / "python"), "-m", "kvtc.pipeline.cli", "calibrate", "--objective", objective,
           "--registry", str(root / "reg"), "--store", str(root / f"store-{objective}"), "--name", name, "--json", *extra]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"kvtc calibrate --objective {objective} failed:\n{out.stderr[-3000:]}")
    summary = json.loads(out.stdout)
    summary["outer_wall_s"] = time.perf_counter() - t0
    return summary


def cost_row(objective: str, summary: dict) -> dict:
    run = summary.get("run", {})
    return {"objective": objective, "model_work_s": run.get("stages", {}).get("fold"),
            "capture_s": run.get("capture_seconds"), "store_bytes": run.get("stats_bytes"),
            "reduce_s": run.get("stages", {}).get("reduce"), "wall_s": run.get("wall_seconds")}


def capture_cost(model: str, sequences: int, seq_len: int) -> list[dict]:
    """Model work of the shard worker's fold (capture + statistics update) per sequence, mse against attention,
    interleaved on the same sequences (ABBA, so load drift and order cancel), and the statistics' bytes of each."""
    import numpy as np
    import torch

    from kvtc.pipeline.job.shards import make_shards
    from kvtc.workers.capture import CaptureSettings, capture_kv
    from kvtc.workers.models import load_model
    from kvtc.workers.stats import CalibrationStats

    lm = load_model(model)
    shard = next(iter(make_shards("pydoc", lm.tokenizer, seq_len=seq_len, seqs_per_shard=sequences, seed=0,
                                  holdout_fraction=0.0, min_holdout_shards=0, max_seq_len=lm.max_positions)))
    seqs = [torch.from_numpy(np.ascontiguousarray(s[None])) for s in shard.input_ids[:sequences]]
    out = {}
    for objective in OBJECTIVES:  # warm-up, and the statistics' sizes
        settings = CaptureSettings(objective=objective)
        stats = CalibrationStats.new(lm.fingerprint, settings)
        stats.update(capture_kv(lm, seqs[0], settings))
        out[objective] = {"objective": objective, "seconds": 0.0, "stats_bytes": len(stats.to_bytes())}
    for i, seq in enumerate(seqs):
        for objective in OBJECTIVES if i % 2 == 0 else OBJECTIVES[::-1]:  # ABBA: the order's effect cancels
            settings = CaptureSettings(objective=objective)
            stats = CalibrationStats.new(lm.fingerprint, settings)
            t0 = time.perf_counter()
            stats.update(capture_kv(lm, seq, settings))
            out[objective]["seconds"] += time.perf_counter() - t0
    for row in out.values():
        row["seconds_per_sequence"] = row.pop("seconds") / len(seqs)
    return list(out.values())


def evaluate(names: dict[str, str], registry: str, domains: dict[str, str], args) -> list[dict]:
    from kvtc.pipeline.operations import quality

    ratios = tuple(float(r) for r in args.ratios.split(","))
    settings = quality.EvalSettings(ratios=ratios, continuation=args.continuation, sequences=args.sequences,
                                    baselines=(), mode=args.mode, served=not args.offline_only)
    rows = []
    for label, spec in domains.items():
        for objective, name in names.items():
            t0 = time.perf_counter()
            result = quality.run(f"{name}@latest", registry, settings, spec)
            for r in result["rows"]:
                if r["ratio"] is None:
                    continue
                path = "chunk" if str(r.get("method", "")).startswith("kvtc-chunk") else "offline"
                rows.append({"domain": label, "objective": objective, "path": path, "ratio": r["ratio"], "cr": r["cr"],
                             "ppl_ratio": r["ppl_ratio"], "kl": r["kl"], "key_mse": r["key_rel_error"],
                             "value_mse": r["value_rel_error"], "key_attn": r.get("key_attn_error"),
                             "value_attn": r.get("value_attn_error"), "sequences": r["sequences"]})
            print(f"  {label} {objective}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return rows


def table(rows: list[dict]) -> str:
    head = ("| domain | CR | objective | path | stored CR | ppl ratio | KL | keys err (mse / attn) | values err (mse / attn) |\n"
            "|---|---|---|---|---|---|---|---|---|")
    lines, order = [head], list(dict.fromkeys(r["objective"] for r in rows))  # labels in the order given
    for r in sorted(rows, key=lambda r: (r["domain"], r["ratio"], r.get("path", "offline") != "offline",
                                         order.index(r["objective"]))):
        lines.append(f"| {r['domain']} | {r['ratio']:g} | {r['objective']} | {r.get('path', 'offline')} | {r['cr']:.1f} | {r['ppl_ratio']:.4f} | "
                     f"{r['kl']:.4f} | {100 * r['key_mse']:.1f}% / {100 * (r['key_attn'] or 0):.1f}% | "
                     f"{100 * r['value_mse']:.1f}% / {100 * (r['value_attn'] or 0):.1f}% |")
    return "\n".join(lines)


def chart(rows: list[dict]) -> bytes:
    """Per domain, perplexity ratio and KL against CR, one line per objective, the offline codec's rows."""
    from kvtc.pipeline.evaluation.charts import figure, png

    domains = sorted({r["domain"] for r in rows})
    objectives = [o for o in dict.fromkeys(r["objective"] for r in rows)]
    plt, fig, axes = figure(2 * len(domains))
    for i, domain in enumerate(domains):
        for ax, key, label in ((axes[2 * i], "ppl_ratio", "perplexity ratio (compressed / uncompressed)"),
                               (axes[2 * i + 1], "kl", "KL(uncompressed || compressed), nats/token")):
            for objective, style in zip(objectives, ("o-", "s--", "^:", "d-.")):
                pts = sorted((r["ratio"], r[key]) for r in rows if r["domain"] == domain and r["objective"] == objective
                             and r.get("path", "offline") == "offline")
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=objective)
            if key == "ppl_ratio":
                for goal in (1.01, 1.02):
                    ax.axhline(goal, color="grey", lw=0.8, ls=":")
            ax.set_xscale("log", base=2)
            ax.set(xlabel="compression ratio", ylabel=label, title=f"unseen text: {domain}")
            ax.legend(fontsize=8)
    return png(plt, fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calibrate", default=None, help="run both calibrations with these extra `kvtc calibrate` args")
    ap.add_argument("--root", default="objective-runs", help="with --calibrate: stores and registry go here")
    ap.add_argument("--registry", default=None)
    ap.add_argument("--names", default=None, help="mse=NAME,attention=NAME of published artifacts")
    ap.add_argument("--costs", default=None, help="mse=SUMMARY.json,attention=SUMMARY.json: `kvtc calibrate --json` "
                                                  "summaries of those artifacts, for the cost table")
    ap.add_argument("--domains", default="stdlib")
    ap.add_argument("--ratios", default="8,16,32")
    ap.add_argument("--sequences", type=int, default=8)
    ap.add_argument("--continuation", type=int, default=128)
    ap.add_argument("--mode", default=None, choices=("ecsq", "fixed"))
    ap.add_argument("--offline-only", action="store_true", help="score the offline codec only, not the chunk path too")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--capture-cost", type=int, default=0, metavar="N",
                    help="also time the fold's model work on N sequences, mse vs attention, interleaved")
    ap.add_argument("--model", default="smollm2-135m", help="the model of --capture-cost")
    ap.add_argument("--seq-len", type=int, default=1024, help="the sequences of --capture-cost")
    ap.add_argument("--out", default=".")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    domains = dict(d.split("=", 1) if "=" in d else (Path(d).name or d, d) for d in args.domains.split(","))
    costs: list[dict] = []
    if args.calibrate is not None:
        root = Path(args.root)
        registry, names = str(root / "reg"), {o: f"objective-{o}" for o in OBJECTIVES}
        for objective in OBJECTIVES:
            summary = calibrate(objective, shlex.split(args.calibrate), root, names[objective])
            costs.append(cost_row(objective, summary))
    elif args.registry and args.names:
        registry, names = args.registry, dict(x.split("=", 1) for x in args.names.split(","))
        for x in (args.costs.split(",") if args.costs else []):
            objective, path = x.split("=", 1)
            costs.append(cost_row(objective, json.loads(Path(path).read_text())))
    elif not args.capture_cost:
        sys.exit("pass --calibrate ARGS, or --registry and --names mse=NAME,attention=NAME, or --capture-cost N")
    else:
        registry, names = "", {}
    rows = evaluate(names, registry, domains, args) if names else []
    if rows:
        print(table(rows))
    if costs:
        print("\n| objective | model work s | capture s | store bytes | reduce s | wall s |\n|---|---|---|---|---|---|")
        for c in costs:
            print(f"| {c['objective']} | {c['model_work_s']} | {c['capture_s']} | {c['store_bytes']:,} | {c['reduce_s']} | "
                  f"{c['wall_s']} |")
    capture = capture_cost(args.model, args.capture_cost, args.seq_len) if args.capture_cost else []
    if capture:
        base = capture[0]
        print(f"\nfold model work per {args.seq_len}-token sequence ({args.model}, {args.capture_cost} sequences, "
              "interleaved):\n| objective | s / sequence | ratio | statistics bytes | ratio |\n|---|---|---|---|---|")
        for c in capture:
            print(f"| {c['objective']} | {c['seconds_per_sequence']:.3f} | {c['seconds_per_sequence'] / base['seconds_per_sequence']:.3f} | "
                  f"{c['stats_bytes']:,} | {c['stats_bytes'] / base['stats_bytes']:.5f} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "objective.json").write_text(json.dumps({"rows": rows, "costs": costs, "capture": capture,
                                                    "domains": domains}, indent=2))
    if rows:
        (out / "objective.png").write_bytes(chart(rows))
    print(f"wrote {out / 'objective.json'} and {out / 'objective.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
