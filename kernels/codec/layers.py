"""LayerSpec: what one decoder layer caches, as the codec sees it (kvtc.workers.layers reads it from a config).

kind "full": every position; "sliding": the last `span` positions (transformers' sliding layers keep
span - 1 between forwards); "chunked": attention within chunks of `span` positions (cached like a sliding
layer of that size); "none": no KV cache at all (linear attention, SSM, conv); "mla": multi-head latent
attention (DeepSeek V2/V3, Kimi, GLM-4 MoE Lite, MiniCPM3...), whose cache holds one "head" per token in each
slot: the normalized latent c_KV (head_dim = kv_lora_rank, no RoPE) where other kinds hold keys, and the
shared RoPE key k_rot (value_dim = qk_rope_head_dim, RoPE applied) where they hold values. rope: the layer's
RoPE, on its keys, or on the rope stream (the values slot) of an "mla" layer (None: no rotary position,
a NoPE layer, or the layer has no cache). value_dim: the width of a head in the values slot (None: head_dim).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from kvtc.kernels.codec.rope import RopeSpec

KINDS = ("full", "sliding", "chunked", "none", "mla")
CACHED_KINDS = ("full", "sliding", "chunked", "mla")


@dataclass(frozen=True)
class LayerSpec:
    """kind (see KINDS); span: window or chunk size (sliding/chunked only); kv_heads, head_dim (0 for "none");
    value_dim: width of a head in the values slot when it differs from head_dim ("mla" only)."""

    kind: str
    kv_heads: int
    head_dim: int
    rope: RopeSpec | None = None
    span: int | None = None
    value_dim: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"layer kind {self.kind!r} is not one of {KINDS}")
        if (self.span is not None) != (self.kind in ("sliding", "chunked")) or (self.span is not None and self.span < 1):
            need = "a window/chunk >= 1" if self.kind in ("sliding", "chunked") else "no span"
            raise ValueError(f"a {self.kind} layer needs {need}, got {self.span}")
        if self.cached and min(self.kv_heads, self.head_dim) < 1:
            raise ValueError(f"a {self.kind} layer needs kv_heads and head_dim >= 1")
        if (self.value_dim is not None) != (self.kind == "mla") or (self.value_dim is not None and self.value_dim < 1):
            raise ValueError(f"a {self.kind} layer needs {'a value_dim >= 1' if self.kind == 'mla' else 'no value_dim'}, "
                             f"got {self.value_dim}")
        if self.kind == "mla" and self.kv_heads != 1:
            raise ValueError(f"an mla layer caches one latent head per token, got kv_heads={self.kv_heads}")
        rope_width = self.values_dim if self.kind == "mla" else self.head_dim
        if self.rope is not None and (not self.cached or self.rope.head_dim != rope_width):
            raise ValueError(f"layer RoPE head_dim {self.rope.head_dim} does not fit a {self.kind} layer of "
                             f"{'rope width' if self.kind == 'mla' else 'head_dim'} {rope_width}")

    @property
    def cached(self) -> bool:
        return self.kind in CACHED_KINDS

    @property
    def values_dim(self) -> int:
        """Width of one head in the values slot (the rope stream of an "mla" layer)."""
        return self.head_dim if self.value_dim is None else self.value_dim

    @property
    def rope_stream(self) -> str:
        """The cache slot that carries RoPE: "values" (k_rot) for an "mla" layer, else "keys"."""
        return "values" if self.kind == "mla" else "keys"

    def dim(self, stream: str) -> int:
        """Width of one head of `stream` ("keys" or "values")."""
        return self.head_dim if stream == "keys" else self.values_dim

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind}
        if self.kind == "sliding":
            out["window"] = self.span
        elif self.kind == "chunked":
            out["chunk"] = self.span
        if self.cached:
            out.update(kv_heads=self.kv_heads, head_dim=self.head_dim, rope=None if self.rope is None else self.rope.to_dict())
        if self.value_dim is not None:
            out["value_dim"] = self.value_dim
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "LayerSpec":
        kind = str(d.get("kind", "?"))
        if kind not in KINDS:
            raise ValueError(f"layer kind {kind!r} is not one of {KINDS}")
        span = d.get("window") if kind == "sliding" else d.get("chunk") if kind == "chunked" else None
        rope = d.get("rope")
        value_dim = d.get("value_dim")
        return cls(kind, int(d.get("kv_heads", 0)), int(d.get("head_dim", 0)),
                   None if rope is None else RopeSpec.from_dict(rope), None if span is None else int(span),
                   None if value_dim is None else int(value_dim))


def uniform_layers(num_layers: int, kv_heads: int, head_dim: int, rope: RopeSpec | None) -> tuple[LayerSpec, ...]:
    """The schema of a model whose layers are all full attention with one RoPE (manifests without `layers`)."""
    return tuple(LayerSpec("full", kv_heads, head_dim, rope) for _ in range(num_layers))


def is_uniform(layers: Sequence[LayerSpec]) -> bool:
    """Every layer full attention with the same RoPE, KV heads and head_dim."""
    return all(l.kind == "full" for l in layers) and len({(l.rope, l.kv_heads, l.head_dim) for l in layers}) == 1


def layers_to_json(layers: Sequence[LayerSpec]) -> list[dict[str, Any]]:
    return [l.to_dict() for l in layers]


def layers_from_json(obj: Any) -> tuple[LayerSpec, ...]:
    if not isinstance(obj, list) or not obj:
        raise ValueError(f"a layer schema must be a non-empty list of layer dicts, got {type(obj).__name__}")
    return tuple(LayerSpec.from_dict(d) for d in obj)


def cached_layers(layers: Sequence[LayerSpec]) -> list[int]:
    """Indices of the layers that keep a KV cache (the coded ones), ascending."""
    return [i for i, l in enumerate(layers) if l.cached]


def layers_of(fingerprint: dict[str, Any]) -> tuple[LayerSpec, ...]:
    """A manifest's model section -> its layer schema (`layers`, or uniform full attention when absent)."""
    if fingerprint.get("layers"):
        return layers_from_json(fingerprint["layers"])
    rope = fingerprint.get("rope")
    return uniform_layers(int(fingerprint["num_layers"]), int(fingerprint["num_kv_heads"]), int(fingerprint["head_dim"]),
                          None if rope is None else RopeSpec.from_dict(rope))


def is_mla(layers: Sequence[LayerSpec] | None) -> bool:
    """True when the coded layers are multi-head latent attention (a schema never mixes them with other kinds)."""
    return bool(layers) and any(l.kind == "mla" for l in layers)

