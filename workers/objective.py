"""The calibration objective: what the bases and allocations minimize, as one small class per objective, with
the options that steer it.

Each class owns what differs between objectives: whether capture hooks the attention metric beside the
KV (and the artifact then stores it), the metric each group task solves in, whether a joint bit split
weighs the bases against each other, and how the report describes its errors. `name` is the string
manifests, JSON and the command line store; settings hold the object, and only records and JSON hold the name.

`--objective` names an objective or `auto` (`AutoObjective`): a choice, resolved per model by `resolve` before
any objective runs (kvtc.workers.attention_metric.choose_objective builds the model's probe); `objective_choice`
reads the option's word, `objective_for` looks a stored (resolved) name up.

The options are declared here and sit on their settings groups' fields (the group decides where the manifest
records them): `--objective` and `--sensitivity` on the capture settings (kvtc.workers.capture_settings),
`--attention-balance` (`Balance`), `--attention-floor` and `--attention-weighting` (`Weighting`) on the reduce
settings (kvtc.pipeline.settings; the metric they build: kvtc.pipeline.fit.metric.AttentionMetric). Their
cross-rule is `ObjectiveChoice.check_options`: a balance scaled by the model's KL sensitivity needs its capture.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Protocol

from kvtc.workers.options import Word, option


class MetricSettings(Protocol):
    """The attention metric's settings (kvtc.pipeline.fit.metric.AttentionMetric)."""

    def to_json(self) -> dict: ...


class Balance(Word):
    """--attention-balance: how the attention metric's (layer, KV head) blocks are scaled."""

    SENSITIVITY = "sensitivity"
    LAYER = "layer"
    HEAD = "head"
    MODEL = "model"

    @property
    def scaled_by_sensitivity(self) -> bool:
        """Each block scaled to the model's measured KL per unit of error (one unit for every block of the model,
        keys and values alike): needs the KL sensitivity captured (--sensitivity >= 1)."""
        return self is Balance.SENSITIVITY

    @property
    def mean_axes(self) -> tuple[int, ...] | None:
        """The axes of the blocks' (layers, heads, d) diagonal that a block's divisor is the mean over: each layer
        to mean 1, each (layer, KV head) (then scaled by the sensitivity), or None: the measured scale kept."""
        return {Balance.LAYER: (1, 2), Balance.HEAD: (2,), Balance.SENSITIVITY: (2,)}.get(self)


class Weighting(Word):
    """--attention-weighting: how the attention metric weighs the KV heads against each other."""

    CONCENTRATION = "concentration"
    NONE = "none"

    @property
    def by_concentration(self) -> bool:
        """Each KV head's blocks times how much of one position's error reaches a query (its mean sum of squared
        attention weights); else heads alike."""
        return self is Weighting.CONCENTRATION


BALANCES = Balance.words()
WEIGHTINGS = Weighting.words()

_NO_SENSITIVITY = ("--attention-balance sensitivity scales the metric by the model's measured KL sensitivity, "
                   "which --sensitivity 0 does not capture; pass --sensitivity 1 or another --attention-balance")


@dataclass(frozen=True)
class ObjectiveChoice:
    """What --objective names: an objective (`Objective`), or `auto`. name: its word; implicit: records leave it
    out (mse: what every record before the option ran)."""

    name: ClassVar[str]
    implicit: ClassVar[bool] = False

    def resolve(self, readable: Callable[[], None]) -> tuple[Objective, str]:
        """-> (the objective to run, why), for a model whose attention metric `readable()` checks can be built
        (ValueError naming what cannot: kvtc.workers.attention_metric.check_readable)."""
        raise NotImplementedError

    def resolved(self) -> Objective:
        """The objective that runs; ValueError for a choice still to be resolved against the model."""
        raise NotImplementedError

    def check_options(self, balance: Balance, sensitivity: int) -> None:
        """The options' cross-rule, before any model work: ValueError where `balance` needs the KL sensitivity
        that `sensitivity` (sequences per shard) 0 does not capture."""
        raise NotImplementedError


@dataclass(frozen=True)
class Objective(ObjectiveChoice):
    """What a calibration minimizes. name: its stored string; captures_metric: capture hooks the queries
    and output projections beside the KV (kvtc.workers.attention_metric), and the artifact stores the
    metric (its bases orthonormal in the metric's whitened space); weighs_bases: a joint bit split weighs
    each basis by the model's error per unit of its own, so one total spans keys and values; caption: what
    the report's charts measure."""

    captures_metric: ClassVar[bool] = False
    weighs_bases: ClassVar[bool] = False
    caption: ClassVar[str]

    def resolve(self, readable: Callable[[], None]) -> tuple[Objective, str]:
        """Asked for explicitly: itself, after `readable()` where it needs the metric (refused, never replaced)."""
        if self.captures_metric:
            readable()
        return self, f"requested (--objective {self.name})"

    def resolved(self) -> Objective:
        return self

    def check_options(self, balance: Balance, sensitivity: int) -> None:
        if self.captures_metric and Balance.of(balance, "attention metric balance").scaled_by_sensitivity \
                and sensitivity < 1:
            raise ValueError(_NO_SENSITIVITY)

    def task_metric(self, settings: MetricSettings) -> dict | None:
        """The metric each group task solves in, as JSON (None: the cache's own squared error)."""
        return None

    def error_text(self, calibration: dict[str, Any]) -> str:
        """The report's sentence on how its relative errors are measured (`calibration`: the manifest's section)."""
        raise NotImplementedError


class MseObjective(Objective):
    """The cache's own squared error: orthonormal bases; a joint bit split shares a total within a stream only."""

    name = "mse"
    implicit = True
    caption = "errors: the cache's own squared error (--objective mse)"

    def error_text(self, calibration: dict[str, Any]) -> str:
        return ("Relative error: ||X - X_hat||_F / ||X||_F over held-out tokens (positions [sinks, T - window)), "
                "whole p-vector, keys RoPE-removed.")


class AttentionObjective(Objective):
    """The error the attention feels: keys weighted by the queries' second moments, values by the output
    projection; distinct encode and decode matrices."""

    name = "attention"
    captures_metric = True
    weighs_bases = True
    caption = ("errors in the attention metric (keys: query-weighted; values: W_O-weighted), the metric this "
               "artifact was calibrated in")

    def task_metric(self, settings: MetricSettings) -> dict | None:
        return settings.to_json()

    def error_text(self, calibration: dict[str, Any]) -> str:
        return ("Relative error in the attention metric (calibrated with --objective attention): sqrt(sum e^T M e / "
                "sum x^T M x), M per layer and KV head: keys, the queries' scaled second moments per RoPE pair; "
                f"values, sum_h W_O,h^T W_O,h ({json.dumps(calibration.get('attention_metric'))}); positions "
                "[sinks, T - window).")


MSE, ATTENTION = MseObjective(), AttentionObjective()


@dataclass(frozen=True)
class AutoObjective(ObjectiveChoice):
    """--objective auto: attention where the model's attention metric can be built, else mse (saying why)."""

    name = "auto"

    def resolve(self, readable: Callable[[], None]) -> tuple[Objective, str]:
        try:
            readable()
        except ValueError as exc:
            why = str(exc).removeprefix("--objective attention").lstrip(": ").split("; use --objective mse")[0]
            return MSE, f"auto: the attention metric cannot be built for this model ({why}); calibrated with mse"
        return ATTENTION, "auto: every coded layer's query and output projections were read"

    def resolved(self) -> Objective:
        raise ValueError("objective 'auto' is resolved against the model before capture (kvtc.workers.attention_metric."
                         "choose_objective, which the calibration plan runs); pass 'attention' or 'mse'")

    def check_options(self, balance: Balance, sensitivity: int) -> None:
        try:
            ATTENTION.check_options(balance, sensitivity)  # what it runs wherever the metric can be built
        except ValueError as exc:
            raise ValueError(f"{exc} (--objective auto runs attention wherever its metric can be built)") from None


AUTO = AutoObjective()
_BY_NAME: dict[str, Objective] = {o.name: o for o in (MSE, ATTENTION)}
NAMES = tuple(_BY_NAME)
CHOICES = (AUTO.name, *NAMES)  # --objective's words


def objective_for(name: str | Objective) -> Objective:
    """The objective stored as `name` (an objective passes through); ValueError naming the choices for any other."""
    if isinstance(name, Objective):
        return name
    try:
        return _BY_NAME[name]
    except (KeyError, TypeError):
        hint = " ('auto' is resolved against the model first: kvtc.workers.attention_metric.choose_objective)" \
            if name == AUTO.name else ""
        raise ValueError(f"objective must be one of {NAMES}, got {name!r}{hint}") from None


def objective_choice(word: str | ObjectiveChoice) -> ObjectiveChoice:
    """--objective's word -> its choice (a choice passes through); ValueError naming the words for any other."""
    if isinstance(word, ObjectiveChoice):
        return word
    if word == AUTO.name:
        return AUTO
    try:
        return _BY_NAME[word]
    except (KeyError, TypeError):
        raise ValueError(f"--objective must be one of {CHOICES}, got {word!r}") from None


def recorded_objective(calibration: dict[str, Any]) -> Objective:
    """The objective a manifest's "calibration" section records (mse where it names none: the records of
    mse artifacts, and those written before the option, leave it out)."""
    return objective_for(calibration.get("objective", MSE.name))


# The options, on their settings groups' fields (module docstring).
def objective_option() -> Any:
    return option(AUTO, "attention: bases and allocations minimize the error the attention feels (keys weighted by "
                        "the queries' second moments, values by the output projection), with distinct encode and "
                        "decode matrices; mse: the cache's own squared error; auto: attention where its metric can "
                        "be built, else mse (the manifest says which and why)", choices=CHOICES,
                  parse=objective_choice, show=lambda choice: choice.name)


def sensitivity_option() -> Any:
    return option(1, "--objective attention: sequences per shard whose KL sensitivity (the Fisher information of "
                     "each layer's keys and values) is measured, one backward pass each, for --attention-balance "
                     "sensitivity (0: off)", kind=int)


def balance_option() -> Any:
    return option(Balance.SENSITIVITY, "--objective attention: how the metric's blocks are scaled (sensitivity: "
                                       "each (layer, KV head) by the model's measured KL per unit of error, needs "
                                       "--sensitivity >= 1; layer: each layer to mean 1, the squared error's balance "
                                       "between layers kept; head; model: as measured)", choices=BALANCES)


def floor_option() -> Any:
    return option(0.05, "--objective attention: share of each block's mean weight added to every direction (no "
                        "direction is free)", kind=float)


COPY_WEIGHT = 1.5  # the copy probe's Fisher per scored position against fresh text's per position (bench/README.md)


def copy_weight_option() -> Any:
    return option(COPY_WEIGHT, "--objective attention with the sensitivity balance: weight of the copy probe's KL sensitivity "
                       "per scored position against fresh text's per position (--copy-probe; 0: fresh text only)", kind=float)


def weighting_option() -> Any:
    return option(Weighting.CONCENTRATION, "--objective attention: concentration weighs each KV head by how much of "
                                           "one position's error reaches a query (its mean sum of squared attention "
                                           "weights); none: heads alike", choices=WEIGHTINGS)
