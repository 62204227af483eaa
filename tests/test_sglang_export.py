"""SGLang export: the file its KVTC loader reads (per-worker mu/basis float32, quantization schema keyed by
the integer ratio), refusals, and a numpy round trip with the loader's documented math: c = (x - mu) @ B
over the schema's kept prefix; int8/int4 groups asymmetric min/max per token (int8 [-128, 127], int4 [0, 15])
with float16 scale and offset, reconstructed as (q + offset) * scale; float groups cast; x = c @ B.T + mu."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from kvtc.artifacts import publish, pull
from kvtc.artifacts.cli import main as cli
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


def _reconstruct(x: np.ndarray, mu: np.ndarray, basis: np.ndarray, schema) -> np.ndarray:
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
    return np.concatenate(out, 1) @ basis.T + mu


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
    with pytest.raises(ExportError, match="--groups model"):
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
