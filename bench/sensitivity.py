"""The model's KL sensitivity per layer: the Fisher information of each layer's cached keys and values
(kvtc.workers.sensitivity), measured on a few calibration sequences, printed and charted.

    python bench/sensitivity.py [--model SPEC] [--sequences 4] [--seq-len 1024] [--out DIR]

Prints, per coded layer, the trace of the keys' and values' Fisher information per coded position (summed
over KV heads) and its ratio to the mean layer's, the scale the `sensitivity` balance gives a layer before the
metric's own shape; writes DIR/kl_sensitivity.json and DIR/kl_sensitivity.png.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--corpus", default="pydoc")
    ap.add_argument("--sequences", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--out", default="bench/figures")
    args = ap.parse_args()

    from tqdm import tqdm

    from kvtc.pipeline.job.corpus import iter_documents
    from kvtc.workers.models import load_model
    from kvtc.workers.sensitivity import kl_sensitivity

    lm = load_model(args.model)
    text = "\n\n".join(doc.text for doc in iter_documents(args.corpus))
    ids = lm.tokenizer(text, return_tensors="pt").input_ids[0]
    starts = np.linspace(0, len(ids) - args.seq_len - 1, args.sequences).astype(int)
    sums: dict[str, np.ndarray] = {}
    t0 = time.perf_counter()
    for s in tqdm(starts, desc="sensitivity", unit="seq"):
        for name, t in kl_sensitivity(lm, ids[s:s + args.seq_len][None], args.sinks, args.window).items():
            sums[name] = sums.get(name, 0) + t.numpy()
    seconds = time.perf_counter() - t0
    positions = args.sequences * (args.seq_len - args.sinks - args.window)
    keys = sums["sensitivity_keys"].sum(axis=(1, 2)) / positions
    values = np.einsum("lhii->l", sums["sensitivity_values"]) / positions
    print(f"{args.sequences} x {args.seq_len} tokens, {seconds:.1f} s ({seconds / args.sequences:.1f} s per sequence)")
    print("layer | keys tr F | x mean | values tr F | x mean")
    for layer, (k, v) in enumerate(zip(keys, values)):
        print(f"{layer:5d} | {k:.3g} | {k / keys.mean():.2f} | {v:.3g} | {v / values.mean():.2f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kl_sensitivity.json").write_text(json.dumps({
        "model": args.model, "corpus": args.corpus, "sequences": args.sequences, "seq_len": args.seq_len,
        "seconds": seconds, "keys_trace": keys.tolist(), "values_trace": values.tolist()}, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    layers = np.arange(len(keys))
    ax.semilogy(layers, values / values.mean(), "o-", label="values")
    ax.semilogy(layers, keys / keys.mean(), "s--", label="keys")
    ax.axhline(1.0, color="grey", lw=0.5)
    ax.set_xlabel("layer")
    ax.set_ylabel("Fisher trace / mean layer's")
    ax.set_title(f"{args.model}: KL felt per unit of cache error, by layer ({args.sequences} x {args.seq_len} tokens)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "kl_sensitivity.png", dpi=120)
    print(f"wrote {out / 'kl_sensitivity.json'} and {out / 'kl_sensitivity.png'}")


if __name__ == "__main__":
    main()
