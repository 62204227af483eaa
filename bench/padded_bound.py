"""What a padding chunk store keeps per chunk: the serde's size bound against the chunk's bytes in bf16.

LMCache's filesystem adapter reads back exactly the estimated size, so every stored chunk is padded to
`ChunkTransform.serialized_size`, the largest blob any chunk of that shape can be (a first chunk with its raw
sinks, the ECSQ budget, the fixed-rate fallback's exact size). Prints, per artifact and ratio, that bound, the
ratio below bf16 it gives and its share of the nominal ratio (goal >= 0.95), and the parts: the ECSQ bound and
the fixed-rate fallback's size at a later chunk's position, and whether a first chunk shares its budget with
its sinks. Instant; no model is run.

    python bench/padded_bound.py --registry URI --artifacts NAME@REF [NAME@REF ...] [--tokens 256]
"""
from __future__ import annotations

import argparse
import logging
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvtc.kernels import KVTCCodec  # noqa: E402
from kvtc.kernels.codec.chunk_serde import ChunkTransform  # noqa: E402


def report(ref: str, registry: str, ratio: float, tokens: int) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an artifact made with an older kernel bundle: measured with this one
        codec = KVTCCodec.from_registry(ref, ratio, registry)
    t = ChunkTransform(codec, positions=True)
    s, dtype = t.spec, torch.bfloat16
    shape = (2, s.num_layers, tokens, s.kv_heads * s.head_dim)
    raw = 2 * s.num_layers * tokens * s.kv_heads * s.head_dim * 2
    size = t.serialized_size(shape, dtype)
    later = t.sinks or 0
    return (f"{ref} CR {ratio:g}, {tokens}-token chunks: bound {size} bytes = {raw / size:.2f}x below bf16 "
            f"({raw / size / ratio:.3f} of nominal); ECSQ {t.mode_bound(tokens, dtype, later)}, fixed-rate fallback "
            f"{t.fixed_size(tokens, dtype, later)}; first chunk shares its budget: {t._shares(tokens, dtype)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--registry", required=True)
    ap.add_argument("--artifacts", nargs="+", required=True)
    ap.add_argument("--ratios", default="8,16,32")
    ap.add_argument("--tokens", type=int, default=256)
    args = ap.parse_args()
    logging.getLogger("kvtc.chunk_serde").setLevel(logging.ERROR)
    for ref in args.artifacts:
        for ratio in (float(r) for r in args.ratios.split(",")):
            print(report(ref, args.registry, ratio, args.tokens), flush=True)


if __name__ == "__main__":
    main()
