"""Which stream loses far-back needles: needles in held-out windows asked through the raw cache, the chunk path at
each ratio, and the chunk path with only the keys or only the values coded, scored by exact match and by the
answer's negative log-likelihood (nats, summed over its tokens), paired with the raw cache's on the same needle.

    .venv/bin/python -P bench/needle_attribution.py --registry ./registry --artifact smollm2-135m@latest \
        --length 4096 --windows 6 --needles 8 --ratios 16,32 --split 32

Each window is `length` tokens of the artifact's held-out text (what its calibration never saw) with `needles`
RULER needles planted at depths (i + .5) / needles (kvtc.pipeline.evaluation.needle_window), prefilled once; the
chunk path is `kvtc lmcache-server`'s (256-token bf16 chunks at their positions). Prints per path: found, the mean
answer-NLL gap to the raw cache with its 95% interval (Student t over needles), and the gap by depth band.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from kvtc import artifacts
from kvtc.kernels.codec.kvtc_codec import KVTCCodec
from kvtc.pipeline.evaluation.metrics import mean_interval
from kvtc.pipeline.evaluation.model_quality import _forward, build_cache
from kvtc.pipeline.evaluation.needle_window import answers, plant
from kvtc.pipeline.evaluation.served import chunk_transform, restore_through
from kvtc.pipeline.job.heldout_text import heldout_tokens
from kvtc.pipeline.operations.quality import _artifact_model


def prefill(lm, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """ids -> the raw cache's keys, values (L, H, T, D) float32."""
    with torch.no_grad():
        _, cache = _forward(lm.model, torch.tensor([ids], dtype=torch.long, device=lm.device), None)
    keys = torch.stack([layer.keys[0] for layer in cache.layers]).float()
    values = torch.stack([layer.values[0] for layer in cache.layers]).float()
    return keys, values


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--registry", default="registry")
    ap.add_argument("--artifact", default="smollm2-135m@latest")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--windows", type=int, default=6)
    ap.add_argument("--needles", type=int, default=8)
    ap.add_argument("--ratios", default="16,32")
    ap.add_argument("--split", type=float, default=32.0, help="the ratio whose keys-only / values-only paths run")
    ap.add_argument("--haystack", default=None, help="another artifact (same model) whose held-out text the windows "
                    "are cut from, to compare two artifacts on the same needles (default: the artifact's own)")
    ap.add_argument("--json", default=None, help="write every needle's record here")
    args = ap.parse_args()
    art, lm = _artifact_model(args.artifact, args.registry, None, None)
    source = art if args.haystack is None else artifacts.pull(args.haystack, registry=args.registry)
    held = heldout_tokens(source, lm.tokenizer, lm.max_positions, args.windows * args.length)
    ratios = [float(r) for r in args.ratios.split(",")]
    transforms = {r: chunk_transform(KVTCCodec(art, r)) for r in sorted(set(ratios) | {args.split})}
    records: list[dict] = []
    t0 = time.perf_counter()
    for w in range(len(held) // args.length):
        window = held[w * args.length:(w + 1) * args.length]
        planted = plant(lm.tokenizer, window, len(window), args.needles, seed=w)
        keys, values = prefill(lm, list(planted.ids))
        paths = {"raw": (keys, values)}
        for r, transform in transforms.items():
            k, v, _ = restore_through(transform, keys, values)
            if r in ratios:
                paths[f"CR {r:g}"] = (k, v)
            if r == args.split:
                paths[f"CR {r:g} keys coded"] = (k, values)
                paths[f"CR {r:g} values coded"] = (keys, v)
        for name, (k, v) in paths.items():
            with torch.no_grad():
                got = answers(lm, lambda k=k, v=v: build_cache(lm.model, k, v), planted)
            for i, (found, nll) in enumerate(got):
                records.append({"window": w, "needle": i, "depth": planted.depths[i], "path": name,
                                "found": found, "nll": nll})
        print(f"window {w}: {time.perf_counter() - t0:.0f} s", flush=True)
    raw = {(r["window"], r["needle"]): r for r in records if r["path"] == "raw"}
    names = list(dict.fromkeys(r["path"] for r in records))
    print(f"\n{'path':22} {'found':>7} {'NLL gap (nats)':>16} {'95% interval':>18}   gap by depth <.34 / <.67 / rest")
    for name in names:
        rs = [r for r in records if r["path"] == name]
        gaps = [r["nll"] - raw[(r["window"], r["needle"])]["nll"] for r in rs]
        mean, (lo, hi) = sum(gaps) / len(gaps), mean_interval(torch.tensor(gaps), block=1)
        bands = []
        for a, b in ((0, 1 / 3), (1 / 3, 2 / 3), (2 / 3, 1.01)):
            g = [x for x, r in zip(gaps, rs) if a <= r["depth"] < b]
            bands.append(f"{sum(g) / len(g):+.3f}" if g else "-")
        print(f"{name:22} {sum(r['found'] for r in rs):>3}/{len(rs):<3} {mean:>+16.3f} [{lo:+.3f}, {hi:+.3f}]   "
              f"{' / '.join(bands)}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(records, fh)


if __name__ == "__main__":
    main()
