"""The model's KL sensitivity to its own cache: the Fisher information of each coded layer's keys and values.

An error e in one cached position's key or value moves the model's next-token distributions by a KL of about
e^T F e / 2, F the Fisher information of that cache entry: E_y[g g^T], g the gradient of log p(y) with
respect to it, y sampled from the model itself. It is what neither the queries' moments nor W_O can see:
how a layer's attention error grows or fades through the layers above it (an error in layer 0 passes 29
more layers of SmolLM2, one in the last none). Measured per sequence with one backward pass:

- the cache's keys and values enter attention as leaves (`LeafCache`): the gradient reaches a cached entry
  through every later query of its layer, then up the residual stream, never through another position's
  cached keys or values (those are stored, as a server stores them, not recomputed from the error);
- labels are drawn from the model's distribution at each position (a seeded generator), so the sum of
  g g^T over positions estimates the true Fisher, not the empirical one;
- summed over positions [sinks, T - window): the coded ones.

-> {"sensitivity_keys": (coded layers, kv_heads, head_dim) diagonal, each RoPE pair's two dims averaged (the
pair sum |g|^2 is the same in the cached and the RoPE-removed frames), "sensitivity_values": (coded layers,
kv_heads, head_dim, head_dim)}, float64 on the CPU: additive like the attention metric's sums.

Memory (what one shard worker holds for it; kvtc.pipeline.job.fold_plan plans it): linear in T, never T x vocab
or T x T. The parameters do not require grad during the pass (no layer saves its input for a weight gradient);
each coded decoder layer is checkpointed (torch.utils.checkpoint, non-reentrant: its input is kept, its
activations recomputed in the backward, one layer at a time); the logits, their softmax and the loss are
computed `block` positions at a time from the final hidden states (the model's own head, `ModelHead`), each
block's backward into the hidden states done before the next block, then one backward from the hidden states
to the cache. Each layer's gradients are reduced to its sums as they arrive and freed. On the CPU the labels
are the unblocked pass's (multinomial's exponential draws consume the generator row by row) and the sums equal
its sums within float noise (tests/workers/test_sensitivity_blocked.py: bit for bit on the tiny models); on CUDA
each block's draw advances the generator's offset on its own, so the labels are another draw of the same
distributions.
"""
from __future__ import annotations

import functools
import zlib
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import torch.utils.checkpoint
from transformers import DynamicCache
from transformers.modeling_outputs import MoeModelOutputWithPast

from kvtc.kernels.codec.layers import cached_layers
from kvtc.workers.capture_settings import COPY_PROBE_FORMS, FIRST_COPY_PROBE_FORM
from kvtc.workers.attention_metric import decoder_layers, pair_mean
from kvtc.workers.full_cache import cache_kwargs, full_cache


# A shard's pass measures the first SENSITIVITY_TOKENS tokens of its sequence (workers/capture.py): its backward
# reaches each entry through every later query, so it grows about as the square of the length (74 s for 4,096
# tokens against 10 s for 1,024 on the 2-core CPU, half a 4,096-token shard's work), and a balance between layers
# is what it feeds (kvtc.pipeline.fit.metric), not a figure that needs every position.
SENSITIVITY_TOKENS = 1024
LOGIT_BLOCK_BYTES = 64 << 20  # one float32 (positions x vocab) logits block; about six such live at once


# A copy probe: the model copying from far back, which a sequence's first tokens of prose never ask of it. At an
# 8,192-token prefix of text repeating itself from 4K tokens back, the chunk path's KL was 2.3x fresh text's at CR 16,
# over a quarter of it from two heads (layer 7's and layer 18's third KV head on SmolLM2) that fresh text barely uses
# and a copy from 512 tokens back does not yet need (bench/copy_attribution.py). One probe per job (its first training
# shard): a passage, the text that followed it, the passage again, its Fisher information from the copied passage's
# distributions only, per scored position, weighed beside fresh text's
# (kvtc.pipeline.fit.metric.AttentionMetric.copy_weight). Its copy reaches three quarters of the probe back: at 4,096
# tokens it kept what the 8,192-token passage-twice probe of stop 70 kept, at a third of its backward (bench/README.md).


def copy_probe(ids: torch.Tensor, tokens: int, form: str = COPY_PROBE_FORMS[0]) -> tuple[torch.Tensor, int]:
    """ids (T,) -> (probe (L,), scored_from): with L = min(T, tokens) and a passage of p = L // 4 tokens, the
    sequence's first p tokens, its next L - 2p, then the first p again, so every position from scored_from = L - p
    on repeats the one L - p back (an induction the model must find across three quarters of the probe).
    form "passage-twice" (stop 70's, which recalibrating its artifacts repeats): the first h = L // 2 tokens
    followed by themselves, scored_from 0."""
    if ids.dim() != 1:
        raise ValueError(f"copy_probe takes one sequence of token ids (T,), got shape {tuple(ids.shape)}")
    if form not in COPY_PROBE_FORMS:
        raise ValueError(f"unknown copy probe form {form!r}; use one of {', '.join(COPY_PROBE_FORMS)}")
    n = min(int(ids.shape[0]), int(tokens))
    p = n // 2 if form == FIRST_COPY_PROBE_FORM else n // 4
    if p < 1:
        raise ValueError(f"a copy probe of {tokens} tokens from a {ids.shape[0]}-token sequence is empty")
    if form == FIRST_COPY_PROBE_FORM:
        return torch.cat([ids[:p], ids[:p]]), 0
    return torch.cat([ids[:n - p], ids[:p]]), n - p


def logit_block(vocab: int) -> int:
    """Positions per logits block: LOGIT_BLOCK_BYTES of float32 logits, at least 16."""
    return max(16, LOGIT_BLOCK_BYTES // (4 * max(1, vocab)))


class LeafCache(DynamicCache):
    """A cache whose incoming keys and values become grad leaves (`leaves`: {layer: (keys, values)}).

    One update per layer (a whole sequence, no past): the leaves are returned as the layer's keys and values and
    kept only in `leaves`. A later update of the same layer is the checkpointed layer's recomputation: it gets the
    same leaves, so the gradient reaches them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.leaves: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx not in self.leaves:
            self.leaves[layer_idx] = (key_states.detach().requires_grad_(True),
                                      value_states.detach().requires_grad_(True))
        return self.leaves[layer_idx]


class _GivenHidden(torch.nn.Module):
    """Stands in for a causal LM's base model: returns the hidden states it was given (and no router logits, for
    the mixture-of-experts heads that read them)."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden: torch.Tensor | None = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return MoeModelOutputWithPast(last_hidden_state=self.hidden)


class ModelHead:
    """The causal LM's own head on given final hidden states (its forward, with the base model swapped for the
    states): whatever it applies after the base (lm_head, logit scales, final softcapping) is the model's."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    @contextmanager
    def attached(self) -> Iterator[Callable[[torch.Tensor], torch.Tensor]]:
        """-> logits(hidden (1, b, hidden_size)) -> (1, b, vocab), while the base model is swapped out."""
        base, given = self.model.model, _GivenHidden()
        self.model.model = given
        try:
            def logits(hidden: torch.Tensor) -> torch.Tensor:
                given.hidden = hidden
                ids = torch.zeros(hidden.shape[:2], dtype=torch.long, device=hidden.device)
                return self.model(input_ids=ids, use_cache=False).logits
            yield logits
        finally:
            self.model.model = base


@contextmanager
def _frozen(model: torch.nn.Module) -> Iterator[None]:
    """The model's parameters do not require grad inside (so no layer saves inputs for a weight gradient)."""
    flags = [(p, p.requires_grad) for p in model.parameters()]
    for p, _ in flags:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)


@contextmanager
def _checkpointed(layers: torch.nn.ModuleList, indices: list[int]) -> Iterator[None]:
    """Layers `indices` run under non-reentrant activation checkpointing inside (their forward wrapped)."""
    for i in indices:
        layers[i].forward = functools.partial(torch.utils.checkpoint.checkpoint, layers[i].forward, use_reentrant=False)
    try:
        yield
    finally:
        for i in indices:
            del layers[i].forward


def _labels_seed(seed: int, input_ids: torch.Tensor) -> int:
    return (seed * 1_000_003 + zlib.crc32(input_ids.cpu().numpy().tobytes())) % (1 << 62)


def kl_sensitivity(lm: Any, input_ids: torch.Tensor, sinks: int, window: int, seed: int = 0,
                   block: int | None = None, checkpoint: bool = True, scored_from: int = 0) -> dict[str, torch.Tensor]:
    """input_ids (1, T) -> the sequence's Fisher sums (module docstring); zeros when no position is coded.
    block: positions per logits block (default `logit_block(vocab)`); checkpoint: recompute each coded layer's
    activations in the backward (False: keep them all, as an unblocked pass does); scored_from: only the
    distributions at positions [scored_from, T) count (a copy probe's copied passage)."""
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"kl_sensitivity takes one sequence, input_ids of shape (1, T); got {tuple(input_ids.shape)}")
    coded = cached_layers(lm.layers)
    spec0 = lm.layers[coded[0]]
    shape = (len(coded), spec0.kv_heads, spec0.head_dim)
    keys = torch.zeros(shape, dtype=torch.float64)
    values = torch.zeros(shape + shape[-1:], dtype=torch.float64)
    t = int(input_ids.shape[1])
    lo, hi = sinks, t - window
    if not 0 <= scored_from < t:
        raise ValueError(f"scored_from {scored_from} is outside the {t}-token sequence; score from a position in [0, {t})")
    if hi <= lo:
        return {"sensitivity_keys": keys, "sensitivity_values": values}
    block = block or logit_block(int(lm.model.get_output_embeddings().weight.shape[0]))
    cache = full_cache(lm, LeafCache)
    ids = input_ids.to(lm.device)
    layers = decoder_layers(lm.base) if checkpoint else torch.nn.ModuleList()
    with torch.enable_grad(), _frozen(lm.model), _checkpointed(layers, coded if checkpoint else []):
        hidden = lm.base(input_ids=ids, **cache_kwargs(lm.base, cache), use_cache=True).last_hidden_state  # (1, T, hidden)
        missing = [i for i in coded if i not in cache.leaves]
        if missing:
            raise RuntimeError(f"layer {missing[0]} wrote no keys and values through the cache; the KL sensitivity "
                               "needs every coded layer's cache (pass --sensitivity 0 and --attention-balance layer)")
        given = hidden.detach().requires_grad_(True)
        gen = torch.Generator(device=hidden.device).manual_seed(_labels_seed(seed, input_ids))
        with ModelHead(lm.model).attached() as head:
            for a in range(scored_from, t, block):
                logits = head(given[:, a:a + block])[0].float()  # (b, vocab)
                labels = torch.multinomial(torch.softmax(logits.detach(), -1), 1, generator=gen)[:, 0]
                torch.nn.functional.cross_entropy(logits, labels, reduction="sum").backward(inputs=[given])
                del logits, labels

        def reduce_into(slot: int, spec: Any, stream: str) -> Callable[[torch.Tensor], None]:
            def hook(leaf: torch.Tensor) -> None:
                g = leaf.grad[0, :, lo:hi].to(torch.float64)  # (kv_heads, n, d), RoPE applied as cached
                if stream == "keys":
                    keys[slot] = pair_mean((g * g).sum(1), spec).cpu()
                else:
                    values[slot] = torch.einsum("hni,hnj->hij", g, g).cpu()
                leaf.grad = None
            return hook

        leaves = []
        for slot, i in enumerate(coded):
            for stream, leaf in zip(("keys", "values"), cache.leaves[i]):
                leaf.register_post_accumulate_grad_hook(reduce_into(slot, lm.layers[i], stream))
                leaves.append(leaf)
        grad, given = given.grad, None
        torch.autograd.backward(hidden, grad_tensors=grad, inputs=leaves)  # a leaf it does not reach keeps zeros
    return {"sensitivity_keys": keys, "sensitivity_values": values}
