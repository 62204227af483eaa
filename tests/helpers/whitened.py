"""Whitened toy content: bases that are not orthonormal (encoder E = S U, decoder D = S^-1 U), shared by the
decoder tests and the joint budget's refusal test."""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from kvtc.artifacts.schema import STREAMS
from kvtc.pipeline.fit.ecsq import fit_ecsq
from helpers.toy_artifacts import toy_content

L, H, D = 2, 2, 8
P = H * D  # one group per layer
FULL, PARTIAL = 1.5, 4.0  # ratios: every component at int8 (full rank), and the toy allocation (4 kept)
WHITENED = (("keys", 0), ("keys", 1), ("values", 0))  # ("values", 1) stays orthonormal


def metric_root(p: int, rng: np.random.Generator) -> np.ndarray:
    """S (p, p): symmetric positive definite, block-diagonal with odd block sizes (5, 7, 3, 1) and spread scales."""
    s = np.zeros((p, p))
    start = 0
    for size in (5, 7, 3, 1):
        a = rng.standard_normal((size, size))
        s[start:start + size, start:start + size] = a @ a.T / size + np.diag(rng.uniform(0.3, 3.0, size))
        start += size
    return s


def full_allocation(p: int) -> dict:
    return {"budget_bits": int(16 * p // FULL), "blocks": [(0, p, "int8", 8, 32)], "cost_bits": 8 * p + 32, "kept": p}


def whitened_content(name: str = "whitened", ecsq: bool = True, decoders: bool = True, seed: int = 3):
    """Toy content, one group per layer, RoPE off (sinks 2, window 3): encoder E = S U in place of the
    components of WHITENED bases, decoder D = S^-1 U; allocations at FULL (int8, full rank) and PARTIAL."""
    content = toy_content(name=name, num_layers=L, num_kv_heads=H, head_dim=D, groups=[[0, 1], [1, 2]],
                          ratios=(FULL, PARTIAL), seed=seed)
    rng = np.random.default_rng(seed)
    bases, decs = dict(content.bases), {}
    for key in WHITENED:
        mean, eig, u = bases[key]
        s = metric_root(P, rng)
        bases[key] = (mean, eig, (s @ u).astype(np.float32))
        decs[key] = (np.linalg.inv(s) @ u).astype(np.float32)
    allocations = {k: (full_allocation(P) if k[0] == FULL else v) for k, v in content.allocations.items()}
    model = {**content.model, "rope": None}
    calibration = {**content.calibration, "sinks": 2, "window": 3}
    content = dataclasses.replace(content, bases=bases, allocations=allocations, model=model, calibration=calibration,
                                  decoders=decs if decoders else {})
    if ecsq:
        tables_ = {}
        for (stream, g), (mean, _, comp) in content.bases.items():
            x = features(300, seed + 11)[stream][g]
            z = (torch.from_numpy(x) - torch.from_numpy(mean)) @ torch.from_numpy(comp)
            tables_[(FULL, stream, g)] = fit_ecsq(FULL, z.float(), P).to_table()
        content = dataclasses.replace(content, ecsq=tables_)
    return content


def features(tokens: int, seed: int) -> dict[str, list[np.ndarray]]:
    """Per stream, per group (layer): (tokens, P) float32 rows with a decaying spectrum."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for stream in STREAMS:
        out[stream] = [(torch.randn(tokens, P, generator=g) * torch.linspace(2.0, 0.2, P) + 0.3).numpy()
                       for _ in range(L)]
    return out
