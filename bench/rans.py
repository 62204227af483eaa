"""Interleaved rANS figures in one run, against the constriction ECSQ format (the baseline):

1. rate: ECSQ bytes (coded symbols + escapes) per middle token of both formats at each ratio, on
   held-out text of the artifact's model (the tail of Python's pydoc topics, as bench/codec.py);
2. CPU speed, 1 thread: encode and decode MB/s of the compiled rANS path ("rans", kernels/codec/rans_numba.py), the
   numpy reference ("rans-numpy") and constriction on the same symbols (coded MB/s, and raw MB/s of the fp16
   middle cache they stand for);
3. Triton interpreter: the kernels bit-identical to the reference on odd shapes (1, 3, 129, 4097
   tokens; 1 and many lanes; escapes present) with the artifact's own symbol models;
4. fuzz: mutated rANS blobs (checksums recomputed so they reach the rANS parser) end in BlobError or
   a decode of the declared shape, never another exception; a share through the Triton interpreter.

    TRITON_INTERPRET=1 python bench/rans.py [--artifact NAME@REF --registry URI] [--sequences 4] [--fuzz 20000]
"""
from __future__ import annotations

import argparse
import collections
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the fixtures: tests/helpers

from kvtc.kernels import BlobError, KVTCCodec, read_blob  # noqa: E402
from kvtc.kernels.codec import ecsq, rans  # noqa: E402
from kvtc.kernels.codec.blob import TAG_ECSQ, TAG_ESCAPES, write_blob  # noqa: E402
from kvtc.kernels.codec.ecsq import EcsqGroup  # noqa: E402
from kvtc.kernels.codec.rans_triton import decode_device, encode_device  # noqa: E402
from kvtc.kernels.codec.modes import ECSQ  # noqa: E402
from kvtc.kernels.codec.spec import STREAMS  # noqa: E402


def held_out_caches(artifact, sequences: int, tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`sequences` caches of `tokens` from the tail of the pydoc topics, fp16, keys with RoPE."""
    from pydoc_data.topics import topics

    from kvtc.workers.capture import raw_cache
    from kvtc.workers.models import load_model

    lm = load_model(artifact.manifest["model"]["spec"], device="cpu", dtype=torch.float32)
    text = "\n\n".join(topics[k] for k in sorted(topics))
    ids = lm.tokenizer(text[-12 * tokens * sequences:], return_tensors="pt").input_ids[0]
    out = []
    for i in range(sequences):
        part = ids[len(ids) - (i + 1) * tokens:len(ids) - i * tokens][None]
        keys, values = raw_cache(lm, part)
        out.append((keys.to(torch.float16), values.to(torch.float16)))
    return out


def ecsq_bytes(blob: bytes) -> int:
    return sum(len(s.stored) for s in read_blob(blob)[1] if s.key.tag in (TAG_ECSQ, TAG_ESCAPES))


def symbols_of(codec: KVTCCodec, keys: torch.Tensor, values: torch.Tensor) -> list[tuple[np.ndarray, EcsqGroup]]:
    """The quantized symbols (mid, kept) of every stream and group, at the calibrated step."""
    from kvtc.kernels.codec.backend import resolve_ops

    T = keys.shape[2]
    head, mid, _ = codec.split(T, 0)
    ops = resolve_ops("torch", keys.device)
    out = []
    for stream, x in zip(STREAMS, (keys, values)):
        mean, parts = codec._params(stream, keys.device, ECSQ)
        cos, sin, layout = codec._cos_sin(stream, torch.arange(head, head + mid))
        feat = ops.rope_center(x[:, :, head:head + mid], cos, sin, mean, layout)
        for cols, comps, g in parts:
            out.append((ecsq.quantize(feat[:, cols] @ comps, g.step).numpy(), g))
    return out


def rate_and_speed(artifact, ratios, caches) -> None:
    torch.set_num_threads(1)
    for ratio in ratios:
        new = KVTCCodec(artifact, ratio, mode="ecsq", rate_control=False)
        old = KVTCCodec(artifact, ratio, mode="ecsq", rate_control=False, ecsq_format="constriction")
        b_new = b_old = mids = 0
        for keys, values in caches:
            blob_new, blob_old = new.encode(keys, values), old.encode(keys, values)
            b_new, b_old = b_new + ecsq_bytes(blob_new), b_old + ecsq_bytes(blob_old)
            mids += new.split(keys.shape[2], 0)[1]
            k1, v1 = new.decode(blob_new)
            k2, v2 = old.decode(blob_old)
            assert torch.equal(k1, k2) and torch.equal(v1, v2), "formats decode to different caches"
        print(f"rate CR {ratio:g}: rANS {8 * b_new / mids:.1f} bits/token, constriction {8 * b_old / mids:.1f} "
              f"bits/token (both streams), rANS/constriction = {b_new / b_old:.4f} ({100 * (b_new / b_old - 1):+.2f}%)")
        t = collections.Counter()
        coded = collections.Counter()
        raw = 0
        for keys, values in caches:
            for q, g in symbols_of(new, keys, values):
                raw += q.shape[0] * g.mean.shape[0] * 2
                tables = rans.group_tables(g)
                rans.encode(q[:2], tables)  # warm the tables
                for name, enc, dec in (
                        ("rans", lambda: rans.encode(q, tables), lambda c: rans.decode(c[0], c[1], q.shape[0], tables)),
                        ("rans-numpy", lambda: rans.encode(q, tables, reference=True),
                         lambda c: rans.decode(c[0], c[1], q.shape[0], tables, reference=True)),
                        ("constriction", lambda: ecsq.encode_symbols(q, g),
                         lambda c: ecsq.decode_symbols(c[0], c[1], q.shape[0], g))):
                    t0 = time.perf_counter()
                    c = enc()
                    t1 = time.perf_counter()
                    back = dec(c)
                    t2 = time.perf_counter()
                    assert np.array_equal(back, q)
                    t[name, "enc"] += t1 - t0
                    t[name, "dec"] += t2 - t1
                    coded[name] += len(c[0]) + len(c[1])
        for name in ("rans", "rans-numpy", "constriction"):
            print(f"speed CR {ratio:g} {name:>12} (1 thread): encode {coded[name] / t[name, 'enc'] / 1e6:6.2f} MB/s coded "
                  f"{raw / t[name, 'enc'] / 1e6:7.1f} MB/s raw; decode {coded[name] / t[name, 'dec'] / 1e6:6.2f} MB/s coded "
                  f"{raw / t[name, 'dec'] / 1e6:7.1f} MB/s raw")


def interpreter_identity(artifact, ratio: float) -> None:
    """Odd shapes through the Triton interpreter with a few of the artifact's components and models."""
    codec = KVTCCodec(artifact, ratio, mode="ecsq")
    g = codec.spec.ecsq["values"][0]
    rng = np.random.default_rng(0)
    checked = same = 0
    for tokens in (1, 3, 129, 4097):
        for kept in (1, 3, 7):
            cols = np.sort(rng.choice(g.kept, size=kept, replace=False))
            sub = rans.RansTables(g.models, g.model[cols])
            std = np.maximum(2.0 ** (np.log2(np.maximum(sub.radius[sub.comp_model], 1)) - 2.6), 0.3)
            q = np.round(rng.standard_normal((tokens, kept)) * std).astype(np.int32)
            q.flat[rng.integers(q.size)] = 1 << 20  # an escape
            n = tokens * kept
            for lanes in sorted({1, min(n, 64), min(n, max(1, n // 3))}):
                if -(-n // lanes) > 4500:
                    continue  # the interpreter runs one program at a time: keep each lane short
                ref = rans.encode(q, sub, lanes)
                dev = encode_device(torch.from_numpy(q), sub, lanes)
                back = decode_device(ref[0], ref[1], tokens, sub, torch.device("cpu")).numpy()
                checked += 1
                same += ref == dev and np.array_equal(back, q) and np.array_equal(rans.decode(*ref, tokens, sub), q)
    print(f"interpreter: {same}/{checked} odd-shape cases bit-identical (tokens 1, 3, 129, 4097; kept 1, 3, 7; "
          "1 to 64 lanes; an escape in each)")


def fuzz(cases: int, share: float) -> None:
    """Mutate the rANS and escapes sections of small synthetic ECSQ blobs (two groups per stream), recompute
    checksums, decode; a share of the mutated sections also through the Triton interpreter."""
    import zlib

    from helpers.synthetic import synthetic_cache, synthetic_ecsq, synthetic_spec

    torch.set_num_threads(1)  # tiny GEMMs: a thread pool only waits on a loaded machine
    spec = synthetic_ecsq(synthetic_spec(3, 2, 16, 4.0, kept=24, sinks=2, window=3, groups=[(0, 1), (1, 3)]))
    codec = KVTCCodec(spec, mode="ecsq", rate_control=False)
    keys, values = synthetic_cache(spec, 17, torch.float16)
    header, sections = read_blob(codec.encode(keys, values))
    targets = [i for i, s in enumerate(sections) if s.key.tag in (TAG_ECSQ, TAG_ESCAPES)]
    rng = random.Random(0)
    outcome = collections.Counter()
    t0 = time.perf_counter()
    for case in range(cases):
        i = rng.choice(targets)
        data = bytearray(sections[i].stored if sections[i].coding == 0 else zlib.decompress(sections[i].stored))
        if not data:
            data = bytearray(4)
        kind = rng.randrange(5)
        if kind == 0:
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        elif kind == 1:
            del data[rng.randrange(len(data)):]
        elif kind == 2 and len(data) >= 8:
            j = rng.randrange(4, len(data) - 3)
            data[j:j + 4] = rng.choice([0, 1, 0xFFFF, 0x10000, 0xFFFFFFFF, rng.getrandbits(32)]).to_bytes(4, "little")
        elif kind == 3:
            data += bytes(rng.randrange(1, 9))
        else:
            data[4:8] = rng.choice([0, 1, 2, 1 << 20, 0xFFFFFFFF]).to_bytes(4, "little")  # the lane count
        new = list(sections)
        new[i] = type(sections[i])(sections[i].key, 0, len(data), bytes(data))
        blob = write_blob(header, new)
        try:
            k, v = codec.decode(blob)
            assert k.shape == keys.shape and v.shape == values.shape
            outcome["decoded"] += 1
        except BlobError:
            outcome["BlobError"] += 1
        except Exception as exc:  # noqa: BLE001 - the figure counts these
            outcome[f"other {type(exc).__name__}"] += 1
        if rng.random() < share and sections[i].key.tag == TAG_ECSQ:
            g = spec.ecsq[STREAMS[sections[i].key.stream]][sections[i].key.group]
            esc = next(s.stored for s in new if s.key == sections[i].key._replace(tag=TAG_ESCAPES))
            mid = codec.split(keys.shape[2], 0)[1]
            try:
                ref = ecsq.decode_group(bytes(data), esc, mid, g, "rans")[0]
            except BlobError:
                ref = None
            try:
                dev = ecsq.decode_group_to(bytes(data), esc, mid, g, "rans", torch.device("cpu"), True)[0].numpy()
            except BlobError:
                dev = None
            outcome["interpreter agrees" if (ref is None) == (dev is None) and (ref is None or np.array_equal(ref, dev))
                    else "interpreter DISAGREES"] += 1
        if (case + 1) % 1000 == 0:
            print(f"fuzz: {case + 1} of {cases} after {time.perf_counter() - t0:.0f} s: {dict(outcome)}", flush=True)
    print(f"fuzz: {cases} mutated rANS blobs in {time.perf_counter() - t0:.0f} s: {dict(outcome)}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--artifact", default=None, help="NAME@REF (the rate, speed and interpreter figures need one)")
    ap.add_argument("--registry", default=None)
    ap.add_argument("--ratios", default="8,16,32")
    ap.add_argument("--sequences", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--fuzz", type=int, default=20000)
    ap.add_argument("--interpreter-share", type=float, default=0.02)
    args = ap.parse_args()
    from kvtc.artifacts import pull

    if args.artifact:
        art = pull(args.artifact, registry=args.registry)
        ratios = [float(r) for r in args.ratios.split(",")]
        rate_and_speed(art, ratios, held_out_caches(art, args.sequences, args.tokens))
        interpreter_identity(art, ratios[len(ratios) // 2])
    if args.fuzz:
        fuzz(args.fuzz, args.interpreter_share)
    return 0


if __name__ == "__main__":
    sys.exit(main())
