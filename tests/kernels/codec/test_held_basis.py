"""A server's basis (kernels/codec/held_basis.py): held once per artifact in half precision, every ratio's and mode's
components and decoder views of it, multiplied in float32 blocks on the host (kernels/codec/basis_product.py), and
decoding within a small fraction of the codec's own error of the float32 basis."""
from __future__ import annotations

import warnings

import pytest
import torch

from helpers.toy_artifacts import toy_content
from helpers.whitened import FULL, PARTIAL, D, H, L, features, whitened_content
from kvtc.artifacts import publish, pull
from kvtc.artifacts.schema import STREAMS
from kvtc.kernels.codec import basis_product
from kvtc.kernels.codec.held_basis import held_bytes, held_spec, served_codec
from kvtc.kernels.codec.kvtc_codec import KVTCCodec
from kvtc.kernels.integrations.lmcache_ranks import load_rank_codec


@pytest.fixture(scope="module")
def registry(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("held") / "reg")
    publish(whitened_content(), root)
    return root


def _cache(tokens: int, seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    f = features(tokens, seed)
    return tuple(torch.stack([torch.from_numpy(f[s][l]).reshape(tokens, H, D).permute(1, 0, 2) for l in range(L)])
                 for s in STREAMS)


def _matrices(spec) -> list[torch.Tensor]:
    return [t for gs in [*spec.streams.values(), *(spec.ecsq or {}).values()] for g in gs
            for t in (g.components, g.decoder) if t is not None]


def test_every_ratio_and_mode_of_a_server_shares_one_half_matrix_per_basis(registry):
    codecs = [load_rank_codec("whitened@latest", r, None, registry=registry, mode=m)  # each its own pull
              for r, m in ((FULL, "fixed"), (FULL, "ecsq"), (PARTIAL, "fixed"))]  # ECSQ tables at FULL only
    keys, values = _cache(40)
    for codec in codecs:
        codec.decode(codec.encode(keys, values, start=0))
    held = {m.untyped_storage().data_ptr() for c in codecs for m in _matrices(c.spec)}
    used = {m.untyped_storage().data_ptr() for c in codecs for _, parts in c._on_device.values() for _, m, _ in parts}
    assert used <= held and len(held) == 7  # 4 bases' components, 3 whitened bases' decoders: each once
    assert {m.dtype for c in codecs for m in _matrices(c.spec)} == {torch.float16}
    assert all(c.spec.held_dtype == torch.float16 for c in codecs)
    whole = {m.untyped_storage().nbytes() for c in codecs for m in _matrices(c.spec)}
    assert held_bytes(*(c.spec for c in codecs)) == 7 * next(iter(whole)) == 7 * H * D * H * D * 2


def _toy(root: str, **kw) -> object:
    content = toy_content(**kw)
    d = content.model["head_dim"]
    content.model["rope"] = {"rope_type": "default", "theta": 10000.0, "head_dim": d, "rotary_dim": d,
                             "inv_freq": [10000.0 ** (-2 * i / d) for i in range(d // 2)], "attention_scaling": 1.0,
                             "layout": "half"}
    publish(content, root)
    return content


@pytest.mark.parametrize("mode, ratio", [("fixed", FULL), ("fixed", PARTIAL), ("ecsq", FULL), ("odd", 4.0)])
def test_a_half_held_basis_decodes_as_well_as_the_float32_one(registry, tmp_path, mode, ratio):
    """The half basis' error against the cache within 10% of the float32 basis' (a coefficient's bin, or the ECSQ
    rate control's step, may differ: the decoded caches move by at most the codec's own error)."""
    if mode == "odd":  # 3 layers x 3 KV heads x head_dim 6, p = 54
        _toy(str(tmp_path), num_layers=3, num_kv_heads=3, head_dim=6)
        art, mode = pull("toy@latest", registry=str(tmp_path)), "fixed"
        keys, values = torch.randn(3, 3, 157, 6), torch.randn(3, 3, 157, 6)
    else:
        art = pull("whitened@latest", registry=registry)
        keys, values = _cache(53)  # odd token count: sinks, an odd coded middle, the window
    exact = KVTCCodec(art, ratio, mode=mode, rate_control=mode == "fixed")  # the toy's ECSQ budget is knife-edge
    half = served_codec(exact)
    assert half.spec.held_dtype == torch.float16 and exact.spec.held_dtype == torch.float32
    k32, v32 = exact.decode(exact.encode(keys, values, start=0))
    k16, v16 = half.decode(half.encode(keys, values, start=0))
    for x, a, b in ((keys, k32, k16), (values, v32, v16)):
        error32, error16 = float((a - x).norm() / x.norm()), float((b - x).norm() / x.norm())
        change = float((b - a).norm() / x.norm())
        assert error16 <= 1.1 * error32 + 2e-3 and change <= error32 + 2e-3, (error32, error16, change)


def test_a_pinned_float32_basis_is_kept_and_a_basis_beyond_float16_stays_float32(tmp_path):
    content = toy_content(num_layers=2, num_kv_heads=2, head_dim=8)
    content.model["rope"] = None
    mean, eig, comps = content.bases[("keys", 0)]
    content.bases[("keys", 0)] = (mean, eig, comps * 1e6)
    publish(content, str(tmp_path))
    art = pull("toy@latest", registry=str(tmp_path))
    pinned = KVTCCodec(art, 4.0, basis_dtype=torch.float32, mode="fixed")
    assert served_codec(pinned) is pinned
    codec = KVTCCodec(art, 4.0, mode="fixed")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert held_spec(codec.spec) is codec.spec
    assert any("beyond" in str(w.message) for w in caught)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_blockwise_product_is_the_float32_product_of_the_half_matrix(monkeypatch, dtype):
    monkeypatch.setattr(basis_product, "BLOCK_BYTES", 4 * 37 * 5)  # 5 columns (rows) a block: ragged last blocks
    g = torch.Generator().manual_seed(0)
    basis = torch.randn(37, 23, generator=g).to(dtype)
    x, z = torch.randn(11, 37, generator=g), torch.randn(11, 23, generator=g)
    want_z, want_x = x @ basis.float(), z @ basis.float().T
    got_z, got_x = basis_product.project(x, basis), basis_product.reconstruct(z, basis)
    assert got_z.dtype == got_x.dtype == torch.float32
    torch.testing.assert_close(got_z, want_z, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_x, want_x, rtol=1e-6, atol=1e-6)
    assert torch.equal(basis_product.project(x, basis.float()), x @ basis.float())  # float32: the plain product


def test_blocks_converted_once_give_the_same_products_bit_for_bit(monkeypatch):
    monkeypatch.setattr(basis_product, "BLOCK_BYTES", 4 * 37 * 5)  # ragged last blocks
    g = torch.Generator().manual_seed(1)
    basis, other = torch.randn(37, 23, generator=g).half(), torch.randn(37, 23, generator=g).half()
    x, z = torch.randn(11, 37, generator=g), torch.randn(11, 23, generator=g)
    want = [basis_product.project(x, b) for b in (basis, other)] + [basis_product.reconstruct(z, b) for b in (basis, other)]
    calls = []
    convert = torch.Tensor.float
    monkeypatch.setattr(torch.Tensor, "float", lambda t: (t.dtype == torch.float16 and calls.append(t.shape)) or convert(t))
    with basis_product.converted_blocks():
        for _ in range(3):  # each block converted once in the scope, for each basis and each side
            got = [basis_product.project(x, b) for b in (basis, other)] + \
                [basis_product.reconstruct(z, b) for b in (basis, other)]
            assert all(torch.equal(a, b) for a, b in zip(got, want))
    # column blocks (project) and row blocks (reconstruct) of two bases
    blocks = 2 * (-(-23 // basis_product._step(37)) + -(-37 // basis_product._step(23)))
    assert len(calls) == blocks
    calls.clear()
    basis_product.project(x, basis)  # outside the scope: converted again
    assert len(calls) == -(-23 // 5)


def test_a_narrower_projection_is_read_from_the_wider_one_only_where_they_agree(monkeypatch):
    monkeypatch.setattr(basis_product, "BLOCK_BYTES", 4 * 37 * 5)  # ragged last blocks
    g = torch.Generator().manual_seed(2)
    whole = torch.randn(37, 23, generator=g).half()
    x, other = torch.randn(11, 37, generator=g), torch.randn(11, 37, generator=g)
    want = {k: basis_product.project(x, whole[:, :k]) for k in (23, 20, 10)}  # whole blocks of 5
    calls = []
    project = basis_product._project
    monkeypatch.setattr(basis_product, "_project", lambda a, b: calls.append(b.shape[1]) or project(a, b))
    with basis_product.shared_projections():
        for _ in range(3):
            got = {k: basis_product.project(x, whole[:, :k]) for k in (23, 20, 10)}
            assert all(torch.equal(got[k], want[k]) for k in want)
        assert calls == [23, 20, 10]  # each narrower width checked once against its own product, then read
        basis_product.project(other, whole[:, :10])  # other rows: projected, not read from x's
        assert calls[-1] == 10 and len(calls) == 4
        # a pairing whose products differ (a BLAS summing the narrow one otherwise) is always computed
        monkeypatch.setattr(basis_product, "_project", lambda a, b: calls.append(b.shape[1]) or project(a, b) + (
            1e-3 if b.shape[1] == 5 else 0.0))
        basis_product.project(x, whole)
        first, again = basis_product.project(x, whole[:, :5]), basis_product.project(x, whole[:, :5])
        assert torch.equal(first, again) and not torch.equal(first, want[23][:, :5]) and calls[-2:] == [5, 5]
    calls.clear()
    basis_product.project(x, whole[:, :17])  # outside the scope: computed
    assert calls == [17]
