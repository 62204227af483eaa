"""Dynamo export: what Dynamo's KVTC kernels can run, refusals, the real ratio, and a numpy round trip
with Dynamo's documented math ((x - mean) @ P, IntX min/max per row per range, c @ P.T + mean), for
token rows and for block rows (a row = one KVBM block region: tokens_per_block x heads x head_dim),
and the tensor-parallel rank mapping."""
from __future__ import annotations

import json

import numpy as np
import pytest

from kvtc.artifacts import publish, pull
from kvtc.pipeline.cli import main as cli
from kvtc.artifacts.export import DynamoExportOptions, ExportError, export_dynamo
from kvtc.artifacts.groups import parse_groups
from kvtc.artifacts.tensor_parallel import TensorParallelLayout
from helpers.toy_artifacts import toy_content

PAGED_KEPT = dict(groups=[[0, 1], [1, 2]])
TOKEN = DynamoExportOptions(layout="token")


def _artifact(tmp_path, keys: str = "rope-kept", **kw):
    content = toy_content(**{**PAGED_KEPT, **kw})
    content.calibration["keys"] = keys
    return pull("toy", registry=publish(content, tmp_path / "reg").registry), content


def _load(out, config):
    p, k = config["features"], config["pca_components"]
    mean = np.fromfile(out / config["mean"]["file"], dtype="<f4")
    projection = np.fromfile(out / config["projection"]["file"], dtype="<f4").reshape(p, k)
    return mean, projection


def _intx(c: np.ndarray, bits: int) -> np.ndarray:
    """Dynamo IntX on one range: per-row float32 min/max, (2^bits - 1) steps, round to nearest."""
    lo, hi = c.min(axis=1, keepdims=True), c.max(axis=1, keepdims=True)
    scale = np.where(hi > lo, (hi - lo) / (2**bits - 1), 1.0).astype(np.float32)
    return lo + np.clip(np.rint((c - lo) / scale), 0, 2**bits - 1) * scale


def test_round_trip_with_dynamos_math(tmp_path):
    art, content = _artifact(tmp_path)
    out = tmp_path / "out"
    doc = json.loads(export_dynamo(art, 4, out, TOKEN).read_text())
    assert doc["keys"] == "rope-kept" and doc["layout"] == "token" and len(doc["configs"]) == 4
    rng = np.random.default_rng(0)
    for config in doc["configs"]:
        mean, P = _load(out, config)
        src_mean, _, comps = content.bases[(config["stream"], config["group"])]
        np.testing.assert_array_equal(mean, src_mean)
        k = P.shape[1]
        # rows living in the exported subspace come back exactly without quantization ...
        z = rng.standard_normal((33, k)).astype(np.float32) * (np.arange(k, dtype=np.float32) + 1) ** -0.5
        x = mean + z @ P.T
        c = (x - mean) @ P
        np.testing.assert_allclose(c @ P.T + mean, x, rtol=1e-4, atol=1e-4)
        # ... and within the quantizers' step with IntX per range, ranges contiguous from 0 to k
        ranges = config["ranges"]
        assert ranges[0]["start_idx"] == 0 and ranges[-1]["end_idx"] == k
        assert all(a["end_idx"] == b["start_idx"] for a, b in zip(ranges, ranges[1:]))
        c_hat = np.concatenate([_intx(c[:, r["start_idx"]:r["end_idx"]], r["int_bits"]) for r in ranges], axis=1)
        x_hat = c_hat @ P.T + mean
        rel = np.linalg.norm(x_hat - x) / np.linalg.norm(x - mean)
        assert 0 < rel < 0.35
        # exported components are the allocation's kept ones, in order, plus zero columns padding ranges
        blocks = [b for b in content.allocations[(4.0, config["stream"], config["group"])]["blocks"] if b[2] != "none"]
        columns = [i for b in blocks for i in range(b[0], b[0] + b[1])]
        padding = np.concatenate([np.arange(r["end_idx"] - r["zero_columns"], r["end_idx"]) for r in ranges]).astype(int)
        np.testing.assert_array_equal(P[:, padding], 0)
        np.testing.assert_array_equal(np.delete(P, padding, axis=1), comps[:, columns])


def test_fp8_blocks_become_int8_and_the_real_ratio_counts_64_bits_per_range(tmp_path):
    art, content = _artifact(tmp_path)
    doc = json.loads(export_dynamo(art, 4, tmp_path / "out", TOKEN).read_text())
    for config in doc["configs"]:
        ranges = config["ranges"]
        assert all(r["quant_type"] == "IntX" and r["int_bits"] in (1, 2, 4, 8) for r in ranges)
        assert [r["int_bits"] for r in ranges if r["from"] == "fp8"] == [8] * sum(r["from"] == "fp8" for r in ranges)
        assert all((r["end_idx"] - r["start_idx"]) * r["int_bits"] % 8 == 0 for r in ranges)  # whole bytes per row
        bits = sum((r["end_idx"] - r["start_idx"]) * r["int_bits"] + 64 for r in ranges)
        assert config["dynamo_bits_per_row"] == bits > 0
        per_call = bits // 8 * doc["batch"] + 40 * len(ranges)
        assert config["dynamo_bytes_per_call"] == per_call
        assert config["dynamo_ratio"] == round(2 * config["features"] * doc["batch"] / per_call, 3) < 4
    assert doc["dynamo_ratio"] < 4


def test_refusals_name_the_fix_and_write_nothing(tmp_path):
    removed, _ = _artifact(tmp_path / "a", keys="rope-removed")
    with pytest.raises(ExportError, match="--allow-rope-removed"):
        export_dynamo(removed, 4, tmp_path / "o1")
    assert json.loads(export_dynamo(removed, 4, tmp_path / "o1b", DynamoExportOptions(allow_rope_removed=True))
                      .read_text())["configs"][0]["rope_removed"] is True
    wide, _ = _artifact(tmp_path / "b", groups=[[0, 2]])
    with pytest.raises(ExportError, match="--groups layer"):
        export_dynamo(wide, 4, tmp_path / "o2")
    assert export_dynamo(wide, 4, tmp_path / "o2b", DynamoExportOptions(layout="token-major")).is_file()
    kept, _ = _artifact(tmp_path / "c")
    with pytest.raises(ExportError, match="fp8"):
        export_dynamo(kept, 4, tmp_path / "o3", DynamoExportOptions(fp8="refuse"))
    assert not any((tmp_path / d).exists() for d in ("o1", "o2", "o3"))


def test_odd_widths_export_at_the_next_dynamo_width(tmp_path):
    content = toy_content(**PAGED_KEPT)
    content.calibration["keys"] = "rope-kept"
    content.allocations[(8.0, "values", 0)]["blocks"][0] = (0, 4, "int3", 3, 32)
    art = pull("toy", registry=publish(content, tmp_path / "reg").registry)
    doc = json.loads(export_dynamo(art, 8, tmp_path / "out", TOKEN).read_text())
    config = next(c for c in doc["configs"] if c["stream"] == "values" and c["group"] == 0)
    assert config["ranges"][0]["int_bits"] == 4 and config["ranges"][0]["from"] == "int3"


def test_cli_prints_the_real_ratio_and_exits_2_on_refusal(tmp_path, capsys):
    art, _ = _artifact(tmp_path, keys="rope-removed")
    reg = str(tmp_path / "reg")
    assert cli(["export", "toy", "--ratio", "4", "--to", str(tmp_path / "o"), "--registry", reg]) == 2
    assert "--allow-rope-removed" in capsys.readouterr().err
    assert cli(["export", "toy", "--ratio", "4", "--to", str(tmp_path / "o"), "--registry", reg,
                "--allow-rope-removed", "--layout", "token"]) == 0
    assert "Dynamo's 64-bit min/max" in capsys.readouterr().out


def _dynamo_buffer(ranges: list[dict], batch: int) -> int:
    """Dynamo's kvtc_compressed_size: header + min/max + packed bytes rounded over the whole batch."""
    return sum(40 + 8 * batch + -(-batch * (r["end_idx"] - r["start_idx"]) // (8 // r["int_bits"])) for r in ranges)


def _dynamo_writes(ranges: list[dict], batch: int) -> int:
    """What its quantize kernel writes: every row's codes padded to whole bytes."""
    return sum(40 + 8 * batch + batch * -(-(r["end_idx"] - r["start_idx"]) // (8 // r["int_bits"])) for r in ranges)


def test_a_range_of_partial_bytes_is_padded_with_zero_columns_or_refused(tmp_path):
    content = toy_content(**PAGED_KEPT)
    content.calibration["keys"] = "rope-kept"
    blocks = content.allocations[(4.0, "keys", 0)]["blocks"]
    blocks[:] = [(0, 3, "int2", 2, 32), (3, 5, "int4", 4, 32)] + [(b[0], b[1], "none", 0, 0) for b in blocks[-1:]
                                                                    if b[0] >= 8]
    art = pull("toy", registry=publish(content, tmp_path / "reg").registry)
    raw = [{"start_idx": 0, "end_idx": 3, "int_bits": 2}, {"start_idx": 3, "end_idx": 8, "int_bits": 4}]
    assert _dynamo_writes(raw, 16) > _dynamo_buffer(raw, 16)  # as allocated, Dynamo's kernel would overrun
    with pytest.raises(ExportError, match="--ranges pad"):
        export_dynamo(art, 4, tmp_path / "refused", DynamoExportOptions(ranges="refuse", layout="token"))
    assert not (tmp_path / "refused").exists()
    out = tmp_path / "out"
    doc = json.loads(export_dynamo(art, 4, out, DynamoExportOptions(batch=16, layout="token")).read_text())
    config = next(c for c in doc["configs"] if c["stream"] == "keys" and c["group"] == 0)
    ranges = config["ranges"]
    assert [(r["start_idx"], r["end_idx"], r["zero_columns"]) for r in ranges] == [(0, 4, 1), (4, 10, 1)]
    assert _dynamo_writes(ranges, 16) == _dynamo_buffer(ranges, 16) == config["dynamo_bytes_per_call"]
    mean, P = _load(out, config)
    _, _, comps = content.bases[("keys", 0)]
    np.testing.assert_array_equal(P[:, [3, 9]], 0)
    np.testing.assert_array_equal(P[:, [0, 1, 2, 4, 5, 6, 7, 8]], comps[:, :8])
    x = mean + np.random.default_rng(1).standard_normal((16, P.shape[0])).astype(np.float32)
    c = (x - mean) @ P
    np.testing.assert_array_equal(c[:, [3, 9]], 0)  # zero columns code 0 and add nothing back
    assert config["dynamo_bits_per_row"] == 8 * (1 + 8 + 3 + 8)


def _dynamo_round_trip(x: np.ndarray, mean: np.ndarray, P: np.ndarray, ranges: list[dict]) -> np.ndarray:
    c = (x - mean) @ P
    c_hat = np.concatenate([_intx(c[:, r["start_idx"]:r["end_idx"]], r["int_bits"]) for r in ranges], axis=1)
    return c_hat @ P.T + mean


def test_block_rows_are_kvbm_block_regions_and_round_trip_with_dynamos_math(tmp_path):
    art, content = _artifact(tmp_path)
    T = 4
    token_doc = json.loads(export_dynamo(art, 4, tmp_path / "tok", TOKEN).read_text())
    out = tmp_path / "blk"
    doc = json.loads(export_dynamo(art, 4, out, DynamoExportOptions(tokens_per_block=T, batch=8)).read_text())
    assert doc["layout"] == "block" and doc["row_layout"]["order"] == ["token", "kv_head", "head_dim"]
    rng = np.random.default_rng(2)
    for config, per_token in zip(doc["configs"], token_doc["configs"]):
        p = per_token["features"]
        assert config["features"] == T * p and config["tokens_per_row"] == T
        mean, P = _load(out, config)
        tmean, tP = _load(tmp_path / "tok", per_token)
        np.testing.assert_array_equal(mean, np.tile(tmean, T))
        # without quantization a block row projects and reconstructs exactly as its tokens do one by one
        src_mean, eig, comps = content.bases[(config["stream"], config["group"])]
        tokens = src_mean + (rng.standard_normal((3 * T, p)) * np.sqrt(eig)).astype(np.float32) @ comps.T
        blocks = tokens.reshape(3, T * p)  # a KVBM region: token-major, each token (heads, head_dim)
        per_tok = ((tokens - tmean) @ tP) @ tP.T + tmean
        np.testing.assert_allclose((((blocks - mean) @ P) @ P.T + mean).reshape(3 * T, p), per_tok, atol=1e-4)
        # range j of a block row holds range j's components of every token
        for rb, rt in zip(config["ranges"], per_token["ranges"]):
            assert rb["int_bits"] == rt["int_bits"]
            assert rb["end_idx"] - rb["start_idx"] - rb["zero_columns"] == T * (rt["end_idx"] - rt["start_idx"]
                                                                               - rt["zero_columns"])
        assert all((r["end_idx"] - r["start_idx"]) * r["int_bits"] % 8 == 0 for r in config["ranges"])
        # with Dynamo's IntX (one min/max per block and range) the error stays near the per-token rows'
        x_blk = _dynamo_round_trip(blocks, mean, P, config["ranges"]).reshape(3 * T, p)
        x_tok = _dynamo_round_trip(tokens, tmean, tP, per_token["ranges"])
        rel_blk = np.linalg.norm(x_blk - tokens) / np.linalg.norm(tokens - src_mean)
        rel_tok = np.linalg.norm(x_tok - tokens) / np.linalg.norm(tokens - src_mean)
        assert rel_blk < 2 * rel_tok + 0.05, (rel_blk, rel_tok)
        # 64 bits of min/max per range per block, not per token: fewer bytes per token than token rows
        assert config["dynamo_bits_per_row"] / T < per_token["dynamo_bits_per_row"]
        assert config["projection_bytes"] == 4 * T * p * config["pca_components"]
    assert doc["dynamo_ratio"] > token_doc["dynamo_ratio"]


def test_block_rows_refuse_cross_layer_groups_and_oversized_projections(tmp_path):
    wide, _ = _artifact(tmp_path / "a", groups=[[0, 2]])
    with pytest.raises(ExportError, match="one layer's block region.*--groups layer"):
        export_dynamo(wide, 4, tmp_path / "o1")
    kept, _ = _artifact(tmp_path / "b")
    with pytest.raises(ExportError, match=r"dense 512 x \d+ projection .*--layout token"):
        export_dynamo(kept, 4, tmp_path / "o2", DynamoExportOptions(tokens_per_block=32, max_projection_mb=0.01))
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()


def _tp_artifact(tmp_path, tp: int, kv_heads: int = 2):
    """A toy per-rank artifact: one group per layer and distinct head range (as kvtc calibrate --tp --groups layer)."""
    layout = TensorParallelLayout(tp, kv_heads)
    groups = [{"layers": [layer], "heads": list(h)} for layer in range(2) for h in layout.shards]
    content = toy_content(num_kv_heads=kv_heads, head_dim=16, groups=groups)
    content.calibration["keys"] = "rope-kept"
    content.calibration["tensor_parallel"] = layout.to_dict(parse_groups(groups))
    return pull("toy", registry=publish(content, tmp_path / "reg").registry), content


@pytest.mark.parametrize("tp", [2, 4])
def test_every_rank_maps_to_its_heads_and_configs(tmp_path, tp):
    art, content = _tp_artifact(tmp_path, tp)
    out = tmp_path / "out"
    doc = json.loads(export_dynamo(art, 4, out, DynamoExportOptions(tokens_per_block=2, tp=tp)).read_text())
    section = doc["tensor_parallel"]
    assert section["tp"] == tp and [r["rank"] for r in section["ranks"]] == list(range(tp))
    layout = TensorParallelLayout(tp, 2)
    for rank in section["ranks"]:
        h0, h1 = layout.heads(rank["rank"])
        assert rank["heads"] == [h0, h1]
        mine = [c for c in doc["configs"] if rank["rank"] in c["ranks"]]
        assert len(mine) == 4  # 2 layers x keys, values
        for c in mine:
            assert c["features_per_token"] == (h1 - h0) * 16  # the rank's region: its heads only
    if tp == 4:  # two ranks per head share one config and its files
        assert sorted(len(c["ranks"]) for c in doc["configs"]) == [2] * len(doc["configs"])
    with pytest.raises(ExportError, match=f"calibrated for TP {tp}.*--tp 1 deployment"):
        export_dynamo(art, 4, tmp_path / "o", DynamoExportOptions(tp=1))
