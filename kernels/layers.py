"""LayerSpec: what one decoder layer caches, as the codec sees it (kvtc.workers.layers reads it from a config).

kind "full": every position; "sliding": the last `span` positions (transformers' sliding layers keep
span - 1 between forwards); "chunked": attention within chunks of `span` positions (cached like a sliding
layer of that size); "none": no KV cache at all (linear attention, SSM, conv). rope: the layer's RoPE
(None: keys carry no rotary position, a NoPE layer, or the layer has no cache).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from kvtc.kernels.rope import RopeSpec

KINDS = ("full", "sliding", "chunked", "none")
CACHED_KINDS = ("full", "sliding", "chunked")


@dataclass(frozen=True)
class LayerSpec:
    """kind (see KINDS); span: window or chunk size (sliding/chunked only); kv_heads, head_dim (0 for "none")."""

    kind: str
    kv_heads: int
    head_dim: int
    rope: RopeSpec | None = None
    span: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"layer kind {self.kind!r} is not one of {KINDS}")
        if (self.span is not None) != (self.kind in ("sliding", "chunked")) or (self.span is not None and self.span < 1):
            need = "a window/chunk >= 1" if self.kind in ("sliding", "chunked") else "no span"
            raise ValueError(f"a {self.kind} layer needs {need}, got {self.span}")
        if self.cached and min(self.kv_heads, self.head_dim) < 1:
            raise ValueError(f"a {self.kind} layer needs kv_heads and head_dim >= 1")
        if self.rope is not None and (not self.cached or self.rope.head_dim != self.head_dim):
            raise ValueError(f"layer RoPE head_dim {self.rope.head_dim} does not fit a {self.kind} layer of "
                             f"head_dim {self.head_dim}")

    @property
    def cached(self) -> bool:
        return self.kind in CACHED_KINDS

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind}
        if self.kind == "sliding":
            out["window"] = self.span
        elif self.kind == "chunked":
            out["chunk"] = self.span
        if self.cached:
            out.update(kv_heads=self.kv_heads, head_dim=self.head_dim, rope=None if self.rope is None else self.rope.to_dict())
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "LayerSpec":
        kind = str(d.get("kind", "?"))
        if kind not in KINDS:
            raise ValueError(f"layer kind {kind!r} is not one of {KINDS}")
        span = d.get("window") if kind == "sliding" else d.get("chunk") if kind == "chunked" else None
        rope = d.get("rope")
        return cls(kind, int(d.get("kv_heads", 0)), int(d.get("head_dim", 0)),
                   None if rope is None else RopeSpec.from_dict(rope), None if span is None else int(span))


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
