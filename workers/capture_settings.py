"""The capture settings: which positions a calibration captures and how features are grouped into
bases (kvtc.workers.capture uses them). Light, for the command line: each field is its
`kvtc calibrate` option (the objective's, --objective and --sensitivity, declared by kvtc.workers.objective)."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Sequence

from kvtc.artifacts.groups import FeatureGroup
from kvtc.artifacts.tensor_parallel import TensorParallelLayout
from kvtc.workers.objective import MSE, ObjectiveChoice, objective_choice, objective_option, sensitivity_option
from kvtc.workers.options import option

if TYPE_CHECKING:
    from kvtc.kernels.codec.layers import LayerSpec

KEY_FORMS = ("rope-removed", "rope-kept")
GROUP_FORMS = ("auto", "model", "layer")
# The copy probe's forms (kvtc.workers.sensitivity.copy_probe): today's, and stop 70's, which recalibrating its
# artifacts repeats (their manifests name no form).
COPY_PROBE_FORMS = ("passage-text-passage", "passage-twice")
FIRST_COPY_PROBE_FORM = COPY_PROBE_FORMS[1]


@dataclass(frozen=True)
class CaptureSettings:
    """Which positions and how features are grouped. Positions [0, sinks) and the last `window` are excluded.
    tp: tensor-parallel ranks; above 1 every layer group is split by the KV head ranges the ranks hold
    (kvtc.artifacts.tensor_parallel), one basis per (layer group, head range)."""

    sinks: int = option(4, "leading positions kept raw", kind=int)
    window: int = option(128, "trailing positions kept raw", kind=int)
    groups: str = option("auto", "auto: one basis per layer kind (full-attention and sliding-window layers apart; model "
                                 "for models of one kind), model, layer, or layers:K (K consecutive layers of one kind)")
    sample: float = option(1.0, "fraction of positions sampled", kind=float)
    seed: int = option(0, "corpus shuffle and position sampling seed", kind=int)
    keys: str = option("rope-removed", "rope-removed: keys calibrated and coded without RoPE; rope-kept: as servers store "
                                       "them, for consumers that cannot remove RoPE (Dynamo, chunk stores without "
                                       "positions)", choices=KEY_FORMS)
    objective: ObjectiveChoice = objective_option()  # an objective, or auto until the plan resolves it
    sensitivity: int = sensitivity_option()
    copy_probe: int = option(4096, "--objective attention with --sensitivity: tokens of the long-range copy probe whose "
                                   "KL sensitivity the first shard also measures (its first sequence's first quarter, "
                                   "the next half, the first quarter again, at most the sequence's length; 0: off)",
                             kind=int)
    copy_probe_form: str = option("passage-text-passage", "the copy probe's form: passage-text-passage (a passage, the "
                                  "text after it, the passage again, only the copy scored) or passage-twice (the "
                                  "first half twice, every position scored: what artifacts calibrated before "
                                  "passage-text-passage ran)", choices=COPY_PROBE_FORMS)
    tp: int = option(1, "tensor-parallel ranks the model is served at: one basis per rank's KV heads (and per layer "
                        "group), as vLLM and SGLang shard them; ranks holding the same heads share one", kind=int)

    def __post_init__(self) -> None:
        if not isinstance(self.tp, int) or self.tp < 1:
            raise ValueError(f"--tp must be an integer >= 1, got {self.tp!r}")
        if not isinstance(self.copy_probe, int) or isinstance(self.copy_probe, bool) or not (
                self.copy_probe == 0 or 2 + 2 * (self.sinks + self.window) <= self.copy_probe <= 1 << 20):
            raise ValueError(f"--copy-probe must be 0 (off) or tokens in [{2 + 2 * (self.sinks + self.window)}, "
                             f"{1 << 20}] (more than twice the sinks and window), got {self.copy_probe!r}")
        if self.copy_probe_form not in COPY_PROBE_FORMS:
            raise ValueError(f"--copy-probe-form must be one of {', '.join(COPY_PROBE_FORMS)}, got {self.copy_probe_form!r}")
        if not isinstance(self.sensitivity, int) or self.sensitivity < 0:
            raise ValueError(f"--sensitivity must be an integer >= 0 (sequences per shard), got {self.sensitivity!r}")
        object.__setattr__(self, "objective", objective_choice(self.objective))  # its word read: the option's refusal
        if self.keys not in KEY_FORMS:
            raise ValueError(f"keys must be one of {KEY_FORMS}, got {self.keys!r}")
        if self.sinks < 0 or self.window < 0:
            raise ValueError(f"sinks and window must be >= 0, got sinks={self.sinks}, window={self.window}")
        if not 0.0 < self.sample <= 1.0:
            raise ValueError(f"sample must be in (0, 1], got {self.sample}")
        if self.groups not in GROUP_FORMS:
            head, _, k = self.groups.partition(":")
            if head != "layers" or not k.isdigit() or int(k) < 1:
                raise ValueError(f"groups must be 'auto', 'model', 'layer' or 'layers:K' with K >= 1, got {self.groups!r}")

    def group_layers(self, layers: int | Sequence[LayerSpec], kv_heads: int | None = None) -> list[FeatureGroup]:
        """The groups (one basis each), in order; `layers`: the layer schema, or a layer count for a model
        of full-attention layers only. Over all KV heads, or with tp > 1 (kv_heads needed) each group
        once per rank's head range, head range major (a rank's groups are consecutive)."""
        from kvtc.kernels.codec.layers import cached_layers  # noqa: PLC0415 - the codec loads torch, `kvtc` start-up does not

        if isinstance(layers, int):
            kinds = {i: "full" for i in range(layers)}
        else:
            kinds = {i: layers[i].kind for i in cached_layers(layers)}
        by_kind: dict[str, list[int]] = {}
        for i, kind in kinds.items():
            by_kind.setdefault(kind, []).append(i)
        if self.groups == "model" and len(by_kind) > 1:
            raise ValueError(f"--groups model would give layers of kinds {sorted(by_kind)} one basis, but their caches "
                             "hold different positions; use --groups auto (one basis per kind), layer or layers:K")
        if self.groups in ("model", "auto"):
            out = [FeatureGroup(tuple(ix)) for ix in by_kind.values()]
        else:
            k = 1 if self.groups == "layer" else int(self.groups.split(":")[1])
            out = sorted([FeatureGroup(tuple(ix[a:a + k])) for ix in by_kind.values() for a in range(0, len(ix), k)],
                         key=lambda g: g.layers[0])
        if self.tp == 1:
            return out
        if kv_heads is None:
            raise ValueError("tensor-parallel groups need the model's KV head count")
        return [FeatureGroup(g.layers, heads) for heads in TensorParallelLayout(self.tp, kv_heads).shards for g in out]

    def eligible(self, seq_len: int) -> int:
        return seq_len - self.sinks - self.window

    def to_dict(self) -> dict[str, Any]:
        d = {**asdict(self), "objective": self.objective.name}
        if self.keys == "rope-removed":
            del d["keys"]  # the default stays out, so shard-store keys written before the option still match
        if self.tp == 1:
            del d["tp"]  # likewise
        if self.objective.implicit:
            del d["objective"]  # likewise: the objective before the option
        if self.sensitivity == 0 or self.objective.implicit:
            del d["sensitivity"]  # likewise: what ran before the KL sensitivity was (mse never captures it)
        if self.copy_probe == 0 or "sensitivity" not in d:
            del d["copy_probe"]  # likewise: what ran before the copy probe was
        if "copy_probe" not in d or self.copy_probe_form == FIRST_COPY_PROBE_FORM:
            del d["copy_probe_form"]  # likewise: no probe, or the first form, which wrote none
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CaptureSettings":
        """The inverse of `to_dict` (whose missing objective is "mse", missing sensitivity and copy probe 0, and a
        probe's missing form the first, passage-twice)."""
        first = {"copy_probe_form": FIRST_COPY_PROBE_FORM} if d.get("copy_probe") else {}
        return cls(**{"objective": MSE, "sensitivity": 0, "copy_probe": 0, **first, **d})
