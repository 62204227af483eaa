"""Resident memory of a server holding one artifact at several ratios: each ratio's KVTCCodec and the ChunkTransform
`kvtc lmcache-server` serves it with, every codec instance warmed by a first and a later chunk (the state a serving
process reaches). Prints the artifact's basis matrices, the process's RSS after reading them and after the first
transform (imports, JIT), then what each further ratio adds.

    .venv/bin/python -P bench/server_memory.py --registry ./registry --artifact smollm2-135m@latest --ratios 8,16,32
"""
from __future__ import annotations

import argparse

import psutil
import torch

from kvtc import artifacts
from kvtc.kernels.codec.kvtc_codec import KVTCCodec
from kvtc.pipeline.evaluation.served import chunk_transform


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--registry", default="registry")
    ap.add_argument("--artifact", default="smollm2-135m@latest")
    ap.add_argument("--ratios", default="8,16,32")
    args = ap.parse_args()
    proc = psutil.Process()

    def rss() -> float:
        return proc.memory_info().rss / 2**20

    start = rss()
    art = artifacts.pull(args.artifact, registry=args.registry)
    spec = art.manifest["model"]
    held = 0
    for stream in ("keys", "values"):
        groups = len(art.manifest["calibration"].get("groups") or [[0]])
        for g in range(groups):
            held += art.basis(stream, g)[2].nbytes
            decoder = art.decoder(stream, g)
            held += 0 if decoder is None else decoder.nbytes
    print(f"{art.name}@{art.version}: basis matrices {held / 2**20:.0f} MiB float32; RSS +{rss() - start:.0f} MiB "
          "after reading them")
    width = spec["num_kv_heads"] * spec["head_dim"]
    chunk = torch.randn(2, spec["num_layers"], 256, width, dtype=torch.bfloat16)
    ratios = [float(r) for r in args.ratios.split(",")]
    base, kept = None, []
    for r in ratios:
        transform = chunk_transform(KVTCCodec(art, r))
        for at in (0, 256):
            out = torch.empty_like(chunk)
            transform.deserialize(transform.serialize(chunk, start=at), out, start=at)
        kept.append(transform)
        now = rss()
        if base is None:
            base = now
            print(f"CR {r:g}: RSS +{now - start:.0f} MiB over the start (imports and JIT included)")
        else:
            print(f"CR {r:g}: +{now - base:.0f} MiB over the first ratio")
    print(f"total: RSS +{rss() - start:.0f} MiB for {len(ratios)} ratios")


if __name__ == "__main__":
    main()
