"""Models whose layers differ, end to end, on tiny random models built from real transformers configs.

Per architecture: the RoPE round trip per layer kind (max over layers of |f_model(remove(K)) - K| / max|K|,
f_model = the model's own rotary function; "nope" = layers without RoPE, checked to be unrotated), the
held-out relative error per group at CR 16 in both codec modes (as the calibration measured it: fixed-rate
and ECSQ), and whether calibration, both codec modes on the model's own per-layer cache, KVTCCache.generate
and `kvtc eval` completed.

    python bench/architectures.py [--archs gemma3,gpt_oss,...] [--tokens 4096] [--seq-len 128]
"""
from __future__ import annotations

import argparse
import tempfile
import time
import traceback

import torch
from transformers import DynamicCache

from kvtc import artifacts
from kvtc.kernels import KVTCCache, KVTCCodec
from kvtc.kernels.integrations.kvtc_cache import cache_layers, compress_cache, restore_cache
from kvtc.workers.models import load_model
from kvtc.workers.rope_check import rope_round_trip
from kvtc.workers.tiny import MIXED_ARCHS


def rope_by_kind(lm) -> dict[str, float]:
    ids = torch.randint(3, 2000, (1, 256), generator=torch.Generator().manual_seed(0))
    out: dict[str, float] = {}
    for layer, err in rope_round_trip(lm, ids).items():
        kind = lm.layers[layer].kind if lm.layers[layer].rope is not None else "nope"
        out[kind] = max(out.get(kind, 0.0), err)
    return out


def calibrate(arch: str, root: str, tokens: int, seq_len: int) -> dict:
    from kvtc.pipeline.job.calibrate import calibrate_local
    from kvtc.pipeline.settings import JobSettings

    cfg = JobSettings.of(model=f"tiny:{arch}", corpus="pydoc", eval_corpus=None, seq_len=seq_len, window=16, sinks=4,
                         tokens=tokens, seqs_per_shard=4, heldout_rows=2048, ratios=(8.0, 16.0), accumulators=2,
                         tokens_curve_points=1, name=arch.replace("_", "-"), registry=f"{root}/reg", store=f"{root}/store")
    return calibrate_local(cfg)[0]


def group_errors(art, ratio: float = 16.0) -> list[dict]:
    rows = {}
    for m in art.metrics():
        if m["split"] == "heldout" and m["group"] is not None and float(m["ratio"]) == ratio \
                and m["metric"] in ("rel_error", "ecsq_rel_error"):
            rows.setdefault(int(m["group"]), {})[(m["stream"], m["metric"])] = float(m["value"])
    return [{"group": art.groups()[g].label, **{f"{s}-{'ecsq' if 'ecsq' in k else 'fixed'}": v for (s, k), v in r.items()}}
            for g, r in sorted(rows.items())]


def runtime_checks(lm, art, registry: str, name: str) -> dict:
    """Codec round trip (both modes) of the model's own per-layer cache, KVTCCache.generate, kvtc eval."""
    from kvtc.pipeline.operations import quality

    ids = torch.randint(3, 2000, (1, 96), generator=torch.Generator().manual_seed(1))
    cache = DynamicCache(config=lm.model.config)
    with torch.no_grad():
        lm.model(ids, past_key_values=cache, use_cache=True)
    keys, _ = cache_layers(cache)
    out = {}
    for mode in ("fixed", "ecsq"):
        codec = KVTCCodec(art, 16.0, mode=mode)
        blob = compress_cache(codec, cache)
        k2, _ = cache_layers(restore_cache(codec, blob, config=lm.model.config))
        assert [None if k is None else k.shape for k in k2] == [None if k is None else k.shape for k in keys]
        num = sum(float((a - b).square().sum()) for a, b in zip(keys, k2) if a is not None)
        den = sum(float(a.square().sum()) for a in keys if a is not None)
        out[f"cache-{mode}"] = (num / den) ** 0.5
        kv = KVTCCache(codec, config=lm.model.config, chunk=8)
        gen = lm.model.generate(ids, past_key_values=kv, max_new_tokens=16, min_new_tokens=16, do_sample=False)
        assert gen.shape[1] == ids.shape[1] + 16
    result = quality.run(name, registry, quality.EvalSettings(ratios=(16.0,), continuation=16, sequences=2,
                                                               baselines=("evict",)))
    rows = {r["method"]: r for r in result["rows"]}
    out["eval-ppl-ratio"] = rows["kvtc-16x"]["ppl_ratio"]
    out["eval-evict-ppl-ratio"] = rows["evict-16x"]["ppl_ratio"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--archs", default=",".join(("llama",) + MIXED_ARCHS))
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=128)
    args = ap.parse_args()
    table = []
    for arch in args.archs.split(","):
        t0, row = time.perf_counter(), {"arch": arch, "completed": "no"}
        try:
            lm = load_model(f"tiny:{arch}", device="cpu")
            row["kinds"] = "/".join(sorted({l.kind for l in lm.layers}))
            row["rope"] = rope_by_kind(lm)
            with tempfile.TemporaryDirectory() as root:
                summary = calibrate(arch, root, args.tokens, args.seq_len)
                art = artifacts.pull(f"{summary['name']}@latest", registry=summary["registry"])
                row["groups"] = group_errors(art)
                row.update(runtime_checks(lm, art, summary["registry"], summary["name"]))
            row["completed"] = "yes"
        except Exception as exc:  # a bench reports what failed and goes on
            row["error"] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        row["seconds"] = round(time.perf_counter() - t0, 1)
        table.append(row)
        print(row, flush=True)
    print("\n| arch | layer kinds | RoPE round trip (max per kind) | group | keys fixed | keys ECSQ | values fixed "
          "| values ECSQ | cache err 16x fixed / ECSQ | eval ppl ratio 16x (evict) | completed |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in table:
        rope = ", ".join(f"{k} {v:.1e}" for k, v in sorted(r.get("rope", {}).items()))
        for i, g in enumerate(r.get("groups") or [{}]):
            first = i == 0
            cache = f"{r.get('cache-fixed', float('nan')):.3f} / {r.get('cache-ecsq', float('nan')):.3f}" if first else ""
            nan = float("nan")
            ev = f"{r.get('eval-ppl-ratio', nan):.3f} ({r.get('eval-evict-ppl-ratio', nan):.3f})" if first else ""
            print(f"| {r['arch'] if first else ''} | {r.get('kinds', '') if first else ''} | {rope if first else ''} | "
                  f"{g.get('group', '-')} | {g.get('keys-fixed', float('nan')):.3f} | {g.get('keys-ecsq', float('nan')):.3f} | "
                  f"{g.get('values-fixed', float('nan')):.3f} | {g.get('values-ecsq', float('nan')):.3f} | {cache} | {ev} | "
                  f"{r['completed'] if first else ''} |")


if __name__ == "__main__":
    main()
