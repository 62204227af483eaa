"""The objective strategies (kvtc.workers.objective): what each owns, and the one lookup by stored name."""
from __future__ import annotations

import pytest

from kvtc.artifacts import calibration
from kvtc.pipeline.fit.metric import AttentionMetric
from kvtc.workers.capture_settings import OBJECTIVES as CLI_CHOICES
from kvtc.workers.objective import (NAMES, AttentionObjective, MseObjective, objective_for,
                                    recorded_objective)


def test_names_are_the_stored_strings():
    assert NAMES == ("mse", "attention")
    assert CLI_CHOICES == ("auto", "mse", "attention")  # "auto" stays a command-line choice
    assert set(NAMES) == set(calibration.OBJECTIVES)  # the record validates the same names it stores
    assert objective_for("mse") == MseObjective() and objective_for("attention") == AttentionObjective()


def test_mse_objective():
    mse = objective_for("mse")
    assert not mse.captures_metric and not mse.weighs_bases
    assert mse.task_metric(AttentionMetric()) is None
    assert mse.caption == "errors: the cache's own squared error (--objective mse)"
    assert mse.error_text({}).startswith("Relative error: ||X - X_hat||_F / ||X||_F over held-out tokens")


def test_attention_objective():
    attention = objective_for("attention")
    assert attention.captures_metric and attention.weighs_bases
    metric = AttentionMetric(floor=0.1)
    assert attention.task_metric(metric) == {"balance": "sensitivity", "floor": 0.1, "weighting": "concentration"}
    assert attention.caption.startswith("errors in the attention metric")
    text = attention.error_text({"attention_metric": metric.to_json()})
    assert '{"balance": "sensitivity", "floor": 0.1, "weighting": "concentration"}' in text


def test_recorded_objective_defaults_to_mse():
    """mse records (and those written before the option) leave the objective out."""
    assert recorded_objective({}) == MseObjective()
    assert recorded_objective({"objective": "attention"}) == AttentionObjective()


@pytest.mark.parametrize("name", ["auto", "MSE", "", None, "l1"])
def test_unknown_name_refused_naming_the_choices(name):
    with pytest.raises(ValueError, match=r"objective must be one of \('mse', 'attention'\)") as err:
        objective_for(name)
    assert ("choose_objective" in str(err.value)) == (name == "auto")
    with pytest.raises(ValueError, match="must be one of"):
        recorded_objective({"objective": name})
