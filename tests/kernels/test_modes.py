"""The codec modes (kvtc.kernels.codec.modes): what each owns, the one lookup by name, and the codec's choice."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from helpers.synthetic import synthetic_cache, synthetic_ecsq, synthetic_spec
from kvtc.kernels import BlobError, KVTCCodec, read_blob
from kvtc.kernels.codec import blob
from kvtc.kernels.codec.coefficients import CoefficientCoder
from kvtc.kernels.codec.ecsq_mode import EcsqMode
from kvtc.kernels.codec.fixed_mode import FixedMode
from kvtc.kernels.codec.modes import NAMES, default_mode, mode_for, resolve_mode

PLAIN = synthetic_spec(2, 2, 8, 8.0, sinks=1, window=2)
ECSQ = synthetic_ecsq(PLAIN)


def test_names_are_the_blob_modes():
    assert NAMES == blob.MODES == ("fixed", "ecsq")  # in flag order: bit 0 set is ECSQ
    assert blob.MODE_FLAGS == {"fixed": 0, "ecsq": blob.FLAG_ECSQ}
    assert mode_for("fixed") == FixedMode() and mode_for("ecsq") == EcsqMode()
    assert [str(mode_for(n)) for n in NAMES] == list(NAMES)


@pytest.mark.parametrize("name", ["auto", "ECSQ", "", None, "rans"])
def test_unknown_name_refused_naming_the_choices(name):
    with pytest.raises(ValueError, match=r"mode must be one of \('fixed', 'ecsq'\)"):
        mode_for(name)
    with pytest.raises(ValueError, match="mode must be one of"):
        CoefficientCoder(ECSQ, mode=name)
    if name is not None:  # the codec's None is its default mode
        with pytest.raises(ValueError, match="mode must be one of"):
            KVTCCodec(ECSQ, mode=name)


def test_fixed_mode():
    fixed = FixedMode()
    assert fixed.codes(ECSQ, "keys") is ECSQ.streams["keys"]
    fixed.check(PLAIN)  # every spec has its fixed-rate groups
    fixed.check_resident(PLAIN)
    codec = KVTCCodec(ECSQ, mode="fixed", backend="torch")
    header, sections = read_blob(codec.encode(*synthetic_cache(ECSQ, 9, torch.float32)))
    bounds = fixed.section_bounds(codec, 6, {}, header)
    assert {b.key.tag for b in bounds} == {blob.TAG_PARAMS, blob.TAG_CODES} and all(b.exact for b in bounds)
    assert [b.key for b in bounds] == [s.key for s in sections if s.key.tag in (blob.TAG_PARAMS, blob.TAG_CODES)]
    fixed.check_capacity(codec, 6, sections, header)  # exact sizes: nothing to check beyond read_blob's


def test_ecsq_mode():
    ecsq = EcsqMode()
    assert ecsq.codes(ECSQ, "values") is ECSQ.ecsq["values"]
    ecsq.check(ECSQ)
    with pytest.raises(ValueError, match="has no ECSQ tables for ratio 8.*recalibrate.*mode='fixed'"):
        ecsq.check(PLAIN)
    codec = KVTCCodec(ECSQ, mode="ecsq", backend="torch")
    header, sections = read_blob(codec.encode(*synthetic_cache(ECSQ, 9, torch.float32)))
    table = {s.key: s for s in sections}
    bounds = ecsq.section_bounds(codec, 6, table, header)
    assert [b.key.tag for b in bounds] == [blob.TAG_ECSQ, blob.TAG_ESCAPES] * 2
    assert bounds[0].plain and not bounds[0].exact
    ecsq.check_capacity(codec, 6, sections, header)
    with pytest.raises(BlobError, match="written in the ECSQ mode"):
        ecsq.section_bounds(KVTCCodec(PLAIN, mode="fixed"), 6, table, header)


def test_the_codec_resolves_its_mode():
    assert default_mode(ECSQ) == EcsqMode() and default_mode(PLAIN) == FixedMode()
    assert resolve_mode(ECSQ, None) == EcsqMode() and resolve_mode(ECSQ, "fixed") == FixedMode()
    with pytest.raises(ValueError, match="no ECSQ tables"):
        resolve_mode(PLAIN, "ecsq")
    for spec, mode, want in ((ECSQ, None, "ecsq"), (PLAIN, None, "fixed"), (ECSQ, "fixed", "fixed")):
        codec = KVTCCodec(spec, mode=mode)
        assert type(codec.mode) is str and codec.mode == want  # the public attribute stays a plain string
        assert read_blob(codec.encode(*synthetic_cache(spec, 9, torch.float32)))[0].mode == want


@pytest.mark.parametrize("name", NAMES)
def test_resident_form(name):
    coder = CoefficientCoder(ECSQ, "torch", name)
    assert coder.mode == name
    keys, values = synthetic_cache(ECSQ, 5, torch.float32)
    coded = coder.encode(torch.stack([keys, keys.flip(2)], 1), torch.stack([values, values.flip(2)], 1), 3)
    assert coded.mode == name and coded.nbytes > 0
    swapped = coded.select_batch(torch.tensor([1, 0, 1]))
    assert (swapped.batch, swapped.mode, swapped.device) == (3, name, coded.device)
    z, w = coder.coefficients(coded, "keys", 0), coder.coefficients(swapped, "keys", 0)
    assert torch.equal(w, torch.cat([z[5:], z[:5], z[5:]]))
    if name == "ecsq":
        assert coded.nbytes == sum(len(a) + len(b) for gs in coded.blocks.values() for seqs in gs for a, b in seqs)
    with pytest.raises(ValueError, match="no ECSQ tables"):
        CoefficientCoder(dataclasses.replace(ECSQ, ecsq=None), "torch", "ecsq")
