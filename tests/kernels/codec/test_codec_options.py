"""CodecOptions (kernels/codec/codec_options.py): one frozen, validated value a codec holds as `codec.options`; every
codec made from another (a layer segment's, a chunk transform's, the vLLM tier's, a placement's) is
`replace(codec.options, ...)`, so it keeps every option but the ones it means to change."""
from dataclasses import FrozenInstanceError, asdict, fields, replace

import pytest
import torch
from helpers.ecsq_synthetic import synthetic_ecsq_spec
from helpers.synthetic import synthetic_spec

from kvtc.kernels.codec.chunk_serde import ChunkTransform
from kvtc.kernels.codec.codec_options import CodecOptions
from kvtc.kernels.codec.kvtc_codec import KVTCCodec

# every field away from its default, so a clone that dropped one would show it
ODD = CodecOptions(backend="torch", level=4, coder="plain", max_tokens=999, mode="ecsq", rate_control=False,
                   ecsq_format="constriction", basis_dtype=torch.float32, sink_format="int8", outlier_factor=3.0,
                   blob_version=1)


def _differing(a: CodecOptions, b: CodecOptions) -> set[str]:
    return {f.name for f in fields(CodecOptions) if getattr(a, f.name) != getattr(b, f.name)}


@pytest.fixture(scope="module")
def spec():
    return synthetic_ecsq_spec(2, 2, 8, 4.0, sinks=2, window=3)


@pytest.mark.parametrize("field,bad", [("backend", "cuda"), ("level", 10), ("level", 1.0), ("level", True),
                                       ("coder", "lz4"), ("max_tokens", -1), ("mode", "rans"), ("rate_control", 1),
                                       ("ecsq_format", "lz4"), ("basis_dtype", torch.int8), ("sink_format", "fp4"),
                                       ("outlier_factor", 0), ("outlier_factor", float("nan")), ("blob_version", 3),
                                       ("blob_version", True)])
def test_a_bad_value_names_its_field(field, bad, spec):
    with pytest.raises(ValueError, match=field):
        CodecOptions(**{field: bad})
    with pytest.raises(ValueError, match=field):
        replace(ODD, **{field: bad})
    with pytest.raises(ValueError, match=field):
        KVTCCodec(spec, **{field: bad})


def test_options_are_frozen_and_a_replace_keeps_every_other_field():
    assert CodecOptions(outlier_factor=2).outlier_factor == 2.0 and CodecOptions().outlier_factor == 2.5
    with pytest.raises(FrozenInstanceError):
        ODD.level = 0
    for f in fields(CodecOptions):
        other = replace(ODD, **{f.name: getattr(CodecOptions(), f.name)})
        assert _differing(ODD, other) == {f.name}


def test_the_codec_takes_keywords_or_options_and_refuses_an_unknown_keyword(spec):
    assert KVTCCodec(spec, **asdict(ODD)).options == ODD == KVTCCodec(spec, options=ODD).options
    assert KVTCCodec(spec, options=ODD, level=0).options == replace(ODD, level=0)
    assert KVTCCodec(spec).options == CodecOptions(mode="ecsq")  # the mode it resolved
    with pytest.raises(TypeError, match="levle"):
        KVTCCodec(spec, levle=3)
    codec = KVTCCodec(spec, options=ODD)
    assert (codec.level, codec.backend, codec.basis_dtype, codec.mode) == (4, "torch", torch.float32, "ecsq")
    with pytest.raises(AttributeError, match="replace"):
        codec.level = 0


def test_the_four_clone_sites_keep_every_option_but_the_ones_they_change(spec):
    from kvtc.kernels.integrations.lmcache_ranks import RankedChunkTransforms
    from kvtc.kernels.integrations.vllm_offload import ChunkCodec

    layered = synthetic_spec(2, 2, 8, 4.0, groups=[(0, 1), (1, 2)], sinks=2, window=3)  # a basis per layer
    fixed = KVTCCodec(layered, options=replace(ODD, mode="fixed"))
    assert fixed._sub((1,)).options == fixed.options  # a layer segment's codec
    tier = ChunkCodec(fixed, [1])  # one stage's layers: the tier keeps the codec's level and coder
    assert tier.spec.num_layers == 1 and tier.codec.options == fixed.options
    codec = KVTCCodec(spec, options=ODD)
    t = ChunkTransform(codec, positions=True, sink_format="cache", level=2, coder="zlib")
    assert _differing(ODD, t.codec.options) == {"sink_format", "level", "coder"}
    # one codec: the fallback is a plan of it (fixed-rate; all raw sinks, the first alone, none), not a clone
    assert [(p.mode.name, p.sinks, p.outliers) for p in t.fallbacks] == [("fixed", 2, False), ("fixed", 1, False),
                                                                        ("fixed", 0, False)]
    ranked = RankedChunkTransforms(codec, positions=True, outlier_factor=None)
    assert _differing(ODD, ranked.default.codec.options) == {"outlier_factor", "level", "coder"}
