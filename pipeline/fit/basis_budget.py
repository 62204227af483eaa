"""The basis budget: how many components per group the runtime may hold.

A server holds, per stream and group, the kept columns of the basis (p_g x kept) on its device.
`--basis-budget 3%` caps that at a share of the model's parameter count (both streams, all
groups; one cap K per group: 2 K sum_g p_g <= share x parameters), `--max-components K` caps it
directly; with both, the smaller wins. The allocators (DP and ECSQ) then find the best code that
uses at most K components of each group (AllocatorSettings.max_components, EcsqSettings.max_components).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class BasisBudget:
    """share: of the model's parameters, in (0, 1]; max_components: per group, >= 1; None = no cap."""

    share: float | None = None
    max_components: int | None = None

    def __post_init__(self) -> None:
        if self.share is not None and not (0 < self.share <= 1 and math.isfinite(self.share)):
            raise ValueError(f"basis budget {self.share!r} must be a share of the model's parameters in (0, 1], "
                             "e.g. 3% or 0.03")
        if self.max_components is not None and (not isinstance(self.max_components, int) or self.max_components < 1):
            raise ValueError(f"max components must be an integer >= 1, got {self.max_components!r}")

    @classmethod
    def parse(cls, share: str | float | None, max_components: int | None = None) -> "BasisBudget":
        """share "3%", "0.03" or a float; None for no share cap."""
        if isinstance(share, str):
            text = share.strip()
            try:
                share = float(text[:-1]) / 100 if text.endswith("%") else float(text)
            except ValueError:
                raise ValueError(f"basis budget {text!r} is not a share: give e.g. 3% or 0.03") from None
        return cls(share, max_components)

    @property
    def active(self) -> bool:
        return self.share is not None or self.max_components is not None

    def cap(self, parameters: int | None, features: int) -> int:
        """Components per group (0 = no cap) for a model of `parameters` whose groups hold `features`
        = sum_g p_g per stream."""
        caps = [] if self.max_components is None else [self.max_components]
        if self.share is not None:
            if not parameters:
                raise ValueError("a basis budget as a share needs the model's parameter count")
            k = int(self.share * parameters // (2 * features))
            if k < 1:
                raise ValueError(f"basis budget {self.share:.3%} of {parameters} parameters holds less than one "
                                 f"component per group (p = {features} per stream); raise it")
            caps.append(k)
        return min(caps) if caps else 0


def model_parameters(config: Any) -> int:
    """Parameter count of a transformers config's causal LM, built on the meta device (no memory, no weights)."""
    import torch  # noqa: PLC0415 - this module is the light CLI checks' (kvtc.pipeline.checks.header)
    from transformers import AutoModelForCausalLM  # noqa: PLC0415 - as torch above

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return int(sum(p.numel() for p in model.parameters()))


def basis_elements(features: list[int], kept: list[int]) -> int:
    """Elements a runtime holds for groups of p_g features keeping kept_g columns (components and mean)."""
    return sum(p * (k + 1) for p, k in zip(features, kept))
