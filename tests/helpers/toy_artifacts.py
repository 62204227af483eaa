"""A small synthetic `ArtifactContent` (random orthonormal bases, a greedy allocation) for tests of
the registry and of anything that consumes artifacts without running a calibration."""
from __future__ import annotations

import hashlib
import json
from typing import Callable

import numpy as np

from kvtc.artifacts.blocks import block_cost_bits, qtype_bits
from kvtc.artifacts.manifest import encode_manifest, listing_hash, manifest_digest
from kvtc.artifacts.groups import parse_groups
from kvtc.artifacts.schema import STREAMS, ArtifactContent

PATTERN = (("fp8", 4), ("int4", 8), ("int2", 16))


def toy_allocation(p: int, ratio: float) -> dict:
    """Greedy blocks from PATTERN within B = floor(16 p / ratio) bits, then one "none" block to p."""
    budget = int(16 * p // ratio)
    blocks, start, cost = [], 0, 0
    for qtype, size in PATTERN:
        size = min(size, p - start)
        block_cost = block_cost_bits(qtype, size)
        if size <= 0 or cost + block_cost > budget:
            break
        blocks.append((start, size, qtype, qtype_bits(qtype), block_cost - size * qtype_bits(qtype)))
        start, cost = start + size, cost + block_cost
    if start < p:
        blocks.append((start, p - start, "none", 0, 0))
    kept = max((b[0] + b[1] for b in blocks if b[2] != "none"), default=0)
    return {"budget_bits": budget, "blocks": blocks, "cost_bits": cost, "kept": kept}


def toy_content(name: str = "toy", num_layers: int = 2, num_kv_heads: int = 2, head_dim: int = 8,
                groups: list | None = None, ratios: tuple = (4.0, 8.0), seed: int = 0,
                bases_dtype: str = "float32", parent: str | None = None) -> ArtifactContent:
    """Synthetic content: p = layers x kv_heads x head_dim per group; float32 bases."""
    rng = np.random.default_rng(seed)
    groups = groups or [[0, num_layers]]
    model = {"spec": "toy", "source": "synthetic", "weights_sha256": "0" * 64, "revision": None,
             "architecture": "LlamaForCausalLM", "model_type": "llama", "num_layers": num_layers,
             "num_kv_heads": num_kv_heads, "head_dim": head_dim, "max_positions": 2048,
             "rope": {"rope_type": "default", "theta": 10000.0, "head_dim": head_dim, "rotary_dim": head_dim},
             "key_norm": False}
    calibration = {"sinks": 4, "window": 128, "seq_len": 1024, "tokens": 4096, "groups": groups, "seed": seed,
                   "allocator": {"block_sizes": [1, 16, 64, 256, 1024], "types": ["none", "int2", "int4", "fp8"],
                                 "error_model": "measured"}, "ratios": list(ratios)}
    corpus = {"spec": "pydoc", "shard_ids": ["a1b2", "c3d4"], "tokens": {"calibration": 4096, "holdout": 1024}}
    bases, allocations, metrics = {}, {}, []
    for stream in STREAMS:
        for g, group in enumerate(parse_groups(groups)):
            p = group.dim(num_kv_heads, head_dim)
            components, _ = np.linalg.qr(rng.standard_normal((p, p)))
            eigenvalues = np.sort(rng.exponential(size=p))[::-1]
            bases[(stream, g)] = (rng.standard_normal(p).astype(np.float32), eigenvalues.astype(np.float32),
                                  components.astype(np.float32))
            for ratio in ratios:
                allocations[(float(ratio), stream, g)] = toy_allocation(p, ratio)
                metrics.append({"ratio": float(ratio), "stream": stream, "group": g, "split": "holdout",
                                "metric": "rel_error", "value": float(rng.random())})
    curves = {"error_by_position": [{"position": t, "stream": s, "ratio": float(r), "rel_error": float(rng.random())}
                                    for t in (0, 1, 4, 64) for s in STREAMS for r in ratios],
              "error_by_tokens": [{"tokens": n, "stream": s, "domain": d, "rel_error": float(rng.random())}
                                  for n in (512, 1024) for s in STREAMS for d in ("pydoc", "stdlib")]}
    extras = {"report.md": b"# toy report\n", "charts/allocation.png": rng.bytes(64)}
    return ArtifactContent(name=name, model=model, calibration=calibration, corpus=corpus, bases=bases,
                           allocations=allocations, metrics=metrics, curves=curves, extra_files=extras,
                           parent=parent, code_version="test", bases_dtype=bases_dtype)


def forge_version(reg, name: str, version: str, mutate: Callable[[dict], None],
                  files: dict[str, bytes] | None = None) -> bytes:
    """Rewrite a version as an attacker with write access would: write `files`, change the manifest,
    fix every hash and the digest file, so that only a pinned digest or a signature can tell.
    -> the forged manifest bytes."""
    prefix = reg.version_path(name, version)
    manifest = json.loads(reg.fs.cat_file(f"{prefix}/manifest.json"))
    for rel, data in (files or {}).items():
        reg.fs.pipe_file(f"{prefix}/{rel}", data)
        manifest["files"][rel] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    mutate(manifest)
    manifest["content_sha256"] = listing_hash(manifest["files"])
    data = encode_manifest(manifest)
    reg.fs.pipe_file(f"{prefix}/manifest.json", data)
    reg.fs.pipe_file(f"{prefix}/manifest.sha256", (manifest_digest(data) + "\n").encode())
    return data
