"""The one prepared device check for a machine with a CUDA GPU (run it where torch sees one).

1. Compiled Triton kernels against the torch path on CUDA tensors, odd shapes and the SmolLM2
   shape, for each ratio: blobs must be byte-identical (integer codes identical) and decoded
   caches within fp tolerance; encode/decode GB/s of both.
2. KV capture and statistics on CUDA (bf16 model, TF32 Gram) against the CPU fp32 path on a tiny
   model: relative difference of the covariance.
3. The reducer's eigensolver on CUDA (what the one-GPU reduce task runs): float64 `eigh` on the
   GPU against LAPACK on the CPU at p = 2048 (eigenvalues and subspace), then its time at the
   Llama-3.1-8B half-geometry p = 16384 from a packed Gram.
4. Worker overhead on the GPU: `bench/worker_overhead.py --device cuda` figures.
5. The codec's device path (bench/gpu_rans.py): rANS bit identity against the numpy reference,
   rANS decode/encode GB/s and the restore of a 32K-token cache of an 8B geometry against the
   fixed-rate mode.
3a. cuSOLVER's float64 `eigh` timed at p = 16384 and 32768, against what the reduce's plan says this
   device takes (syevd before CUDA 13 stops near n = 25K; the plan solves such groups on the CPU).
3b. The reduce's unit of work (`group_task.run_group`: solve -> fit -> measure) with its solve on
   CUDA against the same unit on the CPU, on a tiny in-process calibration (held-out errors agree).
6. Multi-GPU workers (two or more GPUs, else skipped with a message): a model spread over every
   visible GPU (`load_model(..., gpu_budgets=)`) captures the same KV rows as on one GPU; the
   memory plan's GPUs per worker for Llama-3.1-8B and 70B at this GPU's memory.
7. The vLLM offloading tier's device path (kernels/integrations/vllm_offload.py; vLLM itself need not be
   installed): 256-token chunks of a SmolLM2-geometry cache laid out as vLLM pages (bf16, 16-token
   blocks, LBNHC) are read from the pages, coded on CUDA (fixed and ECSQ), decoded and written back
   into other blocks: the blobs decode on the CPU to the same cache (fp tolerance), the restored
   pages equal the CUDA decode, and store / load milliseconds per chunk and bytes per chunk print.

8. The attention objective on CUDA: the query and W_O statistics captured from a bf16 model on the GPU
   against the CPU fp32 capture (relative difference), and a whitened artifact (encoder and decoder
   distinct) coded on CUDA with the Triton kernels, fixed and ECSQ: decoded caches against the CPU
   torch path (fp tolerance).

    python bench/gpu_check.py [--skip-overhead] [--only-offload]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the fixtures: tests/helpers

from kvtc.kernels import KVTCCodec  # noqa: E402
from helpers.synthetic import synthetic_cache, synthetic_spec  # noqa: E402


def _timed(fn, repeat: int = 3) -> tuple[object, float]:
    torch.cuda.synchronize()
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return out, best


def check_kernels() -> bool:
    ok = True
    cases = [
        ("odd", dict(num_layers=3, kv_heads=3, head_dim=24, groups=[(0, 2), (2, 3)], sinks=3, window=5, kept=70, seed=1), 131),
        ("smollm2", dict(num_layers=30, kv_heads=3, head_dim=64, ratio=16.0), 4096),
    ]
    for name, kw, tokens in cases:
        for ratio in ((None,) if "kept" in kw else (8.0, 16.0, 32.0)):
            spec = synthetic_spec(**({**kw, "ratio": ratio} if ratio else kw))
            keys, values = synthetic_cache(spec, tokens, torch.float16)
            keys, values = keys.cuda(), values.cuda()
            ref, tri = KVTCCodec(spec, backend="torch"), KVTCCodec(spec, backend="triton")
            blob_ref, t_ref = _timed(lambda: ref.encode(keys, values))
            blob_tri, t_tri = _timed(lambda: tri.encode(keys, values))
            (k1, v1), d_ref = _timed(lambda: ref.decode(blob_ref, device="cuda"))
            (k2, v2), d_tri = _timed(lambda: tri.decode(blob_ref, device="cuda"))
            same = blob_ref == blob_tri
            close = all(torch.allclose(a.float(), b.float(), rtol=2e-3, atol=2e-3) for a, b in ((k1, k2), (v1, v2)))
            ok &= same and close
            mb = 2 * keys.numel() * 2 / 1e9
            print(f"kernels {name} CR {ratio or 'random'}: blob identical {same}, decode close {close}; "
                  f"encode torch {mb / t_ref:.2f} GB/s, triton {mb / t_tri:.2f} GB/s; "
                  f"decode torch {mb / d_ref:.2f} GB/s, triton {mb / d_tri:.2f} GB/s")
    return ok


def check_capture() -> bool:
    from kvtc.workers.capture import CaptureSettings, capture_kv
    from kvtc.workers.models import load_model
    from kvtc.workers.stats import CalibrationStats

    settings = CaptureSettings(sinks=4, window=16, objective="mse")
    ids = torch.randint(0, 49152, (2, 160), generator=torch.Generator().manual_seed(0))
    covs = {}
    for device, dtype in (("cpu", "float32"), ("cuda", "bfloat16")):
        lm = load_model("tiny:llama", device=device, dtype=dtype)
        stats = CalibrationStats.new(lm.fingerprint, settings)
        stats.update(capture_kv(lm, ids.to(device), settings))
        n, s, g = stats.stream("keys")
        mu = s / n
        covs[device] = g / n - mu[:, None] * mu[None, :]
    rel = float(abs(covs["cuda"] - covs["cpu"]).max() / abs(covs["cpu"]).max())
    print(f"capture+stats cuda bf16 vs cpu fp32 (tiny:llama): max rel. covariance difference {rel:.2e}")
    return rel < 5e-2


def _random_packed(p: int, rows: int, seed: int) -> tuple[int, np.ndarray, np.ndarray]:
    """A decaying-spectrum sample's statistics: n, sum (p,), packed upper-triangle Gram."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, p, device="cuda", dtype=torch.float64, generator=g)
    x *= torch.logspace(0, -3, p, device="cuda", dtype=torch.float64)
    gram = x.T @ x
    iu = torch.triu_indices(p, p, device="cuda")
    packed = gram[iu[0], iu[1]].cpu().numpy()
    return rows, x.sum(0).cpu().numpy(), packed


def check_reducer() -> bool:
    from kvtc.pipeline.fit.pca import pca_from_packed

    n, s, packed = _random_packed(2048, 4096, 0)
    cpu = pca_from_packed(n, s, packed, k=256, method="exact")
    gpu = pca_from_packed(n, s, packed, k=256, device="cuda")
    ev = float(np.abs(gpu.eigenvalues - cpu.eigenvalues).max() / cpu.eigenvalues[0])
    overlap = float(np.linalg.svd(cpu.components.T @ gpu.components, compute_uv=False).min())
    print(f"reducer cuda vs cpu, p=2048 k=256: max eigenvalue difference {ev:.1e} of the largest, "
          f"smallest subspace cosine {overlap:.6f}")
    n, s, packed = _random_packed(16384, 8192, 1)
    t0 = time.perf_counter()
    basis = pca_from_packed(n, s, packed, k=2048, device="cuda")
    print(f"reducer cuda p=16384 k=2048 from the packed Gram: {time.perf_counter() - t0:.1f} s, "
          f"{basis.components.shape[1]} components")
    return ev < 1e-8 and overlap > 0.999


def check_eigh_sizes(sizes=(16384, 32768)) -> bool:
    """torch.linalg.eigh (cuSOLVER syevd, float64) at the production group sizes, and what the reduce's
    plan (pipeline/job/reduce_plan.GpuSolve) says this device takes: before CUDA 13, syevd's 32-bit
    workspace query fails above about n = 25K, and the plan sends such groups to the CPU."""
    from kvtc.pipeline.job.reduce_plan import GpuSolve

    props = torch.cuda.get_device_properties(0)
    major = int(str(torch.version.cuda or "12").split(".")[0])
    plan = GpuSolve(int(props.total_memory), major)
    ok = True
    for p in sizes:
        takes = plan.takes(p)
        try:
            a = torch.randn(p, p, device="cuda", dtype=torch.float64)
            a = a @ a.T / p
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            w, v = torch.linalg.eigh(a)
            torch.cuda.synchronize()
            took = time.perf_counter() - t0
            resid = float((a @ v[:, -8:] - v[:, -8:] * w[-8:]).norm() / w[-8:].abs().max())
            print(f"eigh cuda float64 p={p}: {took:.1f} s, residual {resid:.1e}, peak "
                  f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB; plan: {'GPU' if takes else 'CPU'} "
                  f"(CUDA {torch.version.cuda})")
            ok &= resid < 1e-8 or not takes
            del a, w, v
        except RuntimeError as exc:  # the 32-bit workspace limit, or memory
            print(f"eigh cuda float64 p={p}: failed ({str(exc).splitlines()[0][:120]}); plan: "
                  f"{'GPU (wrong: it should know)' if takes else 'CPU (right)'}")
            ok &= not takes
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return ok


def check_reduce_task() -> bool:
    """One stream and group's reduce unit (solve -> fit -> measure) with its solve on CUDA, against the
    same unit on the CPU, on a tiny in-process calibration: held-out errors of both modes agree."""
    import tempfile

    from kvtc.pipeline.fit.allocator import AllocatorSettings
    from kvtc.pipeline.job.calibrate import calibrate_local
    from kvtc.pipeline.job.group_task import GroupTask, run_group
    from kvtc.pipeline.job.heldout_store import load_rows
    from kvtc.pipeline.settings import JobSettings

    with tempfile.TemporaryDirectory() as root:
        cfg = JobSettings.of(model="tiny:llama@8x8x128", corpus="pydoc", eval_corpus=None, seq_len=256, window=32,
                             tokens=8192, seqs_per_shard=4, ratios=(8.0, 16.0), registry=f"{root}/reg",
                             store=f"{root}/store", name="gpu-reduce", tokens_curve_points=0)
        summary, ctx = calibrate_local(cfg)
        from kvtc import artifacts

        art = artifacts.pull("gpu-reduce@latest", registry=summary["registry"])
        cal, corpus = art.manifest["calibration"], art.manifest["corpus"]
        held = load_rows(ctx["store"], corpus["heldout_shards"], 8192)
        p = art.basis("keys")[0].shape[0]
        rows = held.group("keys", slice(0, p), None, cal["sinks"], cal["window"])
        out = {}
        for device in ("cpu", "cuda"):
            task = GroupTask(index=0, stream="keys", group=0, p=p, accumulators=tuple(corpus["accumulators"]),
                             ratios=(8.0, 16.0), allocator=AllocatorSettings.from_dict(cal["allocator"]),
                             sinks=cal["sinks"], window=cal["window"],
                             threads=1, device=device)
            t0 = time.perf_counter()
            r = run_group(task, ctx["store"], rows)
            errs = {m["ratio"]: m["value"] for m in r.measure.metrics
                    if m["split"] == "heldout" and m["metric"] == "ecsq_rel_error"}
            out[device] = errs
            print(f"reduce task on {device}: {time.perf_counter() - t0:.1f} s (solve {r.solve_s:.1f} s), p={p}, "
                  f"ECSQ held-out errors {errs}")
    return all(abs(out["cuda"][r] - out["cpu"][r]) <= 0.02 * out["cpu"][r] for r in out["cpu"])


def check_multi_gpu() -> bool:
    n = torch.cuda.device_count()
    if n < 2:
        print(f"multi-GPU: skipped, {n} GPU visible (a worker spread over GPUs needs 2 or more)")
        return True
    from transformers import LlamaConfig

    from kvtc.pipeline.job.memory_plan import plan_gpus
    from kvtc.workers.capture import CaptureSettings, capture_kv
    from kvtc.workers.model_size import model_size
    from kvtc.workers.models import load_model

    spec, settings = "tiny:llama@8x4x64", CaptureSettings(sinks=4, window=16, objective="mse")
    ids = torch.randint(0, 49152, (2, 160), generator=torch.Generator().manual_seed(0))
    one = load_model(spec, device="cuda:0", dtype="float32")
    units = model_size(one.config, torch.float32, 160).units
    share = sum(u.bytes for u in units) // n + max(u.bytes for u in units)
    spread = load_model(spec, dtype="float32", gpu_budgets={i: share for i in range(n)})
    used = sorted({str(p.device) for p in spread.model.parameters()})
    a, b = capture_kv(one, ids.cuda(), settings), capture_kv(spread, ids.cuda(), settings)
    diff = max(float((x - y).abs().max()) for x, y in ((a.keys, b.keys), (a.values, b.values)))
    print(f"multi-GPU: {spec} spread over {used}: capture max abs difference {diff:.1e} against one GPU")
    memory = torch.cuda.get_device_properties(0).total_memory
    for name, layers, hidden, inter, heads in (("8B", 32, 4096, 14336, 32), ("70B", 80, 8192, 28672, 64)):
        config = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                             num_attention_heads=heads, num_key_value_heads=8, vocab_size=128256,
                             tie_word_embeddings=False)
        plan = plan_gpus(model_size(config, torch.bfloat16, 1024), memory, n, n, lambda workers: 2 << 30)
        print(f"multi-GPU: Llama-3.1-{name} bf16 plan on {memory / 2**30:.0f} GiB GPUs: {plan.gpus} per worker")
    return len(used) == n and diff < 1e-4


def check_vllm_offload(chunks: int = 8, block: int = 16, chunk_tokens: int = 256) -> bool:
    """vLLM pages -> ChunkCodec on CUDA -> blob -> pages of other blocks; the CPU decodes the same blobs."""
    from helpers.synthetic import synthetic_ecsq
    from kvtc.kernels.integrations.vllm_offload import ChunkCodec, PageFormat

    ok = True
    spec = synthetic_ecsq(synthetic_spec(num_layers=30, kv_heads=3, head_dim=64, ratio=16.0, sinks=4, window=128))
    L, H, D = spec.num_layers, spec.kv_heads, spec.head_dim
    page = PageFormat(kv_heads=H, tokens=block, head_dim=D, dtype=torch.bfloat16, order="NHC")
    per_chunk = chunk_tokens // block
    nblocks = 2 * chunks * per_chunk
    keys, values = synthetic_cache(spec, chunks * chunk_tokens, torch.bfloat16)
    # vLLM's per-layer cache [B, N, H, K|V], the first chunks * per_chunk blocks holding the sequence
    cells = torch.cat([keys, values], dim=-1).permute(0, 2, 1, 3).reshape(L, chunks * per_chunk, block, H, 2 * D)
    layers = torch.zeros(L, nblocks, block, H, 2 * D, dtype=torch.bfloat16, device="cuda")
    layers[:, :chunks * per_chunk] = cells.cuda()
    pages = [layers[i].view(torch.int8).reshape(nblocks, page.page_bytes) for i in range(L)]
    for mode in ("fixed", "ecsq"):
        chunk = ChunkCodec(KVTCCodec(spec, mode=mode), list(range(L)))
        cpu = ChunkCodec(KVTCCodec(spec, mode=mode, backend="torch"), list(range(L)))
        store = load = 0.0
        sizes, errs = [], []
        for c in range(chunks):
            src = torch.arange(c * per_chunk, (c + 1) * per_chunk, device="cuda")
            dst = src + chunks * per_chunk
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            read = [page.read(p, src) for p in pages]
            k, v = torch.stack([a for a, _ in read]), torch.stack([b for _, b in read])
            blob = chunk.encode(k, v, c * chunk_tokens)
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            dk, dv = chunk.decode(blob, torch.device("cuda"), c * chunk_tokens)
            for i, p in enumerate(pages):
                page.write(p, dst, dk[i], dv[i])
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            store, load, sizes = store + t1 - t0, load + t2 - t1, sizes + [len(blob)]
            back = [page.read(p, dst) for p in pages]
            ok &= bool(torch.equal(torch.stack([a for a, _ in back]), dk.to(torch.bfloat16)))
            ck, cv = cpu.decode(blob, torch.device("cpu"), c * chunk_tokens)
            errs.append(max(float((ck.float() - dk.float().cpu()).abs().max()),
                            float((cv.float() - dv.float().cpu()).abs().max())))
            ref = torch.cat([k, v]).float()
            rel = float((torch.cat([dk, dv]).float() - ref).norm() / ref.norm())
            ok &= rel < 0.5
        raw = chunk_tokens * L * H * D * 2 * 2
        ok &= max(errs) < 0.05
        print(f"vllm offload {mode}: {np.mean(sizes):.0f} bytes per {chunk_tokens}-token chunk ({raw / np.mean(sizes):.2f}x "
              f"below bf16), store {1e3 * store / chunks:.2f} ms, load {1e3 * load / chunks:.2f} ms per chunk, "
              f"CUDA vs CPU decode max |diff| {max(errs):.2e}, last chunk rel. error {rel:.4f}")
    return ok


def check_attention_objective() -> bool:
    from kvtc.kernels.codec.kvtc_codec import KVTCCodec
    from kvtc.workers.capture import CaptureSettings, capture_kv
    from kvtc.workers.models import load_model

    settings = CaptureSettings(sinks=4, window=16, objective="attention")
    ids = torch.randint(0, 49152, (2, 160), generator=torch.Generator().manual_seed(0))
    sums = {}
    for device, dtype in (("cpu", "float32"), ("cuda", "bfloat16")):
        lm = load_model("tiny:llama", device=device, dtype=dtype)
        cap = capture_kv(lm, ids.to(device), settings)
        sums[device] = {k: v.double() / cap.metric_tokens for k, v in cap.metric.items()}
    ok = True
    for key in ("keys", "values"):
        rel = float((sums["cuda"][key] - sums["cpu"][key]).abs().max() / sums["cpu"][key].abs().max())
        print(f"attention metric {key}: cuda bf16 vs cpu fp32 max rel. difference {rel:.2e}")
        ok &= rel < 5e-2
    import tempfile

    from kvtc.artifacts import publish, pull

    sys.path.insert(0, str(ROOT / "tests" / "kernels" / "codec"))
    from test_decoder import FULL, PARTIAL, _cache, whitened_content  # the decoder tests' pair E = S U, D = S^-1 U

    root = Path(tempfile.mkdtemp()) / "reg"
    art = pull(publish(whitened_content(), root).name, registry=str(root))
    keys, values = _cache(300)
    for mode, ratio in (("fixed", PARTIAL), ("ecsq", FULL)):  # the toy's ECSQ tables are at FULL
        cpu = KVTCCodec(art, ratio, backend="torch", mode=mode)
        gpu = KVTCCodec(art, ratio, backend="triton", mode=mode)
        k_ref, v_ref = cpu.decode(cpu.encode(keys, values))
        k_gpu, v_gpu = gpu.decode(gpu.encode(keys.cuda(), values.cuda()), device="cuda")
        diff = max(float((k_gpu.cpu() - k_ref).abs().max()), float((v_gpu.cpu() - v_ref).abs().max()))
        scale = float(keys.abs().max())
        print(f"whitened artifact, {mode}: triton on CUDA vs torch on CPU max |diff| {diff:.2e} (cache max {scale:.1f})")
        ok &= diff < 0.05 * scale
    return ok


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-overhead", action="store_true")
    ap.add_argument("--only-offload", action="store_true", help="run section 7 (the vLLM offloading tier) alone")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device torch can see; nothing to check")
        return 2
    print(f"device: {torch.cuda.get_device_name()} torch {torch.__version__}")
    if args.only_offload:
        ok = check_vllm_offload()
        print("GPU CHECK", "PASSED" if ok else "FAILED")
        return 0 if ok else 1
    ok = check_kernels() & check_capture() & check_reducer() & check_eigh_sizes() & check_reduce_task()
    import gpu_rans

    ok &= gpu_rans.check_identity() & gpu_rans.check_geometry(32768, 4096)
    ok &= check_multi_gpu()
    ok &= check_vllm_offload()
    ok &= check_attention_objective()
    if not args.skip_overhead:
        subprocess.run([sys.executable, str(ROOT / "bench" / "worker_overhead.py"), "--device", "cuda",
                        "--sequences", "32", "--batch", "8"], check=False, env=os.environ.copy())
    print("GPU CHECK", "PASSED" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
