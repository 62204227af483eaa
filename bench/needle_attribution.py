"""Which stream loses far-back needles: needles in held-out windows asked through the raw cache, the chunk path at
each ratio, and the chunk path with only the keys or only the values coded, scored by exact match and by the
answer's negative log-likelihood (nats, summed over its tokens), paired with the raw cache's on the same needle.
`--layer-split R`: at ratio R, only one layer kind coded (full attention, sliding), the other raw.

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
from kvtc.kernels.codec.layers import cached_layers
from kvtc.pipeline.evaluation.model_quality import build_cache, prefix_state
from kvtc.pipeline.evaluation.needle_window import answers, plant
from kvtc.pipeline.evaluation.served import chunk_transform, restore_through
from kvtc.pipeline.job.heldout_text import heldout_tokens
from kvtc.pipeline.operations.quality import haystack_texts
from kvtc.pipeline.operations.quality import _artifact_model
from kvtc.workers.capture import raw_cache


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--registry", default="registry")
    ap.add_argument("--artifact", default="smollm2-135m@latest")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--windows", type=int, default=6)
    ap.add_argument("--needles", type=int, default=8)
    ap.add_argument("--ratios", default="16,32")
    ap.add_argument("--split", type=float, default=32.0, help="the ratio whose keys-only / values-only paths run "
                    "(0: none)")
    ap.add_argument("--layer-split", type=float, default=0.0, help="the ratio whose full-attention-only and "
                    "sliding-only paths run (models whose layers differ; 0: none): the other kind's layers stay raw")
    ap.add_argument("--also", default=None, help="other artifacts of the same model (comma-separated refs) whose chunk "
                    "paths at --ratios run on the same needles, to compare calibrations at equal stored bytes")
    ap.add_argument("--haystack", default=None, help="where the windows are cut from: another artifact's held-out text "
                    "(NAME@VERSION, the same model), or a corpus spec neither calibration saw (e.g. stdlib), to compare "
                    "two artifacts on the same needles (default: the artifact's own held-out text)")
    ap.add_argument("--json", default=None, help="write every needle's record here")
    args = ap.parse_args()
    art, lm = _artifact_model(args.artifact, args.registry, None, None)
    need = args.windows * args.length
    if args.haystack is None or "@" in args.haystack:
        source = art if args.haystack is None else artifacts.pull(args.haystack, registry=args.registry)
        held = heldout_tokens(source, lm.tokenizer, lm.max_positions, need)
    else:
        held = []
        for text in haystack_texts(args.haystack):
            held += lm.tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(held) >= need:
                break
    ratios = [float(r) for r in args.ratios.split(",")]
    transforms = {r: chunk_transform(KVTCCodec(art, r))
                  for r in sorted(set(ratios) | ({args.split, args.layer_split} - {0.0}))}
    coded = [lm.layers[i].kind for i in cached_layers(lm.layers)] if lm.layers else []  # each coded row's kind
    others = {f"{ref} CR {r:g}": chunk_transform(KVTCCodec(artifacts.pull(ref, registry=args.registry), r))
              for ref in (args.also.split(",") if args.also else ()) for r in ratios}
    records: list[dict] = []
    t0 = time.perf_counter()
    for w in range(min(args.windows, len(held) // args.length)):
        window = held[w * args.length:(w + 1) * args.length]
        planted = plant(lm.tokenizer, window, len(window), args.needles, seed=w)
        ids = torch.tensor([planted.ids], device=lm.device)
        keys, values = raw_cache(lm, ids)
        state = prefix_state(lm, ids, keys, values)  # Gemma 3's sliding layers: from the model's own cache
        keys, values = keys.float(), values.float()
        paths = {"raw": (keys, values)}
        for r, transform in transforms.items():
            k, v, _ = restore_through(transform, keys, values)
            if r in ratios:
                paths[f"CR {r:g}"] = (k, v)
            if r == args.split:
                paths[f"CR {r:g} keys coded"] = (k, values)
                paths[f"CR {r:g} values coded"] = (keys, v)
            for kind in sorted(set(coded)) if r == args.layer_split else ():
                rows = torch.tensor([c == kind for c in coded])[:, None, None, None]
                paths[f"CR {r:g} {kind} coded"] = (torch.where(rows, k, keys), torch.where(rows, v, values))
        for name, transform in others.items():
            paths[name] = restore_through(transform, keys, values)[:2]
        for name, (k, v) in paths.items():
            with torch.no_grad():
                got = answers(lm, lambda k=k, v=v: build_cache(lm.model, k, v, **state), planted, packed=not state)
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
    by = {(r["path"], r["window"], r["needle"]): r["nll"] for r in records}
    for name in others:
        base = f"CR {name.rsplit(' CR ', 1)[1]}"
        diff = [by[(name, w, i)] - by[(base, w, i)] for (p, w, i) in by if p == name]
        lo, hi = mean_interval(torch.tensor(diff), block=1)
        print(f"{name} against {args.artifact} {base}, paired: {sum(diff) / len(diff):+.3f} nats [{lo:+.3f}, {hi:+.3f}]")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(records, fh)


if __name__ == "__main__":
    main()
