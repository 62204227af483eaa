"""The calibration objective: what the bases and allocations minimize, as one small class per objective.

Each class owns what differs between objectives: whether capture hooks the attention metric beside the
KV (and the artifact then stores it), the metric each group task solves in, whether a joint bit split
weighs the bases against each other, and how the report describes its errors. `name` is the string
manifests, JSON and the command line store ("auto" is a command-line choice, resolved per model by
kvtc.workers.attention_metric.choose_objective before any objective runs). `objective_for` looks one up.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol


class MetricSettings(Protocol):
    """The attention metric's settings (kvtc.pipeline.fit.metric.AttentionMetric)."""

    def to_json(self) -> dict: ...


@dataclass(frozen=True)
class Objective:
    """What a calibration minimizes. name: its stored string; captures_metric: capture hooks the queries
    and output projections beside the KV (kvtc.workers.attention_metric), and the artifact stores the
    metric (its bases orthonormal in the metric's whitened space); weighs_bases: a joint bit split weighs
    each basis by the model's error per unit of its own, so one total spans keys and values; caption: what
    the report's charts measure."""

    name: ClassVar[str]
    captures_metric: ClassVar[bool] = False
    weighs_bases: ClassVar[bool] = False
    caption: ClassVar[str]

    def task_metric(self, settings: MetricSettings) -> dict | None:
        """The metric each group task solves in, as JSON (None: the cache's own squared error)."""
        return None

    def error_text(self, calibration: dict[str, Any]) -> str:
        """The report's sentence on how its relative errors are measured (`calibration`: the manifest's section)."""
        raise NotImplementedError


class MseObjective(Objective):
    """The cache's own squared error: orthonormal bases; a joint bit split shares a total within a stream only."""

    name = "mse"
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


_BY_NAME: dict[str, Objective] = {o.name: o for o in (MseObjective(), AttentionObjective())}
NAMES = tuple(_BY_NAME)


def objective_for(name: str) -> Objective:
    """The objective stored as `name`; ValueError naming the choices for any other."""
    try:
        return _BY_NAME[name]
    except (KeyError, TypeError):
        hint = " ('auto' is resolved against the model first: kvtc.workers.attention_metric.choose_objective)" \
            if name == "auto" else ""
        raise ValueError(f"objective must be one of {NAMES}, got {name!r}{hint}") from None


def recorded_objective(calibration: dict[str, Any]) -> Objective:
    """The objective a manifest's "calibration" section records (mse where it names none: the records of
    mse artifacts, and those written before the option, leave it out)."""
    return objective_for(calibration.get("objective", MseObjective.name))
