"""Tensor-parallel ranks: the KV heads each rank holds (vLLM / SGLang QKVParallelLinear), bad TP sizes,
per-rank bases calibrated on an 8-KV-head geometry and each rank's codec on its local cache."""
from __future__ import annotations

import pytest

from kvtc.artifacts.tensor_parallel import TensorParallelLayout


@pytest.mark.parametrize("tp, heads, shards", [
    (1, [(0, 8)], [(0, 8)]),
    (2, [(0, 4), (4, 8)], [(0, 4), (4, 8)]),
    (4, [(0, 2), (2, 4), (4, 6), (6, 8)], [(0, 2), (2, 4), (4, 6), (6, 8)]),
    (8, [(h, h + 1) for h in range(8)], [(h, h + 1) for h in range(8)]),
    (16, [(r // 2, r // 2 + 1) for r in range(16)], [(h, h + 1) for h in range(8)]),  # each head on 2 ranks
])
def test_ranks_hold_the_heads_the_engines_give_them(tp, heads, shards):
    layout = TensorParallelLayout(tp, 8, 32)
    assert [layout.heads(r) for r in range(tp)] == heads
    assert layout.shards == shards
    assert layout.replicas == max(1, tp // 8)
    assert TensorParallelLayout.from_dict(layout.to_dict()) == layout


def test_replicated_heads_map_consecutive_ranks_to_one_shard():
    layout = TensorParallelLayout(16, 8)
    assert [layout.shard_of(r) for r in range(16)] == [r // 2 for r in range(16)]
    assert TensorParallelLayout(6, 2).shards == [(0, 1), (1, 2)]
    assert [TensorParallelLayout(6, 2).shard_of(r) for r in range(6)] == [0, 0, 0, 1, 1, 1]


@pytest.mark.parametrize("tp, kv, attn, message", [
    (3, 8, 0, "--tp 3 does not shard 8 KV heads"),
    (12, 8, 0, "--tp 12 does not shard 8 KV heads"),
    (6, 4, 0, "--tp 6 does not shard 4 KV heads"),
    (0, 8, 0, "--tp must be an integer >= 1"),
    (4, 8, 6, "does not divide the model's 6 attention heads"),
])
def test_tp_sizes_the_engines_refuse_are_refused(tp, kv, attn, message):
    with pytest.raises(ValueError, match=message):
        TensorParallelLayout(tp, kv, attn)


def test_a_rank_outside_the_layout_and_a_forged_rank_table_are_refused():
    layout = TensorParallelLayout(4, 8)
    with pytest.raises(ValueError, match=r"rank must be an integer in \[0, 4\)"):
        layout.heads(4)
    forged = layout.to_dict()
    forged["ranks"][1]["heads"] = [0, 2]
    with pytest.raises(ValueError, match="do not follow the engines' sharding"):
        TensorParallelLayout.from_dict(forged)


# --- calibrated per-rank bases on an 8-KV-head geometry (16 attention heads, so TP 16 is servable) ---

import torch  # noqa: E402

from kvtc import artifacts  # noqa: E402
from kvtc.kernels import KVTCCodec  # noqa: E402
from kvtc.kernels.codec.blob import BlobError  # noqa: E402

TINY = dict(model="tiny:llama@2x8x16x16", corpus="pydoc", eval_corpus=None, seq_len=96, window=16, tokens=1536,
            seqs_per_shard=2, heldout_rows=256, ratios=(8.0,), tokens_curve_points=0, groups="layer",
            served_sequences=0)  # no served check: these tests read the bases, the layout and the codec; one ratio:
# every test below codes or measures at CR 8 alone (each ratio is fitted and measured on its own)


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """TP 1, 2, 4, 8 and 16 artifacts of one tiny model, one shared shard store per TP (in-process)."""
    from kvtc.pipeline.job.calibrate import run
    from kvtc.pipeline.settings import JobSettings

    root = tmp_path_factory.mktemp("tp")
    out = {}
    for tp in (1, 2, 4, 8, 16):
        cfg = JobSettings.of(**TINY, tp=tp, registry=str(root / "reg"), store=str(root / "store"), name=f"tp{tp}")
        summary = run(cfg, in_process=True)
        out[tp] = artifacts.pull(summary["name"], summary["version"], registry=summary["registry"])
    return out


def _cache(tokens: int = 80, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A real cache of the tiny model: (layers, 8, tokens, 16) keys with RoPE, values."""
    from kvtc.workers.capture import raw_cache
    from kvtc.workers.models import load_model

    lm = load_model(TINY["model"], device="cpu")
    ids = torch.randint(0, 49152, (1, tokens), generator=torch.Generator().manual_seed(seed))
    return raw_cache(lm, ids)


@pytest.mark.parametrize("tp", [2, 4, 8, 16])
def test_manifest_records_tp_and_each_ranks_heads_and_groups(calibrated, tp):
    manifest = calibrated[tp].manifest
    section = manifest["calibration"]["tensor_parallel"]
    layout = TensorParallelLayout(tp, 8)
    assert section["tp"] == tp and [r["heads"] for r in section["ranks"]] == [list(layout.heads(r)) for r in range(tp)]
    groups = manifest["calibration"]["groups"]
    distinct = len(layout.shards)
    assert len(groups) == 2 * distinct  # groups="layer": 2 layers x one basis per distinct head range
    for r in section["ranks"]:
        assert [groups[g]["heads"] for g in r["groups"]] == [r["heads"]] * 2
    assert "tensor_parallel" not in calibrated[1].manifest["calibration"]  # single-rank: as before
    if tp == 16:  # each head on two ranks: stored once, both ranks map to it
        assert [r["shard"] for r in section["ranks"]] == [r // 2 for r in range(16)]
        assert section["ranks"][6]["groups"] == section["ranks"][7]["groups"]


@pytest.mark.parametrize("tp", [2, 4, 8, 16])
@pytest.mark.parametrize("mode", ["ecsq", "fixed"])
def test_each_rank_round_trips_its_local_cache(calibrated, tp, mode):
    keys, values = _cache()
    whole = KVTCCodec(calibrated[tp], 8.0, mode=mode)
    k_all, v_all = whole.decode(whole.encode(keys, values))
    for rank in range(tp):
        codec = KVTCCodec(calibrated[tp], 8.0, mode=mode, rank=rank)
        h0, h1 = codec.spec.heads
        assert (h0, h1) == TensorParallelLayout(tp, 8).heads(rank) and codec.spec.kv_heads == h1 - h0
        local = keys[:, h0:h1].contiguous(), values[:, h0:h1].contiguous()
        k, v = codec.decode(codec.encode(*local))
        assert k.shape == local[0].shape
        # the rank's bases are the whole-cache codec's bases for those heads: same reconstruction
        assert torch.allclose(k, k_all[:, h0:h1], atol=1e-4) and torch.allclose(v, v_all[:, h0:h1], atol=1e-4)
        if tp == 2:  # 64 features per basis; at TP 8 and 16 (16 features) CR 8 leaves a bare 32 bits per token
            assert float((v - local[1]).norm() / local[1].norm()) < 0.5
        with pytest.raises(ValueError, match=r"must be shaped \(layers, kv_heads, tokens, head_dim\)"):
            codec.encode(keys, values)  # the whole cache is not a rank's


def test_a_rank_refuses_another_ranks_blob_and_replicas_share_one(calibrated):
    keys, values = _cache()
    two = [KVTCCodec(calibrated[2], 8.0, rank=r) for r in range(2)]
    blob = two[0].encode(keys[:, :4].contiguous(), values[:, :4].contiguous())
    with pytest.raises(BlobError, match="blob is for model .*/kv0-4"):
        two[1].decode(blob)
    replicas = [KVTCCodec(calibrated[16], 8.0, rank=r) for r in (6, 7)]  # both hold head 3
    blob = replicas[0].encode(keys[:, 3:4].contiguous(), values[:, 3:4].contiguous())
    k, _ = replicas[1].decode(blob)
    assert k.shape == (2, 1, 80, 16)


def test_per_rank_bases_cost_some_error_against_one_cross_head_basis(calibrated):
    """Same ratio, same held-out rows: splitting heads cannot beat the cross-head basis by much."""
    def err(art, stream):
        return next(m["value"] for m in art.metrics() if m["group"] is None and m["split"] == "heldout"
                    and m["metric"] == "rel_error" and m["ratio"] == 8.0 and m["stream"] == stream)
    for stream in ("keys", "values"):
        assert err(calibrated[8], stream) > 0.9 * err(calibrated[1], stream)


def test_rank_of_a_single_rank_artifact_and_bad_ranks(calibrated):
    assert KVTCCodec(calibrated[1], 8.0, rank=0).spec.heads is None
    with pytest.raises(ValueError, match="calibrated for one rank"):
        KVTCCodec(calibrated[1], 8.0, rank=1)
    with pytest.raises(ValueError, match=r"rank must be an integer in \[0, 4\)"):
        KVTCCodec(calibrated[4], 8.0, rank=4)


def test_bad_tp_fails_before_model_work(tmp_path, monkeypatch, capsys):
    from kvtc.pipeline import cli

    monkeypatch.setenv("KVTC_CACHE", str(tmp_path / "cache"))
    for tp, message in (("3", "--tp 3 does not shard 8 KV heads"), ("32", "does not divide the model's 16 attention"),
                        ("0", "--tp must be >= 1")):
        rc = cli.main(["calibrate", "--model", TINY["model"], "--tp", tp, "--registry", str(tmp_path / "reg")])
        assert rc == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "cache" / "shards").exists()  # no statistics: refused before any model work
