"""Rate-distortion of the two codec modes on one artifact and one held-out set, in one run.

    python bench/rd.py --artifact NAME@REF --registry URI [--sequences 4] [--corpus SPEC] [--out rd.png]

Per ratio (those with ECSQ tables, default 8/16/32) and stream, through the real codec on the
model's caches of held-out text: bytes per middle token and relative error of the fixed-rate
(baseline) and ECSQ modes; the Gaussian reverse water-filling bound on the calibration
eigenvalues (as the calibration recorded it) and on this held-out set's variances in the basis
(at the budget, and at the bytes ECSQ actually stored);
ECSQ's error at the fixed mode's bytes (dB gain) and the ratio gain at the fixed mode's error
(log-log interpolation between ECSQ points; '*' marks an extrapolation); the spread of ECSQ
bytes per token across sequences; encode and decode MB/s of both modes (fp16 cache bytes per
second, whole codec, CPU). Relative error: ||X - X_hat||_F / ||X||_F over the coded middle
tokens, whole p-vector (RoPE is a rotation, so keys' error is the same with or without it).
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvtc import artifacts  # noqa: E402
from kvtc.kernels import KVTCCodec, read_blob  # noqa: E402
from kvtc.kernels.codec.blob import TAG_RAW_HEAD, TAG_RAW_TAIL  # noqa: E402
from kvtc.pipeline.evaluation.metrics import waterfilling_distortion  # noqa: E402
from kvtc.pipeline.evaluation.rate_distortion import STREAMS  # noqa: E402


def stream_bytes(blob: bytes) -> dict[str, int]:
    """Stored bytes of the coded middle per stream (raw sinks and window left out)."""
    _, sections = read_blob(blob)
    out = {s: 0 for s in STREAMS}
    for s in sections:
        if s.key.tag not in (TAG_RAW_HEAD, TAG_RAW_TAIL):
            out[STREAMS[s.key.stream]] += len(s.stored)
    return out


def interpolate(xs: list[float], ys: list[float], x: float) -> tuple[float, bool]:
    """log-log interpolation of y(x) through points (sorted by x); (value, extrapolated)."""
    pts = sorted(zip(xs, ys))
    lx, ly = np.log([p[0] for p in pts]), np.log([p[1] for p in pts])
    i = int(np.clip(np.searchsorted(lx, math.log(x)), 1, len(pts) - 1))
    t = (math.log(x) - lx[i - 1]) / (lx[i] - lx[i - 1])
    return float(math.exp(ly[i - 1] + t * (ly[i] - ly[i - 1]))), not 0 <= t <= 1


def heldout_bound(art, codec: KVTCCodec, caches, bits: dict[str, float]) -> dict[str, float]:
    """Reverse water-filling on this held-out set's variances in the stored basis, at `bits` per token
    per stream (shared among groups in proportion to their features)."""
    out = {}
    for si, stream in enumerate(STREAMS):
        dist = norm = 0.0
        rows = []
        for keys, values in caches:
            x = (keys, values)[si].float()
            head, mid, _ = codec.split(x.shape[2], 0)
            pos = torch.arange(head, head + mid)
            x = x[:, :, head:head + mid]
            if stream == "keys" and codec.rope is not None:
                x = codec.rope.remove(x, pos)
            rows.append(x.permute(2, 0, 1, 3).reshape(mid, -1))
        flat = torch.cat(rows)
        for gi, group in enumerate(art.groups()):
            mean, _eig, comps = art.basis(stream, gi)
            xc = flat[:, group.columns(codec.spec.kv_heads, codec.spec.head_dim)] - torch.from_numpy(mean)
            z = xc @ torch.from_numpy(comps)
            var = z.double().square().mean(0).numpy()
            outside = float(xc.double().square().sum() - z.double().square().sum()) / flat.shape[0]
            budget = bits[stream] * mean.shape[0] / codec.spec.features
            dist += waterfilling_distortion(var, budget, max(outside, 0.0)) * flat.shape[0]
        norm = float(flat.double().square().sum())
        out[stream] = math.sqrt(dist / norm)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--artifact", required=True, help="NAME@REF")
    ap.add_argument("--registry", default=None)
    ap.add_argument("--sequences", type=int, default=4)
    ap.add_argument("--corpus", default=None, help="held-out text (default: the calibration's held-out shards)")
    ap.add_argument("--ratios", default=None, help="default: the artifact's ECSQ ratios")
    ap.add_argument("--out", default="rate_distortion_bench.png")
    args = ap.parse_args()

    from kvtc.pipeline.operations.quality import heldout_sequences
    from kvtc.workers.capture import raw_cache
    from kvtc.workers.models import load_model

    art = artifacts.pull(args.artifact, registry=args.registry)
    ratios = [float(r) for r in args.ratios.split(",")] if args.ratios else art.ecsq_ratios()
    if not ratios:
        sys.exit(f"{art.name}@{art.version} has no ECSQ tables: recalibrate it with this release")
    lm = load_model(art.manifest["model"]["spec"])
    seqs = heldout_sequences(art, lm.tokenizer, args.corpus, args.sequences, lm.max_positions)
    with torch.no_grad():
        caches = [raw_cache(lm, torch.as_tensor(s, dtype=torch.long).reshape(1, -1).to(lm.device)) for s in seqs]
    caches = [(k.float().cpu(), v.float().cpu()) for k, v in caches]
    fp16_bytes = sum(2 * 2 * k.numel() for k, _ in caches)
    metrics = art.metrics()

    def recorded(ratio: float, stream: str, metric: str) -> float:
        return next((m["value"] for m in metrics if m["metric"] == metric and m["group"] is None and
                     m["split"] == "heldout" and m["stream"] == stream and math.isclose(m["ratio"], ratio)), float("nan"))

    res: dict = {}
    fp = art.manifest["model"]
    p_stream = fp["num_layers"] * fp["num_kv_heads"] * fp["head_dim"]
    for ratio in ratios:
        for mode in ("fixed", "ecsq"):
            codec = KVTCCodec(art, ratio, mode=mode)
            enc, dec = 0.0, 0.0
            err = {s: 0.0 for s in STREAMS}
            norm = {s: 0.0 for s in STREAMS}
            nbytes = {s: 0 for s in STREAMS}
            per_seq = []
            mids = 0
            for keys, values in caches:
                t0 = time.perf_counter()
                blob = codec.encode(keys, values)
                t1 = time.perf_counter()
                kh, vh = codec.decode(blob)
                dec += time.perf_counter() - t1
                enc += t1 - t0
                head, mid, _ = codec.split(keys.shape[2], 0)
                mids += mid
                sb = stream_bytes(blob)
                per_seq.append(sum(sb.values()) / mid)
                for s, x, xh in (("keys", keys, kh), ("values", values, vh)):
                    d = (x[:, :, head:head + mid] - xh[:, :, head:head + mid].float()).double()
                    err[s] += float(d.square().sum())
                    norm[s] += float(x[:, :, head:head + mid].double().square().sum())
                    nbytes[s] += sb[s]
            res[(ratio, mode)] = {"bytes": {s: nbytes[s] / mids for s in STREAMS},
                                  "err": {s: math.sqrt(err[s] / norm[s]) for s in STREAMS},
                                  "enc_mbs": fp16_bytes / enc / 1e6, "dec_mbs": fp16_bytes / dec / 1e6,
                                  "spread": (float(np.mean(per_seq)), float(np.min(per_seq)), float(np.max(per_seq)),
                                             float(np.std(per_seq) / np.mean(per_seq)))}
        fixed_codec = KVTCCodec(art, ratio, mode="fixed")
        res[(ratio, "bound_heldout")] = heldout_bound(art, fixed_codec, caches, {s: 16 * p_stream / ratio for s in STREAMS})
        res[(ratio, "bound_ecsq")] = heldout_bound(art, fixed_codec, caches,
                                                   {s: 8 * res[(ratio, "ecsq")]["bytes"][s] for s in STREAMS})

    p = art.manifest["model"]["num_layers"] * art.manifest["model"]["num_kv_heads"] * art.manifest["model"]["head_dim"]
    print(f"{art.name}@{art.version}: {len(caches)} held-out sequences of {caches[0][0].shape[2]} tokens, "
          f"p = {p} per stream; bytes per middle token per stream (fp16: {2 * p})")
    print("| CR | stream | fixed B/tok | fixed err | ECSQ B/tok | ECSQ err | bound calib. | bound held-out | "
          "ECSQ gain at fixed bytes | ECSQ / held-out bound at ECSQ bytes | CR gain at fixed err |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for ratio in ratios:
        for s in STREAMS:
            f, e = res[(ratio, "fixed")], res[(ratio, "ecsq")]
            eb = [res[(r, "ecsq")]["bytes"][s] for r in ratios]
            ee = [res[(r, "ecsq")]["err"][s] for r in ratios]
            at_bytes, x1 = interpolate(eb, ee, f["bytes"][s]) if len(ratios) > 1 else (e["err"][s], True)
            at_err, x2 = interpolate(ee[::-1], eb[::-1], f["err"][s]) if len(ratios) > 1 else (e["bytes"][s], True)
            bound_h = res[(ratio, "bound_heldout")][s]
            print(f"| {ratio:g} | {s} | {f['bytes'][s]:.0f} | {100 * f['err'][s]:.2f}% | {e['bytes'][s]:.0f} | "
                  f"{100 * e['err'][s]:.2f}% | {100 * recorded(ratio, s, 'bound_rel_error'):.2f}% | {100 * bound_h:.2f}% | "
                  f"{20 * math.log10(f['err'][s] / at_bytes):.2f} dB{'*' if x1 else ''} | "
                  f"{20 * math.log10(e['err'][s] / res[(ratio, 'bound_ecsq')][s]):.2f} dB | {f['bytes'][s] / at_err:.2f}x{'*' if x2 else ''} |")
    print("\n| CR | mode | encode MB/s | decode MB/s | B/token mean | min | max | std/mean |")
    print("|---|---|---|---|---|---|---|---|")
    for ratio in ratios:
        for mode in ("fixed", "ecsq"):
            r = res[(ratio, mode)]
            m, lo, hi, cv = r["spread"]
            print(f"| {ratio:g} | {mode} | {r['enc_mbs']:.1f} | {r['dec_mbs']:.1f} | {m:.0f} | {lo:.0f} | {hi:.0f} | {cv:.3f} |")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, s in zip(axes, STREAMS):
        for mode, style in (("fixed", "o-"), ("ecsq", "s-")):
            pts = sorted((res[(r, mode)]["bytes"][s], res[(r, mode)]["err"][s]) for r in ratios)
            ax.plot([b for b, _ in pts], [20 * math.log10(e) for _, e in pts], style, label=f"{mode} (measured)")
        budget = [2 * p / r for r in ratios]
        ax.plot(budget, [20 * math.log10(res[(r, "bound_heldout")][s]) for r in ratios], "--", label="Gaussian bound, held-out")
        ax.plot(budget, [20 * math.log10(recorded(r, s, "bound_rel_error")) for r in ratios], ":", label="Gaussian bound, calibration")
        ax.set_xscale("log")
        ax.set(xlabel="bytes per middle token", ylabel="relative error (dB)", title=f"{s}: {art.name}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"\nchart: {args.out}")


if __name__ == "__main__":
    main()
