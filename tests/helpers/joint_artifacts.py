"""A toy artifact with a joint bit split (`calibration.bit_split` and ECSQ tables fitted within each share), and
the forgeries of that record and of the tables' budgets that the integrity tests and bench/hostile.py's
calibration-side families read back."""
from __future__ import annotations

import copy
import dataclasses
from typing import Callable

import torch

from kvtc.artifacts.blocks import budget_bits
from kvtc.artifacts.ecsq_tables import encode_ecsq
from kvtc.artifacts.schema import STREAMS, ArtifactContent
from kvtc.pipeline.fit.ecsq import fit_ecsq
from helpers.toy_artifacts import toy_content

P = 32  # toy_content's one group: 2 layers x 2 KV heads x head_dim 8
RATIOS = (4.0, 8.0)
SHIFT = 8  # bits per token the keys take from the values at every ratio


def _projections(content: ArtifactContent, stream: str, rows: int = 256, seed: int = 5) -> torch.Tensor:
    mean, _, comp = content.bases[(stream, 0)]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, P, generator=g) * torch.linspace(2.0, 0.2, P) + torch.from_numpy(mean)
    return ((x - torch.from_numpy(mean)) @ torch.from_numpy(comp)).float()


def joint_content(name: str = "joint", joint: bool = True) -> ArtifactContent:
    """toy_content with ECSQ tables at RATIOS; `joint`: keys SHIFT bits over their own share and values SHIFT
    under, recorded in calibration.bit_split as a calibration records it; else each its own (no record)."""
    content = toy_content(name=name, ratios=RATIOS)
    tables, bits = {}, []
    for ratio in RATIOS:
        own = budget_bits(P, ratio)
        shares = {"keys": own + SHIFT, "values": own - SHIFT} if joint else {s: own for s in STREAMS}
        for stream in STREAMS:
            fit = fit_ecsq(ratio, _projections(content, stream), P, budget=shares[stream])
            tables[(ratio, stream, 0)] = fit.to_table()
            bits.append({"ratio": ratio, "stream": stream, "group": 0, "bits": shares[stream], "own": own})
    calibration = dict(content.calibration)
    if joint:
        calibration["bit_split"] = {"split": "joint", "unit": "each stream's squared error",
                                    "weights": [[s, 0, 1.0] for s in STREAMS], "bits": bits}
    model = {**content.model, "rope": None}  # no RoPE: the runtime codec loads it as is
    return dataclasses.replace(content, model=model, calibration=calibration, ecsq=tables)


def _entries(m: dict) -> list[dict]:
    return m["calibration"]["bit_split"]["bits"]


def _set(ratio: float, stream: str, field: str, value) -> Callable[[dict], None]:
    def edit(m: dict) -> None:
        for e in _entries(m):
            if e["ratio"] == ratio and e["stream"] == stream:
                e[field] = value
    return edit


def _shift(delta: int) -> Callable[[dict], None]:
    def edit(m: dict) -> None:
        for e in _entries(m):
            if e["ratio"] == 8.0:
                e["bits"] += delta if e["stream"] == "keys" else -delta
    return edit


RECORD_FORGERIES: dict[str, Callable[[dict], None]] = {
    "a share of 1e400 (inf)": _set(8.0, "keys", "bits", float("inf")),
    "a share of 10^30": _set(8.0, "keys", "bits", 10 ** 30),
    "a share that is a string": _set(8.0, "keys", "bits", "72"),
    "a share of NaN": _set(8.0, "keys", "bits", float("nan")),
    "a negative share (the other takes it)": _shift(-80),
    "a share of 0 (the other takes it)": _shift(-72),
    "shares one bit over the total": _set(8.0, "keys", "bits", budget_bits(P, 8.0) + SHIFT + 1),
    "a ratio missing": lambda m: m["calibration"]["bit_split"].update(
        bits=[e for e in _entries(m) if e["ratio"] != 8.0]),
    "a ratio the artifact does not have": _set(8.0, "keys", "ratio", 16.0),
    "a basis listed twice": lambda m: _entries(m).append(copy.deepcopy(_entries(m)[0])),
    "its own share misrecorded": _set(8.0, "values", "own", 1),
    "the record is not an object": lambda m: m["calibration"].update(bit_split="joint"),
}


def forged_ecsq(content: ArtifactContent, edit: Callable[[dict], None]) -> bytes:
    """ecsq.parquet of `content` with its tables' budgets edited by `edit({(ratio, stream, group): table})`."""
    tables = {k: dict(v) for k, v in content.ecsq.items()}
    edit(tables)
    return encode_ecsq(tables)


def _budgets(**by_stream: int) -> Callable[[dict], None]:
    def edit(tables: dict) -> None:
        for (ratio, stream, _), t in tables.items():
            if ratio == 8.0 and stream in by_stream:
                t["budget_bits"] = by_stream[stream]
    return edit


TABLE_FORGERIES: dict[str, tuple[bool, Callable[[dict], None]]] = {  # label: (on the joint artifact?, edit)
    "ECSQ budget 0, the other stream twice its own (no joint record)":
        (False, _budgets(keys=0, values=2 * budget_bits(P, 8.0))),
    "ECSQ budgets swapped against the joint record":
        (True, _budgets(keys=budget_bits(P, 8.0) - SHIFT, values=budget_bits(P, 8.0) + SHIFT)),
    "ECSQ budget 0 beside the joint record": (True, _budgets(keys=0, values=2 * budget_bits(P, 8.0))),
}

