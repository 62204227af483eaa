"""The allocator's settings (kvtc.pipeline.fit.allocator uses them). Light, for the command line:
the fields a user sets are `kvtc calibrate` options."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvtc.artifacts.blocks import budget_bits, cheapest_bits_per_component, qtype_bits
from kvtc.workers.options import Word, joined, numbers, option, words


class BitSplit(Word):
    """--bit-split: how each ratio's bits are shared between the bases."""

    JOINT = "joint"
    EVEN = "even"

    @property
    def shares_total(self) -> bool:
        """One total per ratio split between the bases where it lowers the model's error most (a pool of two or
        more bases: kvtc.pipeline.fit.joint_budget); else every basis its own floor(16 p / CR) bits per token."""
        return self is BitSplit.JOINT


BIT_SPLITS = BitSplit.words()


def _share(word: Any) -> float:
    """"3%", "0.03" or a number -> 0.03; "none" -> 0.0 (no basis budget)."""
    if isinstance(word, (int, float)):
        return float(word)
    text = str(word).strip()
    if text.lower() in ("", "none"):
        return 0.0
    try:
        return float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise ValueError(f"--basis-budget {text!r} is not a share: give e.g. 3% or 0.03") from None


def _components(word: Any) -> int:
    if isinstance(word, int):
        return word
    text = str(word).strip().lower()
    if text in ("", "none"):
        return 0
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"--max-components must be an integer, got {word!r}") from None


@dataclass(frozen=True)
class AllocatorSettings:
    """block_sizes: allowed block lengths; types: allowed block types ("none" or any reference
    qtype; the dropped tail is always "none"); error_model: "measured" (reference quantizer on
    held-out projections) or "analytic"; min_rows / recommended_rows: held-out rows below which
    allocation fails / warns; max_dp_states: cap on DP table cells; cost_unit: 0 = automatic;
    max_components: the basis budget, components per group the code may use (0 = no cap);
    basis_budget: the share of the model's parameters that sets max_components (0 = none; the job
    resolves it: pipeline/fit/basis_budget.py, and records the resulting max_components)."""

    block_sizes: tuple[int, ...] = option((1, 16, 64, 256, 1024), "DP block lengths, comma separated",
                                          parse=numbers(int, "--block-sizes"), show=joined)
    types: tuple[str, ...] = option(("none", "int2", "int4", "fp8"), "DP block types, comma separated", parse=words,
                                    show=joined)
    error_model: str = option("measured", "measured (reference quantizer on held-out rows) or analytic",
                              choices=("measured", "analytic"))
    min_rows: int = 16
    recommended_rows: int = 1024
    max_dp_states: int = 150_000_000
    cost_unit: int = 0
    max_components: int = option(0, "components per group the allocators may use", parse=_components,
                                 show=lambda v: str(v) if v else "none")
    basis_budget: float = option(0.0, "basis memory a server may hold, as a share of the model's parameters (e.g. 3%%): "
                                      "caps the components per group both allocators may use", parse=_share,
                                 show=lambda v: f"{100 * v:g}%" if v else "none")
    bit_split: BitSplit = option(BitSplit.JOINT, "joint: the ECSQ mode's total is split between keys, values and "
                                                "layer groups where it lowers the model's error most (with --objective "
                                                "mse, between a stream's groups); even: every basis gets floor(16 p / "
                                                "CR) bits per token", choices=BIT_SPLITS)

    def __post_init__(self) -> None:
        sizes, types = tuple(self.block_sizes), tuple(self.types)
        if not sizes or any(not isinstance(s, int) or s < 1 for s in sizes) or len(set(sizes)) != len(sizes):
            raise ValueError(f"block_sizes={sizes}: give distinct positive integers, e.g. (1, 16, 64, 256, 1024)")
        for t in types:
            qtype_bits(t)
        if len(set(types)) != len(types) or not any(t != "none" for t in types):
            raise ValueError(f"types={types}: give distinct types with at least one quantized type, e.g. int4")
        if self.error_model not in ("measured", "analytic"):
            raise ValueError(f"error_model={self.error_model!r}: use 'measured' or 'analytic'")
        if not 1 <= self.min_rows <= self.recommended_rows:
            raise ValueError("min_rows must be >= 1 and <= recommended_rows")
        if self.max_dp_states < 1000 or self.cost_unit < 0:
            raise ValueError("max_dp_states must be >= 1000 and cost_unit >= 0 (0 = automatic)")
        if not isinstance(self.max_components, int) or self.max_components < 0:
            raise ValueError(f"--max-components must be an integer >= 1 (0 or none: no cap), got {self.max_components!r}")
        if not (0 <= self.basis_budget <= 1 and math.isfinite(self.basis_budget)):
            raise ValueError(f"--basis-budget {self.basis_budget!r} must be a share of the model's parameters in (0, 1], "
                             "e.g. 3% or 0.03")
        object.__setattr__(self, "bit_split", BitSplit.of(self.bit_split, "--bit-split"))
        object.__setattr__(self, "block_sizes", tuple(sorted(sizes)))
        object.__setattr__(self, "types", types)

    @property
    def quantized_types(self) -> tuple[str, ...]:
        return tuple(t for t in self.types if t != "none")

    def kept_bound(self, p: int, ratios, budgets=None) -> int:
        """Most components any allocation at `ratios` can keep: the largest budget (each ratio's own, or
        `budgets`, bits per token per ratio, a joint split's) over the cheapest bits per component, capped at p
        and at the basis budget (max_components)."""
        per_component = cheapest_bits_per_component(self.types, self.block_sizes, p)
        most = max(budgets) if budgets else budget_bits(p, min(ratios))
        return max(1, min(p, self.max_components or p, math.floor(most / per_component)))

    def to_dict(self) -> dict:
        return {"block_sizes": list(self.block_sizes), "types": list(self.types), "error_model": self.error_model,
                "min_rows": self.min_rows, "recommended_rows": self.recommended_rows,
                "max_dp_states": self.max_dp_states, "cost_unit": self.cost_unit,
                "max_components": self.max_components, "basis_budget": self.basis_budget, "bit_split": self.bit_split.value,
                "aligned_starts": True}

    @classmethod
    def from_dict(cls, d: dict) -> "AllocatorSettings":
        """Inverse of to_dict (unknown keys are an error; "aligned_starts" is informational)."""
        d = {k: v for k, v in d.items() if k != "aligned_starts"}
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown allocator settings {sorted(unknown)}")
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})
