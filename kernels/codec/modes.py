"""The codec's modes by name (kernels/codec/mode.py says what a mode owns): `mode_for` looks one up where a name
comes in (options, settings, a blob's header), `resolve_mode` picks a codec's. A new mode is one class with its three
jobs and its entry here (and its layouts in kernels/codec/blob.py's table)."""
from __future__ import annotations

from kvtc.kernels.codec.ecsq_mode import EcsqMode
from kvtc.kernels.codec.fixed_mode import FixedMode
from kvtc.kernels.codec.mode import Mode
from kvtc.kernels.codec.spec import CodecSpec

FIXED, ECSQ = FixedMode(), EcsqMode()
_BY_NAME: dict[str, Mode] = {m.name: m for m in (FIXED, ECSQ)}
NAMES = tuple(_BY_NAME)


def mode_for(name: str) -> Mode:
    """The mode named `name`; ValueError naming the choices for any other."""
    try:
        return _BY_NAME[name]
    except (KeyError, TypeError):
        raise ValueError(f"mode must be one of {NAMES}, got {name!r}") from None


def default_mode(spec: CodecSpec) -> Mode:
    """ECSQ where the spec carries its tables, else fixed-rate."""
    return ECSQ if spec.ecsq is not None else FIXED


def resolve_mode(spec: CodecSpec, mode: str | None) -> Mode:
    """None -> `default_mode`; a named mode the spec cannot code is a clear error (Mode.check)."""
    if mode is None:
        return default_mode(spec)
    chosen = mode_for(mode)
    chosen.check(spec)
    return chosen
