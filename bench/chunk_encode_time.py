"""Encode time and codings of a first chunk against a later one, through the chunk transform the servers run.

A first chunk (start 0) keeps the artifact's sinks raw inside the budget of a later chunk (shared sinks), so the
transform codes it at a smaller ECSQ budget, and may try again; a later chunk (start = tokens) is coded once. Per
ratio, for both chunks of a real cache of the embedded model (`pydoc_data.topics` prose, prefilled once): seconds
per `serialize` (best and median of --repeats, after a warm-up), the codings it took (KVTCCodec.encode calls; mode
encodes, one per stream and coding, re-encodes after outlier selection included; decodes of a coded middle to select
outlier vectors), the stored blob's bytes against `serialized_size`, and the first / later time. With --before DIR
(a copy of the repository's code at an earlier commit, e.g. `git archive HEAD kernels artifacts workers pipeline |
tar -x -C DIR`), the same chunks run through that code in a subprocess first, and both tables print.

    python bench/chunk_encode_time.py [--registry registry] [--artifact smollm2-135m@latest] [--ratios 8,16,32]
        [--tokens 256] [--prefill 1536] [--repeats 3] [--threads 2] [--before DIR]
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.abc
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


class _RootFinder(importlib.abc.MetaPathFinder):
    """kvtc.<folder> from another copy of the repository (the --root of a baseline run)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def find_spec(self, name, path, target=None):  # noqa: ANN001, ANN201 - the finder protocol
        parts = name.split(".")
        if len(parts) != 2 or parts[0] != "kvtc" or not (self.root / parts[1] / "__init__.py").exists():
            return None
        folder = self.root / parts[1]
        return importlib.util.spec_from_file_location(name, folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--registry", default=str(REPO / "registry"))
    p.add_argument("--artifact", default="smollm2-135m@latest")
    p.add_argument("--ratios", default="8,16,32")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--prefill", type=int, default=1536)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kinds", default="text", help="text (the real chunks), or x<scale>: them scaled, e.g. x1e6")
    p.add_argument("--before", help="a copy of the code at an earlier commit, measured first in a subprocess")
    p.add_argument("--root", help=argparse.SUPPRESS)  # the subprocess: import kvtc from this copy
    p.add_argument("--kv", help=argparse.SUPPRESS)  # the subprocess: the chunks the parent captured
    p.add_argument("--json", help=argparse.SUPPRESS)  # the subprocess: write its rows here
    return p.parse_args(argv)


def capture(prefill: int):
    """(2, L, prefill, H * D) bf16: the embedded model's cache of `prefill` tokens of Python's documentation prose."""
    import torch
    from pydoc_data.topics import topics

    from kvtc.workers.capture import raw_cache
    from kvtc.workers.models import load_model

    lm = load_model("smollm2-135m", device="cpu")
    ids: list[int] = []
    for key in sorted(topics):
        ids += lm.tokenizer(topics[key]).input_ids
        if len(ids) >= prefill:
            break
    keys, values = raw_cache(lm, torch.tensor([ids[:prefill]]))
    L, H, T, D = keys.shape
    return torch.stack([x.to(torch.bfloat16).permute(0, 2, 1, 3).reshape(L, T, H * D) for x in (keys, values)])


class Counts:
    """Calls of the codec's and the modes' encode and decode methods, counted while `on`."""

    def __init__(self) -> None:
        from kvtc.kernels.codec import ecsq, ecsq_mode, fixed_mode, kvtc_codec

        self.on, self.n = False, {"codings": 0, "mode encodes": 0, "middle decodes": 0, "step attempts": 0}
        ecsq._attempt = self._counted(ecsq._attempt, "step attempts")  # read from the module by the step search
        # a mode's blob coding is its own object since the split by job (EcsqBlob, FixedBlob); before it, the mode's
        blob = [getattr(m, n, None) or getattr(m, o) for m, n, o in ((ecsq_mode, "EcsqBlob", "EcsqMode"),
                                                                     (fixed_mode, "FixedBlob", "FixedMode"))]
        for cls, name, what in ((kvtc_codec.KVTCCodec, "encode", "codings"),
                                *((c, "encode", "mode encodes") for c in blob),
                                *((c, "decoder", "middle decodes") for c in blob)):
            setattr(cls, name, self._counted(getattr(cls, name), what))

    def _counted(self, fn, what):  # noqa: ANN001, ANN202
        def wrapper(*a, **k):  # noqa: ANN002, ANN003, ANN202
            if self.on:
                self.n[what] += 1
            return fn(*a, **k)
        return wrapper

    def around(self, fn):  # noqa: ANN001, ANN201
        self.n = dict.fromkeys(self.n, 0)
        self.on = True
        try:
            return fn()
        finally:
            self.on = False


def measure(args: argparse.Namespace, kv) -> list[dict]:  # noqa: ANN001
    import torch

    from kvtc.artifacts import pull
    from kvtc.kernels.codec.kvtc_codec import KVTCCodec
    from kvtc.pipeline.evaluation.served import chunk_transform

    torch.set_num_threads(args.threads)
    counts = Counts()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        artifact = pull(args.artifact, registry=args.registry)
    n, rows = args.tokens, []
    for ratio in [float(r) for r in args.ratios.split(",")]:
        t = chunk_transform(KVTCCodec(artifact, ratio))  # as the servers and the served check hold it
        bound = t.serialized_size((2, kv.shape[1], n, kv.shape[3]), kv.dtype)
        for (name, start), kind in ((c, k) for k in args.kinds.split(",") for c in (("first", 0), ("later", n))):
            chunk = kv[:, :, start:start + n].contiguous()
            if kind != "text":  # the real chunk scaled: values unlike the calibration's, coded fixed-rate
                chunk = (chunk.float() * float(kind[1:])).to(chunk.dtype)
            data = t.serialize(chunk, start=start)  # warm-up: bases on the device, tables built
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                data = counts.around(lambda: t.serialize(chunk, start=start))  # noqa: B023 - called here
                times.append(time.perf_counter() - t0)
            out = torch.empty_like(chunk)
            t.deserialize(data, out, start=start)
            err = float((out.float() - chunk.float()).norm() / chunk.float().norm())
            rows.append({"ratio": ratio, "chunk": name, "kind": kind, "best": min(times), "median": statistics.median(times),
                         **counts.n, "bound": bound,
                         "blob": int.from_bytes(data[24:32], "little"), "rel_error": err,
                         "sha": hashlib.sha256(data[48:48 + int.from_bytes(data[24:32], "little")]).hexdigest()[:8]})
    return rows


def table(rows: list[dict], title: str) -> str:
    lines = [title, "| CR | chunk | s (best / median) | codings | mode encodes | middle decodes | step attempts | "
             "blob / bound bytes | blob sha256 | rel. error | first / later |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    later = {(r["ratio"], r["kind"]): r["best"] for r in rows if r["chunk"] == "later"}
    for r in rows:
        first = r["chunk"] == "first"
        lines.append(f"| {r['ratio']:g} | {r['chunk']}{'' if r['kind'] == 'text' else ' ' + r['kind']} | "
                     f"{r['best']:.2f} / {r['median']:.2f} | {r['codings']} | {r['mode encodes']} | "
                     f"{r['middle decodes']} | {r['step attempts']} | {r['blob']:,} / {r['bound']:,} | {r['sha']} | "
                     f"{r['rel_error']:.4f} | " + (f"{r['best'] / later[r['ratio'], r['kind']]:.2f}x" if first else "")
                     + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = _args(argv)
    if args.root:
        sys.meta_path.insert(0, _RootFinder(Path(args.root).resolve()))
    import torch

    if args.kv:
        kv = torch.load(args.kv)
    else:
        torch.set_num_threads(args.threads)
        kv = capture(args.prefill)
    if args.json:  # a baseline subprocess
        Path(args.json).write_text(json.dumps(measure(args, kv)))
        return
    with open("/proc/loadavg") as f:
        print(f"load before: {f.read().split()[:3]}", flush=True)
    if args.before:
        with tempfile.TemporaryDirectory() as tmp:
            torch.save(kv, os.path.join(tmp, "kv.pt"))
            cmd = [sys.executable, "-P", __file__, "--root", args.before, "--kv", os.path.join(tmp, "kv.pt"),
                   "--json", os.path.join(tmp, "rows.json"), "--registry", args.registry, "--artifact", args.artifact,
                   "--ratios", args.ratios, "--tokens", str(args.tokens), "--repeats", str(args.repeats),
                   "--threads", str(args.threads), "--kinds", args.kinds]
            subprocess.run(cmd, check=True)
            before = json.loads(Path(tmp, "rows.json").read_text())
        print(table(before, f"before ({args.before})"), flush=True)
    print(table(measure(args, kv), "after (this tree)"))
    with open("/proc/loadavg") as f:
        print(f"load after: {f.read().split()[:3]}")


if __name__ == "__main__":
    main()
