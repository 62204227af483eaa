"""How much GPU memory a model's weights and one capture forward take, from its config alone.

The weights are measured on a weightless (meta device) instance, so every architecture
transformers builds is covered and nothing is allocated. They are cut into placement units, the
pieces a device map may put on different GPUs, in forward order: each decoder layer whole, and
every other child module (embeddings, final norm, LM head). A unit whose parameters are all
tied to an earlier unit's (an LM head sharing the embedding) weighs nothing and follows it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Unit:
    """One placement unit: module name, bytes of its own parameters, the earlier unit it is tied to."""

    name: str
    bytes: int
    tied_to: str | None = None


@dataclass(frozen=True)
class ModelSize:
    """units: placement units in forward order; activation_bytes: the per-GPU working set of one
    forward of one sequence; itemsize: bytes per weight."""

    units: tuple[Unit, ...]
    itemsize: int
    activation_bytes: int

    def __post_init__(self) -> None:
        if not self.units or self.itemsize < 1 or self.activation_bytes < 0 or any(u.bytes < 0 for u in self.units):
            raise ValueError("model size: needs units with bytes >= 0, itemsize >= 1, activation bytes >= 0")

    @property
    def weight_bytes(self) -> int:
        return sum(u.bytes for u in self.units)

    @property
    def parameters(self) -> int:
        return self.weight_bytes // self.itemsize


def placement_units(model: torch.nn.Module) -> tuple[Unit, ...]:
    """Units of a causal LM (meta or real): the base model's children, its layer lists expanded
    layer by layer, then the LM's other children; bytes as the parameters are stored."""
    base_name = getattr(model, "base_model_prefix", "model")
    base = getattr(model, base_name, None)
    modules: list[tuple[str, torch.nn.Module]] = []
    for name, child in model.named_children():
        if child is base:
            for sub, grandchild in child.named_children():
                if isinstance(grandchild, torch.nn.ModuleList):
                    modules += [(f"{name}.{sub}.{i}", layer) for i, layer in enumerate(grandchild)]
                else:
                    modules.append((f"{name}.{sub}", grandchild))
        else:
            modules.append((name, child))
    owner: dict[int, str] = {}
    units = []
    for name, module in modules:
        params = list(module.parameters()) + list(module.buffers())
        own = [p for p in params if id(p) not in owner]
        tied = next((owner[id(p)] for p in params if id(p) in owner), None)
        for p in own:
            owner[id(p)] = name
        units.append(Unit(name, sum(p.numel() * p.element_size() for p in own), tied if not own else None))
    return tuple(units)


def _text_config(config: Any) -> Any:
    return getattr(config, "text_config", None) or config


def model_size(config: Any, dtype: torch.dtype, seq_len: int) -> ModelSize:
    """Weights (in `dtype`) and one forward's working set of `config` at `seq_len` tokens, batch 1:
    4 copies of the widest hidden activation (input, residual, the MLP's gate and up products)
    plus one layer's attention scores (heads x T x T, what eager attention materialises)."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415 - transformers loads only with a model

    with torch.device("meta"):
        shell = AutoModelForCausalLM.from_config(config, dtype=dtype)
    text = _text_config(config)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    width = max(int(getattr(text, "hidden_size", 0) or 0), int(getattr(text, "intermediate_size", 0) or 0))
    heads = int(getattr(text, "num_attention_heads", 1) or 1)
    activations = (4 * seq_len * width + heads * seq_len * seq_len) * itemsize
    return ModelSize(placement_units(shell), itemsize, activations)
