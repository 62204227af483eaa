"""RopeSpec: exact inverse, serialization, and agreement with transformers' rotary embeddings."""
import math

import pytest
import torch

from kvtc.kernels.codec.rope import RopeSpec
from kvtc.workers.rope import rope_from_config


def _spec(head_dim=16, rotary_dim=16, scaling=1.0, layout="half", theta=10000.0) -> RopeSpec:
    inv = [1.0 / theta ** (i / rotary_dim) for i in range(0, rotary_dim, 2)]
    return RopeSpec("default", theta, head_dim, rotary_dim, tuple(inv), scaling, layout)


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("rotary_dim,scaling", [(16, 1.0), (8, 1.0), (16, 1.2)])
def test_remove_inverts_apply(layout, rotary_dim, scaling):
    spec = _spec(rotary_dim=rotary_dim, scaling=scaling, layout=layout)
    x = torch.randn(3, 2, 37, 16, generator=torch.Generator().manual_seed(0))
    pos = torch.arange(100, 137)
    y = spec.apply(x, pos)
    assert not torch.allclose(y[..., :rotary_dim], x[..., :rotary_dim])
    assert torch.equal(y[..., rotary_dim:], x[..., rotary_dim:])
    torch.testing.assert_close(spec.remove(y, pos), x, rtol=1e-5, atol=1e-5)


def test_apply_rotates_pairs_by_angle():
    spec = _spec(head_dim=4, rotary_dim=4)
    x = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    y = spec.apply(x, torch.tensor([3]))
    # half layout pairs dim 0 with dim 2; angle = 3 * inv_freq[0] = 3
    torch.testing.assert_close(y, torch.tensor([[math.cos(3.0), 0.0, math.sin(3.0), 0.0]]))


def test_dict_roundtrip_and_validation():
    spec = _spec(rotary_dim=8, scaling=1.1)
    assert RopeSpec.from_dict(spec.to_dict()) == spec
    with pytest.raises(ValueError, match="rope_type"):
        RopeSpec("mrope", 1e4, 16, 16, spec.inv_freq * 2)
    with pytest.raises(ValueError, match="inv_freq"):
        RopeSpec("default", 1e4, 16, 16, (1.0,))
    with pytest.raises(ValueError, match="rotary_dim"):
        RopeSpec("default", 1e4, 16, 18, (1.0,) * 9)
    with pytest.raises(ValueError, match="missing"):
        RopeSpec.from_dict({"rope_type": "default"})
    with pytest.raises(ValueError, match="head_dim"):
        spec.apply(torch.zeros(5, 8), torch.arange(5))


def _llama_config(rope_parameters, max_pos=4096):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       max_position_embeddings=max_pos, rope_parameters=rope_parameters)


@pytest.mark.parametrize(
    "params",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
        {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
         "high_freq_factor": 4.0, "original_max_position_embeddings": 512},
        {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024},
        {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 1024,
         "short_factor": [1.0 + i / 8 for i in range(8)], "long_factor": [2.0 + i for i in range(8)]},
    ],
    ids=lambda p: p["rope_type"],
)
def test_from_config_matches_transformers_rotary(params):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = _llama_config(params)
    spec = rope_from_config(config)
    rotary = LlamaRotaryEmbedding(config)
    pos = torch.arange(0, 1000, 7)
    cos_ref, sin_ref = rotary(torch.zeros(1, dtype=torch.float32), pos[None])
    cos, sin = spec.cos_sin(pos)
    torch.testing.assert_close(cos, cos_ref[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sin, sin_ref[0], rtol=1e-5, atol=1e-6)
