"""The sensitivity's reach factors: a layer's errors reach as many later queries as its window lets them, so a
sensitivity measured on a sequence's first tokens understates full-attention layers against sliding ones in the
calibration's longer sequences; models whose layers are alike are left exactly as they were."""
from __future__ import annotations

import numpy as np
import pytest

from kvtc.artifacts.errors import CorruptArtifactError
from kvtc.artifacts.groups import FeatureGroup
from kvtc.kernels.codec.layers import LayerSpec
from kvtc.pipeline.fit.metric import AttentionMetric
from kvtc.pipeline.fit.sensitivity_reach import mean_reach, reach_factors


def _gemma3(layers: int = 18) -> list[LayerSpec]:
    return [LayerSpec("full", 1, 256) if (i + 1) % 6 == 0 else LayerSpec("sliding", 1, 256, span=512)
            for i in range(layers)]


@pytest.mark.parametrize("length, window", [(1, None), (7, None), (7, 3), (100, 1), (1024, 512), (300, 700)])
def test_mean_reach_counts_the_queries_that_read_each_position(length, window):
    w = length if window is None else window
    brute = sum(min(w, length - j) for j in range(length)) / length
    assert mean_reach(length, window) == pytest.approx(brute)


def test_full_layers_gain_their_length_ratio_and_sliding_ones_stop_at_their_window():
    got = reach_factors(_gemma3(), 4096, 1024)
    assert got[5] == pytest.approx(4097 / 1025)  # (T + 1) / 2 over (S + 1) / 2
    assert got[0] == pytest.approx(mean_reach(4096, 512) / mean_reach(1024, 512))
    assert got[5] / got[0] == pytest.approx(3.2, abs=0.01)
    assert reach_factors(_gemma3(), 1024, 1024) is None  # measured on the whole sequence: nothing to correct
    assert reach_factors(_gemma3(), 512, 1024) is None


def test_models_whose_layers_are_alike_and_layers_without_a_cache_are_left_alone():
    assert reach_factors([LayerSpec("full", 3, 64)] * 30, 4096, 1024) is None  # SmolLM2: every factor the same
    chunked = [LayerSpec("chunked", 8, 128, span=8192)] * 3 + [LayerSpec("full", 8, 128)]
    assert reach_factors(chunked, 16384, 1024)[:3] == (1.0, 1.0, 1.0)
    mixed = [LayerSpec("none", 0, 0), LayerSpec("full", 2, 64), LayerSpec("sliding", 2, 64, span=128)]
    assert reach_factors(mixed, 4096, 1024)[0] == 1.0


def test_the_metric_scales_each_layers_sensitivity_and_round_trips_through_json():
    rng = np.random.default_rng(0)
    layers, d = 3, 4
    groups = [FeatureGroup(layers=(0, 1, 2))]
    sums = {"sensitivity_keys": rng.uniform(0.5, 1.5, (layers, 1, d)),
            "sensitivity_values": np.stack([np.diag(rng.uniform(0.5, 1.5, d))[None] for _ in range(layers)])}
    m = np.broadcast_to(np.eye(d), (layers, 1, d, d)).copy()
    plain = AttentionMetric().sensitivity(sums, m, "keys", groups[0], groups)
    scaled = AttentionMetric(reach=(1.0, 2.0, 4.0))
    assert np.allclose(scaled.sensitivity(sums, m, "keys", groups[0], groups), plain * np.array([[1.0], [2.0], [4.0]]))
    assert AttentionMetric(**scaled.to_json()) == scaled
    assert "reach" not in AttentionMetric().to_json()  # artifacts without factors record what they always did
    with pytest.raises(ValueError, match="reach factors"):
        AttentionMetric(reach=(1.0, 0.0))
    with pytest.raises(CorruptArtifactError, match="cover 2 layers, not layer 2"):  # a forged task's short list
        AttentionMetric(reach=(1.0, 2.0)).sensitivity(sums, m, "keys", groups[0], groups)


def test_the_reduce_records_factors_only_where_the_sensitivity_balance_measured_fewer_tokens():
    """tiny:gemma3 (sliding windows of 12, a full layer): factors at 2,048-token sequences, none at 1,024, none under
    another balance or objective, none for a model whose layers are alike."""
    from kvtc.pipeline.job.reduce import metric_json
    from kvtc.pipeline.settings import JobSettings
    from kvtc.workers.models import load_spec

    gemma = load_spec("tiny:gemma3").fingerprint
    of = lambda **kw: metric_json(JobSettings.of(model="tiny:gemma3", objective="attention", **kw), gemma)  # noqa: E731
    reach = of(seq_len=2048)["reach"]
    assert reach[2] == pytest.approx(2049 / 1025) and reach[0] == pytest.approx(reach[1]) and reach[2] > 1.9 * reach[0]
    assert AttentionMetric(**of(seq_len=2048)).reach == tuple(reach)
    assert "reach" not in of(seq_len=1024)
    assert "reach" not in of(seq_len=2048, attention_balance="layer")
    llama = load_spec("tiny:llama").fingerprint
    assert "reach" not in metric_json(JobSettings.of(model="tiny:llama", objective="attention", seq_len=2048), llama)
