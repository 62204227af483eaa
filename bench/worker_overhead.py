"""Worker overhead: tokens/s of the usual forward pass against forward + KV capture + statistics.

Same tokens for every variant (Python's own documentation prose, tokenized), one warm-up batch,
then one timed run over --sequences sequences in batches of --batch; the variants take turns on
each batch so load drift on a shared machine hits them alike.

    python bench/worker_overhead.py [--model smollm2-135m] [--seq-len 1024] [--sequences 4]
"""
from __future__ import annotations

import argparse
import time
from typing import Callable

import torch


def _tokens(tokenizer, n: int, seq_len: int) -> torch.Tensor:
    """(n, seq_len) ids cut from pydoc topics text (repeated if short)."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    ids = tokenizer(text)["input_ids"]
    need = n * seq_len
    ids = (ids * (need // len(ids) + 1))[:need]
    return torch.tensor(ids, dtype=torch.int64).reshape(n, seq_len)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed(variants: dict[str, Callable[[torch.Tensor], None]], batches: list[torch.Tensor],
           device: torch.device) -> dict[str, float]:
    """Seconds per variant; variants take turns on each batch so load drift hits them alike."""
    for fn in variants.values():
        fn(batches[0][:1, : min(256, batches[0].shape[1])])  # warm-up (allocations, kernels)
    total = dict.fromkeys(variants, 0.0)
    for b in batches:
        for name, fn in variants.items():
            _sync(device)
            t0 = time.perf_counter()
            fn(b)
            _sync(device)
            total[name] += time.perf_counter() - t0
    return total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--sequences", type=int, default=4)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--groups", default="model")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch default)")
    args = ap.parse_args(argv)

    from kvtc.workers.capture import CaptureSettings, capture_kv, check_seq_len
    from kvtc.workers.models import load_model
    from kvtc.workers.stats import CalibrationStats

    if args.threads:
        torch.set_num_threads(args.threads)
    lm = load_model(args.model, dtype=args.dtype, device=args.device)
    settings = CaptureSettings(sinks=args.sinks, window=args.window, groups=args.groups, objective="mse")
    check_seq_len(lm, args.seq_len, settings)
    ids = _tokens(lm.tokenizer, args.sequences, args.seq_len).to(lm.device)
    batches = list(ids.split(args.batch))
    stats = CalibrationStats.new(lm.fingerprint, settings)
    scratch = CalibrationStats.new(lm.fingerprint, settings)

    def forward(b: torch.Tensor) -> None:
        with torch.inference_mode():
            lm.model(b)

    def base_forward(b: torch.Tensor) -> None:
        with torch.inference_mode():
            lm.base(input_ids=b, use_cache=True)

    last: list = [None]

    def capture_only(b: torch.Tensor) -> None:
        last[0] = capture_kv(lm, b, settings)

    def update_only(b: torch.Tensor) -> None:
        with torch.inference_mode():
            scratch.update(last[0])

    def capture_stats(b: torch.Tensor) -> None:
        captured = capture_kv(lm, b, settings)
        with torch.inference_mode():
            stats.update(captured)

    variants = {"forward": forward, "base": base_forward, "capture": capture_only, "update": update_only,
                "stats": capture_stats}
    times = _timed(variants, batches, lm.device)
    t_fwd, t_base, t_capture, t_cap = times["forward"], times["base"], times["capture"], times["stats"]
    n_tok = ids.numel()
    print(f"model {args.model} on {lm.device} {str(lm.dtype).replace('torch.', '')}, threads {torch.get_num_threads()}, "
          f"{args.sequences} x {args.seq_len} tokens, batch {args.batch}, groups {args.groups}, "
          f"rows/seq {settings.eligible(args.seq_len)}, p {sum(stats.dims)}")
    print(f"forward (with logits):        {n_tok / t_fwd:10.1f} tok/s  ({t_fwd:.3f} s)")
    print(f"base-model forward (no head): {n_tok / t_base:10.1f} tok/s  ({t_base:.3f} s)")
    print(f"base forward + capture:       {n_tok / t_capture:10.1f} tok/s  ({t_capture:.3f} s)")
    print(f"base fwd + capture + stats:   {n_tok / t_cap:10.1f} tok/s  ({t_cap:.3f} s)")
    t_stats = times["update"]
    print(f"ratio (base forward + capture + stats) / (forward with logits) = {t_cap / t_fwd:.3f}")
    print(f"statistics update alone (timed on its own): {t_stats:.3f} s = {t_stats / t_fwd * 100:.1f}% of the forward with logits, "
          f"{t_stats / t_base * 100:.1f}% of the base-model forward")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
