"""What the attention objective needs from the model, captured in the same forward as the KV cache.

A key error e is felt in the logits as q . e (times the attention's scaling), a value error through the
output projection W_O. Per coded layer and KV head this module gathers, in the captured rows' feature order:
- "keys" (layers, kv_heads, head_dim) float64: sum over query tokens of scaling^2 q_h[d]^2, the query heads
  that share the KV head summed onto it; each RoPE rotation pair gets the mean of its two dims (the relative
  rotation between query and key positions averages the pair's 2 x 2 block to a multiple of the identity,
  in the RoPE-removed frame and in the cached one alike);
- "values" (layers, kv_heads, head_dim, head_dim) float64: sum over query tokens of sum_h W_O,h^T W_O,h
  (from the weights: the same every batch, weighted by the tokens so the sums stay additive);
- "concentration" (layers, kv_heads) float64 (after `attend`): sum over query tokens and the KV head's query heads
  of sum_{j >= sinks} a_ij^2, how much of one coded position's error reaches a query's output (1 for a
  head that attends to one position, about 1/n for one spread over n); softmax of q k^T times the scaling,
  causal, within the window of sliding layers (softcapping and learned sinks are not modelled), on an even
  sample of about QUERY_ROWS queries per sequence (every query up to that length);
and `tokens`, the query tokens counted. Divided by `tokens` these are each KV head's metric block.
Queries are taken after the query norm where the layer has one (Qwen3, Gemma 3, OLMo 2).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from kvtc.kernels.codec.layers import LayerSpec, cached_layers
from kvtc.workers.objective import Objective, ObjectiveChoice, objective_choice

_ATTENTION = ("self_attn", "attention", "attn", "self_attention")
_QUERY = ("q_proj", "qkv_proj", "query")
_OUTPUT = ("o_proj", "dense", "out_proj")
QUERY_ROWS = 256  # attention concentration: at most about this many query rows per sequence are scored


def query_rows(steps: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """(R,) int64: the query positions whose attention concentration is scored, an even sample of about
    QUERY_ROWS of a forward's `steps` (every one up to that length)."""
    return torch.arange(0, steps, max(1, steps // QUERY_ROWS), device=device)


@dataclass(frozen=True)
class AttentionModules:
    """One coded layer's attention: the module whose output is its queries, the output projection, the
    query heads, and the scaling of its logits."""

    layer: int
    query: torch.nn.Module
    fused: bool  # qkv_proj: the queries are the first heads * head_dim outputs
    output: torch.nn.Module
    heads: int
    scaling: float


def decoder_layers(base: torch.nn.Module) -> torch.nn.ModuleList:
    for name in ("layers", "h", "blocks"):
        found = getattr(base, name, None)
        if isinstance(found, torch.nn.ModuleList):
            return found
    raise ValueError(f"--objective attention: cannot find the decoder layers of {type(base).__name__} "
                     "(no layers / h / blocks list); use --objective mse")


def attention_modules(base: torch.nn.Module, layers: tuple[LayerSpec, ...]) -> list[AttentionModules]:
    """Each coded layer's query and output projections; ValueError naming the first layer without them."""
    if any(l.kind == "mla" for l in layers):
        raise ValueError("--objective attention does not support multi-head latent attention (its latent's error is "
                         "felt after kv_b_proj, which the metric does not model); use --objective mse")
    blocks = decoder_layers(base)
    out = []
    for i in cached_layers(layers):
        spec = layers[i]
        attn = next((getattr(blocks[i], n) for n in _ATTENTION if hasattr(blocks[i], n)), None) if i < len(blocks) else None
        query = next((n for n in _QUERY if attn is not None and isinstance(getattr(attn, n, None), torch.nn.Linear)), None)
        output = next((n for n in _OUTPUT if attn is not None and isinstance(getattr(attn, n, None), torch.nn.Linear)), None)
        if query is None or output is None:
            raise ValueError(f"--objective attention: layer {i} ({type(attn).__name__ if attn is not None else 'no attention'}) "
                             f"has no readable query projection ({'/'.join(_QUERY)}) or output projection "
                             f"({'/'.join(_OUTPUT)}) Linear; use --objective mse for this model")
        o_proj = getattr(attn, output)
        heads = o_proj.in_features // spec.head_dim
        if heads < spec.kv_heads or heads % spec.kv_heads or heads * spec.head_dim != o_proj.in_features:
            raise ValueError(f"--objective attention: layer {i}'s output projection takes {o_proj.in_features} features, "
                             f"not a multiple of {spec.kv_heads} KV heads x head_dim {spec.head_dim}; use --objective mse")
        norm = getattr(attn, "q_norm", None)
        fused = query == "qkv_proj"
        module = norm if isinstance(norm, torch.nn.Module) and not fused else getattr(attn, query)
        scaling = float(getattr(attn, "scaling", spec.head_dim ** -0.5))
        out.append(AttentionModules(i, module, fused, o_proj, heads, scaling))
    return out


def check_readable(config: Any, layers: tuple[LayerSpec, ...]) -> None:
    """Before any model work: build the model on the meta device and find every coded layer's projections."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415 - transformers loads only with a model

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    base = getattr(model, "model", model)
    attention_modules(getattr(base, "language_model", base), layers)


def choose_objective(requested: ObjectiveChoice | str, config: Any, layers: tuple[LayerSpec, ...]
                     ) -> tuple[Objective, str]:
    """-> (the objective to run, why): `requested` (an --objective choice or its word) resolved against the model,
    whose attention metric can be built where every coded layer's query and output projections can be read (a
    meta-device model, before any model work; `ObjectiveChoice.resolve` says what each choice makes of that):
    "auto" is attention where they can, else mse naming what could not; "attention" for such a model is refused
    (ValueError naming the layer); "mse" stays."""
    return objective_choice(requested).resolve(lambda: check_readable(config, layers))


def pair_mean(energy: torch.Tensor, spec: LayerSpec) -> torch.Tensor:
    """energy (..., head_dim) -> each RoPE rotation pair's two dims replaced by their mean (dims past the
    rotary ones, and layers without RoPE, unchanged)."""
    rope = spec.rope
    if rope is None:
        return energy
    out = energy.clone()
    r = rope.rotary_dim
    if rope.layout == "half":
        a, b = energy[..., : r // 2], energy[..., r // 2: r]
        out[..., : r // 2] = out[..., r // 2: r] = (a + b) / 2
    else:
        a, b = energy[..., 0:r:2], energy[..., 1:r:2]
        out[..., 0:r:2] = out[..., 1:r:2] = (a + b) / 2
    return out


def output_grams(mods: list[AttentionModules], layers: tuple[LayerSpec, ...]) -> torch.Tensor:
    """(coded layers, kv_heads, head_dim, head_dim) float64: per KV head, sum over its query heads of W_O,h^T W_O,h."""
    grams = []
    for m in mods:
        spec = layers[m.layer]
        w = m.output.weight.detach().to(torch.float64)  # (hidden, heads * head_dim)
        per_head = w.reshape(w.shape[0], m.heads, spec.head_dim).permute(1, 2, 0)  # (heads, head_dim, hidden)
        g = per_head @ per_head.transpose(1, 2)  # (heads, d, d)
        grams.append(g.reshape(spec.kv_heads, m.heads // spec.kv_heads, spec.head_dim, spec.head_dim).sum(1))
    return torch.stack(grams).cpu()


class MetricCapture:
    """Hooks on the query projections of a loaded model; `during(batch)` collects one forward's sums."""

    def __init__(self, base: torch.nn.Module, layers: tuple[LayerSpec, ...]) -> None:
        self.layers = layers
        self.mods = attention_modules(base, layers)
        self.grams = output_grams(self.mods, layers)
        self.keys: torch.Tensor | None = None
        self.concentration: torch.Tensor | None = None
        self.reach: torch.Tensor | None = None
        self.queries: dict[int, torch.Tensor] = {}  # slot -> (B, R, heads, d): the `query_rows` of the last forward
        self.tokens = 0
        self.shape = (0, 0)

    @contextmanager
    def during(self, shape: tuple[int, int]) -> Iterator[None]:
        """Hooks on while a forward of input ids of `shape` (B, T) runs."""
        self.shape = (int(shape[0]), int(shape[1]))
        spec0 = self.layers[self.mods[0].layer] if self.mods else None
        self.keys = torch.zeros(len(self.mods), spec0.kv_heads if spec0 else 0, spec0.head_dim if spec0 else 0,
                                dtype=torch.float64)
        self.tokens = 0
        self.concentration = None
        self.reach = None
        self.queries = {}
        handles = [m.query.register_forward_hook(self._hook(slot, m)) for slot, m in enumerate(self.mods)]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def _hook(self, slot: int, m: AttentionModules):
        spec = self.layers[m.layer]

        def hook(_module: torch.nn.Module, _inputs: Any, output: Any) -> None:
            q = output[0] if isinstance(output, tuple) else output
            if m.fused:
                q = q[..., : m.heads * spec.head_dim]
            batch, steps = self.shape
            q = q.detach()
            if q.ndim == 4 and tuple(q.shape[:3]) == (batch, m.heads, steps) and steps != m.heads:
                q = q.transpose(1, 2)  # a query norm applied after the heads were moved first (Gemma 3)
            q = q.reshape(batch, steps, m.heads, spec.head_dim).to(torch.float32)
            self.queries[slot] = q[:, query_rows(steps, q.device)]  # only the rows `attend` scores
            q = q.reshape(-1, m.heads, spec.head_dim)
            if slot == 0:
                self.tokens += q.shape[0]
            energy = (q * q).sum(0, dtype=torch.float64).reshape(spec.kv_heads, -1, spec.head_dim).sum(1)
            self.keys[slot] += pair_mean(energy, spec).cpu() * (m.scaling ** 2)
        return hook

    def attend(self, keys: list[torch.Tensor], sinks: int, values: list[torch.Tensor] | None = None) -> None:
        """The last forward's attention concentration, from its queries and the cached `keys` of each coded
        layer ((B, kv_heads, T, head_dim), RoPE applied as cached); with the cached `values`, also the keys'
        reach: per KV head, sum over its query heads and queries t of sum_j a_tj^2 |W_O,h (v_j - o_t)|^2 (j past
        the sinks, o_t the attention's output): what a logit error at position j moves the layer's output by."""
        out = torch.zeros(len(self.mods), self.keys.shape[1], dtype=torch.float64)
        reach = torch.zeros_like(out)
        for slot, m in enumerate(self.mods):
            spec, q = self.layers[m.layer], self.queries.pop(slot)  # (B, R, heads, d) rows, RoPE not applied
            k = keys[slot].to(torch.float32)
            t = k.shape[-2]
            positions = torch.arange(t, device=q.device)
            rows = query_rows(t, q.device)  # an even sample of the queries: the sum scales by t / rows
            q = q.permute(0, 2, 1, 3)
            if spec.rope is not None:
                q = spec.rope.apply(q, rows)
            group = m.heads // spec.kv_heads
            k = k.to(q.device).repeat_interleave(group, dim=1)  # (B, heads, T, d)
            allowed = positions[None, :] <= rows[:, None]
            if spec.kind == "sliding":
                allowed &= rows[:, None] - positions[None, :] < spec.span
            elif spec.kind == "chunked":
                allowed &= rows[:, None] // spec.span == positions[None, :] // spec.span
            v = None
            if values is not None:
                v = values[slot].to(torch.float32).to(q.device).repeat_interleave(group, dim=1)  # (B, heads, T, d)
                w = m.output.weight.detach().to(q.device, torch.float32)
                grams = w.reshape(w.shape[0], m.heads, spec.head_dim).permute(1, 2, 0)
                grams = grams @ grams.transpose(1, 2)  # (heads, d, d): W_O,h^T W_O,h
            for h0 in range(0, m.heads, max(1, group)):
                scores = (q[:, h0:h0 + group] @ k[:, h0:h0 + group].transpose(-1, -2)) * m.scaling
                a = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
                out[slot, h0 // group] += float(a[..., sinks:].square().sum(dtype=torch.float64)) * t / len(rows)
                if v is not None:
                    vh, g = v[:, h0:h0 + group], grams[h0:h0 + group]  # (B, G, T, d), (G, d, d)
                    a2 = a.square()
                    a2[..., :sinks] = 0
                    o = a @ vh  # (B, G, R, d)
                    vg, og = vh @ g[None], o @ g[None]
                    energy = (a2 @ (vh * vg).sum(-1, keepdim=True)).squeeze(-1) \
                        - 2 * ((a2 @ vh) * og).sum(-1) + a2.sum(-1) * (o * og).sum(-1)
                    reach[slot, h0 // group] += float(energy.clamp_min(0).sum(dtype=torch.float64)) * t / len(rows)
        self.concentration = out
        self.reach = reach if values is not None else None
        self.queries = {}

    def sums(self) -> dict[str, torch.Tensor]:
        """The last forward's {"keys", "values"[, "concentration"]} sums (module docstring) over `tokens` query tokens."""
        out = {"keys": self.keys.clone(), "values": self.grams * self.tokens}
        if self.concentration is not None:
            out["concentration"] = self.concentration.clone()
        if self.reach is not None:
            out["reach"] = self.reach.clone()
        return out
