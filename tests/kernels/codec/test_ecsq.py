"""ECSQ codec mode: fit against the Gaussian bound, ANS coding with escapes, codec dispatch, tables, bad input."""
import math

import numpy as np
import pytest
import torch

from kvtc.artifacts import publish, pull
from kvtc.artifacts.ecsq_tables import decode_ecsq, encode_ecsq
from kvtc.artifacts.groups import FeatureGroup
from helpers.toy_artifacts import toy_content
from kvtc.kernels import BlobError, CodecSpec, KVTCCodec, read_blob
from kvtc.kernels.codec.blob import TAG_ECSQ, Section, write_blob
from kvtc.kernels.codec.ecsq import EcsqGroup, decode_symbols, dequantize, encode_symbols, quantize
from kvtc.kernels.codec.spec import STREAMS
from helpers.synthetic import synthetic_cache, synthetic_spec
from kvtc.pipeline.evaluation.metrics import waterfilling_distortion
from kvtc.pipeline.fit.ecsq import EcsqFit, fit_ecsq, fit_ratios, squared_error
from kvtc.pipeline.fit.heldout import isotonic_decreasing


def _gaussian(lam: np.ndarray, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, lam.shape[0], generator=g, dtype=torch.float64) * torch.from_numpy(np.sqrt(lam))).float()


def _group(fit: EcsqFit, mean: torch.Tensor, components: torch.Tensor, group=FeatureGroup((0,))) -> EcsqGroup:
    return EcsqGroup(group, mean, components[:, :fit.kept].contiguous(), fit.step, fit.model.astype(np.int64),
                     torch.from_numpy(fit.offsets), fit.models)


def test_isotonic_is_non_increasing_least_squares():
    v = np.array([5.0, 3.0, 4.0, 1.0, 2.0, 2.0, 0.5])
    out = isotonic_decreasing(v)
    assert np.all(np.diff(out) <= 1e-12) and out.sum() == pytest.approx(v.sum())
    assert out.tolist() == pytest.approx([5.0, 3.5, 3.5, 5 / 3, 5 / 3, 5 / 3, 0.5])


@pytest.mark.parametrize("ratio", [8.0, 16.0, 32.0])
def test_fit_meets_budget_near_the_gaussian_bound(ratio):
    p = 160
    lam = np.exp(-np.arange(p) / 25.0) * 4 + 1e-4
    fit = fit_ecsq(ratio, _gaussian(lam, 3000), p)
    assert fit.bits_per_token <= fit.budget_bits
    assert fit.bits_per_token >= 0.97 * fit.budget_bits  # bisection spends the budget
    assert fit.kept < p and np.all(fit.scales[fit.kept - 1] > fit.step * 0.28)
    test = _gaussian(lam, 3000, seed=1)
    err = squared_error(fit, test) / test.shape[0]
    bound = waterfilling_distortion(lam, fit.budget_bits)
    gap_db = 10 * math.log10(err / bound)
    assert 0 < gap_db < 1.6  # ECSQ's high-rate gap is 1.53 dB; lower rates do better


def test_symbols_round_trip_with_escapes_on_odd_shapes():
    p = 37
    lam = np.linspace(9, 0.5, p)
    fit = fit_ecsq(6.0, _gaussian(lam, 500), p)
    group = _group(fit, torch.zeros(p), torch.eye(p))
    z = _gaussian(lam, 13, seed=4)[:, :fit.kept]
    z[3, 0] = 1e6  # far outside every model: escaped
    z[7, -1] = -5e4
    q = quantize(z, fit.step)
    words, escapes = encode_symbols(q.numpy(), group)
    assert len(escapes) >= 8
    back = decode_symbols(words, escapes, 13, group)
    assert np.array_equal(back, q.numpy())
    zhat = dequantize(torch.from_numpy(back), fit.step, torch.from_numpy(fit.offsets))
    assert float((zhat - z).abs().max()) <= fit.step  # within the quantizer's bin, outliers included
    assert decode_symbols(*encode_symbols(q[:0].numpy(), group), 0, group).shape == (0, fit.kept)


def test_truncated_or_corrupt_streams_are_blob_errors():
    p = 24
    lam = np.linspace(4, 0.5, p)
    fit = fit_ecsq(4.0, _gaussian(lam, 400), p)
    group = _group(fit, torch.zeros(p), torch.eye(p))
    z = _gaussian(lam, 50, seed=2)[:, :fit.kept]
    z[0, 0] = 1e5
    words, escapes = encode_symbols(quantize(z, fit.step).numpy(), group)
    bad_escape = np.frombuffer(escapes, dtype="<i4").copy()
    bad_escape[0] = 0  # an escape must lie outside its model's range
    for w, e, n in ((words[:-4], escapes, 50), (words + words[:4], escapes, 50), (words, escapes[:-4], 50),
                    (words, escapes + escapes, 50), (words, bad_escape.tobytes(), 50), (words[:-1], escapes, 50),
                    (words, escapes, 60)):
        with pytest.raises(BlobError):
            decode_symbols(w, e, n, group)
    with pytest.raises(ValueError, match="non-finite"):
        quantize(torch.tensor([[float("nan")]]), 1.0)


def _ecsq_spec(ratio: float = 8.0, seed: int = 0) -> CodecSpec:
    base = synthetic_spec(2, 2, 16, ratio, groups=[(0, 1), (1, 2)], sinks=2, window=3, seed=seed)
    ecsq = {}
    for si, stream in enumerate(STREAMS):
        keys, values = synthetic_cache(base, 400, torch.float32, seed=seed + 7)
        cache = (keys, values)[si]
        if base.rope and stream == "keys":
            from kvtc.kernels.codec.rope import RopeSpec

            cache = RopeSpec.from_dict(base.rope).remove(cache.float(), torch.arange(400))
        flat = cache.float().permute(2, 0, 1, 3).reshape(400, -1)
        groups = []
        for g in base.streams[stream]:
            cols = g.group.columns(2, 16)
            full = synthetic_spec(2, 2, 16, 1.5, groups=[(0, 1), (1, 2)], kept=32, seed=seed)  # all components
            comps = next(x for x in full.streams[stream] if x.group == g.group).components
            z = (flat[:, cols] - g.mean) @ comps
            groups.append(_group(fit_ecsq(ratio, z, 32), g.mean, comps, g.group))
        ecsq[stream] = tuple(groups)
    return CodecSpec(**{**{k: getattr(base, k) for k in ("name", "version", "ratio", "model_id", "num_layers", "kv_heads",
                                                        "head_dim", "sinks", "window", "rope", "streams")}, "ecsq": ecsq})


def test_codec_defaults_to_ecsq_and_still_decodes_fixed_blobs():
    spec = _ecsq_spec()
    keys, values = synthetic_cache(spec, 41, torch.float32, start=5, seed=3)
    codec = KVTCCodec(spec)
    assert codec.mode == "ecsq"
    blob = codec.encode(keys, values, start=5)
    header, sections = read_blob(blob)
    assert header.mode == "ecsq" and any(s.key.tag == TAG_ECSQ for s in sections)
    k2, v2 = codec.decode(blob)
    fixed = KVTCCodec(spec, mode="fixed")
    old = fixed.encode(keys, values, start=5)
    assert read_blob(old)[0].mode == "fixed"
    kf, vf = codec.decode(old)  # a fixed-rate blob decodes with an ECSQ-default codec
    assert torch.equal(kf, fixed.decode(old)[0]) and torch.equal(vf, fixed.decode(old)[1])
    for x, y in ((keys, k2), (values, v2)):
        assert float((x - y).norm() / x.norm()) < 0.5
        assert torch.equal(x[:, :, :0], y[:, :, :0])
        assert torch.equal(x[:, :, -3:], y[:, :, -3:])  # the window stays raw
    no_tables = CodecSpec(**{k: getattr(spec, k) for k in ("name", "version", "ratio", "model_id", "num_layers",
                                                          "kv_heads", "head_dim", "sinks", "window", "rope", "streams")})
    assert KVTCCodec(no_tables).mode == "fixed"
    with pytest.raises(ValueError, match="recalibrate"):
        KVTCCodec(no_tables, mode="ecsq")
    with pytest.raises(BlobError, match="ECSQ"):
        KVTCCodec(no_tables).decode(blob)
    with pytest.raises(ValueError, match="mode"):
        KVTCCodec(spec, mode="huffman")


def test_codec_rejects_a_stream_cut_inside_a_valid_blob():
    spec = _ecsq_spec()
    keys, values = synthetic_cache(spec, 30, torch.float32, seed=5)
    codec = KVTCCodec(spec)
    header, sections = read_blob(codec.encode(keys, values))
    cut = [Section(s.key, s.coding, s.raw_len - 4, bytes(s.stored)[:-4]) if s.key.tag == TAG_ECSQ else s
           for s in sections]
    with pytest.raises(BlobError):
        codec.decode(write_blob(header, cut))


def test_tables_round_trip_through_parquet_and_the_registry(tmp_path):
    import dataclasses

    content = toy_content(ratios=(4.0, 8.0))
    content = dataclasses.replace(content, model={**content.model, "rope": None})  # no RoPE: codec without inv_freq
    p = 2 * 2 * 8
    ecsq = {}
    for (stream, g), (_mean, eig, _comp) in content.bases.items():
        z = _gaussian(np.asarray(eig, dtype=np.float64), 300)
        for f in fit_ratios((4.0, 8.0), z, p):
            ecsq[(f.ratio, stream, g)] = f.to_table()
    back = decode_ecsq(encode_ecsq(ecsq))
    for key, t in ecsq.items():
        assert back[key]["step"] == t["step"] and back[key]["kept"] == t["kept"]
        assert np.array_equal(back[key]["offsets"], t["offsets"]) and np.array_equal(back[key]["model"], t["model"])
    ref = publish(dataclasses.replace(content, ecsq=ecsq), tmp_path / "reg")
    art = pull(ref.name, ref.version, registry=str(tmp_path / "reg"))
    assert art.ecsq_ratios() == [4.0, 8.0] and "ecsq.parquet" in art.manifest["files"]
    assert KVTCCodec(art, 8).mode == "ecsq"
    old = dataclasses.replace(content, name="old")
    plain = pull(publish(old, tmp_path / "reg").name, registry=str(tmp_path / "reg"))
    assert plain.ecsq(8, "keys") is None and KVTCCodec(plain, 8).mode == "fixed"
    with pytest.raises(ValueError, match="recalibrate"):
        KVTCCodec(plain, 8, mode="ecsq")
    bad = dict(ecsq[(4.0, "keys", 0)], kept=10_000)
    with pytest.raises(ValueError):
        dataclasses.replace(content, ecsq={(4.0, "keys", 0): bad})


def test_eval_settings_take_a_mode():
    from kvtc.pipeline.operations.quality import EvalSettings

    assert EvalSettings(mode="fixed").mode == "fixed" and EvalSettings().mode is None
    with pytest.raises(ValueError, match="mode"):
        EvalSettings(mode="huffman")


def test_rate_control_coarsens_the_step_only_for_text_that_codes_larger():
    from kvtc.kernels.codec.ecsq import decode_group, encode_group

    p = 48
    lam = np.exp(-np.arange(p) / 10.0) * 5 + 1e-3
    fit = fit_ecsq(8.0, _gaussian(lam, 2000), p)
    group = _group(fit, torch.zeros(p), torch.eye(p))
    budget = fit.budget_bits * 200 // 8
    usual = _gaussian(lam, 200, seed=8)[:, :fit.kept]
    words, esc = encode_group(usual, group, budget * 2)
    assert decode_group(words, esc, 200, group)[1] == fit.step  # within budget: the calibrated step
    wide = usual * 4.0  # another domain: four times the calibrated spread
    words, esc = encode_group(wide, group, budget)
    q, step = decode_group(words, esc, 200, group)
    assert len(words) + len(esc) <= budget and step > fit.step
    zhat = dequantize(torch.from_numpy(q), step, torch.from_numpy(fit.offsets))
    assert float((zhat - wide).abs().max()) <= step
    with pytest.raises(BlobError, match="exponent"):
        decode_group((-1).to_bytes(4, "little", signed=True) + words[4:], esc, 200, group)


@pytest.mark.parametrize("fmt", ["rans", "constriction"])
def test_rate_control_codes_fewer_components_where_no_step_reaches_the_budget(fmt):
    """The symbol models are fixed, so a coarser step cannot code a token below every symbol 0 (zero_token_bits):
    a basis capped by --basis-budget sat at 93% of its CR 32 budget there. With `truncate`, the group codes its
    first components alone (stream format 2, their count after the exponent) and always fits; without it, the
    coarsest attempt comes back over the budget, for the caller to weigh (a chunk store codes it fixed-rate)."""
    from kvtc.kernels.codec.ecsq import (EMPTY_BYTES, coded_group, decode_group, encode_group, is_truncated,
                                         zero_token_bits)

    p, n = 40, 131
    lam = np.exp(-np.arange(p) / 8.0) * 5 + 1e-3
    fit = fit_ecsq(2.0, _gaussian(lam, 2000), p)  # a fine step: symbol 0 costs several bits
    group = _group(fit, torch.zeros(p), torch.eye(p))
    z = _gaussian(lam, n, seed=3)[:, :fit.kept]
    floor = zero_token_bits(group) * n / 8
    errors = []
    for budget in (int(floor * 0.8), int(floor * 0.3), int(floor * 0.05), EMPTY_BYTES):
        words, esc = encode_group(z, group, budget, fmt)
        assert len(words) + len(esc) > budget and not is_truncated(words)  # the plain step: over, said to the caller
        words, esc = encode_group(z, group, budget, fmt, truncate=True)
        assert len(words) + len(esc) <= budget and is_truncated(words)
        sub, _, _ = coded_group(group, words)
        q, step = decode_group(words, esc, n, group, fmt)
        assert q.shape == (n, fit.kept) and not q[:, sub.kept:].any()
        zhat = dequantize(torch.from_numpy(q), step, torch.from_numpy(fit.offsets))
        errors.append(float((zhat - z).square().sum() / z.square().sum()))
    assert errors == sorted(errors) and errors[0] < 0.5 and errors[-1] == pytest.approx(1.0)
    # in budget at the calibrated step: truncate changes nothing
    words, esc = encode_group(z, group, 10 * int(floor) + 10_000, fmt, truncate=True)
    assert not is_truncated(words) and decode_group(words, esc, n, group, fmt)[1] == fit.step


def test_a_truncated_words_header_is_checked():
    from kvtc.kernels.codec.ecsq import _CODED, _EXPONENT, TRUNCATED_FORMAT, decode_group, encode_group

    p, n = 24, 50
    lam = np.exp(-np.arange(p) / 6.0) * 5 + 1e-3
    fit = fit_ecsq(2.0, _gaussian(lam, 1000), p)
    group = _group(fit, torch.zeros(p), torch.eye(p))
    words, esc = encode_group(_gaussian(lam, n, seed=2)[:, :fit.kept], group, 40, "rans", truncate=True)
    head = _EXPONENT.size + _CODED.size
    with pytest.raises(BlobError, match="codes 24 components of a group that keeps"):
        decode_group(words[:_EXPONENT.size] + _CODED.pack(fit.kept) + words[head:], esc, n, group, "rans")
    with pytest.raises(BlobError, match="shorter than its coded-components count"):
        decode_group(_EXPONENT.pack(TRUNCATED_FORMAT << 16) + b"\0", b"", n, group, "rans")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), 2.0 ** 31, -(2.0 ** 31)])
def test_quantize_refuses_a_symbol_no_coder_can_hold_wherever_it_lies(bad):
    from kvtc.kernels.codec.ecsq import MAX_SYMBOL

    z = torch.randn(37, 29, generator=torch.Generator().manual_seed(0))
    assert torch.equal(quantize(z, 0.25), torch.round(z / 0.25).to(torch.int32))
    edge = z.clone()
    edge[0, 0], edge[-1, -1] = -MAX_SYMBOL * 0.25, MAX_SYMBOL * 0.25  # the largest symbols still coded
    assert int(quantize(edge, 0.25).abs().max()) == MAX_SYMBOL
    for where in [(0, 0), (18, 13), (-1, -1)]:
        broken = z.clone()
        broken[where] = bad * 0.25
        with pytest.raises(ValueError, match="non-finite values or values beyond"):
            quantize(broken, 0.25)
        assert quantize(broken, 0.25, check=False).shape == z.shape  # unchecked: a step no finer passed it
