"""A stored chunk's identity: what its keys and values mean, beside the storage key they were stored under.

LMCache's key names a chunk by its content hash, the engine's model name, the packed rank, the object group and the
tenant's `cache_salt` (the frame's key binding, kernels/codec/chunk_frame.py). It does not say which artifact coded the
chunk, nor which model, RoPE or KV layout produced it: a store shared by servers of two artifact versions, or kept
across a model's new revision, would hand one deployment's chunks to the other. The identity is that namespace,
the model's and the layout's (never the tenant's salt, which stays in the key), in four parts, each a 4-byte
BLAKE2b digest in the frame, so a reader names the part that differs (as LMCache's own EncodedKV gates name theirs):

- artifact: the artifact's name@version and digest (its manifest's content address, "sha256:HEX": the version
  `kvtc pull` verified, or the same digest of the manifest it was loaded from);
- model: the model id the artifact records (the hash of the calibrated model's fingerprint: weights, revision,
  architecture, geometry, RoPE), its revision, its tokenizer (the manifest's "tokenizer" where recorded, else the
  model's source at that revision, whose tokenizer the calibration used) and the engine's name for it (LMCache's
  `ObjectKey.model_name`, where the store says);
- rope: the RoPE configuration the manifest records for the model (every layer's), canonical JSON;
- layout: the KV layout a placement holds (KV heads, head width, layers, the rank's heads and the stage's layers,
  tensor-parallel size) with what the store says of the chunk: its dtype, its tokens and the world size.

A spec built by hand (no manifest) has what it holds: its name@version, model id and RoPE. A mismatch is an
`IdentityMismatch` (a BlobError: a storage layer counts a miss) naming the parts that differ and what the reader
expects; nothing is written to the destination.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from kvtc.artifacts.fingerprint import model_id
from kvtc.artifacts.manifest import encode_manifest, manifest_digest
from kvtc.kernels.codec.blob import BlobError

PARTS = ("artifact", "model", "rope", "layout")
PART_BYTES = 4
IDENTITY_BYTES = PART_BYTES * len(PARTS)  # the frame's identity field
WHAT = {"artifact": "another artifact", "model": "another model (model id, revision, tokenizer or served name)",
        "rope": "another RoPE configuration",
        "layout": "another KV layout (KV heads, head width, layers, placement, dtype, tokens or world size)",
        "frame": "an earlier kvtc release, whose frame carries no identity"}


def canonical(value: Any) -> str:
    """JSON with sorted keys and no spaces: the same value is the same text on every machine."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def artifact_identity(artifact: Any) -> dict[str, str]:
    """What an artifact's manifest says of a chunk's identity (CodecSpec.from_artifact keeps it as `spec.identity`)."""
    m = artifact.manifest
    fp = m.get("model") or {}
    digest = getattr(artifact, "digest", None)
    if not digest:
        try:
            digest = manifest_digest(encode_manifest(m))
        except (TypeError, ValueError):  # an artifact-like object whose manifest is not JSON: name@version alone
            digest = ""
    revision = "" if fp.get("revision") is None else str(fp["revision"])
    layer_ropes = [layer.get("rope") for layer in fp.get("layers") or () if isinstance(layer, dict)]
    return {"artifact": f"{m.get('name')}@{m.get('version')}", "digest": str(digest), "model_id": model_id(fp),
            "revision": revision, "tokenizer": str(fp.get("tokenizer") or f"{fp.get('source', '')}@{revision}"),
            "rope": canonical({"rope": fp.get("rope"), "layers": layer_ropes})}


@dataclass(frozen=True)
class Engine:
    """What the store says of a chunk beside its tensor: the engine's model name and world size ("" / 0: unknown)."""

    model: str = ""
    world_size: int = 0


class IdentityMismatch(BlobError):
    """A stored chunk of another identity (or with none): `reasons` names the parts that differ."""

    def __init__(self, message: str, reasons: tuple[str, ...]) -> None:
        super().__init__(message)
        self.reasons = reasons


@dataclass(frozen=True)
class ChunkIdentity:
    """One placement's identity; `encode` adds what the store says of one chunk. See the module docstring."""

    artifact: str
    digest: str = ""
    model_id: str = ""
    revision: str = ""
    tokenizer: str = ""
    rope: str = "null"
    layout: str = ""

    @classmethod
    def of(cls, spec: Any) -> "ChunkIdentity":
        """A placement's spec (its rank's heads, its stage's layers) -> its identity: the manifest's record where the
        spec was built from an artifact (`spec.identity`), else what the spec holds."""
        base, _, placement = spec.model_id.partition("/")  # a placement's spec names its heads and layers after "/"
        tp = spec.tensor_parallel.tp if spec.tensor_parallel is not None else 1
        layout = canonical({"kv_heads": spec.kv_heads, "head_dim": spec.head_dim, "value_dim": spec.value_dim,
                            "layers": spec.num_layers, "placement": placement, "tp": tp})
        known = dict(spec.identity or {})
        if not known:
            ropes = [None if l.rope is None else l.rope.to_dict() for l in spec.layers or ()]
            known = {"artifact": f"{spec.name}@{spec.version}", "model_id": base,
                     "rope": canonical({"rope": spec.rope, "layers": ropes})}
        return cls(layout=layout, **known)

    def fields(self, dtype: str, tokens: int, engine: Engine | None = None) -> dict[str, tuple]:
        """Each part's fields for a chunk of `tokens` tokens in `dtype` ("bfloat16", ...) as the store describes it."""
        engine = engine or Engine()
        return {"artifact": (self.artifact, self.digest),
                "model": (self.model_id, self.revision, self.tokenizer, engine.model),
                "rope": (self.rope,),
                "layout": (self.layout, dtype, int(tokens), int(engine.world_size))}

    def encode(self, dtype: str, tokens: int, engine: Engine | None = None) -> bytes:
        """The frame's identity field: each part's 4-byte digest, in PARTS order."""
        out = b""
        for name, values in self.fields(dtype, tokens, engine).items():
            h = hashlib.blake2b(canonical(values).encode(), digest_size=PART_BYTES, person=b"kvtc-id-" + name.encode())
            out += h.digest()
        return out

    def differing(self, stored: bytes, dtype: str, tokens: int, engine: Engine | None = None) -> tuple[str, ...]:
        """The parts whose digests in a stored frame's identity differ from this reader's."""
        want = self.encode(dtype, tokens, engine)
        return tuple(name for i, name in enumerate(PARTS)
                     if stored[i * PART_BYTES:(i + 1) * PART_BYTES] != want[i * PART_BYTES:(i + 1) * PART_BYTES])

    def describe(self, part: str, dtype: str, tokens: int, engine: Engine | None = None) -> str:
        """What this reader expects of `part`, in words."""
        engine = engine or Engine()
        if part == "artifact":
            return f"{self.artifact} ({self.digest or 'no manifest digest'})"
        if part == "model":
            served = f", served as {engine.model!r}" if engine.model else ""
            return (f"model id {self.model_id}, revision {self.revision or 'unrecorded'}, tokenizer "
                    f"{self.tokenizer or 'unrecorded'}{served}")
        if part == "rope":
            return _rope_words(self.rope)
        shape = json.loads(self.layout) if self.layout else {}
        where = f" ({shape['placement']})" if shape.get("placement") else ""
        world = f", world size {engine.world_size}" if engine.world_size else ""
        return (f"{shape.get('kv_heads')} KV heads x head_dim {shape.get('head_dim')}, {shape.get('layers')} "
                f"layers{where}, {dtype}, {tokens} tokens{world}")

    def mismatch(self, reasons: tuple[str, ...], dtype: str, tokens: int, engine: Engine | None = None,
                 ) -> IdentityMismatch:
        """The error naming each part that differs and what this reader expects of it."""
        expected = "; ".join(f"{name}: {self.describe(name, dtype, tokens, engine)}" for name in reasons)
        return IdentityMismatch(f"the stored chunk was written for {' and '.join(WHAT[r] for r in reasons)} (this "
                                f"server's {expected}); not loaded", reasons)


def old_frame(magic: bytes) -> IdentityMismatch:
    """The error for a version-1 frame (no identity): a miss until the chunk is stored again."""
    return IdentityMismatch(f"the stored chunk's frame ({magic!r}) was written by an earlier kvtc release and carries "
                            "no identity (artifact digest, model, RoPE, KV layout); not loaded",
                            ("frame",))


def _rope_words(text: str) -> str:
    value = json.loads(text) if text else None
    ropes = [value.get("rope")] + list(value.get("layers") or []) if isinstance(value, dict) else [value]
    kinds = sorted({f"{r.get('rope_type', '?')} theta {r.get('theta', '?')} over {r.get('rotary_dim', '?')} dims"
                    for r in ropes if isinstance(r, dict)})
    return f"RoPE {', '.join(kinds)}" if kinds else "no RoPE recorded"
