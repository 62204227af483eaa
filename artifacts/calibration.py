"""`CalibrationRecord`: how a version was calibrated, the manifest's "calibration" section.

The settings are what a rerun needs to repeat the calibration exactly (the shard plan, the capture
settings, the allocator); the results say what it measured on. Written by the calibration job's
reduce, read by evaluation, drift measurement and recalibration. Settings that older manifests
did not record are None (the reader's default applies).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from kvtc.artifacts.blocks import check_ratios
from kvtc.artifacts.groups import FeatureGroup, groups_json, parse_groups
from kvtc.artifacts.tensor_parallel import TensorParallelLayout

RELATIVE_ERROR = "||X - X_hat||_F / ||X||_F over held-out tokens, whole p-vector, keys RoPE-removed"
KEY_FORMS = ("rope-removed", "rope-kept")
OBJECTIVES = ("mse", "attention")
ATTENTION_ERROR = ("sqrt(sum e^T M e / sum x^T M x) over held-out tokens, M the attention metric (keys: the queries' "
                   "scaled second moments per RoPE pair; values: sum_h W_O,h^T W_O,h; see attention_metric)")


@dataclass(frozen=True)
class CalibrationRecord:
    """sinks, window: positions kept raw; seq_len: tokens per sequence; seed: corpus shuffle and
    position sampling; ratios: compression ratios allocated; groups: FeatureGroups (layers x KV heads), one
    basis each, cut by `group_spec` (model, layer, layers:K, auto); sample: fraction of positions captured;
    allocator: the allocator settings as a dict; tokens_requested / eval_tokens: corpus budgets;
    seqs_per_shard, holdout_fraction: the shard plan; heldout_rows_cap: held-out rows kept per
    stream; dtype: the dtype asked for, model_dtype: the one the model ran in; keys: "rope-removed"
    or "rope-kept" (keys calibrated as the model caches them, for consumers without positions).
    tensor_parallel: the TP layout the bases were cut for (kvtc.artifacts.tensor_parallel: TP size, each
    rank's KV heads and groups); None for a single-rank artifact.
    objective: "mse" (bases and allocations minimize the cache's squared error) or "attention" (the error the
    attention feels, in the metric `attention_metric` describes: the stored errors are in that metric, and
    the bases have distinct encode and decode matrices). objective_reason: why that objective ran (requested,
    or what "auto" found: the metric built, or the layer it could not read); None in older versions.
    bit_split: how each ratio's bits were shared between the bases (a joint split: its unit, each basis's
    weight, and per ratio each basis's bits beside its own floor(16 p / CR)); None: every basis its own.
    settings: the job's computational settings verbatim, group by group (kvtc.pipeline.settings;
    None in versions published before they were recorded): what recalibration repeats.
    Results: tokens (train + held-out), train/heldout/eval rows, notes (warnings of the run),
    tokens_curve (how the error-by-tokens curve was measured)."""

    sinks: int
    window: int
    seq_len: int
    seed: int
    ratios: tuple[float, ...]
    groups: tuple[FeatureGroup, ...]
    allocator: dict[str, Any]
    group_spec: str = "model"
    sample: float = 1.0
    tokens_requested: int | None = None
    eval_tokens: int | None = None
    seqs_per_shard: int | None = None
    holdout_fraction: float | None = None
    heldout_rows_cap: int | None = None
    text_column: str | None = None
    dtype: str | None = None
    model_dtype: str = "float32"
    keys: str = "rope-removed"
    tensor_parallel: dict[str, Any] | None = None
    objective: str = "mse"
    attention_metric: dict[str, Any] | None = None
    objective_reason: str | None = None
    bit_split: dict[str, Any] | None = None
    tokens: int = 0
    train_rows: int = 0
    heldout_rows: int = 0
    eval_rows: int = 0
    notes: tuple[str, ...] = ()
    tokens_curve: dict[str, Any] | None = field(default=None, compare=False)
    settings: dict[str, dict[str, Any]] | None = None

    def __post_init__(self) -> None:
        if self.sinks < 0 or self.window < 0 or self.seq_len < 2:
            raise ValueError(f"calibration record: sinks {self.sinks} and window {self.window} must be >= 0 and "
                             f"seq_len {self.seq_len} >= 2")
        check_ratios(self.ratios, "calibration record: ")
        try:
            groups = tuple(parse_groups(self.groups))
        except ValueError as exc:
            raise ValueError(f"calibration record: bad groups ({exc})") from None
        if not groups:
            raise ValueError("calibration record: groups must not be empty")
        if self.holdout_fraction is not None and not 0 < self.holdout_fraction < 1:
            raise ValueError(f"calibration record: holdout_fraction must be in (0, 1), got {self.holdout_fraction}")
        if self.keys not in KEY_FORMS:
            raise ValueError(f"calibration record: keys must be one of {KEY_FORMS}, got {self.keys!r}")
        if self.objective_reason is not None and not isinstance(self.objective_reason, str):
            raise ValueError("calibration record: objective_reason must be a string")
        if self.bit_split is not None and not isinstance(self.bit_split, dict):
            raise ValueError("calibration record: bit_split must be an object")
        if self.objective not in OBJECTIVES or (self.objective == "attention") != isinstance(self.attention_metric, dict):
            raise ValueError(f"calibration record: objective must be one of {OBJECTIVES} (attention with its "
                             f"attention_metric), got {self.objective!r}")
        if self.settings is not None and not (isinstance(self.settings, dict)
                                              and all(isinstance(v, dict) for v in self.settings.values())):
            raise ValueError("calibration record: settings must map each group to its fields")
        if self.seqs_per_shard is not None and self.seqs_per_shard < 1:
            raise ValueError(f"calibration record: seqs_per_shard must be >= 1, got {self.seqs_per_shard}")
        object.__setattr__(self, "ratios", tuple(float(r) for r in self.ratios))
        object.__setattr__(self, "groups", groups)
        try:
            TensorParallelLayout.from_dict(self.tensor_parallel, groups)
        except ValueError as exc:
            raise ValueError(f"calibration record: {exc}") from None
        object.__setattr__(self, "notes", tuple(self.notes))

    @property
    def tp(self) -> int:
        """Tensor-parallel ranks the bases were cut for (1: one basis over all KV heads per layer group)."""
        return int(self.tensor_parallel["tp"]) if self.tensor_parallel else 1

    def capture(self) -> dict[str, Any]:
        """The capture settings (keyword arguments of kvtc.workers.capture.CaptureSettings); `keys`
        only when not the default, as CaptureSettings.to_dict leaves it out."""
        out = {"sinks": self.sinks, "window": self.window, "groups": self.group_spec, "sample": self.sample,
               "seed": self.seed}
        if self.tp > 1:
            out["tp"] = self.tp
        out["objective"] = self.objective  # explicit: CaptureSettings' own default ("auto") is resolved per model
        return out if self.keys == "rope-removed" else {**out, "keys": self.keys}

    def to_manifest(self) -> dict[str, Any]:
        """The manifest's "calibration" section (plain JSON values)."""
        out = asdict(self)
        out["ratios"], out["groups"], out["notes"] = list(self.ratios), groups_json(self.groups), list(self.notes)
        if self.tensor_parallel is None:
            del out["tensor_parallel"]  # single-rank artifacts read as before
        if self.objective == "mse":
            del out["objective"], out["attention_metric"]  # likewise
        for key in ("objective_reason", "bit_split"):
            if out[key] is None:
                del out[key]  # likewise
        out["relative_error"] = RELATIVE_ERROR if self.keys == "rope-removed" else \
            RELATIVE_ERROR.replace("RoPE-removed", "with RoPE (as cached)")
        if self.objective == "attention":
            out["relative_error"] = ATTENTION_ERROR
        return out

    @classmethod
    def from_manifest(cls, manifest: dict[str, Any]) -> "CalibrationRecord":
        """Read a whole manifest's "calibration" section; for manifests that did not record them,
        seqs_per_shard is inferred from the largest shard and eval_tokens from the eval shards."""
        cal = dict(manifest["calibration"])
        missing = [k for k in ("sinks", "window", "seq_len", "seed", "ratios", "groups", "allocator") if k not in cal]
        if missing:
            raise ValueError(f"the manifest's calibration section lacks {', '.join(missing)}; is it a kvtc artifact?")
        known = {f.name for f in fields(cls)}
        record = {k: v for k, v in cal.items() if k in known}
        corpus = manifest.get("corpus") or {}
        tokens = corpus.get("tokens") or {}
        if not record.get("seqs_per_shard"):
            sizes = [int(tokens.get(i, 0)) for i in [*corpus.get("train_shards", []), *corpus.get("heldout_shards", [])]]
            record["seqs_per_shard"] = max(1, max(sizes, default=0) // int(cal["seq_len"]))
        if not record.get("eval_tokens"):
            record["eval_tokens"] = sum(int(tokens.get(i, 0)) for i in corpus.get("eval_shards", [])) or None
        if record.get("tokens_requested") is None:
            record["tokens_requested"] = cal.get("tokens")
        return cls(**record)
