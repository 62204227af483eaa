"""One artifact's bases as a server holds them: once per (artifact, rank) in the process, in half precision.

An Artifact stores each basis with the columns its least aggressive ratio keeps in any mode (artifacts/manifest.py
`kept_components`), and every ratio's and mode's components (and decoder) in a CodecSpec are leading columns of
that float32 matrix. `held_spec` gives a spec whose matrices are views of one float16 copy of each such matrix
instead, shared by every spec of the same artifact in the process (the serdes of several ratios, their placements):
once the float32 spec and its Artifact are let go (`return_freed_memory`), the half matrices are all the basis a
server holds. On the host the codec multiplies them in float32 blocks (kernels/codec/basis_product.py); on CUDA it
holds them in the cache's dtype, converted once per device (kvtc_codec._held).

Half precision leaves the decoded cache within the codec's own error by orders of magnitude (bench/README.md,
"Served basis precision"); a basis whose values float16 cannot hold (beyond 65504) stays float32, with a warning.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import gc
import sys
import warnings
import weakref
from dataclasses import replace
from typing import Any

import torch

from kvtc.kernels.codec.spec import STREAMS, CodecSpec

SERVED_BASIS_DTYPE = torch.float16
_HELD: "weakref.WeakValueDictionary[tuple, torch.Tensor]" = weakref.WeakValueDictionary()


def held_spec(spec: CodecSpec, dtype: torch.dtype = SERVED_BASIS_DTYPE) -> CodecSpec:
    """`spec` with its components and decoders (fixed-rate and ECSQ groups) views of `dtype` copies of the whole
    matrices they are leading columns of, each copy made once per (artifact, rank, basis) in the process. `spec`
    itself when dtype is float32, when it is held in half already, or when a matrix is beyond dtype's range (warned)."""
    if dtype == torch.float32 or spec.held_dtype != torch.float32:
        return spec
    digest = (spec.identity or {}).get("digest")

    def hold(matrix: torch.Tensor | None, stream: str, group: Any, what: str) -> torch.Tensor | None:
        if matrix is None:
            return None
        root = matrix if matrix._base is None else matrix._base
        if not (matrix.dim() == root.dim() == 2 and matrix.shape[0] == root.shape[0]
                and matrix.stride() == root.stride() and matrix.storage_offset() == root.storage_offset()):
            root = matrix  # not leading columns of a wider matrix: a copy of its own
        key = ((digest, spec.rank, spec.heads, stream, group.label, what, tuple(root.shape), dtype) if digest else
               (root.untyped_storage().data_ptr(), root.storage_offset(), tuple(root.shape), root.stride(), dtype))
        whole = _HELD.get(key)
        if whole is None:
            whole = root.to(device="cpu", dtype=dtype).contiguous()
            if not bool(torch.isfinite(whole).all()):
                raise OverflowError(f"{stream} group {group.label}: its {what} hold values beyond {dtype}'s range "
                                    f"({float(root.abs().max()):.3g})")
            if not digest:
                whole._kvtc_source = root  # the source lives while its copy does: its address names no other basis
            _HELD[key] = whole
        return whole[:, : matrix.shape[1]]

    try:
        streams = {st: tuple(replace(g, components=hold(g.components, st, g.group, "components"),
                                     decoder=hold(g.decoder, st, g.group, "decoder")) for g in spec.streams[st])
                   for st in STREAMS}
        ecsq = None if spec.ecsq is None else {
            st: tuple(replace(g, components=hold(g.components, st, g.group, "components"),
                              decoder=hold(g.decoder, st, g.group, "decoder")) for g in spec.ecsq[st])
            for st in STREAMS}
    except OverflowError as exc:
        warnings.warn(f"artifact {spec.name}@{spec.version}: {exc}; its bases stay float32", stacklevel=2)
        return spec
    return replace(spec, streams=streams, ecsq=ecsq)


def served_codec(codec: Any, dtype: torch.dtype = SERVED_BASIS_DTYPE) -> Any:
    """The codec a server runs in place of `codec` (a KVTCCodec): its options over `held_spec(codec.spec)`; `codec`
    itself where its options pin basis_dtype=torch.float32."""
    from kvtc.kernels.codec.kvtc_codec import KVTCCodec  # noqa: PLC0415 - kvtc_codec imports the modes, which import spec

    if codec.options.basis_dtype == torch.float32:
        return codec
    spec = held_spec(codec.spec, dtype)
    return codec if spec is codec.spec else KVTCCodec(spec, options=codec.options)


def held_bytes(*specs: CodecSpec) -> int:
    """Bytes of the basis matrices `specs` hold on the host, each storage once (whole: a view counts its matrix)."""
    seen, total = set(), 0
    for groups in [gs for spec in specs for gs in [*spec.streams.values(), *(spec.ecsq or {}).values()]]:
        for g in groups:
            for t in (g.components, g.decoder):
                if t is not None and t.untyped_storage().data_ptr() not in seen:
                    seen.add(t.untyped_storage().data_ptr())
                    total += t.untyped_storage().nbytes()
    return total


def return_freed_memory() -> None:
    """Give back to the system what reading an artifact freed: Arrow's pool keeps the Parquet pages it decoded and
    glibc's heap the float32 matrices a server no longer holds (their pages stay resident otherwise)."""
    gc.collect()
    arrow = sys.modules.get("pyarrow")
    if arrow is not None:
        arrow.default_memory_pool().release_unused()
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
