"""The fold's memory: one shard worker's peak RSS per --seq-len, planned (kvtc.pipeline.job.fold_plan) and measured.

Each point runs in a fresh subprocess that does what one shard worker does: load the model
(kvtc.workers.models.load_model), hold the statistics totals of its accumulators, capture one training sequence
with the default capture settings resolved as the job resolves them (attention objective, one KL-sensitivity
pass, and the copy probe's pass, as the job's first training shard does), fold its rows into a total, then store one held-out shard (whole sequences, every position, up to the
worker's row cap, concatenated and serialized as ShardWorker._store_rows does).

Measured: the RSS after loading and a 256-token warm-up that pages the weights in, with the totals resident as
after a worker's first shard (`base`: process, weights, statistics); the peak from there on (VmHWM, reset through
/proc/self/clear_refs, so the load's own transient peak does not hide it); the working set (peak - base); the
process's overall peak (ru_maxrss). `--part` measures one piece alone, to see what holds the memory: capture (the
training sequence only), forward (the model's forward and the KV gather, mse objective), metric (forward and the
attention metric), sensitivity (the KL-sensitivity pass), heldout (one held-out shard). `--guard-gib G` stops a
point when the machine's available memory falls below G GiB (a "before" point that would exhaust it).

    python -P bench/fold_memory.py [--seq-lens 1024,4096,8192] [--part worker] [--accumulators 4 --workers 2]
        [--tree DIR]   # DIR: another tree's code, e.g. `git archive HEAD workers pipeline kernels artifacts | tar -x -C DIR`
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

GIB = 1 << 30
HELDOUT_SHARD_ROWS = 4096  # the job's default: --heldout-rows 8192, half per held-out shard
PARTS = ("worker", "capture", "forward", "metric", "sensitivity", "heldout")


def _tokens(tokenizer, seq_len: int):
    """(1, seq_len) ids cut from pydoc topics text (repeated if short)."""
    import torch
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    ids = tokenizer(text)["input_ids"]
    ids = (ids * (seq_len // len(ids) + 1))[:seq_len]
    return torch.tensor(ids, dtype=torch.int64)[None]


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


def _use_tree(tree: str) -> None:
    """Import kvtc.* from `tree` (its workers/, pipeline/, kernels/, artifacts/) instead of this checkout, through
    the editable install's finder; call before anything imports kvtc."""
    finder = next((m for name, m in sys.modules.items() if name.startswith("__editable__") and "kvtc" in name), None)
    if finder is None or not hasattr(finder, "MAPPING"):
        raise RuntimeError("--tree needs the project installed in editable mode (pip install -e .)")
    for name in list(finder.MAPPING):
        finder.MAPPING[name] = os.path.join(tree, name.split(".", 1)[1])


def measure(seq_len: int, part: str, accumulators: int, threads: int) -> dict:
    """One point, in this process (run it in a fresh one)."""
    import torch

    from kvtc.workers.capture import CaptureSettings, capture_kv
    from kvtc.workers.models import load_model
    from kvtc.workers.sensitivity import kl_sensitivity
    from kvtc.workers.stats import CalibrationStats

    torch.set_num_threads(threads)
    try:  # as the shard worker does, where the code measured has it
        from kvtc.workers.malloc import release_large_frees
        release_large_frees()
    except ImportError:
        pass
    lm = load_model("smollm2-135m", dtype="float32", device="cpu")
    settings = CaptureSettings(objective="attention", groups="model")  # the job resolves auto so on SmolLM2

    def run(ids: torch.Tensor) -> None:
        if part == "sensitivity":
            kl_sensitivity(lm, ids, settings.sinks, settings.window, settings.seed)
        elif part in ("forward", "metric"):
            objective = "mse" if part == "forward" else "attention"
            capture_kv(lm, ids, CaptureSettings(objective=objective, groups="model", sensitivity=0))
        elif part == "heldout":
            heldout_rows(ids)
        else:
            captured = capture_kv(lm, ids, settings, settings.sensitivity, probe=True)  # the first shard's, the largest
            if totals:
                totals[0].update(captured)
            del captured
            if part == "worker":  # a worker also stores held-out shards
                heldout_rows(ids)

    def heldout_rows(ids: torch.Tensor) -> None:
        import numpy as np
        from safetensors.numpy import save

        every = CaptureSettings(sinks=0, window=0, groups="model", objective="mse", sensitivity=0)
        keys, values, n = [], [], 0
        while n < HELDOUT_SHARD_ROWS:
            cap = capture_kv(lm, ids, every)
            keys.append(cap.keys.numpy())
            values.append(cap.values.numpy())
            n += cap.keys.shape[0]
        save({"keys": np.concatenate(keys), "values": np.concatenate(values)})

    totals = [CalibrationStats.new(lm.fingerprint, settings) for _ in range(accumulators if part == "worker" else 0)]
    for total in totals:  # the worker's running totals, resident from its first shard on
        for stream in ("keys", "values"):
            total._get(stream, 0, torch.device("cpu")).gram.fill_(0)
    run(_tokens(lm.tokenizer, 256))  # warm-up: the weights paged in, lazy initialisations done
    ids = _tokens(lm.tokenizer, seq_len)
    base = _status_bytes("VmRSS")
    _reset_peak()
    t0 = time.perf_counter()
    run(ids)
    seconds = time.perf_counter() - t0
    return {"seq_len": seq_len, "part": part, "base_gib": base / GIB, "peak_gib": _status_bytes("VmHWM") / GIB,
            "maxrss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB, "seconds": seconds,
            "attn": lm.model.config._attn_implementation, "code": os.path.dirname(capture_kv.__code__.co_filename)}


GUARD_RC = -9


def _guarded(cmd: list[str], guard_gib: float) -> tuple[int, str, str, float]:
    """Run `cmd`; kill it when the machine's available memory falls below `guard_gib` (0: never).
    -> (return code, GUARD_RC when killed; stdout; stderr; least available GiB seen)."""
    import psutil

    least = psutil.virtual_memory().available / GIB
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        import threading

        out: dict[str, str] = {}
        readers = [threading.Thread(target=lambda k=k, f=f: out.__setitem__(k, f.read()))
                   for k, f in (("stdout", proc.stdout), ("stderr", proc.stderr))]
        for r in readers:
            r.start()
        killed = False
        while proc.poll() is None:
            least = min(least, psutil.virtual_memory().available / GIB)
            if guard_gib and least < guard_gib:
                proc.kill()
                killed = True
            time.sleep(0.2)
        for r in readers:
            r.join()
    return (GUARD_RC if killed else proc.returncode), out.get("stdout", ""), out.get("stderr", ""), least


def planned(seq_len: int, accumulators: int, workers: int) -> float | None:
    """The fold plan's per-worker peak in GiB (None where this checkout has no fold plan)."""
    try:
        from kvtc.pipeline.job.fold_plan import smollm2_worker_bytes
    except ImportError:
        return None
    return smollm2_worker_bytes(seq_len, accumulators=accumulators, workers=workers) / GIB


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-lens", default="1024,4096,8192")
    ap.add_argument("--part", default="worker", choices=PARTS)
    ap.add_argument("--accumulators", type=int, default=4, help="the job's --accumulators (the worker holds its share)")
    ap.add_argument("--workers", type=int, default=2, help="the job's shard workers (each holds accumulators/workers)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads, as --threads-per-worker")
    ap.add_argument("--guard-gib", type=float, default=2.0, help="stop a point below this much available memory")
    ap.add_argument("--tree", default=None, help="measure the kvtc code of this folder (before/after comparisons)")
    ap.add_argument("--point", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.tree:
        _use_tree(os.path.abspath(args.tree))
    held = -(-args.accumulators // max(1, min(args.workers, args.accumulators)))
    if args.point is not None:
        print(json.dumps(measure(args.point, args.part, held, args.threads)))
        return 0
    print(f"# fold memory, part {args.part}, {held} accumulator total(s) held, {args.threads} thread(s), "
          f"code {args.tree or 'this checkout'}; "
          f"load {os.getloadavg()[0]:.2f}")
    print("| seq-len | planned GiB | base GiB | peak GiB (capture) | working set GiB | maxrss GiB | capture s | attention |")
    print("|---|---|---|---|---|---|---|---|")
    for t in (int(s) for s in args.seq_lens.split(",")):
        cmd = [sys.executable, "-P", __file__, "--point", str(t), "--part", args.part, "--accumulators",
               str(args.accumulators), "--workers", str(args.workers), "--threads", str(args.threads),
               *(["--tree", args.tree] if args.tree else [])]
        rc, stdout, stderr, least = _guarded(cmd, args.guard_gib)
        if rc != 0:
            why = f"stopped by the guard, available memory down to {least:.1f} GiB" if rc == GUARD_RC else \
                f"failed (rc {rc}): {stderr.strip().splitlines()[-1:]}"
            print(f"| {t} | {why} |", flush=True)
            continue
        r = json.loads(stdout.strip().splitlines()[-1])
        if args.tree and not r["code"].startswith(os.path.abspath(args.tree)):
            raise RuntimeError(f"--tree {args.tree}: the point ran the code of {r['code']}")
        plan = None if args.tree else planned(t, args.accumulators, args.workers)
        print(f"| {t} | {'-' if plan is None else f'{plan:.2f}'} | {r['base_gib']:.2f} | {r['peak_gib']:.2f} | "
              f"{r['peak_gib'] - r['base_gib']:.2f} | {r['maxrss_gib']:.2f} | {r['seconds']:.1f} | {r['attn']} |", flush=True)
    print(f"# load after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
