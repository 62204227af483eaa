"""KVTCCache against DynamicCache and QuantizedCache (quanto int2 / int4) on the embedded model.

Needs a calibrated SmolLM2 artifact and the bench extra (`pip install -e '.[bench]'`, optimum-quanto):
    kvtc calibrate --tokens 24576 --registry REG --name smollm2-135m
    python bench/hf_cache.py --registry REG --artifact smollm2-135m@latest

For each cache: greedy generation of --new-tokens after a --prompt-tokens prompt (tokens/s, greedy
agreement with DynamicCache: identical tokens at the same position, and the first divergence),
resident cache bytes after it (summed over the tensors the cache holds, shared storage counted
once), and, on a fresh cache, the prompt's held-out continuation (--eval-tokens) scored in one
forward: perplexity ratio, KL and top-1 agreement against DynamicCache. Text: a corpus the
artifact was not calibrated on (default `stdlib`). Goal: at each KVTC ratio fewer resident bytes
than quanto int4 and better agreement than quanto int2.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def held_bytes(obj, seen: set[int] | None = None, depth: int = 0) -> int:
    """Bytes of every tensor reachable from obj's attributes (subclass tensors through their inner
    tensors), each storage counted once, plus the payload of bytes objects (KVTCCache's ECSQ chunks)."""
    import torch

    seen = set() if seen is None else seen
    if depth > 8:
        return 0
    if isinstance(obj, torch.Tensor):
        if type(obj) is not torch.Tensor and hasattr(obj, "__tensor_flatten__"):
            names, _ = obj.__tensor_flatten__()
            return sum(held_bytes(getattr(obj, n), seen, depth + 1) for n in names)
        storage = obj.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() == 0:
            return 0
        seen.add(storage.data_ptr())
        return storage.nbytes()
    if isinstance(obj, (bytes, bytearray)):
        return len(obj)
    if isinstance(obj, (list, tuple)):
        return sum(held_bytes(x, seen, depth + 1) for x in obj)
    if isinstance(obj, dict):
        return sum(held_bytes(x, seen, depth + 1) for x in obj.values())
    if hasattr(obj, "__dict__") and not isinstance(obj, type):
        return sum(held_bytes(v, seen, depth + 1) for k, v in vars(obj).items() if k not in ("store", "codec"))
    return 0


def cache_bytes(cache) -> int:
    """Resident bytes of a transformers cache: its layers, plus KVTCCache's coded chunks."""
    seen: set[int] = set()
    total = sum(held_bytes(layer, seen) for layer in cache.layers)
    store = getattr(cache, "store", None)
    if store is not None:
        total += held_bytes(store.chunks, seen)
    return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--registry", default=os.environ.get("KVTC_REGISTRY", "registry"))
    ap.add_argument("--artifact", default="smollm2-135m@latest")
    ap.add_argument("--ratios", default="8,16,32")
    ap.add_argument("--quanto", default="2,4", help="QuantizedCache quanto bit widths ('' to skip)")
    ap.add_argument("--corpus", default="stdlib")
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--eval-tokens", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=64, help="KVTCCache tokens coded together")
    ap.add_argument("--window", type=int, default=None, help="KVTCCache recent window (default: the artifact's)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import torch
    from transformers import DynamicCache, QuantizedCache

    from kvtc import artifacts
    from kvtc.kernels import KVTCCache, KVTCCodec
    from kvtc.pipeline.job.corpus import iter_documents
    from kvtc.workers.models import load_model

    torch.set_num_threads(args.threads)
    lm = load_model(device="cpu")
    model, config = lm.model, lm.model.config
    need = args.prompt_tokens + max(args.eval_tokens, 1)
    ids: list[int] = []
    for doc in iter_documents(args.corpus):
        ids += lm.tokenizer(doc.text).input_ids
        if len(ids) >= need:
            break
    ids_t = torch.tensor([ids[:need]])
    prompt, cont = ids_t[:, :args.prompt_tokens], ids_t[:, args.prompt_tokens:]
    art = artifacts.pull(args.artifact, registry=args.registry)

    makers = {"DynamicCache": lambda: DynamicCache(config=config)}
    for r in (float(x) for x in args.ratios.split(",") if x):
        codec = KVTCCodec(art, r)
        makers[f"KVTC CR {r:g}"] = lambda codec=codec: KVTCCache(codec, config=config, chunk=args.chunk,
                                                                 window=args.window)
    for bits in (int(x) for x in args.quanto.split(",") if x):
        makers[f"quanto int{bits}"] = lambda bits=bits: QuantizedCache("quanto", config, nbits=bits,
                                                                       residual_length=128, q_group_size=64)
    window = art.manifest["calibration"]["window"] if args.window is None else args.window
    print(f"{art.name}@{art.version} (sinks {art.manifest['calibration']['sinks']}, KVTCCache window {window}, "
          f"chunk {args.chunk}), quanto residual 128, model dtype {lm.dtype}, {args.threads} threads, corpus "
          f"{args.corpus}: prompt {args.prompt_tokens}, generate {args.new_tokens}, score {cont.shape[1]}\n",
          flush=True)

    rows, ref = [], {}
    for name, make in makers.items():
        cache = make()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt), cache=cache,
                                 max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
                                 pad_token_id=lm.tokenizer.eos_token_id)
        seconds = time.perf_counter() - t0
        gen = out[0, args.prompt_tokens:].tolist()
        nbytes = cache_bytes(cache)
        if hasattr(cache, "resident_bytes"):
            assert nbytes == cache.resident_bytes(), (nbytes, cache.resident_bytes())
        cache = make()
        with torch.no_grad():
            model(prompt, cache=cache, use_cache=True)
            logits = model(cont, cache=cache, use_cache=True).logits[0, :-1].float()
        logp = torch.log_softmax(logits, -1)
        nll = -logp.gather(1, cont[0, 1:, None]).mean().item()
        if name == "DynamicCache":
            ref = {"gen": gen, "logp": logp, "nll": nll, "bytes": nbytes}
        same = sum(a == b for a, b in zip(gen, ref["gen"]))
        first = next((i for i, (a, b) in enumerate(zip(gen, ref["gen"])) if a != b), len(gen))
        kl = float((ref["logp"].exp() * (ref["logp"] - logp)).sum(-1).mean())
        top1 = float((logp.argmax(-1) == ref["logp"].argmax(-1)).float().mean())
        row = {"cache": name, "bytes": nbytes, "vs_dynamic": ref["bytes"] / nbytes, "tok_s": args.new_tokens / seconds,
               "agree": same / len(gen), "first_diff": first, "ppl_ratio": float(torch.tensor(nll - ref["nll"]).exp()),
               "kl": kl, "top1": top1}
        rows.append(row)
        print(f"{name:<13} {nbytes / 2**20:8.2f} MiB ({row['vs_dynamic']:5.1f}x smaller)  {row['tok_s']:6.2f} tok/s  "
              f"greedy agree {100 * row['agree']:5.1f}% (first diff {first:>3})  ppl x{row['ppl_ratio']:.4f}  "
              f"KL {kl:.4f}  top-1 {100 * top1:5.1f}%", flush=True)

    print("\n| cache | resident bytes | vs DynamicCache | tokens/s | greedy agreement (first diff) | perplexity ratio "
          "| KL | top-1 vs DynamicCache |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['cache']} | {r['bytes'] / 2**20:.2f} MiB | {r['vs_dynamic']:.1f}x | {r['tok_s']:.2f} | "
              f"{100 * r['agree']:.1f}% ({r['first_diff']}) | {r['ppl_ratio']:.4f} | {r['kl']:.4f} | {100 * r['top1']:.1f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
