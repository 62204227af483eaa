"""What `kvtc eval` and the main job's served check score: the ratios, the continuation, the sequences, the
baselines and the prefix (EvalSettings), in a module that loads no torch, so the command layer reads its
names and checks its settings before anything heavy loads (kvtc.pipeline.evaluation.model_quality scores)."""
from __future__ import annotations

from dataclasses import dataclass

from kvtc.artifacts.blocks import check_ratios

BASELINES = ("kivi", "fp8", "pca_uniform", "evict", "deflate")
KIVI_CONFIGS = ((2, 32), (2, 128), (4, 32), (4, 128))


@dataclass(frozen=True)
class EvalSettings:
    """ratios: codec ratios (also the budgets of pca_uniform and evict); continuation: tokens scored
    per sequence; sequences: how many held-out sequences; baselines: subset of BASELINES; mode: the
    codec's mode, "ecsq" or "fixed" (None: the codec's default, ECSQ where the artifact has its tables);
    served: also each ratio through the chunk path the serving integrations use (`kvtc-chunk-{r}x` rows:
    kvtc.pipeline.evaluation.served), for artifacts the chunk path serves; attention_errors: also the errors
    in the attention objective's metric (each sequence's own queries captured; off, the rows carry none);
    prefix: the prefix tokens each sequence is scored after (None: the calibration's --seq-len less the
    continuation and one token; longer prefixes read long windows of the scored text); offline_ratios: the ratios
    the offline codec is scored at (None: every ratio; the served check's long window scores the chunk path at every
    ratio and the offline codec at the middle one only, whose error by position it charts)."""

    ratios: tuple[float, ...] = (8.0, 16.0, 32.0)
    continuation: int = 64
    sequences: int = 4
    baselines: tuple[str, ...] = BASELINES
    kivi_configs: tuple[tuple[int, int], ...] = KIVI_CONFIGS
    mode: str | None = None
    served: bool = True
    attention_errors: bool = True
    prefix: int | None = None
    offline_ratios: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.mode not in (None, "ecsq", "fixed"):
            raise ValueError(f"mode must be 'ecsq' or 'fixed', got {self.mode!r}")
        check_ratios(self.ratios, "kvtc eval: ")
        if self.continuation < 1 or self.sequences < 1:
            raise ValueError(f"continuation and sequences must be >= 1, got {self.continuation}, {self.sequences}")
        if self.prefix is not None and (isinstance(self.prefix, bool) or not isinstance(self.prefix, int)
                                        or self.prefix < 1):
            raise ValueError(f"prefix must be a token count >= 1, got {self.prefix!r}")
        if self.offline_ratios is not None:
            if not isinstance(self.offline_ratios, (tuple, list)):
                raise ValueError(f"offline_ratios must be a tuple of ratios, got {self.offline_ratios!r}")
            if not set(self.offline_ratios) <= set(self.ratios):
                raise ValueError(f"offline_ratios {list(self.offline_ratios)} must be among the ratios {list(self.ratios)}")
            object.__setattr__(self, "offline_ratios", tuple(dict.fromkeys(self.offline_ratios)))  # each scored once
        bad = [b for b in self.baselines if b not in BASELINES]
        if bad:
            raise ValueError(f"unknown baselines {bad}; choose from {', '.join(BASELINES)} (or 'none')")

    @property
    def length(self) -> int | None:
        """Tokens per scored sequence: the prefix, the continuation and the token it starts from."""
        return None if self.prefix is None else self.prefix + self.continuation + 1

    def check_context(self, max_positions: int | None, model: str) -> None:
        """ValueError naming both figures where a sequence of `length` tokens exceeds the model's context."""
        if self.length is not None and max_positions is not None and self.length > max_positions:
            raise ValueError(f"--prefix {self.prefix} with --continuation {self.continuation} needs {self.length} "
                             f"positions, beyond model {model}'s limit of {max_positions}: lower --prefix to at most "
                             f"{max_positions - self.continuation - 1}")
