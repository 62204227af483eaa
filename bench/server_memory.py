"""Resident memory of a server holding one artifact at several ratios: each ratio's KVTCCodec and the ChunkTransform
`kvtc lmcache-server` serves it with, every codec instance warmed by a first and a later chunk (the state a serving
process reaches). Prints the process's RSS after the first transform (reading the artifact, imports, JIT), what each
further ratio adds, and the basis bytes the codecs hold (each storage once).

--basis float16 (the default): each ratio's codec as the server loads it (lmcache_ranks.load_rank_codec: its own
pull, the basis held once per artifact in half precision, kernels/codec/held_basis.py); float32: every ratio's codec
over one Artifact's own float32 matrices (the server before).

    .venv/bin/python -P bench/server_memory.py --registry ./registry --artifact smollm2-135m@latest --ratios 8,16,32
"""
from __future__ import annotations

import argparse

import psutil
import torch

from kvtc import artifacts
from kvtc.kernels.codec.held_basis import held_bytes
from kvtc.kernels.codec.kvtc_codec import KVTCCodec
from kvtc.kernels.integrations.lmcache_ranks import load_rank_codec
from kvtc.pipeline.evaluation.served import chunk_transform


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--registry", default="registry")
    ap.add_argument("--artifact", default="smollm2-135m@latest")
    ap.add_argument("--ratios", default="8,16,32")
    ap.add_argument("--basis", choices=("float16", "float32"), default="float16")
    args = ap.parse_args()
    proc = psutil.Process()

    def rss() -> float:
        return proc.memory_info().rss / 2**20

    start = rss()
    art = artifacts.pull(args.artifact, registry=args.registry) if args.basis == "float32" else None
    ratios = [float(r) for r in args.ratios.split(",")]
    base, kept, chunk = None, [], None
    for r in ratios:
        codec = KVTCCodec(art, r, basis_dtype=torch.float32) if art is not None else load_rank_codec(args.artifact, r, None,
                                                                            registry=args.registry)
        transform = chunk_transform(codec)
        if chunk is None:
            spec = codec.spec
            chunk = torch.randn(2, spec.num_layers, 256, spec.kv_heads * spec.head_dim, dtype=torch.bfloat16)
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
    held = held_bytes(*(t.codec.spec for t in kept))
    storages = {m.untyped_storage().data_ptr(): m.untyped_storage().nbytes() for t in kept for c in (t.codec,)
                for _, parts in c._on_device.values() for _, m, _ in parts}
    sketches = {g.untyped_storage().data_ptr(): g.untyped_storage().nbytes() for t in kept
                for sk in t.codec._sketches.values() for g in sk.sketched}  # the outlier stage's (error_sketch.py)
    print(f"total: RSS +{rss() - start:.0f} MiB for {len(ratios)} ratios; basis held {held / 2**20:.0f} MiB "
          f"({kept[0].codec.spec.held_dtype}); the codecs' components, each storage once: "
          f"{sum(storages.values()) / 2**20:.0f} MiB; the outlier stage's decoder sketches, each once: "
          f"{sum(sketches.values()) / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
