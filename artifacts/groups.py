"""FeatureGroup: the unit that gets one basis, an ordered set of layers x a range of KV heads.

A group's features for one token are its layers' keys (or values) in the group's layer order, each
layer's KV heads [h0, h1) in head order, each head's head_dim dims: p_g = layers x (h1 - h0) x head_dim.
A model's (or a tensor-parallel rank's) groups cover every (coded layer, KV head) exactly once.

JSON form (manifest `calibration.groups`, basis entries, statistics files): a contiguous layer
range over all heads stays the compact `[a, b]` of earlier releases (so older manifests load
unchanged); any other group is `{"layers": [l, ...], "heads": [h0, h1]}` ("heads" omitted: all).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np


@dataclass(frozen=True)
class FeatureGroup:
    """layers: model layer indices, in feature order (distinct, >= 0); heads: KV heads [h0, h1), None = all."""

    layers: tuple[int, ...]
    heads: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        layers = tuple(int(v) for v in self.layers)
        if not layers or min(layers) < 0 or len(set(layers)) != len(layers):
            raise ValueError(f"a group needs distinct layer indices >= 0, got {list(self.layers)}")
        object.__setattr__(self, "layers", layers)
        if self.heads is not None:
            h0, h1 = (int(v) for v in self.heads)
            if not 0 <= h0 < h1:
                raise ValueError(f"a group's KV heads [h0, h1) need 0 <= h0 < h1, got {list(self.heads)}")
            object.__setattr__(self, "heads", (h0, h1))

    @classmethod
    def span(cls, a: int, b: int, heads: tuple[int, int] | None = None) -> "FeatureGroup":
        """Layers [a, b) in order."""
        if not 0 <= a < b:
            raise ValueError(f"a layer range [a, b) needs 0 <= a < b, got [{a}, {b})")
        return cls(tuple(range(a, b)), heads)

    @property
    def is_span(self) -> bool:
        """A contiguous ascending layer range over all heads (the legacy form)."""
        return self.heads is None and self.layers == tuple(range(self.layers[0], self.layers[-1] + 1))

    def head_range(self, kv_heads: int) -> tuple[int, int]:
        h0, h1 = self.heads or (0, kv_heads)
        if h1 > kv_heads:
            raise ValueError(f"group {self.label}: heads [{h0}, {h1}) exceed the model's {kv_heads} KV heads")
        return h0, h1

    def dim(self, kv_heads: int, head_dim: int) -> int:
        """p_g = layers x heads x head_dim."""
        h0, h1 = self.head_range(kv_heads)
        return len(self.layers) * (h1 - h0) * head_dim

    def columns(self, kv_heads: int, head_dim: int, slots: dict[int, int] | None = None) -> slice | np.ndarray:
        """The group's features inside a token's flattened (slot, kv_head, head_dim) vector, in group
        order; `slots` maps a layer to its slot (default: the layer index). A slice when contiguous."""
        h0, h1 = self.head_range(kv_heads)
        rows = [slots[layer] if slots is not None else layer for layer in self.layers]
        if h0 == 0 and h1 == kv_heads and rows == list(range(rows[0], rows[0] + len(rows))):
            width = kv_heads * head_dim
            return slice(rows[0] * width, (rows[-1] + 1) * width)
        heads = np.arange(h0, h1)
        idx = (np.asarray(rows)[:, None, None] * kv_heads + heads[None, :, None]) * head_dim \
            + np.arange(head_dim)[None, None, :]
        return idx.reshape(-1).astype(np.int64)

    def layer_offset(self, layer: int, kv_heads: int, head_dim: int) -> int:
        """Row of `layer`'s first feature inside the group's features."""
        h0, h1 = self.head_range(kv_heads)
        return self.layers.index(layer) * (h1 - h0) * head_dim

    @property
    def label(self) -> str:
        if self.is_span:
            return f"layers [{self.layers[0]}, {self.layers[-1] + 1})"
        heads = "" if self.heads is None else f" heads [{self.heads[0]}, {self.heads[1]})"
        return f"layers {list(self.layers)}{heads}"

    def to_json(self) -> list[int] | dict[str, Any]:
        if self.is_span:
            return [self.layers[0], self.layers[-1] + 1]
        out: dict[str, Any] = {"layers": list(self.layers)}
        if self.heads is not None:
            out["heads"] = list(self.heads)
        return out

    @classmethod
    def from_json(cls, obj: Any) -> "FeatureGroup":
        """`[a, b]` (layers [a, b), all heads) or `{"layers": [...], "heads": [h0, h1]}`; a FeatureGroup passes."""
        if isinstance(obj, FeatureGroup):
            return obj
        try:
            if isinstance(obj, dict):
                extra = set(obj) - {"layers", "heads"}
                if extra:
                    raise ValueError(f"unknown keys {sorted(extra)}")
                heads = obj.get("heads")
                return cls(tuple(int(v) for v in obj["layers"]), None if heads is None else (int(heads[0]), int(heads[1])))
            a, b = obj
            return cls.span(int(a), int(b))
        except (TypeError, ValueError, KeyError, IndexError) as exc:
            raise ValueError(f"a group must be [start, end) or {{\"layers\": [...], \"heads\": [h0, h1]}}, got "
                             f"{obj!r} ({exc})") from None


def parse_groups(obj: Iterable[Any]) -> list[FeatureGroup]:
    """A JSON list of groups (either form, mixed) -> FeatureGroups."""
    if isinstance(obj, (str, bytes)) or not hasattr(obj, "__iter__"):
        raise ValueError(f"groups must be a list, got {obj!r}")
    return [FeatureGroup.from_json(g) for g in obj]


def groups_json(groups: Sequence[FeatureGroup]) -> list:
    return [g.to_json() for g in groups]


def check_cover(groups: Sequence[FeatureGroup], layers: Sequence[int], kv_heads: int, what: str = "groups") -> None:
    """Raise ValueError unless `groups` cover every (layer in `layers`, KV head) exactly once."""
    seen: dict[tuple[int, int], str] = {}
    for g in groups:
        h0, h1 = g.head_range(kv_heads)
        for layer in g.layers:
            for h in range(h0, h1):
                if (layer, h) in seen:
                    raise ValueError(f"{what}: layer {layer} head {h} is in two groups ({seen[(layer, h)]} and {g.label})")
                seen[(layer, h)] = g.label
    want = {(layer, h) for layer in layers for h in range(kv_heads)}
    if set(seen) != want:
        missing, extra = sorted(want - set(seen)), sorted(set(seen) - want)
        raise ValueError(f"{what} must cover every coded (layer, KV head) exactly once; "
                         f"missing {missing[:4]}{'...' if len(missing) > 4 else ''}, "
                         f"not coded {extra[:4]}{'...' if len(extra) > 4 else ''}")


def layer_slots(groups: Sequence[FeatureGroup]) -> dict[int, int]:
    """Each coded layer's slot in a token's flattened features: coded layers (the groups' union) ascending."""
    return {layer: i for i, layer in enumerate(sorted({layer for g in groups for layer in g.layers}))}


def group_columns(groups: Sequence[FeatureGroup], kv_heads: int, head_dim: int) -> list[slice | np.ndarray]:
    """Per group, its columns in a token's (coded layer, KV head, head_dim) feature vector (see layer_slots)."""
    slots = layer_slots(groups)
    return [g.columns(kv_heads, head_dim, slots) for g in groups]


def stream_dims(fingerprint: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """A manifest's model section -> {stream: (heads, head width)}: keys and values share kv_heads x head_dim
    except in a multi-head latent attention model (latent kv_lora_rank in the keys slot, RoPE key of
    `value_dim` in the values slot)."""
    heads, dim = int(fingerprint["num_kv_heads"]), int(fingerprint["head_dim"])
    return {"keys": (heads, dim), "values": (heads, int(fingerprint.get("value_dim") or dim))}
