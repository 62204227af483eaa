"""Codec figures in one run: bytes (effective CR, entropy gain), CPU speed against zlib -1 on the raw fp16
cache, the projection GEMM's share of the time, and reconstruction errors of the coded middle.

    python bench/codec.py                                   # synthetic CodecSpec of SmolLM2 shape
    python bench/codec.py --artifact NAME@REF --registry URI [--consistency]

--consistency (needs a real artifact): encodes held-out text through the artifact's model at CR 16
and compares the measured relative errors with those the calibration recorded (goal: within 10%).
"""
from __future__ import annotations

import argparse
import sys
import time
import zlib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the fixtures: tests/helpers

from kvtc.kernels import KVTCCodec, read_blob  # noqa: E402
from kvtc.kernels.codec.blob import TAG_CODES, TAG_PARAMS  # noqa: E402
from helpers.synthetic import synthetic_cache, synthetic_spec  # noqa: E402


def rel_errors(codec: KVTCCodec, keys: torch.Tensor, values: torch.Tensor, dec: tuple, start: int = 0) -> dict:
    """||X - X_hat||_F / ||X||_F over the coded middle, per stream (keys in RoPE-removed space)."""
    head, mid, _ = codec.split(keys.shape[2], start)
    out = {}
    for name, x, y in (("keys", keys, dec[0]), ("values", values, dec[1])):
        x, y = x[:, :, head:head + mid].float(), y[:, :, head:head + mid].float()
        if name == "keys" and codec.rope is not None:
            pos = torch.arange(start + head, start + head + mid)
            x, y = codec.rope.remove(x, pos), codec.rope.remove(y, pos)
        out[name] = float((x - y).norm() / x.norm()) if mid else 0.0
    return out


def byte_figures(codec: KVTCCodec, blob: bytes, tokens: int, start: int = 0) -> dict:
    """Effective CRs (fp16 reference), entropy gain on coded sections, and the planar layout's gain."""
    header, sections = read_blob(blob)
    _, mid, _ = codec.split(tokens, start)
    p = codec.spec.features
    coded = [s for s in sections if s.key.tag in (TAG_CODES, TAG_PARAMS)]
    stored = sum(len(s.stored) for s in coded)
    raw = sum(s.raw_len for s in coded)
    row_major = 0
    for s in coded:
        data = zlib.decompress(s.stored) if s.coding == 1 else bytes(s.stored)
        if s.key.tag == TAG_CODES:
            data = torch.frombuffer(bytearray(data), dtype=torch.uint8).reshape(-1, mid).t().contiguous().numpy().tobytes()
        else:
            data = torch.frombuffer(bytearray(data), dtype=torch.uint8).reshape(4, mid).t().contiguous().numpy().tobytes()
        row_major += min(len(data), len(zlib.compress(data, codec.level)))
    return {"cr_middle": 4 * mid * p / stored if stored else float("nan"),
            "cr_whole": 4 * tokens * p / len(blob),
            "entropy_gain": raw / stored if stored else 1.0,
            "row_major_gain": raw / row_major if row_major else 1.0,
            "blob_bytes": len(blob)}


def timed(fn, repeat: int):
    best, result = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t0)
    return best, result


def recorded_rel_errors(artifact, ratio: float) -> dict:
    """The calibration's held-out relative errors at `ratio` (group-less rows, or the only group)."""
    rows = [r for r in artifact.metrics() if r.get("metric") == "rel_error" and r.get("split") in ("heldout", "holdout")
            and r.get("ratio") is not None and abs(float(r["ratio"]) - ratio) < 1e-9]
    out = {}
    for stream in ("keys", "values"):
        mine = [r for r in rows if r.get("stream") == stream]
        whole = [r for r in mine if r.get("group") is None] or (mine if len(mine) == 1 else [])
        if whole:
            out[stream] = float(whole[0]["value"])
    return out


def model_cache(artifact, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The artifact's model run on the tail of Python's docs text -> (L, H, T, D) fp16 cache (keys with RoPE)."""
    from pydoc_data.topics import topics

    from kvtc.workers.capture import raw_cache
    from kvtc.workers.models import load_model

    lm = load_model(artifact.manifest["model"]["spec"], device="cpu", dtype=torch.float32)
    text = "\n\n".join(topics[k] for k in sorted(topics))[-12 * tokens:]
    ids = lm.tokenizer(text, return_tensors="pt").input_ids[:, -tokens:]
    keys, values = raw_cache(lm, ids)
    return keys.to(torch.float16), values.to(torch.float16)


def consistency(args: argparse.Namespace) -> int:
    """Held-out text through the artifact's model at CR 16 vs the recorded errors (within 10%)."""
    from kvtc.artifacts import pull

    artifact = pull(args.artifact, registry=args.registry)
    codec = KVTCCodec(artifact, 16.0)
    recorded = recorded_rel_errors(artifact, 16.0)
    keys, values = model_cache(artifact, args.tokens)
    measured = rel_errors(codec, keys, values, codec.decode(codec.encode(keys, values)))
    ok = True
    for stream, value in measured.items():
        ref = recorded.get(stream)
        within = ref is not None and abs(value - ref) <= 0.1 * ref
        ok &= within
        print(f"consistency CR16 {stream}: measured {100 * value:.2f}%, recorded "
              f"{'n/a' if ref is None else f'{100 * ref:.2f}%'} -> {'OK' if within else 'OUTSIDE 10%'}")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--ratios", type=float, nargs="+", default=[8.0, 16.0, 32.0])
    ap.add_argument("--artifact", help="NAME@REF of a published artifact (default: synthetic SmolLM2-shaped spec)")
    ap.add_argument("--registry", help="registry URI for --artifact")
    ap.add_argument("--level", type=int, default=1, help="zlib level per section")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    ap.add_argument("--consistency", action="store_true", help="held-out CR16 errors vs recorded (real artifact)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.consistency:
        if not args.artifact:
            ap.error("--consistency needs --artifact NAME@REF (and --registry)")
        return consistency(args)
    if args.artifact:
        from kvtc.artifacts import pull

        artifact = pull(args.artifact, registry=args.registry)
        codecs = {r: KVTCCodec(artifact, r, level=args.level) for r in args.ratios}
        keys, values = model_cache(artifact, args.tokens)
        print(f"artifact {args.artifact}; cache: the artifact's model on Python docs text (held-out tail)")
    else:
        codecs = {r: KVTCCodec(synthetic_spec(30, 3, 64, r), level=args.level) for r in args.ratios}
        print("SYNTHETIC CodecSpec of SmolLM2 shape (30 layers, 3 kv heads, head_dim 64, one group, random "
              "orthonormal basis, DP-like allocation); no real artifact given")
        keys, values = synthetic_cache(codecs[min(args.ratios)].spec, args.tokens, torch.float16, seed=1)
    mb = 2 * keys.numel() * 2 / 1e6
    raw = keys.numpy().tobytes() + values.numpy().tobytes()
    t_zlib, packed = timed(lambda: zlib.compress(raw, 1), args.repeat)
    print(f"cache (L, H, T, D) = {tuple(keys.shape)} x 2 streams = {mb:.1f} MB fp16; torch threads "
          f"{torch.get_num_threads()}")
    print(f"zlib -1 on raw fp16: CR {len(raw) / len(packed):.3f}, {mb / t_zlib:.1f} MB/s")
    print(f"{'CR':>4} {'CR mid':>7} {'CR all':>7} {'ent.gain':>8} {'(rows)':>7} {'enc MB/s':>9} {'dec MB/s':>9} "
          f"{'GEMM enc':>8} {'q+p+ent':>8} {'err K':>6} {'err V':>6}")
    for r, codec in codecs.items():
        t_enc, blob = timed(lambda: codec.encode(keys, values), args.repeat)
        t_dec, dec = timed(lambda: codec.decode(blob), args.repeat)
        prof: dict[str, float] = {}
        for _ in range(args.repeat):
            codec.profile = {}
            codec.encode(keys, values)
            prof = {k: min(v, prof.get(k, v)) for k, v in codec.profile.items()}
        dprof: dict[str, float] = {}
        for _ in range(args.repeat):
            codec.profile = {}
            codec.decode(blob)
            dprof = {k: min(v, dprof.get(k, v)) for k, v in codec.profile.items()}
        codec.profile = None
        b = byte_figures(codec, blob, args.tokens)
        e = rel_errors(codec, keys, values, dec)
        total = sum(prof.values())
        rest = prof.get("quantize_pack", 0) + prof.get("entropy", 0)
        print(f"{r:>4g} {b['cr_middle']:>7.2f} {b['cr_whole']:>7.2f} {b['entropy_gain']:>8.3f} "
              f"{b['row_major_gain']:>7.3f} {mb / t_enc:>9.1f} {mb / t_dec:>9.1f} "
              f"{100 * prof.get('project', 0) / total:>7.1f}% {100 * rest / total:>7.1f}% "
              f"{100 * e['keys']:>5.2f}% {100 * e['values']:>5.2f}%")
        print("      encode stages (s): " + ", ".join(f"{k} {v:.3f}" for k, v in prof.items()))
        print("      decode stages (s): " + ", ".join(f"{k} {v:.3f}" for k, v in dprof.items()))
    print("CR mid: fp16 bytes of the coded middle / its coded sections; CR all: fp16 bytes of the whole "
          "sequence / blob (raw sinks, window, headers included); ent.gain: coded sections before/after "
          "DEFLATE, (rows): the same with row-major instead of planar layout; GEMM enc and q+p+ent: shares of "
          "encode time; err: ||X - X_hat|| / ||X|| on the middle, keys RoPE-removed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
