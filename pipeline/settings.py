"""The calibration job's settings, grouped by concern, each a frozen dataclass validated on construction.

`JobSettings` holds one of each group: `model` (which model, in which dtype), `plan` (the shard
plan: corpus, tokens, sequences), `capture` (kvtc.workers.capture.CaptureSettings: positions, groups,
keys), `allocator` (kvtc.pipeline.fit.allocator.AllocatorSettings), `reduce` (ratios, held-out rows,
accumulators, the error-by-tokens chart) and `runtime` (where and how fast: registry, store, Ray).
All but `runtime` decide what the job computes: the manifest records them verbatim
(`JobSettings.computational`) and `JobSettings.from_computational` rebuilds them, so recalibration
repeats a parent exactly.

A command-line option is a field: in every group a field's `metadata["option"]` (an `Option`,
kvtc.workers.options) makes it a `kvtc calibrate` flag named after the field (`seq_len` ->
`--seq-len`); the capture and allocator groups declare theirs on their own fields, in their light
modules (kvtc.workers.capture_settings, kvtc.pipeline.fit.allocator_settings). `JobSettings.of`
takes the flat field names (the options' dests) of every group.

This module imports nothing heavy at import time: the CLI builds its parser from it.
"""
from __future__ import annotations

import math
import os
from dataclasses import Field, dataclass, field, fields, replace
from enum import Enum
from typing import TYPE_CHECKING, Any, Iterator

from kvtc.artifacts.blocks import check_ratios
from kvtc.artifacts.calibration import CalibrationRecord
from kvtc.artifacts.names import check_name
from kvtc.pipeline.checks.words import parse_ratios
from kvtc.pipeline.fit.allocator_settings import AllocatorSettings, BitSplit
from kvtc.workers.capture_settings import FIRST_COPY_PROBE_FORM, CaptureSettings
from kvtc.workers.objective import (Balance, ObjectiveChoice, Weighting, balance_option, copy_weight_option,
                                    floor_option, weighting_option)
from kvtc.workers.options import Option, joined, option

if TYPE_CHECKING:
    from kvtc.pipeline.fit.metric import AttentionMetric

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_CORPUS = "pydoc+pkgdocs"  # prose mixture; stdlib code stays the evaluation domain
DEFAULT_EVAL_CORPUS = "stdlib"
# Sized for about 10 minutes end to end on a 2-core CPU with the embedded model at 1,024-token sequences; at the
# 8,192-token default the fold runs about 145 tok/s (attention and the attention metric grow with the length):
# about 14 minutes with the reduce and the served check (bench/README.md).
DEFAULT_CPU_TOKENS = 80 * 1024
DEFAULT_GPU_TOKENS = 2_000_000
# Calibrate at the context the model serves: 8,192-token sequences against 4,096 cut the chunk path's KL at 8K
# prefixes by 45% (CR 16) and copying's by 41%, and 4,096 kept far-back needles at CR 32 that 1,024 lost
# (bench/README.md, long context); a model whose limit is shorter calibrates at its limit. Shards hold SHARD_TOKENS.
DEFAULT_SEQ_LEN = 8192
# A model with sliding-window (or chunked) layers beside full ones stays at 4,096: its KL sensitivity scales each full
# layer by its reach over the sequence (pipeline/fit/sensitivity_reach.py), x8 at 8,192 against x4, and on Gemma 3
# 270M the bits that moved to its global layers cost 1,024-token prefixes 7% / 9% / 22% KL at CR 8 / 16 / 32.
WINDOWED_SEQ_LEN = 4096
SHARD_TOKENS = 8192


def _none_word(word: Any) -> str | None:
    return None if word is None or str(word).strip().lower() in ("", "none") else word


def _count(value: int | None, flag: str, minimum: int = 1) -> None:
    if value is not None and (not isinstance(value, int) or value < minimum):
        raise ValueError(f"{flag} must be an integer >= {minimum}, got {value}")


@dataclass(frozen=True)
class ModelSettings:
    """model: the model spec (see kvtc.workers.models.load_spec); dtype: the workers' dtype (None:
    float32 on CPU workers, bfloat16 on GPU ones)."""

    model: str = option(DEFAULT_MODEL, "the embedded SmolLM2, gemma3-270m (sliding-window and global layers), a hub id, "
                                       "a model dir, a .gguf path, or tiny:ARCH")
    dtype: str | None = option(None, "float32 (CPU default), bfloat16 or float16")

    def __post_init__(self) -> None:
        if not str(self.model).strip():
            raise ValueError("--model is empty; pass a model spec, e.g. smollm2-135m")
        if self.dtype is not None and self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"--dtype must be float32, bfloat16 or float16, got {self.dtype!r}")


@dataclass(frozen=True)
class PlanSettings:
    """The shard plan: `tokens` of `corpus` cut into shards of `seqs_per_shard` sequences of `seq_len`
    tokens, `holdout_fraction` of them held out; `eval_tokens` of `eval_corpus` for the second domain.
    tokens None: the job picks DEFAULT_CPU_TOKENS or DEFAULT_GPU_TOKENS (and records what it picked)."""

    corpus: str = option(DEFAULT_CORPUS, "a mixture (+ interleaves, so the default mixes two), pydoc, pkgdocs, stdlib, "
                                         "hf:ORG/NAME, or local .txt/.jsonl/.parquet files, dirs, globs")
    eval_corpus: str | None = option(DEFAULT_EVAL_CORPUS, "second domain for cross-domain errors ('none' to skip)",
                                     parse=_none_word, show=lambda v: v or "none")
    tokens: int | None = option(None, "tokens to run through the model (default: sized for ~10 min on a 2-core CPU)",
                                kind=int)
    eval_tokens: int | None = option(None, "tokens of --eval-corpus to run (default: 4 sequences, at most 4,096 "
                                           "tokens where one sequence holds them)", kind=int)
    seq_len: int | None = option(None, f"sequence length (default: {DEFAULT_SEQ_LEN:,}, or the model's limit or a "
                                       "quarter of --tokens where shorter)", kind=int)
    seqs_per_shard: int | None = option(None, f"sequences per shard (default: {SHARD_TOKENS:,} tokens' worth, at most a "
                                              "quarter of the sequences)", kind=int)
    holdout_fraction: float = option(0.2, "share of shards held out for measurement", kind=float)
    text_column: str | None = option(None, "text column of .jsonl/.parquet/hf corpora")

    def __post_init__(self) -> None:
        for flag, value in (("--tokens", self.tokens), ("--eval-tokens", self.eval_tokens), ("--seq-len", self.seq_len),
                            ("--seqs-per-shard", self.seqs_per_shard)):
            _count(value, flag)
        if self.tokens is not None and self.seq_len is not None and self.tokens < self.seq_len:
            raise ValueError(f"--tokens {self.tokens} is below one sequence of --seq-len {self.seq_len}")
        if not 0 < self.holdout_fraction < 1:
            raise ValueError(f"--holdout-fraction must be in (0, 1), got {self.holdout_fraction}")
        if not str(self.corpus).strip():
            raise ValueError("--corpus is empty; pass a corpus spec, e.g. pydoc")

    def resolved(self, context: int | None, windowed: bool = False) -> PlanSettings:
        """The plan with its sequence defaults taken for a model whose longest sequence is `context` (None: not
        known yet) and which has sliding-window or chunked layers (`windowed`); given values are kept. seq_len:
        DEFAULT_SEQ_LEN (WINDOWED_SEQ_LEN for a windowed model), or the model's limit, or a quarter of the given
        --tokens, whichever is least; seqs_per_shard: SHARD_TOKENS of them, or a quarter of the sequences where that
        is fewer (a run needs shards to train on and to hold out)."""
        default = WINDOWED_SEQ_LEN if windowed else DEFAULT_SEQ_LEN
        seq_len = self.seq_len or min(default, context or default, (self.tokens or math.inf) // 4)
        sequences = (self.tokens or math.inf) // seq_len
        per_shard = self.seqs_per_shard or int(max(1, min(SHARD_TOKENS // seq_len, sequences // 4)))
        return replace(self, seq_len=int(seq_len), seqs_per_shard=per_shard)


def _ratios(word: Any) -> tuple[float, ...]:
    return tuple(float(r) for r in word) if isinstance(word, (tuple, list)) else parse_ratios(str(word))


@dataclass(frozen=True)
class ReduceSettings:
    """ratios: compression ratios allocated; heldout_rows: cap on held-out rows per stream;
    accumulators: statistics totals kept in the store (results are bit-identical for any number of
    workers, not across values); tokens_curve_points: prefixes measured for the error-by-tokens chart
    (0: none, which skips a refold of every accumulator)."""

    ratios: tuple[float, ...] = option((8.0, 16.0, 32.0), "compression ratios, comma separated", parse=_ratios,
                                       show=joined)
    heldout_rows: int = option(4096, "cap on held-out rows per stream", kind=int)
    tokens_curve_points: int = option(3, "prefixes of the shard stream measured for the error-vs-calibration-tokens "
                                         "chart (0: off)", kind=int)
    accumulators: int = option(4, "running statistics totals kept in the store: the store holds this many Grams per "
                                  "stream and group whatever --tokens is; results are bit-identical for any --workers, "
                                  "not across values", kind=int)
    served_sequences: int = option(1, "held-out sequences scored through the chunk path the servers use, beside the "
                                      "offline codec, before publishing (report and metrics: what serving will cost; "
                                      "each scores up to 128 tokens after its coded prefix; 0: off)", kind=int)
    attention_balance: Balance = balance_option()  # the objective's options (kvtc.workers.objective)
    attention_floor: float = floor_option()
    attention_weighting: Weighting = weighting_option()
    attention_copy_weight: float = copy_weight_option()

    def __post_init__(self) -> None:
        metric = self.attention_metric  # validated there
        object.__setattr__(self, "attention_balance", metric.balance)  # the words read: Balance, Weighting
        object.__setattr__(self, "attention_weighting", metric.weighting)
        object.__setattr__(self, "ratios", check_ratios(self.ratios))
        _count(self.heldout_rows, "--heldout-rows")
        _count(self.accumulators, "--accumulators")
        _count(self.tokens_curve_points, "--tokens-curve-points", minimum=0)
        _count(self.served_sequences, "--served-sequences", minimum=0)

    @property
    def attention_metric(self) -> "AttentionMetric":
        from kvtc.pipeline.fit.metric import AttentionMetric  # noqa: PLC0415 - pyarrow: not for the command line's parse

        return AttentionMetric(self.attention_balance, self.attention_floor, self.attention_weighting,
                               copy_weight=self.attention_copy_weight)

    @property
    def curve_ratio(self) -> float:
        """The middle ratio: the one the error-by-tokens chart follows."""
        return sorted(self.ratios)[len(self.ratios) // 2]


@dataclass(frozen=True)
class RuntimeSettings:
    """Where and how fast the job runs; nothing here changes what it computes. registry: where it
    publishes; name: the artifact's name (None: from the model spec); store: the shard statistics
    cache (store_shared: a path every node mounts); address: a Ray cluster; workers, threads_per_worker:
    the actor pool; cache_dir: model cache; parent: the version a recalibration derives from."""

    registry: str | None = option(None, "registry root: a path or fsspec URI (default $KVTC_REGISTRY or ./registry)")
    name: str | None = option(None, "artifact name (default: derived from the model spec)")
    address: str | None = option(None, "Ray cluster address to join (default: a local Ray started for the job)")
    workers: int | None = option(None, "worker actors (default: one per GPU, else one per CPU)", kind=int)
    threads_per_worker: int = option(1, "torch threads per worker actor", kind=int)
    gpus_per_worker: int | None = option(None, "GPUs each worker spreads the model over (default: the fewest that hold "
                                               "its weights, statistics and activations, from its config, dtype and "
                                               "the GPU memory; refused when too few)", kind=int)
    store: str | None = option(None, "shard statistics cache: a path or fsspec URI (default $KVTC_CACHE/shards)")
    store_shared: bool = option(False, "--store is a path every node of the Ray cluster mounts (NFS, a shared "
                                       "volume); without it a local path is refused on a multi-node cluster",
                                kind=bool)
    cache_dir: str | None = option(None, "model cache dir (default $KVTC_CACHE)")
    verbose: bool = option(False, "show the workers' model conversion and loading output and per-group solver "
                                  "lines (default: one progress bar per stage; worker output goes to Ray's log)",
                           kind=bool)
    parent: str | None = None

    def __post_init__(self) -> None:
        _count(self.workers, "--workers")
        _count(self.threads_per_worker, "--threads-per-worker")
        _count(self.gpus_per_worker, "--gpus-per-worker")
        if self.name is not None:
            check_name("artifact name (--name)", self.name)  # before the run, not at publish time
        for flag, value in (("--registry", self.registry), ("--store", self.store), ("--cache-dir", self.cache_dir)):
            if value is not None and not str(value).strip():
                raise ValueError(f"{flag} is empty; pass a path or URI, or omit it for the default")

    @property
    def cluster_address(self) -> str | None:
        """The Ray cluster this job joins (--address, else $RAY_ADDRESS), or None for a local Ray: the one place
        that tells whether a job runs on a cluster."""
        return self.address or os.environ.get("RAY_ADDRESS") or None


GROUPS = ("model", "plan", "capture", "allocator", "reduce", "runtime")
COMPUTATIONAL = ("model", "plan", "capture", "allocator", "reduce")


GROUP_CLASSES: dict[str, type] = {"model": ModelSettings, "plan": PlanSettings, "capture": CaptureSettings,
                                   "allocator": AllocatorSettings, "reduce": ReduceSettings, "runtime": RuntimeSettings}


def _group_class(group: str) -> type:
    return GROUP_CLASSES[group]


def group_options(group: str) -> dict[str, Option]:
    """field name -> Option of one group's command-line options."""
    return {f.name: f.metadata["option"] for f in fields(_group_class(group)) if "option" in f.metadata}


def options() -> Iterator[tuple[str, str, Option, Any]]:
    """(group, field name, Option, default) of every `kvtc calibrate` option, group by group."""
    for group in GROUPS:
        for f in fields(_group_class(group)):
            if "option" in f.metadata:
                yield group, f.name, f.metadata["option"], f.default


def _plain(value: Any) -> Any:
    """A field's value as JSON: tuples as lists, a switch (kvtc.workers.options.Word) or an objective as its word."""
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, ObjectiveChoice):
        return value.name
    if isinstance(value, Enum):
        return value.value
    return value


@dataclass(frozen=True)
class JobSettings:
    """All settings of one calibration job (see the module docstring)."""

    model: ModelSettings = field(default_factory=ModelSettings)
    plan: PlanSettings = field(default_factory=PlanSettings)
    capture: CaptureSettings = field(default_factory=CaptureSettings)
    allocator: AllocatorSettings = field(default_factory=AllocatorSettings)
    reduce: ReduceSettings = field(default_factory=ReduceSettings)
    runtime: RuntimeSettings = field(default_factory=RuntimeSettings)

    def __post_init__(self) -> None:
        for group in ("capture", "allocator"):
            if getattr(self, group) is None:
                object.__setattr__(self, group, _group_class(group)())
        for group in GROUPS:
            if not isinstance(getattr(self, group), _group_class(group)):
                raise TypeError(f"JobSettings.{group} must be a {_group_class(group).__name__}")

    @classmethod
    def of(cls, **flat: Any) -> "JobSettings":
        """Settings from flat field names of any group (option dests: `seq_len=128, ratios=(4, 8)`);
        option words are accepted too (`ratios="4,8"`, `eval_corpus="none"`). Unknown names are refused."""
        parts: dict[str, dict[str, Any]] = {g: {} for g in GROUPS}
        owner = {f.name: g for g in GROUPS for f in fields(_group_class(g))}
        for name, value in flat.items():
            if name not in owner:
                raise TypeError(f"unknown calibration setting {name!r}")
            opt = group_options(owner[name]).get(name)
            parts[owner[name]][name] = opt.value(value) if opt is not None and value is not None else value
        return cls(**{g: _group_class(g)(**parts[g]) for g in GROUPS})

    def flat(self) -> dict[str, Any]:
        """Every field of every group by its flat name (the inverse of `of`)."""
        return {f.name: getattr(getattr(self, g), f.name) for g in GROUPS for f in fields(_group_class(g))}

    def replace(self, **flat: Any) -> "JobSettings":
        """These settings with some flat fields changed (validated again)."""
        return JobSettings.of(**{**self.flat(), **flat})

    def computational(self) -> dict[str, dict[str, Any]]:
        """What the job computes from, group by group, as plain JSON values (the manifest's record)."""
        return {g: {f.name: _plain(getattr(getattr(self, g), f.name)) for f in fields(_group_class(g))}
                for g in COMPUTATIONAL}

    @classmethod
    def from_computational(cls, recorded: dict[str, dict[str, Any]], runtime: RuntimeSettings | None = None
                           ) -> "JobSettings":
        """The settings `computational()` recorded (fields a newer version added keep their defaults).
        `recorded` is untrusted (a manifest): every value is type-checked against its field, then the
        group's own validation (the CLI's) runs; a safety cap is never lifted. ValueError names the field."""
        if not isinstance(recorded, dict):
            raise ValueError(f"{_WHERE}: expected an object of settings groups, got {type(recorded).__name__}")
        parts = {}
        for g in COMPUTATIONAL:
            group = recorded.get(g)
            if group is None:
                group = {}
            if not isinstance(group, dict):
                raise ValueError(f"{_WHERE}.{g}: expected an object of settings, got {type(group).__name__}")
            cls_ = _group_class(g)
            values = {f.name: _recorded(f"{_WHERE}.{g}.{f.name}", f, group[f.name]) for f in fields(cls_)
                      if f.name in group}
            for name in _SAFETY_CAPS.get(g, ()):
                cap = next(f.default for f in fields(cls_) if f.name == name)
                if name in values and values[name] > cap:
                    raise ValueError(f"{_WHERE}.{g}.{name} = {values[name]} lifts a safety cap of {cap}; a manifest "
                                     "cannot raise it (the manifest is corrupt or was edited)")
            try:
                parts[g] = cls_(**values)
            except (ValueError, TypeError) as exc:
                raise ValueError(f"{_WHERE}.{g}: {exc} (the manifest is corrupt or was edited)") from None
        return cls(**parts, runtime=runtime or RuntimeSettings())

    @property
    def artifact_name(self) -> str:
        if self.runtime.name:
            return self.runtime.name
        base = self.model.model.rstrip("/").split("/")[-1].replace(":", "-").removesuffix(".gguf")
        return base.lower()

    def with_runtime(self, **changes: Any) -> "JobSettings":
        return replace(self, runtime=replace(self.runtime, **changes))


_WHERE = "manifest calibration.settings"
_SAFETY_CAPS = {"allocator": ("max_dp_states",)}  # a manifest may lower these below their defaults, never lift them
_SCALARS: dict[str, tuple[type, ...]] = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,)}
_NAMES = {"int": "an integer", "float": "a finite number", "str": "a string", "bool": "true or false"}


def _scalar(where: str, kind: str, value: Any) -> Any:
    ok = isinstance(value, _SCALARS[kind]) and (kind == "bool" or not isinstance(value, bool))
    if kind == "float" and ok and not math.isfinite(value):
        ok = False
    if not ok:
        raise ValueError(f"{where}: expected {_NAMES[kind]}, got {value!r} "
                         "(the manifest is corrupt or was edited)")
    return float(value) if kind == "float" else value


def _recorded(where: str, f: Field, value: Any) -> Any:
    """A recorded value checked against its field: an option of choices (an objective, a switch) records its
    word, which the group's own validation reads; any other field, by its annotation (`_typed`)."""
    opt = f.metadata.get("option")
    if opt is not None and opt.choices is not None:
        return _scalar(where, "str", value)
    return _typed(where, f.type, value)


def _typed(where: str, annotation: Any, value: Any) -> Any:
    """A recorded value checked against its field's annotation (a string under postponed annotations):
    int, float, str, bool, X | None, tuple[X, ...]; JSON lists become tuples. ValueError names `where`."""
    kind = str(annotation).replace(" ", "")
    if kind.endswith("|None"):
        return None if value is None else _typed(where, kind[:-len("|None")], value)
    if kind.startswith("tuple[") and kind.endswith(",...]"):
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{where}: expected a list, got {value!r} (the manifest is corrupt or was edited)")
        return tuple(_scalar(f"{where}[{i}]", kind[len("tuple["):-len(",...]")], v) for i, v in enumerate(value))
    if kind in _SCALARS:
        return _scalar(where, kind, value)
    raise TypeError(f"{where}: no type check for a field of type {annotation!r}")  # a new field type: add it here


def settings_from_manifest(manifest: dict[str, Any], runtime: RuntimeSettings | None = None) -> JobSettings:
    """The settings that repeat the calibration of `manifest` (a published version): its recorded
    settings verbatim, or for versions published before they were recorded, what its calibration
    record and corpus section say (settings they did not record keep today's defaults)."""
    rec = CalibrationRecord.from_manifest(manifest)
    if rec.settings:
        recorded_settings = dict(rec.settings)
        capture = recorded_settings.get("capture")
        if isinstance(capture, dict) and "objective" not in capture:  # recorded before the option: what it ran
            recorded_settings["capture"] = {**capture, "objective": rec.objective}
        if isinstance(capture, dict) and "sensitivity" not in capture:  # recorded before the KL sensitivity was
            recorded_settings["capture"] = {**recorded_settings["capture"], "sensitivity": 0}
            reduce = recorded_settings.get("reduce")
            if isinstance(reduce, dict) and "attention_balance" not in reduce:
                recorded_settings["reduce"] = {**reduce, "attention_balance": Balance.LAYER.value}
        if isinstance(capture, dict) and "copy_probe" not in capture:  # recorded before the copy probe was, or off
            recorded_settings["capture"] = {**recorded_settings["capture"], "copy_probe": 0}
        capture = recorded_settings["capture"] if isinstance(recorded_settings.get("capture"), dict) else None
        if capture and capture.get("copy_probe") and "copy_probe_form" not in capture:  # the first form named none
            recorded_settings["capture"] = {**capture, "copy_probe_form": FIRST_COPY_PROBE_FORM}
        allocator = recorded_settings.get("allocator")
        if isinstance(allocator, dict) and "bit_split" not in allocator:  # likewise: every basis its own share
            recorded_settings["allocator"] = {**allocator, "bit_split": BitSplit.EVEN.value}
        return JobSettings.from_computational(recorded_settings, runtime)
    corpus = manifest.get("corpus") or {}
    recorded = dict(
        model=manifest["model"]["spec"], corpus=corpus.get("spec"), eval_corpus=corpus.get("eval_spec") or None,
        ratios=rec.ratios, tokens=rec.tokens_requested, eval_tokens=rec.eval_tokens, seq_len=rec.seq_len,
        seqs_per_shard=rec.seqs_per_shard, sinks=rec.sinks, window=rec.window, groups=rec.group_spec,
        sample=rec.sample, seed=rec.seed, holdout_fraction=rec.holdout_fraction, heldout_rows=rec.heldout_rows_cap,
        text_column=rec.text_column, dtype=rec.dtype, keys=rec.keys, objective=rec.objective, block_sizes=tuple(rec.allocator["block_sizes"]),
        types=tuple(rec.allocator["types"]), error_model=rec.allocator["error_model"],
        bit_split=rec.allocator.get("bit_split", BitSplit.EVEN.value),
    )
    unrecorded = {"holdout_fraction", "heldout_rows", "seqs_per_shard", "corpus"}  # None: keep the default
    recorded = {k: v for k, v in recorded.items() if v is not None or k not in unrecorded}
    settings = JobSettings.of(**recorded)
    return settings if runtime is None else replace(settings, runtime=runtime)
