"""The KL-sensitivity pass computed cheaply (logits by blocks of positions, checkpointed layers, frozen weights)
gives the sums the unblocked pass gave: the whole (T, vocab) logits at once and every activation kept."""
import zlib

import pytest
import torch
from transformers import DynamicCache

from kvtc.kernels.codec.layers import cached_layers
from kvtc.workers.attention_metric import decoder_layers, pair_mean, query_rows
from kvtc.workers.capture import CaptureSettings, capture_kv, metric_capture
from kvtc.workers.full_cache import full_cache
from kvtc.workers.models import load_model
from kvtc.workers.sensitivity import ModelHead, kl_sensitivity, logit_block


class _KeptLeaves(DynamicCache):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.leaves = {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        k, v = key_states.detach().requires_grad_(True), value_states.detach().requires_grad_(True)
        self.leaves[layer_idx] = (k, v)
        return super().update(k, v, layer_idx, *args, **kwargs)


def _unblocked(lm, input_ids: torch.Tensor, sinks: int, window: int, seed: int = 0,
               scored_from: int = 0) -> dict[str, torch.Tensor]:
    """The pass as first written: the model's whole logits, one cross entropy, one backward through every layer
    (the distributions at positions from `scored_from` on)."""
    coded = cached_layers(lm.layers)
    spec0 = lm.layers[coded[0]]
    keys = torch.zeros(len(coded), spec0.kv_heads, spec0.head_dim, dtype=torch.float64)
    values = torch.zeros(len(coded), spec0.kv_heads, spec0.head_dim, spec0.head_dim, dtype=torch.float64)
    lo, hi = sinks, input_ids.shape[1] - window
    cache = full_cache(lm, _KeptLeaves)
    with torch.enable_grad():
        logits = lm.model(input_ids=input_ids, past_key_values=cache, use_cache=True).logits[0, scored_from:].float()
        gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(input_ids.numpy().tobytes())) % (1 << 62))
        labels = torch.multinomial(torch.softmax(logits.detach(), -1), 1, generator=gen)[:, 0]
        loss = torch.nn.functional.cross_entropy(logits, labels, reduction="sum")
        grads = torch.autograd.grad(loss, [x for i in coded for x in cache.leaves[i]], allow_unused=True)
    for slot, i in enumerate(coded):
        gk, gv = grads[2 * slot], grads[2 * slot + 1]
        if gk is not None:
            gk = gk[0, :, lo:hi].double()
            keys[slot] = pair_mean((gk * gk).sum(1), lm.layers[i])
        if gv is not None:
            gv = gv[0, :, lo:hi].double()
            values[slot] = torch.einsum("hni,hnj->hij", gv, gv)
    return {"sensitivity_keys": keys, "sensitivity_values": values}


def _ids(t: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 1000, (1, t), generator=torch.Generator().manual_seed(seed))


# llama: plain; gemma3: sliding layers; qwen3_next: layers without a KV cache (not checkpointed); cohere2: a logit
# scale after lm_head; gpt_oss: a mixture-of-experts head that reads router logits
@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen3_next", "cohere2", "gpt_oss"])
def test_blocked_checkpointed_sums_equal_the_unblocked_pass(arch):
    lm = load_model(f"tiny:{arch}")
    ids = _ids(40)
    want = _unblocked(lm, ids, 2, 4)
    assert float(want["sensitivity_values"].abs().sum()) > 0
    for block, checkpoint in ((None, True), (7, True), (7, False), (40, False)):
        got = kl_sensitivity(lm, ids, 2, 4, block=block, checkpoint=checkpoint)
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-12 * float(want[name].abs().max()))
    assert all(p.requires_grad for p in lm.model.parameters())  # frozen only during the pass
    assert not any("forward" in vars(layer) for layer in decoder_layers(lm.base))  # the checkpoint wrappers are gone


def test_scored_from_counts_only_the_later_distributions():
    lm = load_model("tiny:llama")
    ids = _ids(40, 1)
    want = _unblocked(lm, ids, 2, 4, scored_from=25)
    for block in (None, 7):
        got = kl_sensitivity(lm, ids, 2, 4, block=block, scored_from=25)
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6 * float(want[name].abs().max()))
    every = kl_sensitivity(lm, ids, 2, 4)
    assert float(want["sensitivity_keys"].sum()) < float(every["sensitivity_keys"].sum())  # fewer distributions count
    assert not torch.equal(want["sensitivity_keys"], every["sensitivity_keys"])
    with pytest.raises(ValueError, match="scored_from"):
        kl_sensitivity(lm, ids, 2, 4, scored_from=40)


def test_the_model_head_is_the_models_own_logits_and_blocks_have_a_floor():
    lm = load_model("tiny:cohere2")  # its logits are lm_head's times a logit scale
    ids = _ids(12)
    with torch.inference_mode():
        out = lm.model(input_ids=ids)
        hidden = lm.base(input_ids=ids).last_hidden_state
        with ModelHead(lm.model).attached() as head:
            torch.testing.assert_close(head(hidden[:, 3:9]), out.logits[:, 3:9])
    assert lm.model.model is lm.base and type(lm.base).__name__ != "_GivenHidden"
    assert logit_block(49152) == 341 and logit_block(10**9) == 16


def test_the_metric_keeps_only_the_query_rows_it_scores():
    lm = load_model("tiny:llama")
    settings = CaptureSettings(sinks=2, window=4, objective="attention")
    metric = metric_capture(lm)
    t = 600
    shapes = []
    original = metric.attend

    def spy(keys, sinks, values=None):
        shapes.extend(tuple(q.shape) for q in metric.queries.values())
        return original(keys, sinks, values)

    metric.attend = spy
    try:
        capture_kv(lm, _ids(t), settings)
    finally:
        del metric.attend
    rows = len(query_rows(t))
    assert rows < t and shapes and all(s[:2] == (1, rows) for s in shapes)
