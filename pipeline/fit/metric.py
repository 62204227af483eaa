"""The attention objective's metric: PCA and allocation in the error the attention feels.

A group's features are (layer, KV head, head_dim) blocks; the metric M is block diagonal, one (d, d) block
per layer and KV head: diag of the queries' scaled second moments for keys, sum_h W_O,h^T W_O,h for values
(kvtc.workers.attention_metric). With S = M^(1/2) (symmetric, per block), the error e costs e^T M e =
|S e|^2, so the statistics are whitened (sum -> S sum, Gram -> S Gram S), the PCA and both allocators run
unchanged on the whitened rows, and the artifact stores encode E = S U and decode D = S^-1 U (p, k):
z = (x - mean) @ E, x_hat = mean + z_hat @ D^T.

balance: "sensitivity" (the default) scales each (layer, KV head) block to what the model's output feels: the
block's shape is the metric's, its scale tr(M^-1 F) / d, the KL an error of one whitened unit in every
direction costs (F: the measured Fisher information of that layer's cached keys or values,
kvtc.workers.sensitivity; where the statistics hold the job's copy probe, F per position is fresh text's plus
`copy_weight` times the probe's per scored position: what copying from far back needs, kvtc.workers.sensitivity.copy_probe), in one
unit for every block of the model (keys and values alike); "layer" scales
each layer's blocks to mean diagonal 1 (the squared error's balance between layers is kept, the metric
reshapes the error within a layer), "head" likewise per (layer, KV head), "model" keeps the measured scale. floor: added to each block's diagonal, times the block's mean diagonal, so that no
direction is free and S^-1 stays bounded. weighting: "concentration" multiplies each KV head's blocks by how
much of one position's error reaches a query (its mean sum of squared attention weights past the sinks:
sharp heads pass an error whole, diffuse ones average it away), "none" leaves heads alike (a per-head scale:
under "sensitivity" only the Fisher information sets it).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvtc.artifacts.errors import CorruptArtifactError
from kvtc.artifacts.groups import FeatureGroup, layer_slots
from kvtc.workers.objective import COPY_WEIGHT, Balance, Weighting

SENSITIVITY_FLOOR = 1e-4  # of the group's largest block scale: a head the model barely feels still costs something


def row_offset(p: int, i: int) -> int:
    """Index of entry (i, i) in a packed upper triangle (kvtc.workers.triangle's layout)."""
    return i * p - i * (i - 1) // 2


@dataclass(frozen=True)
class AttentionMetric:
    """balance, weighting: `Balance` and `Weighting` members (their words are read); floor: see the module docstring."""

    balance: Balance = Balance.SENSITIVITY
    floor: float = 0.05
    weighting: Weighting = Weighting.CONCENTRATION
    reach: tuple[float, ...] | None = None  # per model layer, the sensitivity's factor (sensitivity_reach.py); None: 1
    copy_weight: float = COPY_WEIGHT  # a copy probe's Fisher per scored position against fresh text's per position

    def __post_init__(self) -> None:
        object.__setattr__(self, "weighting", Weighting.of(self.weighting, "attention metric weighting"))
        object.__setattr__(self, "balance", Balance.of(self.balance, "attention metric balance"))
        if not 0.0 < self.floor < 1e3:
            raise ValueError(f"attention metric floor must be in (0, 1000), got {self.floor}")
        if not (isinstance(self.copy_weight, (int, float)) and 0.0 <= self.copy_weight <= 1e3):
            raise ValueError(f"attention metric copy weight (--attention-copy-weight) must be in [0, 1000], got "
                             f"{self.copy_weight!r}")
        object.__setattr__(self, "copy_weight", float(self.copy_weight))
        if self.reach is not None:
            object.__setattr__(self, "reach", tuple(float(r) for r in self.reach))
            if not all(0.0 < r < 1e6 for r in self.reach):
                raise ValueError(f"attention metric reach factors must be in (0, 1e6), got {list(self.reach)}")

    def to_json(self) -> dict:
        """{"balance": word, "floor": float, "weighting": word, "copy_weight": float[, "reach": [float per layer]]}:
        what tasks and manifests carry."""
        out = {"balance": self.balance.value, "floor": self.floor, "weighting": self.weighting.value,
               "copy_weight": self.copy_weight}
        return out if self.reach is None else {**out, "reach": list(self.reach)}

    def blocks(self, metric: dict[str, np.ndarray], tokens: int, stream: str, group: FeatureGroup,
               groups: list[FeatureGroup], kv_heads: int) -> np.ndarray:
        """The group's metric blocks (layers x its heads, d, d) float64 in its feature order, balanced and floored."""
        m = self.weighted(metric, tokens, stream, group, groups, kv_heads)
        m = m / self.divisors(m)[..., None, None]
        d = m.shape[-1]
        scale = np.maximum(np.einsum("lhii->lh", m) / d, 1e-300)
        m = m + self.floor * scale[..., None, None] * np.eye(d)
        if self.balance.scaled_by_sensitivity:
            m = m * self.sensitivity(metric, m, stream, group, groups)[..., None, None]
        return m.reshape(-1, d, d)

    def sensitivity(self, metric: dict[str, np.ndarray], m: np.ndarray, stream: str, group: FeatureGroup,
                    groups: list[FeatureGroup]) -> np.ndarray:
        """(layers, heads, d, d) balanced, floored blocks -> (layers, heads): each block's scale in the model's KL,
        tr(M^-1 F) / d over the model's mean value Fisher diagonal (one unit for every stream and group), F fresh
        text's Fisher information times its layer's `reach` factor where one is set, plus the copy probe's times
        `copy_weight` (both per position, `fisher`), at least SENSITIVITY_FLOOR of the group's largest."""
        if "sensitivity_values" not in metric or "sensitivity_keys" not in metric:
            raise ValueError("the statistics hold no KL sensitivity (captured with --sensitivity 0 or by an earlier "
                             "release); recalibrate with a fresh --store and --sensitivity 1, or pass "
                             "--attention-balance layer")
        d = m.shape[-1]
        slots = layer_slots(groups)
        h0, h1 = group.head_range(np.asarray(metric["sensitivity_keys"]).shape[1])
        inverse = np.linalg.inv(m)

        def scale(parts: dict[str, np.ndarray]) -> np.ndarray:
            fisher = parts[stream]
            if stream == "keys":  # a diagonal per block
                fisher = fisher[..., :, None] * np.eye(d)
            f = np.stack([fisher[slots[layer], h0:h1] for layer in group.layers])  # (layers, heads, d, d)
            return np.einsum("lhij,lhji->lh", inverse, f) / d

        fresh, probe = fisher(metric)
        values = fresh["values"] + (self.copy_weight * probe["values"] if probe else 0.0)
        ref = float(np.einsum("lhii->", values)) / max(int(np.prod(values.shape[:-1])), 1)
        w = scale(fresh)
        if self.reach is not None:  # measured on a sequence's first tokens: what each layer's errors reach over all
            if max(group.layers) >= len(self.reach):
                raise CorruptArtifactError(f"the attention metric's reach factors cover {len(self.reach)} layers, not "
                                           f"layer {max(group.layers)} of this group; recalibrate with a fresh --store")
            w = w * np.array([self.reach[layer] for layer in group.layers])[:, None]
        if probe and self.copy_weight > 0:  # measured over the probe's whole length: no reach to add
            w = w + self.copy_weight * scale(probe)
        w = w / max(ref, 1e-300)
        top = float(w.max(initial=0.0))
        if not ref > 0 or not top > 0 or not np.isfinite(w).all():
            raise ValueError(f"the measured KL sensitivity of the {stream} of layers {list(group.layers)} is zero or "
                             "not finite (the model does not feel them on the sensitivity sequences); pass "
                             "--attention-balance layer")
        return np.maximum(w, SENSITIVITY_FLOOR * top)

    def divisors(self, m: np.ndarray) -> np.ndarray:
        """(layers, heads, d, d) weighted blocks -> (layers, heads): what the balance divides each block by."""
        diag = np.einsum("lhii->lhi", m)
        axes = self.balance.mean_axes  # sensitivity: per (layer, KV head), then scaled by the Fisher information
        if axes is None:
            return np.ones(diag.shape[:2])
        return np.broadcast_to(np.maximum(diag.mean(axis=axes, keepdims=True), 1e-300)[..., 0], diag.shape[:2])

    def weighted(self, metric: dict[str, np.ndarray], tokens: int, stream: str, group: FeatureGroup,
                 groups: list[FeatureGroup], kv_heads: int) -> np.ndarray:
        """The group's blocks (layers, heads, d, d) float64 as measured, times the concentration: the error
        energy the attention feels (keys: logits; values: the output), before balance and floor."""
        if tokens < 1 or stream not in metric:
            raise ValueError(f"the statistics hold no attention metric for {stream}; recalibrate with --objective attention")
        raw = np.asarray(metric[stream], dtype=np.float64) / tokens
        if stream == "keys":  # (layers, heads, d): a diagonal per block
            raw = raw[..., :, None] * np.eye(raw.shape[-1])
        slots = layer_slots(groups)
        h0, h1 = group.head_range(kv_heads)
        m = np.stack([raw[slots[layer], h0:h1] for layer in group.layers])  # (layers, heads, d, d)
        if self.weighting.by_concentration:
            if "concentration" not in metric:
                raise ValueError("the statistics hold no attention concentration (captured by an earlier release); "
                                 "recalibrate with a fresh --store, or pass --attention-weighting none")
            c = np.asarray(metric["concentration"], dtype=np.float64) / tokens
            m = m * np.stack([c[slots[layer], h0:h1] for layer in group.layers])[..., None, None]
        return (m + np.swapaxes(m, -1, -2)) / 2


def fisher(metric: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray] | None]:
    """The statistics' Fisher information: ({"keys", "values"} of fresh text, those of the copy probe or None),
    each per position where the statistics count them (a store captured before the counts holds no probe: its
    fresh sums as they are, whose scale the balance divides away)."""
    fresh = {s: np.asarray(metric[f"sensitivity_{s}"], dtype=np.float64) for s in ("keys", "values")}
    if "fisher_positions" not in metric or "probe_keys" not in metric:
        return fresh, None
    n, n_probe = float(np.sum(metric["fisher_positions"])), float(np.sum(metric["probe_positions"]))
    if not (n > 0 and n_probe > 0):
        return fresh, None
    return ({s: f / n for s, f in fresh.items()},
            {s: np.asarray(metric[f"probe_{s}"], dtype=np.float64) / n_probe for s in ("keys", "values")})


def metric_file(stream: str, group: int) -> str:
    """Where an artifact keeps a group's whitening S (an extra file: decoding never needs it; drift does)."""
    return f"metric/{stream}-g{int(group)}.parquet"


def encode_root(root: np.ndarray) -> bytes:
    """S blocks (blocks, d, d) -> Parquet bytes: one row per block, a float32 (d, d) tensor."""
    import pyarrow as pa  # noqa: PLC0415 - Parquet only where a file is written: the settings import this module

    from kvtc.artifacts.tables import to_parquet  # noqa: PLC0415

    return to_parquet(pa.table({"root": pa.FixedShapeTensorArray.from_numpy_ndarray(
        np.ascontiguousarray(root, dtype=np.float32))}), "none")


MAX_CONDITION = 1e6  # of a stored S (1e12 of M): the floor keeps a block's near d / floor + 1; past it S^-1 is not usable


def root_declared(p: int, d: int):
    """The shape of a metric file of p features in blocks of d: p / d rows of a float32 (d, d) tensor."""
    from kvtc.artifacts.parquet_bounds import Declared, dense_bytes, tensor_of  # noqa: PLC0415 - Parquet, as above

    rows = p // d if d > 0 and p % d == 0 else -1
    return Declared(dense_bytes(max(rows, 0), [4 * d * d]), max(rows, 0) * d * d, rows=rows,
                    columns={"root": tensor_of((d, d), ("float32",))})


def check_root(root: np.ndarray, where: str) -> None:
    """ValueError naming `where` unless S is finite, symmetric and positive definite with a condition number
    (largest over smallest eigenvalue, over all its blocks) within MAX_CONDITION."""
    if not np.isfinite(root).all():
        raise ValueError(f"{where}: the whitening holds NaN or inf")
    scale = float(np.abs(root).max(initial=0.0))
    if scale == 0.0 or float(np.abs(root - np.swapaxes(root, -1, -2)).max(initial=0.0)) > 1e-4 * scale:
        raise ValueError(f"{where}: the whitening is {'zero' if scale == 0.0 else 'not symmetric'}")
    w = np.linalg.eigvalsh(root)
    if float(w.min()) <= 0.0 or float(w.max()) / float(w.min()) > MAX_CONDITION:
        cond = float("inf") if float(w.min()) <= 0.0 else float(w.max()) / float(w.min())
        raise ValueError(f"{where}: the whitening is {'singular' if cond == float('inf') else 'ill-conditioned'} "
                         f"(condition number {cond:.3g}, at most {MAX_CONDITION:.0e})")


def decode_root(path: str, p: int, d: int | None = None) -> "Whitening":
    """A stored S of a group of p features in blocks of d (its stream's head width) -> its Whitening; the
    file is checked from its footer against that shape before it is read, and S must pass check_root.
    CorruptArtifactError naming the file when it does not (d None: any square blocks, read unchecked)."""
    from kvtc.artifacts.parquet_bounds import read_checked  # noqa: PLC0415 - Parquet, as above
    from kvtc.artifacts.tables import from_parquet  # noqa: PLC0415

    try:
        table = from_parquet(path) if d is None else read_checked(path, root_declared(p, d), "attention metric file")
        root = np.asarray(table.column("root").combine_chunks().to_numpy_ndarray(), dtype=np.float64)
    except CorruptArtifactError:
        raise
    except Exception as exc:  # any malformed Parquet: one clear error
        raise CorruptArtifactError(f"attention metric file {path}: unreadable ({type(exc).__name__}: {exc})") from None
    if root.ndim != 3 or root.shape[1] != root.shape[2] or root.shape[0] * root.shape[1] != p:
        raise CorruptArtifactError(f"attention metric file {path}: expected (blocks, d, d) with blocks x d = {p}, "
                                   f"got {root.shape}; recalibrate")
    try:
        check_root(root, f"attention metric file {path}")
    except ValueError as exc:
        raise CorruptArtifactError(f"{exc}; the version was forged or damaged: recalibrate or pull another version") \
            from None
    return Whitening.of(root @ root)  # S is symmetric positive definite: S S = M


@dataclass(frozen=True)
class Whitening:
    """S = M^(1/2) and S^-1 per block: (blocks, d, d) float64 each."""

    root: np.ndarray
    inverse: np.ndarray

    @classmethod
    def of(cls, blocks: np.ndarray) -> "Whitening":
        if not np.isfinite(blocks).all():
            raise ValueError("the attention metric holds NaN or inf; check the captured queries")
        w, v = np.linalg.eigh(blocks)
        w = np.maximum(w, w.max(axis=-1, keepdims=True) * 1e-12)
        root = (v * np.sqrt(w)[..., None, :]) @ np.swapaxes(v, -1, -2)
        inverse = (v / np.sqrt(w)[..., None, :]) @ np.swapaxes(v, -1, -2)
        return cls(root, inverse)

    @property
    def p(self) -> int:
        return self.root.shape[0] * self.root.shape[1]

    def apply(self, x: np.ndarray, inverse: bool = False) -> np.ndarray:
        """x (N, p) -> x S (= (S x^T)^T, S symmetric), or x S^-1; float32 rows stay float32 (held-out rows:
        no float64 copy), anything else is computed in float64. One batched GEMM per block."""
        x = np.asarray(x)
        dtype = np.float32 if x.dtype == np.float32 else np.float64
        s = (self.inverse if inverse else self.root).astype(dtype, copy=False)
        n, d = x.shape[0], s.shape[1]
        blocks = x.astype(dtype, copy=False).reshape(n, -1, d).transpose(1, 0, 2)  # (blocks, N, d)
        return np.matmul(blocks, s).transpose(1, 0, 2).reshape(n, -1)

    def columns(self, u: np.ndarray, inverse: bool = False) -> np.ndarray:
        """u (p, k) -> S u, or S^-1 u."""
        return self.apply(np.ascontiguousarray(u.T), inverse).T

    def whiten_packed(self, total: np.ndarray, packed: np.ndarray) -> None:
        """In place: sum -> S sum, packed upper Gram -> packed upper S Gram S (one block row at a time)."""
        s, d = self.root, self.root.shape[1]
        p = self.p
        total[:] = self.apply(total[None, :])[0]
        for b in range(s.shape[0]):
            a = b * d
            rows = np.empty((d, p - a))
            for i in range(d):
                o = row_offset(p, a + i)
                rows[i, i:] = packed[o: o + p - a - i]
            diag = rows[:, :d]
            diag[np.tril_indices(d, -1)] = diag.T[np.tril_indices(d, -1)]
            out = s[b] @ rows  # (d, p - a)
            out = np.einsum("rbi,bij->rbj", out.reshape(d, -1, d), s[b:]).reshape(d, -1)
            for i in range(d):
                o = row_offset(p, a + i)
                packed[o: o + p - a - i] = out[i, i:]
