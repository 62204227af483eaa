"""Multi-head latent attention end to end, on small random models with DeepSeek V3's cache widths.

Per architecture (DeepSeek V3 with q_lora_rank and interleaved RoPE weights, DeepSeek V3 without either,
MiniCPM3), a random model of LAYERS layers with kv_lora_rank 512 and qk_rope_head_dim 64 (the cache of
DeepSeek V2/V3, Kimi K2: 576 values per token and layer) and a hidden size of HIDDEN (above 512, so that
the latent is not confined to a subspace of the hidden size), saved to a temporary directory and calibrated
with one basis per stream over its layers (per-layer groups leave a RoPE-key stream of 64 values per
layer, too few bits at CR 32: 32 < the 34-bit cheapest block; the job refuses it before model work):

- the RoPE round trip of the rope stream (max over layers of |f_model(remove(k_rot)) - k_rot| / max |k_rot|,
  f_model the model's own rotary function);
- held-out relative error per stream (latent, rope key) at CR 8/16/32 in both modes, as the calibration
  measured it;
- `kvtc eval` at each ratio and mode: latent-space errors, errors after up-projection (per-head keys
  [W_UK c ; k_rot] and values W_UV c, kvtc.workers.mla), perplexity ratio, and bytes per coded token
  against the raw latent cache in bf16 (2 x 576 bytes per layer) and fp8 (576).

Random weights: the spectra are not a trained model's, so the errors say what the codec does with this
geometry, not what DeepSeek V3 will see.

    python bench/mla.py [--archs deepseek_v3,deepseek_v3_plain,minicpm3] [--layers 4] [--hidden 1024]
                        [--tokens 8192] [--seq-len 256]
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from kvtc import artifacts
from kvtc.workers.models import embedded_tokenizer, load_model
from kvtc.workers.rope_check import rope_round_trip
from kvtc.workers.tiny import MLA_ARCHS, Geometry, tiny_config

RATIOS = (8.0, 16.0, 32.0)


def save_model(arch: str, layers: int, hidden: int, directory: Path) -> None:
    """A random model of `arch` with DeepSeek V3's cache widths (latent 512, RoPE key 64), saved with the
    embedded tokenizer."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch, Geometry(layers, 512, 64))
    config.update(dict(hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=8, num_key_value_heads=8,
                       qk_nope_head_dim=64, v_head_dim=64))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(directory)
    embedded_tokenizer().save_pretrained(directory)


def calibrate(model: str, name: str, root: str, tokens: int, seq_len: int) -> dict:
    from kvtc.pipeline.job.calibrate import calibrate_local
    from kvtc.pipeline.settings import JobSettings

    cfg = JobSettings.of(model=model, corpus="pydoc", eval_corpus=None, seq_len=seq_len, window=16, sinks=4,
                         tokens=tokens, seqs_per_shard=4, heldout_rows=2048, ratios=RATIOS, accumulators=1,
                         tokens_curve_points=1, name=name, registry=f"{root}/reg",
                         store=f"{root}/store")
    return calibrate_local(cfg)[0]


def heldout(art) -> dict[tuple[float, str, str], float]:
    """{(ratio, stream, mode): held-out relative error over the stream} as the calibration measured it."""
    out = {}
    for m in art.metrics():
        if m["split"] == "heldout" and m["group"] is None and m["metric"] in ("rel_error", "ecsq_rel_error"):
            out[(float(m["ratio"]), m["stream"], "ecsq" if m["metric"] == "ecsq_rel_error" else "fixed")] = float(m["value"])
    return out


def evaluate(name: str, registry: str, mode: str) -> list[dict]:
    from kvtc.pipeline.operations import quality

    settings = quality.EvalSettings(ratios=RATIOS, continuation=16, sequences=2, baselines=("fp8",), mode=mode)
    return quality.run(name, registry, settings)["rows"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--archs", default=",".join(MLA_ARCHS))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--seq-len", type=int, default=256)
    args = ap.parse_args()
    raw_bf16, raw_fp8 = args.layers * 576 * 2, args.layers * 576
    for arch in args.archs.split(","):
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as root:
            directory = Path(root) / arch
            save_model(arch, args.layers, args.hidden, directory)
            lm = load_model(str(directory), device="cpu")
            ids = torch.randint(3, 2000, (1, 256), generator=torch.Generator().manual_seed(0))
            rope = max(rope_round_trip(lm, ids).values())
            del lm
            summary = calibrate(str(directory), arch.replace("_", "-"), root, args.tokens, args.seq_len)
            art = artifacts.pull(f"{summary['name']}@latest", registry=summary["registry"])
            held = heldout(art)
            rows = {mode: {r["method"]: r for r in evaluate(summary["name"], summary["registry"], mode)}
                    for mode in ("fixed", "ecsq")}
        print(f"\n### {arch}: {args.layers} layers, latent 512 + RoPE key 64, hidden {args.hidden} "
              f"({time.perf_counter() - t0:.0f} s)\n")
        print(f"RoPE round trip of the rope stream (max over layers): {rope:.1e}\n")
        print("| CR | mode | held-out latent | held-out rope key | eval latent | eval rope key | keys after W_UK "
              "| values after W_UV | ppl ratio | bytes / token (coded middle) | vs bf16 latent | vs fp8 latent |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for ratio in RATIOS:
            for mode in ("fixed", "ecsq"):
                r = rows[mode][f"kvtc-{ratio:g}x"]
                print(f"| {ratio:g} | {mode} | {held.get((ratio, 'keys', mode), float('nan')):.2%} | "
                      f"{held.get((ratio, 'values', mode), float('nan')):.2%} | {r['key_rel_error']:.2%} | "
                      f"{r['value_rel_error']:.2%} | {r['key_up_error']:.2%} | {r['value_up_error']:.2%} | "
                      f"{r['ppl_ratio']:.4f} | {r['bytes_per_token']:.0f} | {raw_bf16 / r['bytes_per_token']:.1f}x | "
                      f"{raw_fp8 / r['bytes_per_token']:.1f}x |")
        fp8 = rows["ecsq"]["fp8-e4m3"]
        print(f"| - | fp8 cast | | | {fp8['key_rel_error']:.2%} | {fp8['value_rel_error']:.2%} | "
              f"{fp8['key_up_error']:.2%} | {fp8['value_up_error']:.2%} | {fp8['ppl_ratio']:.4f} | "
              f"{fp8['bytes_per_token']:.0f} | {raw_bf16 / fp8['bytes_per_token']:.1f}x | 1.0x |", flush=True)


if __name__ == "__main__":
    main()
