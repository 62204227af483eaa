"""The objective strategies (kvtc.workers.objective): what each owns, and the one lookup by stored name."""
from __future__ import annotations

import pytest

from kvtc.artifacts import calibration
from kvtc.pipeline.fit.metric import AttentionMetric
from kvtc.workers.capture_settings import CaptureSettings
from kvtc.workers.objective import (ATTENTION, AUTO, CHOICES as CLI_CHOICES, MSE, NAMES, AttentionObjective, Balance,
                                    MseObjective, Weighting, objective_choice, objective_for, recorded_objective)


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
    assert attention.task_metric(metric) == {"balance": "sensitivity", "floor": 0.1, "weighting": "concentration",
                                             "copy_weight": 1.5}
    assert attention.caption.startswith("errors in the attention metric")
    text = attention.error_text({"attention_metric": metric.to_json()})
    assert '{"balance": "sensitivity", "floor": 0.1, "weighting": "concentration", "copy_weight": 1.5}' in text


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


def test_the_option_word_is_read_into_its_choice_and_stored_by_name():
    assert [objective_choice(w) for w in CLI_CHOICES] == [AUTO, MSE, ATTENTION]
    assert objective_choice(ATTENTION) is ATTENTION and objective_for(MSE) is MSE  # objects pass through
    with pytest.raises(ValueError, match=r"--objective must be one of \('auto', 'mse', 'attention'\), got 'l1'"):
        objective_choice("l1")
    settings = CaptureSettings(objective="attention")
    assert settings.objective == ATTENTION and settings.to_dict()["objective"] == "attention"
    assert "objective" not in CaptureSettings(objective=MSE).to_dict()  # mse: the records' implicit objective
    assert CaptureSettings.from_dict(CaptureSettings(objective="attention").to_dict()) == settings


def test_auto_resolves_to_attention_where_the_metric_can_be_built_else_mse_naming_why():
    def unreadable():
        raise ValueError("--objective attention: layer 3 has no query projection; use --objective mse")

    def readable():
        return None

    assert AUTO.resolve(readable) == (ATTENTION, "auto: every coded layer's query and output projections were read")
    used, why = AUTO.resolve(unreadable)
    assert used == MSE and why == ("auto: the attention metric cannot be built for this model (layer 3 has no query "
                                   "projection); calibrated with mse")
    assert MSE.resolve(unreadable) == (MSE, "requested (--objective mse)")  # never probed
    assert ATTENTION.resolve(readable) == (ATTENTION, "requested (--objective attention)")
    with pytest.raises(ValueError, match="layer 3"):
        ATTENTION.resolve(unreadable)  # asked for explicitly: refused, never replaced
    with pytest.raises(ValueError, match="resolved against the model before capture"):
        AUTO.resolved()
    assert ATTENTION.resolved() is ATTENTION


def test_the_sensitivity_balance_needs_its_capture():
    for balance in Balance:
        for objective in (MSE, ATTENTION, AUTO):
            objective.check_options(balance, 1)
            if objective is MSE or not balance.scaled_by_sensitivity:
                objective.check_options(balance, 0)
    with pytest.raises(ValueError, match=r"which --sensitivity 0 does not capture; pass --sensitivity 1 or another "
                                         r"--attention-balance$"):
        ATTENTION.check_options(Balance.SENSITIVITY, 0)
    with pytest.raises(ValueError, match=r"\(--objective auto runs attention wherever its metric can be built\)$"):
        AUTO.check_options(Balance.SENSITIVITY, 0)


def test_the_switches_are_their_words():
    assert Balance.words() == ("sensitivity", "layer", "head", "model") and Weighting.words() == ("concentration", "none")
    assert Balance.of("layer", "balance") is Balance.LAYER and Balance.LAYER == "layer" and f"{Balance.HEAD}" == "head"
    assert [b.mean_axes for b in Balance] == [(2,), (1, 2), (2,), None]
    assert [w.by_concentration for w in Weighting] == [True, False]
    with pytest.raises(ValueError, match=r"balance must be one of \('sensitivity', 'layer', 'head', 'model'\), got 'x'"):
        Balance.of("x", "balance")
