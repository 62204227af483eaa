"""Where a served path's KL comes from, when the model copies from far back and on fresh text.

    python bench/copy_attribution.py --registry REG --artifact smollm2-135m@latest --ratio 16 --prefix 7936 \
        --sequences 4 [--heads] [--out DIR]

For `--sequences` fresh `stdlib` sequences and as many `repeat:stdlib` ones (a passage followed by itself: every
scored token repeats one the prefix holds half a prefix back, bench/served_quality.py), the prefix cache goes through
the chunk path as served, then the scored continuation's KL against the raw cache is measured with only a part of
the cache coded (the rest raw):

- every coded entry (the path as served), only the keys, only the values;
- by position: the copied source (the prefix positions the continuation repeats, 16 either side), the last 1,024
  positions but the source, everything else;
- by layer (and with --heads, by layer and KV head): only that layer's keys and values coded.

Each part's KL and its share of the whole (parts are not exactly additive: KL is not linear in the error) for both
texts, printed and charted per layer (DIR/copy_attribution.png, DIR/copy_attribution.json).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def parts(P: int, n: int, layers: int, heads: int, by_head: bool) -> dict[str, dict]:
    """name -> which entries are coded: {"stream": "kv" | "k" | "v", "pos": (a, b) or None, "layer", "head"}."""
    half = (P + n + 1) // 2 + 1  # bench/served_quality.sequences: the second copy starts `half` tokens after the first
    src = max(0, P - half - 16), min(P, P - half + n + 16)
    out = {"all": {}, "keys": {"stream": "k"}, "values": {"stream": "v"}, "source": {"pos": src},
           "last 1024": {"pos": (P - 1024, P), "except": [src]}, "rest": {"pos": None, "except": [src, (P - 1024, P)]}}
    for layer in range(layers):
        out[f"L{layer}"] = {"layer": layer}
        if by_head:
            for h in range(heads):
                out[f"L{layer}h{h}"] = {"layer": layer, "head": h}
    return out


def coded_as(keys, values, k, v, part: dict):
    """The raw cache with the part's entries replaced by the decoded ones."""
    if not part:
        return k, v
    kk, vv = keys.clone(), values.clone()
    layer = slice(None) if "layer" not in part else slice(part["layer"], part["layer"] + 1)
    head = slice(None) if "head" not in part else slice(part["head"], part["head"] + 1)
    stream = part.get("stream", "kv")
    spans = [part["pos"]] if part.get("pos") else [(0, keys.shape[2])]
    for a, b in spans:
        for src, dst, s in ((k, kk, "k"), (v, vv, "v")):
            if s in stream:
                dst[layer, head, a:b] = src[layer, head, a:b]
    for a, b in part.get("except", []):  # back to raw
        kk[:, :, a:b], vv[:, :, a:b] = keys[:, :, a:b], values[:, :, a:b]
    return kk, vv


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--registry", required=True)
    ap.add_argument("--artifact", default="smollm2-135m@latest")
    ap.add_argument("--ratio", type=float, default=16.0)
    ap.add_argument("--prefix", type=int, default=7936, help="prefix tokens, a multiple of 256")
    ap.add_argument("--sequences", type=int, default=4, help="per text (fresh, copy)")
    ap.add_argument("--continuation", type=int, default=64)
    ap.add_argument("--corpus", default="stdlib")
    ap.add_argument("--heads", action="store_true", help="also each (layer, KV head) alone")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.prefix % 256 or a.prefix < 2048:
        raise SystemExit(f"--prefix must be a multiple of 256 and at least 2048, got {a.prefix}")

    import torch
    from served_quality import sequences
    from tqdm import tqdm

    from kvtc.artifacts import pull
    from kvtc.kernels.codec.chunk_serde import ChunkTransform
    from kvtc.kernels.codec.kvtc_codec import KVTCCodec
    from kvtc.pipeline.evaluation.model_quality import continuation_logprobs
    from kvtc.pipeline.evaluation.served import restore_through
    from kvtc.workers.capture import raw_cache
    from kvtc.workers.models import load_model

    art = pull(a.artifact, registry=a.registry)
    lm = load_model(art.manifest["model"]["spec"], device="cpu")
    served = ChunkTransform(KVTCCodec(art, a.ratio), positions=True)
    P, n, t0 = a.prefix, a.continuation, time.perf_counter()
    kl: dict[str, dict[str, list[float]]] = {}
    texts = (("fresh", a.corpus), ("copy", f"repeat:{a.corpus}"))
    bar = tqdm(total=2 * a.sequences, desc="sequences", unit="seq")
    for text, corpus in texts:
        for ids in sequences(lm, corpus, a.sequences, P + n + 1):
            seq = torch.tensor([ids])
            keys, values = (x.to(torch.bfloat16) for x in raw_cache(lm, seq[:, :P]))
            feed = seq[:, P:P + n]
            ref = continuation_logprobs(lm.model, keys.float(), values.float(), feed)
            k, v, _ = restore_through(served, keys, values)
            for name, part in parts(P, n, keys.shape[0], keys.shape[1], a.heads).items():
                kk, vv = coded_as(keys, values, k, v, part)
                lp = continuation_logprobs(lm.model, kk.float(), vv.float(), feed)
                kl.setdefault(text, {}).setdefault(name, []).append(float((ref.exp() * (ref - lp)).sum()) / n)
            bar.update()
    bar.close()
    mean = {t: {name: sum(x) / len(x) for name, x in d.items()} for t, d in kl.items()}
    print(f"{a.artifact} CR {a.ratio:g}, prefix {P}, {a.sequences} sequences per text x {n} scored tokens, "
          f"{time.perf_counter() - t0:.0f} s\n\n{'coded part':12} {'fresh KL':>9} {'share':>6} {'copy KL':>9} {'share':>6}")
    for name in mean["fresh"]:
        f, c = mean["fresh"][name], mean["copy"][name]
        print(f"{name:12} {f:9.4f} {f / mean['fresh']['all']:6.2f} {c:9.4f} {c / mean['copy']['all']:6.2f}")
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "copy_attribution.json").write_text(json.dumps({"artifact": a.artifact, "ratio": a.ratio, "prefix": P,
                                                               "sequences": a.sequences, "kl": kl}, indent=1))
        chart(mean, out / "copy_attribution.png", f"{a.artifact} CR {a.ratio:g}, {P}-token prefix")


def chart(mean: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    layers = [name for name in mean["fresh"] if name[1:].isdigit()]
    x = np.arange(len(layers))
    fig, ax = plt.subplots(figsize=(10, 3.5))
    for i, text in enumerate(("fresh", "copy")):
        ax.bar(x + (i - 0.5) * 0.4, [mean[text][name] for name in layers], 0.4, label=f"{text} (all coded: "
               f"{mean[text]['all']:.4f})")
    ax.set_xticks(x, [name[1:] for name in layers])
    ax.set_xlabel("layer coded alone (the rest raw)")
    ax.set_ylabel("KL per scored token")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
