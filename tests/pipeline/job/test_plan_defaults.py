"""The sequence defaults follow the model: 8,192-token sequences (the chunk path's KL at 8K prefixes 45% below a
4,096-token calibration's at CR 16), 4,096 for a model with sliding-window layers (its global layers' reach would
take bits from short prefixes), the model's limit where that is shorter, a quarter of --tokens where fewer were
asked; shards of 8,192 tokens. The plan stage records what it resolved, so a recalibration repeats it; given values are kept or refused."""
from __future__ import annotations

import pytest

from kvtc.pipeline.settings import DEFAULT_SEQ_LEN, SHARD_TOKENS, WINDOWED_SEQ_LEN, JobSettings, PlanSettings


@pytest.mark.parametrize("tokens, limit, windowed, seq_len, per_shard", [
    (None, 8192, False, 8192, 1),     # the embedded model: 10 sequences of the CPU default, a shard each
    (None, 32768, True, 4096, 2),     # Gemma 3 270M: sliding-window layers beside global ones
    (None, 32768, False, 8192, 1),    # a long-context model whose layers are alike
    (None, 4096, False, 4096, 2),     # a model whose limit is shorter calibrates at its limit
    (None, 2048, True, 2048, 4),      # the tiny test models stop at 2,048
    (None, None, False, 8192, 1),     # the limit not told yet (the command line on a tiny model)
    (20000, 8192, False, 5000, 1),    # 4 sequences: a shard each, so some train and some are held out
    (2048, 2048, False, 512, 1),
])
def test_defaults_resolve_against_the_model_and_the_tokens(tokens, limit, windowed, seq_len, per_shard):
    got = PlanSettings(tokens=tokens).resolved(limit, windowed)
    assert (got.seq_len, got.seqs_per_shard) == (seq_len, per_shard)
    assert DEFAULT_SEQ_LEN == 8192 and WINDOWED_SEQ_LEN == 4096 and SHARD_TOKENS == 8192


def test_given_values_are_kept():
    got = PlanSettings(seq_len=1024, seqs_per_shard=3).resolved(2048)
    assert (got.seq_len, got.seqs_per_shard) == (1024, 3)
    assert PlanSettings(seq_len=1024).resolved(8192).seqs_per_shard == 8  # the shard's 8,192 tokens


def test_the_plan_stage_records_what_it_resolved(tmp_path, capsys):
    from kvtc.pipeline.job import calibrate

    cfg = JobSettings.of(model="tiny:llama", corpus="pydoc", eval_corpus=None, ratios=(8.0,), served_sequences=0,
                         registry=str(tmp_path / "reg"), store=str(tmp_path / "store"), name="defaults")
    planned = calibrate.plan_job(cfg, in_process=True)
    plan = planned.settings.plan
    assert (plan.tokens, plan.seq_len, plan.seqs_per_shard) == (80 * 1024, 2048, 4)  # the tiny model's limit
    assert planned.settings.computational()["plan"]["seq_len"] == 2048  # recorded as run
    assert "running 81920 tokens in sequences of 2048, 4 per shard" in capsys.readouterr().err

    explicit = JobSettings.of(model="tiny:llama", corpus="pydoc", eval_corpus=None, seq_len=4096, ratios=(8.0,),
                              registry=str(tmp_path / "reg"), name="defaults")
    with pytest.raises(ValueError, match="--seq-len 4096 exceeds the model's limit of 2048"):
        calibrate.plan_job(explicit, in_process=True)


def test_too_few_tokens_for_the_default_sequence_name_tokens():
    from kvtc.pipeline.checks.header import check_calibration

    with pytest.raises(ValueError, match=r"--tokens 100 is too few: .*25 tokens.*pass --tokens 532 or more"):
        check_calibration(JobSettings.of(tokens=100))
