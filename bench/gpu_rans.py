"""The codec's device check (called by bench/gpu_check.py; runnable alone on a CUDA host):

1. rANS bit identity on the GPU: compiled Triton encode against the numpy reference (bytes), and
   the compiled decode against the input symbols, on odd shapes and real-sized lanes.
2. An 8B geometry (32 layers x 8 KV heads x 128: p = 32768 per stream, one group), a 32K-token
   cache, a basis held at p/8 components in the cache's dtype: rANS decode and encode throughput
   on the device (GB/s of fp16 cache restored / coded, and coded GB/s), and end-to-end restore
   (KVTCCodec.decode onto the GPU) in the ECSQ mode against the fixed-rate mode, both timed in
   the same run; basis bytes held; fp16/bf16 basis error against float32.

    python bench/gpu_rans.py [--tokens 32768] [--components 4096]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

if "--cpu-dry-run" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the fixtures: tests/helpers

from kvtc.artifacts.groups import FeatureGroup  # noqa: E402
from kvtc.kernels import KVTCCodec, read_blob  # noqa: E402
from kvtc.kernels.codec import rans  # noqa: E402
from kvtc.kernels.codec.blob import TAG_ECSQ, TAG_ESCAPES  # noqa: E402
from kvtc.kernels.codec.ecsq import SymbolModel  # noqa: E402
from kvtc.kernels.codec.rans_triton import decode_device, encode_device  # noqa: E402
from kvtc.kernels.codec.spec import STREAMS, CodecSpec, GroupCode  # noqa: E402
from helpers.synthetic import budget_blocks, synthetic_ecsq  # noqa: E402


DEV = torch.device("cuda")


def _sync() -> None:
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def _timed(fn, repeat: int = 3):
    _sync()
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        _sync()
        best = min(best, time.perf_counter() - t0)
    return out, best


def check_identity() -> bool:
    rng = np.random.default_rng(0)
    models = tuple(SymbolModel(r, np.maximum(np.round(np.exp(-0.5 * (np.arange(-r, r + 1) / max(r / 6, 0.3)) ** 2)
                                                      * 1e6), 1).astype(np.int64).tolist() + [2]) for r in (1, 6, 48, 700))
    models = tuple(SymbolModel(m.radius, np.asarray(m.counts, dtype=np.int64)) for m in models)
    ok = True
    for tokens, kept, lanes in ((1, 1, 1), (3, 5, None), (129, 7, 5), (4097, 3, 64), (4096, 600, None), (1000, 37, 999)):
        model = rng.integers(0, len(models), size=kept)
        tables = rans.RansTables(models, model)
        std = np.array([0.3, 1.0, 8.0, 116.0])[model]
        q = np.round(rng.standard_normal((tokens, kept)) * std).astype(np.int32)
        q.flat[rng.integers(q.size)] = 1 << 25
        ref = rans.encode(q, tables, lanes)
        dev = encode_device(torch.from_numpy(q).to(DEV), tables, lanes)
        back = decode_device(ref[0], ref[1], tokens, tables, DEV).cpu().numpy()
        same = ref == dev and np.array_equal(back, q)
        ok &= same
        print(f"rans identity tokens {tokens} kept {kept} lanes {rans.Layout(ref[0], tokens, kept).lanes}: {same}")
    return ok


def geometry_spec(layers: int, heads: int, head_dim: int, ratio: float, components: int) -> CodecSpec:
    """One model-wide group with a random orthonormal basis of `components` columns (built on the GPU)."""
    p = layers * heads * head_dim
    groups = {}
    for si, stream in enumerate(STREAMS):
        g = torch.Generator(device=DEV.type).manual_seed(si)
        q, _ = torch.linalg.qr(torch.randn(p, components, device=DEV, generator=g))
        blocks = tuple(b for b in budget_blocks(components, ratio * components / p))
        groups[stream] = (GroupCode(FeatureGroup.span(0, layers), torch.randn(p, generator=torch.Generator().manual_seed(si)) * 0.5,
                                    q.cpu(), blocks),)
    spec = CodecSpec(name="geom", version="v0", ratio=ratio, model_id="geom", num_layers=layers, kv_heads=heads,
                     head_dim=head_dim, sinks=4, window=128, rope=None, streams=groups)
    return synthetic_ecsq(spec, step=0.05)


def device_cache(spec: CodecSpec, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """keys, values (L, H, T, D) fp16 on the GPU drawn from the spec's bases (decaying spectrum + noise)."""
    out = []
    for stream in STREAMS:
        code = spec.streams[stream][0]
        comps = code.components.to(DEV)
        k = comps.shape[1]
        sigma = (torch.arange(k, device=DEV, dtype=torch.float32) + 1) ** -0.7 * 4
        x = code.mean.to(DEV) + (torch.randn(tokens, k, device=DEV) * sigma) @ comps.T
        x += 0.02 * torch.randn_like(x)
        out.append(x.reshape(tokens, spec.num_layers, spec.kv_heads, spec.head_dim).permute(1, 2, 0, 3)
                   .to(torch.float16).contiguous())
    return out[0], out[1]


def check_geometry(tokens: int, components: int, geometry: tuple[int, int, int] = (32, 8, 128)) -> bool:
    spec = geometry_spec(*geometry, 16.0, components)
    keys, values = device_cache(spec, tokens)
    raw_gb = 2 * keys.numel() * 2 / 1e9
    ecsq_codec = KVTCCodec(spec, mode="ecsq", max_tokens=tokens)  # rate control: within the fixed mode's budget
    fixed_codec = KVTCCodec(spec, mode="fixed", max_tokens=tokens)
    blob_e, t_enc_e = _timed(lambda: ecsq_codec.encode(keys, values), 2)
    blob_f, t_enc_f = _timed(lambda: fixed_codec.encode(keys, values), 2)
    (k_e, v_e), t_dec_e = _timed(lambda: ecsq_codec.decode(blob_e, device=DEV), 3)
    (k_f, v_f), t_dec_f = _timed(lambda: fixed_codec.decode(blob_f, device=DEV), 3)
    _, sections = read_blob(blob_e)
    header_mid = ecsq_codec.split(tokens, 0)[1]
    coded = {s.key: bytes(s.stored) for s in sections if s.key.tag in (TAG_ECSQ, TAG_ESCAPES)}
    import zlib

    t_rans_dec = t_rans_enc = 0.0
    coded_bytes = 0
    for si, stream in enumerate(STREAMS):
        g = spec.ecsq[stream][0]
        tables = rans.group_tables(g)
        key = next(k for k in coded if k.tag == TAG_ECSQ and k.stream == si)
        words = coded[key][4:]
        esc_s = next(s for s in sections if s.key == key._replace(tag=TAG_ESCAPES))
        esc = zlib.decompress(esc_s.stored) if esc_s.coding == 1 else bytes(esc_s.stored)
        q, t = _timed(lambda: decode_device(words, esc, header_mid, tables, DEV), 3)
        t_rans_dec += t
        again, t = _timed(lambda: encode_device(q, tables), 2)
        t_rans_enc += t
        coded_bytes += len(words) + len(esc)
        if again != (words, esc):
            print("rans re-encode on the GPU differs from the blob's section")
            return False
    mid_gb = 2 * header_mid * spec.features * 2 / 1e9
    err = {}
    for name, (k, v) in (("ecsq", (k_e, v_e)), ("fixed", (k_f, v_f))):
        err[name] = float((torch.cat([k.flatten(), v.flatten()]).float() - torch.cat([keys.flatten(), values.flatten()])
                           .float()).norm() / torch.cat([keys.flatten(), values.flatten()]).float().norm())
    f32 = KVTCCodec(spec, mode="ecsq", max_tokens=tokens, basis_dtype=torch.float32)
    k32, v32 = f32.decode(blob_e, device=DEV)
    cost = float((torch.cat([k_e.flatten(), v_e.flatten()]).float() - torch.cat([k32.flatten(), v32.flatten()]).float())
                 .norm() / torch.cat([keys.flatten(), values.flatten()]).float().norm())
    params = 8.03e9
    print(f"8B geometry, {tokens} tokens, basis {components} of p = {spec.features} components in fp16: "
          f"{ecsq_codec.basis_bytes() / 1e6:.0f} MB held ({ecsq_codec.basis_bytes() / 2 / params:.2%} of 8.03B parameters)")
    print(f"rANS on the GPU: decode {mid_gb / t_rans_dec:.1f} GB/s of fp16 cache ({coded_bytes / t_rans_dec / 1e9:.2f} GB/s "
          f"coded, {t_rans_dec * 1e3:.1f} ms); encode {mid_gb / t_rans_enc:.1f} GB/s ({t_rans_enc * 1e3:.1f} ms); "
          f"goal decode >= 100 GB/s")
    print(f"restore of the {raw_gb:.2f} GB cache onto the GPU: ECSQ/rANS {t_dec_e * 1e3:.0f} ms, fixed {t_dec_f * 1e3:.0f} ms "
          f"(x{t_dec_e / t_dec_f:.2f}, goal <= 2); encode ECSQ {t_enc_e * 1e3:.0f} ms, fixed {t_enc_f * 1e3:.0f} ms; "
          f"blobs {len(blob_e) / 1e6:.1f} MB / {len(blob_f) / 1e6:.1f} MB; rel error {err['ecsq']:.4f} / {err['fixed']:.4f}; "
          f"fp16 basis vs float32: {cost:.2e} relative difference")
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--components", type=int, default=4096)
    ap.add_argument("--cpu-dry-run", action="store_true", help="tiny shapes on the CPU through the Triton interpreter")
    args = ap.parse_args(argv)
    if args.cpu_dry_run:
        global DEV
        DEV = torch.device("cpu")
        ok = check_geometry(args.tokens, args.components, (2, 2, 16))
        print("CPU DRY RUN", "PASSED" if ok else "FAILED")
        return 0 if ok else 1
    if not torch.cuda.is_available():
        print("no CUDA device torch can see; nothing to check")
        return 2
    ok = check_identity() & check_geometry(args.tokens, args.components)
    print("GPU RANS CHECK", "PASSED" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
