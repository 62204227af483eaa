"""The model's own cache after a prefix, filled from the keys and values `raw_cache` already captured instead of a
second forward of the prefix: what the model continues from is the same, for sliding, chunked and sink-attention
layers; a model with layers that keep no KV cache still runs the forward (their states come only from it)."""
import pytest
import torch
from transformers import DynamicCache

from kvtc.kernels.codec.layers import cached_layers
from kvtc.pipeline.evaluation import model_quality
from kvtc.pipeline.evaluation.model_quality import _forward, continuation_logprobs, own_cache
from kvtc.workers.capture import raw_cache
from kvtc.workers.models import load_model


@pytest.mark.parametrize("arch", ["gemma3", "gpt_oss", "cohere2", "llama4", "qwen3_next"])
def test_own_cache_from_the_captured_cache_continues_as_the_prefills_own(arch, monkeypatch):
    lm = load_model(f"tiny:{arch}")
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(3, lm.model.config.vocab_size, (1, 37), generator=gen)  # past every tiny window and chunk
    feed = torch.randint(3, lm.model.config.vocab_size, (1, 5), generator=gen)
    keys, values = raw_cache(lm, ids)
    with monkeypatch.context() as patch:
        if arch != "qwen3_next":  # every layer keeps a KV cache: no second forward of the prefix
            patch.setattr(model_quality, "_forward", lambda *a, **k: pytest.fail("the prefix ran a second time"))
        made = own_cache(lm, ids, keys, values)
    _, run = _forward(lm.model, ids, DynamicCache(config=lm.model.config))
    coded = cached_layers(lm.layers)
    for layer in coded:  # each layer holds what the prefill's forward left in it: a sliding layer its window
        assert torch.equal(made.layers[layer].keys, run.layers[layer].keys)
        assert torch.equal(made.layers[layer].values, run.layers[layer].values)
    got = continuation_logprobs(lm.model, keys.float(), values.float(), feed, prefix_cache=made, coded=coded)
    want = continuation_logprobs(lm.model, keys.float(), values.float(), feed, prefix_cache=run, coded=coded)
    assert torch.equal(got, want)
    keys.zero_()  # the cache it made holds its own copies
    assert not torch.equal(made.layers[coded[0]].keys, torch.zeros_like(made.layers[coded[0]].keys))
