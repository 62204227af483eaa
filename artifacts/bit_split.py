"""The joint bit split a manifest records (`calibration.bit_split`), checked wherever it is read.

A joint split shares each ratio's bits per token between the bases: the record holds, per ratio and
basis, its share (`bits`) beside its own floor(16 p / CR) (`own`); the allocation and ECSQ tables then
carry the same shares as their `budget_bits`. An artifact re-digested by a writer of the registry
(unsigned) may hold any JSON there, so one function checks the record against the manifest
(`check_bit_split`, run by `manifest.decode_manifest`, hence by `show`, `verify`, `pull`, `report`,
`export` and the codec's load) and one checks the tables against it (`check_table_budgets`, run when
an `Artifact` reads its tables): shares present for every ratio and basis, finite positive integers
of at most 16 p, adding up exactly to each ratio's total per rank; anything else is a
`CorruptArtifactError` (exit 6) naming the entry, never a silent fallback.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Mapping

from kvtc.artifacts.blocks import budget_bits, check_budget_split
from kvtc.artifacts.errors import CorruptArtifactError
from kvtc.artifacts.groups import parse_groups, stream_dims

SPLITS = ("joint",)  # an even split records nothing
STREAMS = ("keys", "values")
REPUBLISH = "the version is damaged or was edited: republish it"


@dataclass(frozen=True)
class Share:
    """One basis's bits per token at one ratio, and its own floor(16 p / CR)."""

    ratio: float
    stream: str
    group: int
    bits: int
    own: int


def _republish(message: str) -> str:
    return message if "republish" in message else f"{message}; {REPUBLISH}"


def _integer(value: Any) -> int | None:
    """`value` as an int when it is one (not a bool, not a float), else None."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return None
    return int(value)


def _basis_dims(manifest: Mapping[str, Any]) -> tuple[dict[tuple[str, int], int], dict[int, Any]]:
    """{(stream, group): p} of the manifest's bases (its entries, or `bases` given as {(stream, group): ...}),
    {group: its KV head range}."""
    groups = parse_groups(manifest["calibration"]["groups"])
    dims = stream_dims(manifest["model"])
    bases = manifest["bases"]
    keys = [(e.get("stream"), e.get("group")) for e in bases["entries"] if isinstance(e, dict)] \
        if isinstance(bases, dict) and "entries" in bases else list(bases)
    out = {}
    for stream, group in keys:
        if stream in dims and _integer(group) is not None and 0 <= group < len(groups):
            out[(stream, int(group))] = groups[group].dim(*dims[stream])
    return out, {g: group.heads for g, group in enumerate(groups)}


def _ratio(value: Any, ratios: tuple[float, ...]) -> float | None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        return None
    return next((r for r in ratios if math.isclose(r, float(value))), None)


def read_shares(manifest: Mapping[str, Any], where: str) -> dict[tuple[float, str, int], Share] | None:
    """The checked joint split of a manifest: {(ratio, stream, group): Share}, None when it records none.
    CorruptArtifactError naming the entry for anything a calibration could not have written."""
    record = (manifest.get("calibration") or {}).get("bit_split")
    if record is None:
        return None
    what = f"{where}: calibration.bit_split"
    if not isinstance(record, dict) or record.get("split") not in SPLITS or not isinstance(record.get("bits"), list):
        raise CorruptArtifactError(f"{what} is not a joint split {{split: 'joint', bits: [...]}}; {REPUBLISH}")
    try:
        ratios = tuple(float(r) for r in manifest["calibration"]["ratios"])
        dims, ranks = _basis_dims(manifest)
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptArtifactError(f"{what} cannot be checked: the manifest's model, groups or ratios are unusable "
                                   f"({exc}); {REPUBLISH}") from None
    shares: dict[tuple[float, str, int], Share] = {}
    for i, entry in enumerate(record["bits"]):
        if not isinstance(entry, dict):
            raise CorruptArtifactError(f"{what}.bits[{i}] is not an object; {REPUBLISH}")
        ratio = _ratio(entry.get("ratio"), ratios)
        stream, group = entry.get("stream"), _integer(entry.get("group"))
        key = (ratio, stream, group)
        if ratio is None or (stream, group) not in dims:
            raise CorruptArtifactError(f"{what}.bits[{i}] names ratio {entry.get('ratio')!r}, stream {stream!r}, group "
                                       f"{entry.get('group')!r}: not a ratio and basis of this artifact "
                                       f"(ratios {list(ratios)}); {REPUBLISH}")
        if key in shares:
            raise CorruptArtifactError(f"{what} lists CR {ratio:g} ({stream}, {group}) twice; {REPUBLISH}")
        p = dims[(stream, group)]
        bits, own = _integer(entry.get("bits")), _integer(entry.get("own"))
        if bits is None or not 1 <= bits <= 16 * p:
            raise CorruptArtifactError(f"{what}: CR {ratio:g} ({stream}, {group}) shares {entry.get('bits')!r} bits per "
                                       f"token, not an integer in [1, 16 p = {16 * p}]; {REPUBLISH}")
        if own != budget_bits(p, ratio):
            raise CorruptArtifactError(f"{what}: CR {ratio:g} ({stream}, {group}) records its own share as "
                                       f"{entry.get('own')!r}, not floor(16 p / CR) = {budget_bits(p, ratio)}; {REPUBLISH}")
        shares[key] = Share(ratio, stream, group, bits, own)
    missing = [(r, s, g) for r in ratios for (s, g) in sorted(dims) if (r, s, g) not in shares]
    if missing:
        r, s, g = missing[0]
        raise CorruptArtifactError(f"{what} has no share for CR {r:g} ({s}, {g}) ({len(missing)} missing): a joint "
                                   f"split covers every ratio and basis; {REPUBLISH}")
    try:
        check_budget_split({k: v.bits for k, v in shares.items()}, dims, ranks, what)
    except ValueError as exc:
        raise CorruptArtifactError(_republish(str(exc))) from None
    return shares


def check_bit_split(manifest: Mapping[str, Any], where: str) -> None:
    """CorruptArtifactError unless the manifest's joint split (if any) is one a calibration writes."""
    read_shares(manifest, where)


def check_table_budgets(manifest: Mapping[str, Any], tables: Mapping[tuple, Mapping[str, Any]], what: str,
                        where: str) -> None:
    """The `budget_bits` of every allocation or ECSQ table (`what`) against the manifest: a ratio's budgets add
    up to its total (per rank), none is below 1 (the codec would read 0 as "unset"), and each is what the split
    gave its basis: an ECSQ table its share of the manifest's joint split (its own floor(16 p / CR) without
    one), a DP allocation always its own (the fixed mode keeps each basis's own share)."""
    shares = read_shares(manifest, where)
    dims, ranks = _basis_dims(manifest)
    try:
        check_budget_split({k: t["budget_bits"] for k, t in tables.items()}, dims, ranks, f"{where} {what}")
    except ValueError as exc:
        raise CorruptArtifactError(_republish(str(exc))) from None
    for (ratio, stream, group), table in tables.items():
        p = dims.get((stream, int(group)))
        if p is None:
            continue  # a table without a basis: the table's own check names it
        share = None
        if shares is not None and what.startswith("ECSQ"):
            share = next((v for k, v in shares.items() if math.isclose(k[0], float(ratio)) and k[1:] == (stream, int(group))),
                         None)
        want = budget_bits(p, float(ratio)) if share is None else share.bits
        if _integer(table.get("budget_bits")) != want:
            source = "its share in the manifest's joint split" if share is not None else "its basis's own floor(16 p / CR)"
            raise CorruptArtifactError(f"{where} {what} (CR {float(ratio):g}, {stream}, {group}): budget "
                                       f"{table.get('budget_bits')!r} bits per token is not {want} ({source}); "
                                       f"{REPUBLISH}")
