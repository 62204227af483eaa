"""SGLang export: the file its KVTC loader reads (per-worker mu/basis float32, quantization schema keyed by
the integer ratio), refusals, and a numpy round trip with the loader's documented math: c = (x - mu) @ B
over the schema's kept prefix; int8/int4 groups asymmetric min/max per token (int8 [-128, 127], int4 [0, 15])
with float16 scale and offset, reconstructed as (q + offset) * scale; float groups cast; x = c @ B.T + mu.
Per-rank artifacts of a tiny model (`--tp 2`, and `--tp 4` over 2 KV heads: replicated) export every
worker `tp_<r>_pp_<s>`, each loaded as SGLang's `KVTCArtifactLoader` loads it (worker key, p = layers x
the rank's heads x head_dim) and round-tripping that rank's slice of a real cache."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from kvtc.artifacts import publish, pull
from kvtc.pipeline.cli import main as cli
from kvtc.artifacts.export import ExportError
from kvtc.artifacts.export_sglang import export_sglang, sglang_schema
from helpers.toy_artifacts import toy_content

BITS = {"float32": 32, "bfloat16": 16, "int8": 8, "int4": 4}


def _artifact(tmp_path, keys: str = "rope-removed", **kw):
    content = toy_content(**kw)
    content.calibration["keys"] = keys
    return pull("toy", registry=publish(content, tmp_path / "reg").registry), content


def _check_schema(schema, rank: int) -> int:
    """SGLang's build_layout rules -> bits per token."""
    assert isinstance(schema, list) and schema
    bits, used, previous = 0, 0, 99
    for size, dtype in schema:
        assert isinstance(size, int) and size > 0 and dtype in BITS
        assert BITS[dtype] <= previous  # non-increasing precision
        previous = BITS[dtype]
        if dtype == "int4":
            assert size >= 8 and size % 8 == 0
        used += size
        bits += size * BITS[dtype] + (32 if dtype in ("int8", "int4") else 0)
    assert used <= rank and bits % 8 == 0
    return bits


def _reconstruct(x: np.ndarray, mu: np.ndarray, basis: np.ndarray, schema, decoder: np.ndarray | None = None) -> np.ndarray:
    c = (x - mu) @ basis
    out, start = [], 0
    for size, dtype in schema:
        v = c[:, start:start + size].astype(np.float32)
        start += size
        if dtype == "float32":
            out.append(v)
        elif dtype == "bfloat16":
            out.append(torch.from_numpy(v).to(torch.bfloat16).float().numpy())
        else:
            qmin, qmax = (-128, 127) if dtype == "int8" else (0, 15)
            lo, hi = v.min(1, keepdims=True), v.max(1, keepdims=True)
            scale = np.where(hi > lo, (hi - lo) / (qmax - qmin), 1.0).astype(np.float16).astype(np.float32)
            zero = qmin - np.round(lo / scale)
            q = np.clip(np.round(v / scale + zero), qmin, qmax)
            offset = (-zero).astype(np.float16).astype(np.float32)
            out.append((q + offset) * scale)
    return np.concatenate(out, 1) @ (basis if decoder is None else decoder).T + mu  # a whitened basis decodes by its decoder


def test_file_is_what_sglangs_loader_reads_and_round_trips_with_its_math(tmp_path):
    art, content = _artifact(tmp_path)
    path = export_sglang(art, 4, tmp_path / "out")
    data = torch.load(path, map_location="cpu", weights_only=True)  # the loader's own call
    assert data["version"] == "v3-worker-quant" and set(data) == {"version", "keys", "values"}
    summary = json.loads(path.with_suffix(".json").read_text())
    rng = np.random.default_rng(0)
    for stream in ("keys", "values"):
        params = data[stream]["tp_0_pp_0"]
        mu, basis, schema = params["mu"], params["basis"], params["quant"]["4"]
        assert mu.dtype == basis.dtype == torch.float32 and mu.shape == (32,) and basis.shape[0] == 32
        bits = _check_schema(schema, basis.shape[1])
        src_mean, eig, comps = content.bases[(stream, 0)]
        np.testing.assert_array_equal(mu.numpy(), src_mean)
        np.testing.assert_array_equal(basis.numpy(), comps[:, :basis.shape[1]])
        row = next(s for s in summary["streams"] if s["stream"] == stream)
        assert row["bits_per_token"] == bits and row["sglang_ratio"] == round(16 * 32 / bits, 3)
        assert bits <= 16 * 32 / 4 * 1.1  # near the ratio's budget
        z = rng.standard_normal((64, 32)).astype(np.float32) * np.sqrt(eig)
        x = src_mean + z @ comps.T
        x_hat = _reconstruct(x, mu.numpy(), basis.numpy(), schema)
        kept = basis.shape[1]
        tail = np.linalg.norm(z[:, kept:]) / np.linalg.norm(z)
        rel = np.linalg.norm(x_hat - x) / np.linalg.norm(x - src_mean)
        assert tail <= rel < tail + 0.25


def test_schema_maps_blocks_to_sglang_dtypes_with_non_increasing_precision():
    blocks = [(0, 1, "fp8", 8), (1, 16, "int4", 4), (17, 1, "int4", 4), (18, 64, "int2", 2), (82, 10, "none", 0)]
    assert sglang_schema(blocks, "x") == [(1, "int8"), (16, "int8"), (1, "int8"), (64, "int4")]
    with pytest.raises(ExportError, match="contiguous prefix"):
        sglang_schema([(0, 4, "int4", 4), (4, 4, "none", 0), (8, 16, "int4", 4)], "x")


def test_refusals_name_the_fix_and_write_nothing(tmp_path):
    kept, _ = _artifact(tmp_path / "a", keys="rope-kept")
    with pytest.raises(ExportError, match="--keys rope-removed"):
        export_sglang(kept, 4, tmp_path / "o1")
    layered, _ = _artifact(tmp_path / "b", groups=[[0, 1], [1, 2]])
    with pytest.raises(ExportError, match=r"tp_0_pp_0 loads one basis over its layers \[0, 2\).*--groups model"):
        export_sglang(layered, 4, tmp_path / "o2")
    art, _ = _artifact(tmp_path / "c", ratios=(4.0, 5.5))
    with pytest.raises(ExportError, match="integer"):
        export_sglang(art, 5.5, tmp_path / "o3")
    assert not any((tmp_path / d).exists() for d in ("o1", "o2", "o3"))


def test_cli_exports_sglang_and_prints_the_real_ratio(tmp_path, capsys):
    _artifact(tmp_path)
    reg = str(tmp_path / "reg")
    assert cli(["export", "toy", "--ratio", "4", "--format", "sglang", "--to", str(tmp_path / "o"),
                "--registry", reg]) == 0
    assert "fp16 scale and offset" in capsys.readouterr().out and (tmp_path / "o" / "kvtc_sglang.pt").is_file()


def test_pipeline_stages_follow_sglangs_split_and_need_matching_groups(tmp_path):
    from kvtc.artifacts.export_sglang import pp_stages

    assert pp_stages(30, 4) == [(0, 7), (7, 14), (14, 22), (22, 30)]  # remainder on the last stages
    assert pp_stages(5, 2, (3, 2)) == [(0, 3), (3, 5)]
    with pytest.raises(ExportError, match="summing to the model's 5 layers"):
        pp_stages(5, 2, (3, 3))
    staged, _ = _artifact(tmp_path / "a", groups=[[0, 1], [1, 2]])
    path = export_sglang(staged, 4, tmp_path / "o", pp=2)
    data = torch.load(path, map_location="cpu", weights_only=True)
    assert set(data["keys"]) == {"tp_0_pp_0", "tp_0_pp_1"}
    assert data["values"]["tp_0_pp_1"]["mu"].shape == (16,)  # one layer x 2 heads x 8
    whole, _ = _artifact(tmp_path / "b")
    with pytest.raises(ExportError, match=r"tp_0_pp_0 loads one basis over its layers \[0, 1\)"):
        export_sglang(whole, 4, tmp_path / "o2", pp=2)


# --- per-rank artifacts of a tiny model: every worker exported, each loaded as SGLang loads it ---

TINY = dict(model="tiny:llama@2x2x16x8", corpus="pydoc", eval_corpus=None, seq_len=64, window=8, tokens=768,
            seqs_per_shard=4, heldout_rows=256, ratios=(8.0,), tokens_curve_points=0, groups="model",
            served_sequences=0)


@pytest.fixture(scope="module")
def ranked(tmp_path_factory):
    """TP 2 and 4 (2 KV heads: each held by two ranks) artifacts of one tiny model (small budgets: the
    test is about shapes and the loader's math, not the error)."""
    from kvtc.artifacts import pull as pull_version
    from kvtc.pipeline.job.calibrate import run
    from kvtc.pipeline.settings import JobSettings

    root = tmp_path_factory.mktemp("sglang-tp")
    out = {}
    for tp in (2, 4):
        cfg = JobSettings.of(**TINY, tp=tp, registry=str(root / "reg"), store=str(root / "store"), name=f"tp{tp}")
        summary = run(cfg, in_process=True)
        out[tp] = pull_version(summary["name"], summary["version"], registry=summary["registry"])
    return out


def _load_worker(data: dict, worker: str, p: int, ratio: int):
    """KVTCArtifactLoader's checks and trimming, per stream -> {stream: (mu, basis[:, :retained], schema, decoder
    trimmed alike or None)}."""
    assert data.get("version") == "v3-worker-quant"
    out = {}
    for stream in ("keys", "values"):
        if worker not in data[stream]:
            raise ValueError(f"KVTC artifact is missing {stream}/{worker}")
        params = data[stream][worker]
        mu, basis = params["mu"], params["basis"]
        if mu.dtype != torch.float32 or tuple(mu.shape) != (p,):
            raise ValueError(f"KVTC artifact {stream}/{worker}/mu must be an FP32 tensor of shape [{p}]")
        assert basis.dtype == torch.float32 and basis.ndim == 2 and basis.shape[0] == p and basis.shape[1] > 0
        schema = params["quant"][str(ratio)]
        retained = sum(size for size, _ in schema)
        _check_schema(schema, basis.shape[1])
        decoder = params.get("decoder")
        out[stream] = (mu.numpy(), basis[:, :retained].numpy(), schema,
                       None if decoder is None else decoder[:, :retained].numpy())
    return out


def _values(lm_model: str, tokens: int = 64) -> np.ndarray:
    """A real cache of the tiny model: values (layers, kv_heads, tokens, head_dim) as float32."""
    from kvtc.workers.capture import raw_cache
    from kvtc.workers.models import load_model

    lm = load_model(lm_model, device="cpu")
    ids = torch.randint(0, 49152, (1, tokens), generator=torch.Generator().manual_seed(3))
    _, values = raw_cache(lm, ids)
    return values.float().numpy()


@pytest.mark.parametrize("tp", [2, 4])
def test_every_rank_is_exported_and_loads_and_round_trips_its_slice(ranked, tmp_path, tp):
    art = ranked[tp]
    path = export_sglang(art, 8, tmp_path / "out", tp=tp)
    data = torch.load(path, map_location="cpu", weights_only=True)
    doc = json.loads(path.with_suffix(".json").read_text())
    assert set(data["keys"]) == set(data["values"]) == {f"tp_{r}_pp_0" for r in range(tp)}
    assert doc["tp"] == tp and [w["worker"] for w in doc["workers"]] == [f"tp_{r}_pp_0" for r in range(tp)]
    values = _values(TINY["model"])
    L, H, T, D = values.shape
    local = max(1, H // tp)
    for rank in range(tp):
        h0 = rank * H // tp if tp <= H else rank // (tp // H)
        p = L * local * D  # SGLang's p: the worker's layer_num x head_num x head_dim
        worker = _load_worker(data, f"tp_{rank}_pp_0", p, 8)
        with pytest.raises(ValueError, match="mu must be an FP32 tensor"):
            _load_worker(data, f"tp_{rank}_pp_0", L * H * D, 8)  # the whole model's p: not this worker's
        mu, basis, schema, decoder = worker["values"]
        # the rank's slice, (tokens, layer x its heads x head_dim), as the host pool flattens a page
        x = values[:, h0:h0 + local].transpose(2, 0, 1, 3).reshape(T, p)
        rel = np.linalg.norm(_reconstruct(x, mu, basis, schema, decoder) - x) / np.linalg.norm(x)
        assert rel < 0.6, (rank, rel)
        row = next(w for w in doc["workers"] if w["worker"] == f"tp_{rank}_pp_0")
        assert row["sglang_ratio"] > 4
    if tp == 4:  # ranks holding the same head load the same basis
        a, b = data["values"]["tp_0_pp_0"], data["values"]["tp_1_pp_0"]
        assert torch.equal(a["basis"], b["basis"]) and not torch.equal(a["basis"], data["values"]["tp_2_pp_0"]["basis"])


def test_a_tp_the_artifact_was_not_calibrated_for_is_refused(ranked, tmp_path):
    one, _ = _artifact(tmp_path / "a")
    with pytest.raises(ExportError, match=r"calibrated for TP 1 .* at --tp 2 holds 1 of the model's 2 KV heads"):
        export_sglang(one, 4, tmp_path / "o", tp=2)
    assert json.loads(export_sglang(one, 4, tmp_path / "one", tp=1).with_suffix(".json").read_text())["tp"] == 1
    with pytest.raises(ExportError, match=r"calibrated for TP 2 .* --tp 4"):
        export_sglang(ranked[2], 8, tmp_path / "o", tp=4)
    assert not (tmp_path / "o").exists()
