"""Basis memory and what a basis budget costs, in one run:

1. the basis the runtime holds at each ratio (ECSQ mode: kept columns plus the mean, both streams),
   for the artifact's model and for an 8B geometry (Llama-3.1-8B: p = 32768 per stream, 8.03B
   parameters; its kept share is assumed equal to the artifact's, no 8B model is run), in bytes at
   fp16/bf16 and as a share of the parameter count, uncapped and capped at p/4, p/8, p/16;
2. the held-out error cost (dB, 20 log10 of the relative-error ratio) of those caps, per stream, from
   the artifact's `basis_size` curve (the calibration's held-out rows);
3. the cost of holding the basis in bf16/fp16 instead of float32, through the codec on held-out text
   (relative difference of the decoded caches, and their errors).

    python bench/basis_budget.py --artifact NAME@REF --registry URI
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kvtc.kernels import KVTCCodec  # noqa: E402
from kvtc.pipeline.evaluation.basis_size import cost_db  # noqa: E402

P_8B, PARAMS_8B = 32768, 8.03e9


def memory(art, ratios, params: int) -> None:
    p = {s: art.basis(s)[0].shape[0] for s in ("keys", "values")}
    print(f"model: {art.manifest['model']['spec']}, {params / 1e6:.1f}M parameters, p = {p['keys']} per stream")
    for ratio in ratios:
        kept = {s: art.ecsq(ratio, s)["kept"] for s in p}
        elems = sum(p[s] * (kept[s] + 1) for s in p)
        share = {s: kept[s] / p[s] for s in p}
        e8 = sum(P_8B * (round(share[s] * P_8B) + 1) for s in p)
        line = (f"CR {ratio:g}: kept keys {kept['keys']}, values {kept['values']}: {2 * elems / 1e6:.1f} MB fp16 "
                f"({elems / params:.1%} of parameters; float32 {4 * elems / 1e6:.1f} MB) | 8B geometry at the same kept "
                f"share: {2 * e8 / 1e9:.2f} GB fp16 ({e8 / PARAMS_8B:.1%})")
        print(line)
    for div in (4, 8, 16):
        elems = sum(p[s] * (p[s] // div + 1) for s in p)
        e8 = 2 * P_8B * (P_8B // div + 1)
        print(f"cap p/{div}: {2 * elems / 1e6:.1f} MB fp16 ({elems / params:.1%} of parameters) | 8B geometry: "
              f"{2 * e8 / 1e9:.2f} GB fp16 ({e8 / PARAMS_8B:.1%} of 8.03B)")


def costs(art, ratios) -> None:
    rows = art.curve("basis_size")
    p = art.basis("keys")[0].shape[0]
    for ratio in ratios:
        parts = []
        for div in (4, 8, 16):
            cap = max(1, p // div)
            k, v = (cost_db(rows, s, ratio, cap) for s in ("keys", "values"))
            parts.append(f"p/{div} ({cap}): keys {k:+.2f} dB, values {v:+.2f} dB")
        free = {s: next(r["components"] for r in rows if r["stream"] == s and r["ratio"] == ratio and r["cap"] == 0)
                for s in ("keys", "values")}
        print(f"cost CR {ratio:g} (uncapped keeps {free['keys']}/{free['values']}): " + "; ".join(parts))


def dtype_cost(art, ratios, caches) -> None:
    for ratio in ratios:
        ref = KVTCCodec(art, ratio, mode="ecsq", basis_dtype=torch.float32)
        out = []
        for dt in (torch.bfloat16, torch.float16):
            half = KVTCCodec(art, ratio, mode="ecsq", basis_dtype=dt)
            num = den = err32 = errh = 0.0
            for keys, values in caches:
                blob = ref.encode(keys, values)
                a, b = ref.decode(blob), half.decode(blob)
                for x, y, z in zip((keys, values), a, b):
                    num += float((y.float() - z.float()).square().sum())
                    den += float(x.float().square().sum())
                    err32 += float((x.float() - y.float()).square().sum())
                    errh += float((x.float() - z.float()).square().sum())
            out.append(f"{str(dt).split('.')[1]} basis (decode): {100 * (num / den) ** 0.5:.3f}% relative difference "
                       f"from float32, error {100 * (errh / den) ** 0.5:.2f}% vs {100 * (err32 / den) ** 0.5:.2f}%")
        print(f"dtype CR {ratio:g}: " + "; ".join(out))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--artifact", required=True)
    ap.add_argument("--registry", default=None)
    ap.add_argument("--ratios", default="8,16,32")
    ap.add_argument("--sequences", type=int, default=1)
    args = ap.parse_args()
    from kvtc.artifacts import pull
    from kvtc.pipeline.fit.basis_budget import model_parameters
    from kvtc.workers.models import load_spec

    art = pull(args.artifact, registry=args.registry)
    ratios = [float(r) for r in args.ratios.split(",")]
    params = model_parameters(load_spec(art.manifest["model"]["spec"]).config)
    memory(art, ratios, params)
    costs(art, ratios)
    from rans import held_out_caches

    dtype_cost(art, ratios, held_out_caches(art, args.sequences, 1024))
    return 0


if __name__ == "__main__":
    sys.exit(main())
