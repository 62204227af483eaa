"""The outlier stage's error measure (kernels/codec/error_sketch.py): each (token, layer) vector's coding error
estimated through a sketch of the decoder and measured exactly where it may count, against the full reconstruction
it replaces, on odd shapes, groups of layers and of heads, and a half-precision decoder."""
import pytest
import torch

from kvtc.kernels.codec import error_sketch, kvtc_codec, outliers
from kvtc.kernels.codec.error_sketch import ErrorSketch, reference_errors, vector_errors
from kvtc.kernels.codec.kvtc_codec import KVTCCodec


def _groups(L: int, H: int, W: int, by: str) -> list[slice | torch.Tensor]:
    """A stream's feature columns (L, H, W) split by layers (slices) or by heads (index tensors, a TP rank's)."""
    if by == "layers":
        cut = (L + 1) // 2
        return [slice(0, cut * H * W), slice(cut * H * W, L * H * W)]
    index = torch.arange(L * H * W).reshape(L, H, W)
    return [index[:, :1].flatten(), index[:, 1:].flatten()]


def _decoded(L: int, H: int, W: int, by: str, dtype: torch.dtype, n: int = 37, seed: int = 0):
    """feat (n, L H W), z_hat per group, decoders per group (p_g, k_g) in `dtype`, and the exact reconstruction."""
    g = torch.Generator().manual_seed(seed)
    cols = _groups(L, H, W, by)
    feat = torch.randn(n, L * H * W, generator=g)
    feat.view(n, L, -1)[5, L - 1] *= 0.05  # a short vector, coded as badly as the rest
    decoders, zs, rec = [], [], torch.zeros_like(feat)
    for c in cols:
        p = len(range(c.start, c.stop)) if isinstance(c, slice) else len(c)
        k = max(1, p // 2 + 1)
        d, _ = torch.linalg.qr(torch.randn(p, k, generator=g))
        d = d.to(dtype)
        z = feat[:, c] @ d.float() + 0.1 * torch.randn(n, k, generator=g)  # the coefficients' quantization noise
        decoders.append(d)
        zs.append(z)
        rec[:, c] = z @ d.float().T
    return feat, cols, decoders, zs, rec


@pytest.mark.parametrize("shape,by", [((1, 1, 3), "layers"), ((3, 2, 5), "layers"), ((5, 2, 16), "layers"),
                                      ((3, 2, 5), "heads"), ((5, 3, 16), "heads")])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 1e-5)])
def test_exact_errors_equal_the_full_reconstructions_and_estimates_keep_the_expected_norm(shape, by, dtype, tol):
    L, H, W = shape
    feat, cols, decoders, zs, rec = _decoded(L, H, W, by, dtype)
    sketch = ErrorSketch(L, H * W, cols, decoders, torch.device("cpu"))
    truth, _ = outliers.errors(feat, rec, torch.zeros(L * H * W), L)
    for layer in range(L):
        tokens = torch.tensor([0, 5, 36])
        assert torch.allclose(sketch.exact(feat, zs, tokens, layer), truth[tokens, layer], rtol=tol, atol=tol)
    est = sketch.estimate(feat, zs)
    assert est.shape == truth.shape and bool((est >= 0).all())
    ratio = float(est.sum() / truth.sum())  # one sketch for every token: spread about sqrt(2 / (r L w)) at most
    assert abs(ratio - 1) < 5 * (2 / (error_sketch.SKETCH_ROWS * L * H * W)) ** 0.5


@pytest.mark.parametrize("by", ["layers", "heads"])
def test_the_selection_through_the_sketch_is_the_exact_one(by):
    L, H, W, n = 4, 2, 24, 300
    feat, cols, decoders, zs, rec = _decoded(L, H, W, by, torch.float32, n=n, seed=1)
    feat.view(n, L, -1)[200, 1] *= 0.1
    rec = torch.zeros_like(feat)
    zs = [feat[:, c] @ d + 0.1 * torch.randn(n, d.shape[1], generator=torch.Generator().manual_seed(2))
          for c, d in zip(cols, decoders)]
    for c, z, d in zip(cols, zs, decoders):
        rec[:, c] = z @ d.T
    blocks, mean = [(0, 128), (128, 300)], torch.randn(L * H * W) * 0.1
    exact = outliers.select([outliers.errors(feat[a:b], rec[a:b], mean, L) for a, b in blocks], 2.5, 10**6, 1)
    sketch = ErrorSketch(L, H * W, cols, decoders, torch.device("cpu"))
    found = outliers.select(vector_errors(sketch, feat, mean, lambda a, b: [z[a:b] for z in zs], blocks, 2.5),
                            2.5, 10**6, 1)
    assert found.tolist() == exact.tolist() and {(L - 1) * n + 5, 1 * n + 200} <= set(found.tolist())


def test_the_codec_finds_the_vectors_a_full_decode_finds_and_holds_each_sketch_once(monkeypatch):
    from helpers.ecsq_synthetic import synthetic_ecsq_spec
    from helpers.synthetic import synthetic_cache

    spec = synthetic_ecsq_spec(3, 2, 8, 4.0, sinks=2, window=3)
    keys, values = synthetic_cache(spec, 60, torch.float32, start=0)
    values = values.clone()
    values[0, :, 9] *= 0.02
    values[2, :, 30] *= 0.02
    codec = KVTCCodec(spec)
    sketched = codec.encode(keys, values)
    assert len(codec._sketches) == 2 and codec.basis_bytes() > KVTCCodec(spec, outlier_factor=None).basis_bytes()

    monkeypatch.setattr(kvtc_codec, "vector_errors", reference_errors)  # the stage as it was: every vector exact
    decoded = KVTCCodec(spec).encode(keys, values)
    mid = 60 - 2 - 3
    for blob in (sketched, decoded):
        index = _outlier_index(blob, 1, spec, mid)
        assert {0 * mid + 7, 2 * mid + 28} <= index  # tokens 9 and 30 of the cache
        _, v = codec.decode(blob)
        for layer, token in ((0, 9), (2, 30)):
            assert (v[layer, :, token] - values[layer, :, token]).norm() < 0.02 * values[layer, :, token].norm()


def _outlier_index(blob: bytes, stream: int, spec, mid: int) -> set[int]:
    from kvtc.kernels.codec.blob import TAG_OUTLIERS, read_blob

    section = next(s for s in read_blob(blob)[1] if s.key.tag == TAG_OUTLIERS and s.key.stream == stream)
    return set(outliers.unpack(bytes(section.stored), spec.num_layers, spec.kv_heads, mid, spec.head_dim,
                               torch.float32)[0].tolist())
