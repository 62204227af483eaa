"""One chunk's CPU encode and decode, stage by stage, as a storage layer stores and restores it (one run):

1. stages: a real 256-token chunk of the embedded model, (2, layers, 256, kv_heads x head_dim) bf16, through
   kernels/codec/chunk_serde's transform (ECSQ, the rANS format): milliseconds per stage (centre / RoPE, projection
   GEMM, quantize, entropy coding; entropy decoding, dequantize, projection GEMM, restore), best of --repeats,
   at 1 and 2 torch threads, the entropy stage with the compiled rANS path and with the numpy reference
   (before); the entropy / projection ratio; the projection's FLOP floor (2 x tokens x p x kept per stream
   and direction) and its share of the chunk's time; the transform's own serialize / deserialize time;
2. speed: rANS (compiled, numpy reference) and constriction encode / decode MB/s on the same symbols;
3. amplification: a 27 KB rANS blob (lane tables, no words) declaring 131,072 tokens at the artifact's
   geometry, through the codec: time and traced (numpy) peak before its BlobError.

    python bench/chunk_restore.py --registry REG --artifact smollm2-kept@latest [--ratios 16] [--repeats 5]
    python bench/chunk_restore.py --synthetic   # no artifact: synthetic bases at the same geometry

The artifact must keep RoPE on the keys (`kvtc calibrate --keys rope-kept --sinks 0 --window 0`), as chunk
stores need. Stages run the codec's own functions in the codec's order (bench/rans.py does the same).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import struct
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the fixtures: tests/helpers

from kvtc.kernels import BlobError, KVTCCodec, read_blob  # noqa: E402
from kvtc.kernels.codec import ecsq, rans  # noqa: E402
from kvtc.kernels.codec.backend import resolve_ops  # noqa: E402
from kvtc.kernels.codec.blob import TAG_ECSQ, Section, write_blob  # noqa: E402
from kvtc.kernels.codec.chunk_serde import ChunkTransform  # noqa: E402
from kvtc.kernels.integrations.lmcache_ranks import RankedChunkTransforms  # noqa: E402
from kvtc.kernels.integrations.lmcache_settings import ChunkSerdeSettings
from kvtc.kernels.codec.mode import HeldOffsets  # noqa: E402
from kvtc.kernels.codec.modes import ECSQ  # noqa: E402
from kvtc.kernels.codec.spec import STREAMS  # noqa: E402

CPU = torch.device("cpu")


def chunk_of_model(corpus: str, tokens: int) -> torch.Tensor:
    """(2, L, tokens, H * D) bf16: the embedded model's cache of the first `tokens` tokens of `corpus`."""
    from kvtc.pipeline.job.corpus import iter_documents
    from kvtc.workers.capture import raw_cache
    from kvtc.workers.models import load_model

    lm = load_model(device="cpu")
    ids: list[int] = []
    for doc in iter_documents(corpus):
        ids += lm.tokenizer(doc.text).input_ids
        if len(ids) >= tokens:
            break
    keys, values = raw_cache(lm, torch.tensor([ids[:tokens]]))
    L, H, T, D = keys.shape
    return torch.stack([x.permute(0, 2, 1, 3).reshape(L, T, H * D) for x in (keys, values)]).to(torch.bfloat16)


def synthetic_chunk_spec(ratio: float):
    """A synthetic rope-kept ECSQ spec at the embedded model's geometry (30 layers, 3 KV heads, head_dim 64)."""
    from helpers.synthetic import synthetic_ecsq, synthetic_spec

    return synthetic_ecsq(synthetic_spec(30, 3, 64, ratio, sinks=0, window=0, rope_theta=None))


def synthetic_chunk(tokens: int) -> torch.Tensor:
    """(2, 30, tokens, 192) bf16 drawn from synthetic_chunk_spec's bases."""
    from helpers.synthetic import synthetic_cache

    keys, values = synthetic_cache(synthetic_chunk_spec(16.0), tokens, torch.bfloat16)
    L, H, T, D = keys.shape
    return torch.stack([x.permute(0, 2, 1, 3).reshape(L, T, H * D) for x in (keys, values)])


def best(fn, repeats: int) -> float:
    """Fewest seconds of `repeats` calls (the machine is shared: the least disturbed run)."""
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return min(out)


def stages(transform: ChunkTransform, kv: torch.Tensor, repeats: int) -> dict[str, float]:
    """Seconds per stage for one chunk (both streams), encode then decode, in the codec's order."""
    codec = transform.codec
    s = codec.spec
    L, T = s.num_layers, kv.shape[2]
    x = kv.reshape(2, L, T, s.kv_heads, s.head_dim).permute(0, 1, 3, 2, 4)
    ops = resolve_ops(codec.backend, CPU)
    positions = torch.arange(T)
    t: dict[str, float] = {}

    def add(name: str, fn, n: int = repeats):
        t[name] = t.get(name, 0.0) + best(fn, n)
        return fn()

    for si, stream in enumerate(STREAMS):
        mean, parts = codec._params(stream, CPU, ECSQ, codec.basis_dtype_on(CPU, kv.dtype))
        _, decoding = codec._params(stream, CPU, ECSQ, codec.basis_dtype_on(CPU, kv.dtype), decode=True)
        cos, sin, layout = codec._cos_sin(stream, positions)
        feat = add("enc rope/centre", lambda: ops.rope_center(x[si], cos, sin, mean, layout))
        back = torch.empty(T, feat.shape[1], dtype=torch.float32)
        for gi, ((cols, comps, g), (_, dec, _)) in enumerate(zip(parts, decoding)):
            tables = rans.group_tables(g)
            z = add("enc projection", lambda: (feat[:, cols].to(comps.dtype) @ comps).float())
            q = add("enc quantize", lambda: ecsq.quantize(z, g.step).numpy())
            coded = add("enc entropy", lambda: rans.encode(q, tables))
            add("enc entropy (numpy reference)", lambda: rans.encode(q, tables, reference=True), 1)
            sym = add("dec entropy", lambda: rans.decode(*coded, T, tables))
            add("dec entropy (numpy reference)", lambda: rans.decode(*coded, T, tables, reference=True), 1)
            off = HeldOffsets(codec.spec, CPU)(stream, gi)
            zhat = add("dec dequantize", lambda: ecsq.dequantize(torch.from_numpy(sym), g.step, off))
            add("dec projection", lambda: back.__setitem__((slice(None), cols), zhat.to(dec.dtype) @ dec.T))
        out = torch.empty(L, s.kv_heads, T, s.head_dim, dtype=kv.dtype)
        add("dec restore", lambda: ops.rope_restore(back, cos, sin, mean, out, layout))
    data = transform.serialize(kv)
    dest = torch.empty_like(kv)
    t["serialize (whole transform)"] = best(lambda: transform.serialize(kv), repeats)
    t["deserialize (whole transform)"] = best(lambda: transform.deserialize(data, dest), repeats)
    return t


def flop_floor(transform: ChunkTransform, tokens: int) -> float:
    """FLOPs of the projection GEMMs of one direction: 2 x tokens x p_g x kept_g over streams and groups."""
    return float(sum(2 * tokens * g.mean.shape[0] * g.kept for st in STREAMS for g in transform.codec.spec.ecsq[st]))


def report_stages(transform: ChunkTransform, kv: torch.Tensor, repeats: int, threads: int) -> None:
    torch.set_num_threads(threads)
    t = stages(transform, kv, repeats)
    flops = flop_floor(transform, kv.shape[2])
    for direction in ("enc", "dec"):
        names = [n for n in t if n.startswith(direction) and "reference" not in n]
        total = sum(t[n] for n in names)
        parts = ", ".join(f"{n[4:]} {1e3 * t[n]:.2f}" for n in names)
        proj, ent, ref = t[f"{direction} projection"], t[f"{direction} entropy"], t[f"{direction} entropy (numpy reference)"]
        print(f"threads {threads} {direction}: {parts} ms; sum {1e3 * total:.1f} ms; entropy / projection = "
              f"{ent / proj:.3f} (numpy reference {ref:.3f} s: {ref / proj:.2f}); projection {flops / 1e9:.2f} GFLOP "
              f"= {flops / proj / 1e9:.1f} GFLOP/s, {100 * proj / total:.0f}% of the chunk's stages")
    print(f"threads {threads} whole transform: serialize {1e3 * t['serialize (whole transform)']:.1f} ms, "
          f"deserialize {1e3 * t['deserialize (whole transform)']:.1f} ms")


def speed(transform: ChunkTransform, kv: torch.Tensor, repeats: int) -> None:
    """Encode / decode MB/s of rANS (compiled and numpy reference) and constriction on the chunk's symbols."""
    torch.set_num_threads(1)
    codec = transform.codec
    s = codec.spec
    T = kv.shape[2]
    x = kv.reshape(2, s.num_layers, T, s.kv_heads, s.head_dim).permute(0, 1, 3, 2, 4)
    ops = resolve_ops(codec.backend, CPU)
    coders = {
        "rANS compiled": (lambda q, tb, g: rans.encode(q, tb), lambda c, tb, g: rans.decode(*c, T, tb)),
        "rANS numpy (before)": (lambda q, tb, g: rans.encode(q, tb, reference=True),
                                lambda c, tb, g: rans.decode(*c, T, tb, reference=True)),
        "constriction": (lambda q, tb, g: ecsq.encode_symbols(q, g), lambda c, tb, g: ecsq.decode_symbols(*c, T, g)),
    }
    enc = dict.fromkeys(coders, 0.0)
    dec = dict.fromkeys(coders, 0.0)
    size = dict.fromkeys(coders, 0)
    raw = 0
    for si, stream in enumerate(STREAMS):
        mean, parts = codec._params(stream, CPU, ECSQ)
        feat = ops.rope_center(x[si], None, None, mean, "half")
        for cols, comps, g in parts:
            q = ecsq.quantize(feat[:, cols] @ comps, g.step).numpy()
            tables = rans.group_tables(g)
            raw += T * g.mean.shape[0] * 2
            for name, (e, d) in coders.items():
                c = e(q, tables, g)
                assert np.array_equal(d(c, tables, g), q)
                n = repeats if "numpy" not in name else 1
                enc[name] += best(lambda: e(q, tables, g), n)
                dec[name] += best(lambda: d(c, tables, g), n)
                size[name] += len(c[0]) + len(c[1])
    for name in coders:
        print(f"speed {name:>20} (1 thread): encode {size[name] / enc[name] / 1e6:7.2f} MB/s coded "
              f"{raw / enc[name] / 1e6:8.1f} MB/s raw; decode {size[name] / dec[name] / 1e6:7.2f} MB/s coded "
              f"{raw / dec[name] / 1e6:8.1f} MB/s raw ({size[name]} bytes)")
    base = "constriction"
    for name in ("rANS compiled", "rANS numpy (before)"):
        print(f"speed {name} / constriction: encode {enc[base] / enc[name]:.2f}x, decode {dec[base] / dec[name]:.2f}x")


def amplification(transform: ChunkTransform, kv: torch.Tensor, tokens: int = 131072, nbytes: int = 27_000) -> None:
    """A blob of lane tables and no words declaring `tokens` tokens: time and traced peak before its BlobError."""
    codec = transform.codec
    header, sections = read_blob(codec.encode(*kv.reshape(2, kv.shape[1], kv.shape[2], codec.spec.kv_heads,
                                                          codec.spec.head_dim).permute(0, 1, 3, 2, 4)))
    groups = {sec.key: codec.spec.ecsq[STREAMS[sec.key.stream]][sec.key.group] for sec in sections
              if sec.key.tag == TAG_ECSQ}
    fake, lanes = [], []
    for sec in sections:
        if sec.key.tag != TAG_ECSQ:
            fake.append(Section(sec.key, 0, 0, b""))
            continue
        # as many lanes as nbytes pays for, or the fewest the format allows for the declared symbols
        w = max((nbytes // len(groups) - 8) // 6, -(-tokens * groups[sec.key].kept // rans.MAX_LANE_SYMBOLS))
        raw = struct.pack("<iI", ecsq.STREAM_FORMAT << 16, w) + struct.pack(f"<{w}I", *[rans.STATE_LOW] * w) + bytes(2 * w)
        fake.append(Section(sec.key, 0, len(raw), raw))
        lanes.append(w)
    blob = write_blob(dataclasses.replace(header, tokens=tokens), fake)
    kept = sum(g.kept for g in groups.values())
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        codec.decode(blob, max_tokens=tokens)
        verdict = "DECODED"
    except BlobError as exc:
        verdict = f"BlobError ({str(exc)[:110]}...)"
    elapsed = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    print(f"amplification: {len(blob)} byte blob, {tokens} tokens x {kept} kept symbols declared, "
          f"lane tables of {lanes} lanes, no words: {verdict} after {1e3 * elapsed:.1f} ms, "
          f"traced peak {peak / 1e6:.2f} MB")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--artifact", default=None, help="NAME@REF of a rope-kept artifact of the embedded model")
    ap.add_argument("--synthetic", action="store_true",
                    help="no artifact: a synthetic ECSQ spec at the embedded model's geometry and a cache drawn from it")
    ap.add_argument("--registry", default=None)
    ap.add_argument("--ratios", default="16")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--corpus", default="stdlib")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if not args.artifact and not args.synthetic:
        ap.error("pass --artifact NAME@REF (with --registry) or --synthetic")
    kv = synthetic_chunk(args.tokens) if args.synthetic else chunk_of_model(args.corpus, args.tokens)
    print(f"chunk {tuple(kv.shape)} {kv.dtype}; rANS compiled path: {rans.warm_up()}; "
          f"host cores {os.cpu_count()}")
    for ratio in (float(r) for r in args.ratios.split(",")):
        if args.synthetic:
            transform = ChunkTransform(KVTCCodec(synthetic_chunk_spec(ratio), mode="ecsq"), mode="ecsq")
        else:
            transform = RankedChunkTransforms.from_settings(ChunkSerdeSettings(args.artifact, ratio, args.registry,
                                                                               mode="ecsq"))(None)
        kept = {st: [g.kept for g in transform.codec.spec.ecsq[st]] for st in STREAMS}
        print(f"CR {ratio:g}: kept components {kept}, p = {transform.codec.spec.features} per stream")
        for threads in (int(n) for n in args.threads.split(",")):
            report_stages(transform, kv, args.repeats, threads)
        speed(transform, kv, args.repeats)
        amplification(transform, kv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
