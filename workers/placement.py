"""Spread a model over a worker's GPUs: placement units (kvtc.workers.model_size) packed in forward
order onto GPUs 0, 1, ... within a byte budget each, then dispatched with accelerate (hooks move
each layer's inputs to its GPU). Contiguous packing keeps the cross-GPU hops to one per boundary.
"""
from __future__ import annotations

import torch

from kvtc.workers.model_size import Unit, placement_units


def pack(units: tuple[Unit, ...], budgets: dict[int, int]) -> dict[str, int] | None:
    """{unit name: GPU index}, filling GPUs in index order, each within budgets[gpu] bytes; a tied
    unit goes where its owner went. None when the units do not fit."""
    devices = sorted(budgets)
    out: dict[str, int] = {}
    used = dict.fromkeys(devices, 0)
    d = 0
    for u in units:
        if u.tied_to is not None:
            out[u.name] = out[u.tied_to]
            continue
        while d < len(devices) and used[devices[d]] + u.bytes > budgets[devices[d]]:
            d += 1
        if d == len(devices):
            return None
        used[devices[d]] += u.bytes
        out[u.name] = devices[d]
    return out


def device_map(model: torch.nn.Module, budgets: dict[int, int]) -> dict[str, int]:
    """The device map of `model` (meta or real) within `budgets`; ValueError naming the shortfall."""
    units = placement_units(model)
    placed = pack(units, budgets)
    if placed is None:
        need = sum(u.bytes for u in units)
        raise ValueError(f"the model's {need / 2**30:.1f} GiB of weights do not fit the worker's {len(budgets)} GPU(s) "
                         f"({sum(budgets.values()) / 2**30:.1f} GiB for weights); raise --gpus-per-worker")
    return placed


def config_device_map(config, dtype: torch.dtype, budgets: dict[int, int]) -> dict[str, int]:
    """The device map of the model `config` describes, with weights in `dtype`, built on the meta device."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415 - transformers loads only with a model

    with torch.device("meta"):
        shell = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return device_map(shell, budgets)


def spread(model: torch.nn.Module, budgets: dict[int, int]) -> torch.nn.Module:
    """Dispatch a loaded (CPU) model over CUDA devices 0..n-1 within `budgets` bytes each."""
    from accelerate import dispatch_model  # noqa: PLC0415 - accelerate loads only to spread a model over GPUs

    placed = device_map(model, budgets)
    return dispatch_model(model, device_map=placed, main_device=placed[next(iter(placed))])
