"""GPUs per worker from a model's config (meta device, no weights): Llama-3.1-8B and 70B geometries.

The rule (pipeline/job/memory_plan.plan_gpus): each GPU counts at 90% of its memory, minus one
forward's working set; the first GPU also holds the worker's statistics totals and captured rows;
the weights (parameters x dtype bytes) must fit what is left over the worker's GPUs.
"""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from kvtc.pipeline.job.memory_plan import estimate, plan_gpus
from kvtc.workers.capture import CaptureSettings
from kvtc.workers.model_size import model_size, placement_units
from kvtc.workers.placement import device_map, pack
from kvtc.workers.tiny import tiny_config

GB80 = 85_031_714_816  # what torch reports for an H100 80GB (79.2 GiB)
SEQ = 1024


def _llama(layers: int, hidden: int, intermediate: int, heads: int) -> LlamaConfig:
    return LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=8, vocab_size=128256,
                       max_position_embeddings=131072, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def sizes():
    return {"8b": (model_size(_llama(32, 4096, 14336, 32), torch.bfloat16, SEQ), 32),
            "70b": (model_size(_llama(80, 8192, 28672, 64), torch.bfloat16, SEQ), 80)}


def _first_gpu(layers: int, groups: str, accumulators: int = 4):
    dims = [g.dim(8, 128) for g in CaptureSettings(groups=groups).group_layers(layers)]
    return lambda workers: estimate(dims, accumulators=accumulators, workers=workers, rows_per_batch=SEQ,
                                    heldout_rows=8192, kept_max=4096).worker


def _plan(sizes, model: str, groups: str, cluster: int = 8, per_node: int = 8, requested=None, gpu=GB80):
    size, layers = sizes[model]
    return plan_gpus(size, gpu, cluster, per_node, _first_gpu(layers, groups), requested)


def test_parameter_counts_from_meta_configs(sizes):
    assert 8.0e9 < sizes["8b"][0].parameters < 8.1e9     # Llama-3.1-8B: 8.03B
    assert 70.5e9 < sizes["70b"][0].parameters < 70.6e9  # Llama-3.1-70B: 70.55B
    assert sizes["70b"][0].weight_bytes == 2 * sizes["70b"][0].parameters


def test_8b_bf16_fits_one_80gb_gpu(sizes):
    plan = _plan(sizes, "8b", "model")
    assert (plan.gpus, plan.workers) == (1, 8)
    budget = plan.max_memory()
    assert list(budget) == [0] and budget[0] >= plan.weights


def test_70b_needs_two_80gb_gpus_and_spreads_over_them(sizes):
    plan = _plan(sizes, "70b", "layer")
    assert (plan.gpus, plan.workers) == (2, 4)
    budget = plan.max_memory()
    assert budget[0] == budget[1] - plan.first_gpu
    units = sizes["70b"][0].units
    placed = pack(units, budget)
    order = [placed[u.name] for u in units]
    assert order == sorted(order) and set(order) == {0, 1}  # forward order, one boundary
    assert placed["model.embed_tokens"] == 0 and placed["lm_head"] == 1
    for gpu in (0, 1):
        assert sum(u.bytes for u in units if placed[u.name] == gpu) <= budget[gpu]
    assert _plan(sizes, "70b", "layer", gpu=150_754_820_096).gpus == 2  # H200 (140.4 GiB): still two for 131 GiB of weights


def test_too_few_gpus_per_worker_names_the_number_that_fits(sizes):
    with pytest.raises(ValueError, match=r"--gpus-per-worker 1 is too few: the model needs 2 GPUs per worker"):
        _plan(sizes, "70b", "layer", requested=1)
    assert _plan(sizes, "70b", "layer", requested=4).gpus == 4  # more than needed is the user's choice


def test_statistics_too_large_for_a_gpu_suggest_layer_groups(sizes):
    # --groups model at p = 81920: one accumulator's Grams alone take 54 GB of the first GPU
    with pytest.raises(ValueError, match=r"cannot fit any number of GPUs per worker.*--groups layers:K"):
        _plan(sizes, "70b", "model")


def test_node_smaller_than_a_worker_is_refused(sizes):
    with pytest.raises(ValueError, match=r"needs 2 GPUs per worker on one node .* largest node has 1"):
        _plan(sizes, "70b", "layer", cluster=4, per_node=1)


def test_tied_head_follows_the_embedding_and_a_short_budget_is_refused():
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        shell = AutoModelForCausalLM.from_config(tiny_config("llama"))  # lm_head tied to embed_tokens
    units = placement_units(shell)
    head = next(u for u in units if u.name == "lm_head")
    assert head.bytes == 0 and head.tied_to == "model.embed_tokens"
    total = sum(u.bytes for u in units)
    first = units[0].bytes + units[1].bytes  # the embedding and layer 0
    placed = device_map(shell, {0: first, 1: total})
    assert placed["lm_head"] == placed["model.embed_tokens"] == placed["model.layers.0"] == 0
    assert placed["model.layers.1"] == placed["model.norm"] == 1
    with pytest.raises(ValueError, match="do not fit the worker's 2 GPU"):
        device_map(shell, {0: total // 4, 1: total // 4})


def test_job_plans_the_model_from_its_config_and_refuses_too_few_gpus():
    from kvtc.pipeline.job.calibrate import Planned, _gpu_plan
    from kvtc.pipeline.settings import JobSettings
    from kvtc.workers.models import load_spec

    info = load_spec("tiny:llama")  # bf16 on GPUs: 6.5 MB of weights

    def planned(**flat):
        cfg = JobSettings.of(model="tiny:llama", seq_len=256, **flat)
        return Planned(cfg, "", "", None, info.fingerprint, 0.0, info.config)

    assert _gpu_plan(planned(), 4, 1 << 30, 4).gpus == 1
    assert _gpu_plan(planned(), 4, 8 << 20, 4).gpus == 2  # 8 MiB GPUs: two per worker
    with pytest.raises(ValueError, match="--gpus-per-worker 1 is too few: the model needs 2 GPUs per worker"):
        _gpu_plan(planned(gpus_per_worker=1), 4, 8 << 20, 4)


@pytest.mark.parametrize("argv, message", [
    (["--gpus-per-worker", "0"], "--gpus-per-worker must be >= 1"),
    (["--gpus-per-worker", "2"], "no GPU torch can see"),
])
def test_cli_refuses_bad_gpus_per_worker_before_model_work(argv, message, tmp_path, monkeypatch, capsys):
    from kvtc.pipeline import cli

    if torch.cuda.is_available() and argv[-1] == "2":
        pytest.skip("this machine has a GPU")
    monkeypatch.setenv("KVTC_CACHE", str(tmp_path / "cache"))
    rc = cli.main(["calibrate", "--model", "tiny:llama", "--registry", str(tmp_path / "reg"), *argv])
    assert rc == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "cache" / "shards").exists()
