"""The codec modes (kvtc.kernels.codec.modes): what each owns, the one lookup by name, and the codec's choice."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from helpers.synthetic import synthetic_cache, synthetic_ecsq, synthetic_spec
from kvtc.kernels import BlobError, KVTCCodec, read_blob
from kvtc.kernels.codec import blob
from kvtc.kernels.codec.coefficients import CoefficientCoder
from kvtc.kernels.codec.ecsq_mode import EcsqMode
from kvtc.kernels.codec.extremes import EXTREME
from kvtc.kernels.codec.fixed_mode import FixedMode
from kvtc.kernels.codec.mode import BlobCoding, BlobContext, HeldOffsets, Mode, ResidentForm, SectionCoder, SizeBounds, StageTimer
from kvtc.kernels.codec.modes import NAMES, default_mode, mode_for, resolve_mode

REPO = Path(__file__).resolve().parents[3]

PLAIN = synthetic_spec(2, 2, 8, 8.0, sinks=1, window=2)
ECSQ = synthetic_ecsq(PLAIN)


def test_names_are_the_blob_modes():
    assert NAMES == blob.MODES == ("fixed", "ecsq")  # in the order of the blob's format codes
    assert [f.modes[0] for f in blob.FORMATS] == ["fixed", "fixed", "ecsq", "ecsq"]
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
    fixed.resident.check(PLAIN)
    codec = KVTCCodec(ECSQ, mode="fixed", backend="torch")
    header, sections = read_blob(codec.encode(*synthetic_cache(ECSQ, 9, torch.float32)))
    bounds = fixed.blob.section_bounds(codec.spec, 6, {}, header)
    assert {b.key.tag for b in bounds} == {blob.TAG_PARAMS, blob.TAG_CODES} and all(b.exact for b in bounds)
    assert [b.key for b in bounds] == [s.key for s in sections if s.key.tag in (blob.TAG_PARAMS, blob.TAG_CODES)]
    fixed.blob.check_capacity(codec.spec, 6, sections, header)  # exact sizes: nothing to check beyond read_blob's


def test_ecsq_mode():
    ecsq = EcsqMode()
    assert ecsq.codes(ECSQ, "values") is ECSQ.ecsq["values"]
    ecsq.check(ECSQ)
    with pytest.raises(ValueError, match="has no ECSQ tables for ratio 8.*recalibrate.*mode='fixed'"):
        ecsq.check(PLAIN)
    codec = KVTCCodec(ECSQ, mode="ecsq", backend="torch")
    header, sections = read_blob(codec.encode(*synthetic_cache(ECSQ, 9, torch.float32)))
    table = {s.key: s for s in sections}
    bounds = ecsq.blob.section_bounds(codec.spec, 6, table, header)
    assert [b.key.tag for b in bounds] == [blob.TAG_ECSQ, blob.TAG_ESCAPES] * 2
    assert bounds[0].plain and not bounds[0].exact
    ecsq.blob.check_capacity(codec.spec, 6, sections, header)
    with pytest.raises(BlobError, match="written in the ECSQ mode"):
        ecsq.blob.section_bounds(PLAIN, 6, table, header)


def test_a_mode_is_its_codes_and_three_jobs_each_implemented_whole():
    with pytest.raises(TypeError, match="abstract"):
        Mode()
    with pytest.raises(TypeError, match="must set blob to a BlobCoding"):
        class Partial(Mode):  # noqa: F841 - a mode without its jobs is refused when defined
            name, label = "half", "half"

    class Half(SizeBounds):
        exact = True

        def bound_bytes(self, spec, tokens):
            return 0

    with pytest.raises(TypeError, match="abstract"):
        Half()
    assert Mode.__abstractmethods__ == {"codes", "check", "admit"}
    assert BlobCoding.__abstractmethods__ == {"encode", "coefficients", "section_bounds", "check_capacity"}
    assert SizeBounds.__abstractmethods__ == {"bound_bytes", "stream_bound_bytes", "fallback"}
    assert ResidentForm.__abstractmethods__ == {"check", "encode", "coefficients", "nbytes", "select"}
    for mode in (FixedMode(), EcsqMode()):
        assert isinstance(mode.blob, BlobCoding) and isinstance(mode.sizes, SizeBounds)
        assert isinstance(mode.resident, ResidentForm)
    fields = {f.name: f.type for f in dataclasses.fields(BlobContext)}
    assert {"spec", "device", "ops", "stage", "section", "offsets"} <= set(fields)
    assert (fields["stage"], fields["section"], fields["offsets"]) == ("StageTimer", "SectionCoder", "HeldOffsets")


def test_the_context_carries_public_objects_not_the_codecs_methods():
    """A stage timer that adds seconds where a profile is set, a section coder with the codec's level and coder,
    and the ECSQ offsets held once per device in the codec's table."""
    profile: dict = {}
    timer = StageTimer(profile, torch.device("cpu"))
    with timer("project"):
        pass
    with StageTimer(None, torch.device("cpu"))("project"):
        pass
    assert set(profile) == {"project"}
    section = SectionCoder(0, "zlib", timer)(blob.SectionKey(blob.TAG_ESCAPES, 0, 0, 0), b"abc")
    assert (section.coding, section.raw_len, bytes(section.stored)) == (0, 3, b"abc") and "entropy" in profile
    held: dict = {}
    offsets = HeldOffsets(ECSQ, torch.device("cpu"), held)
    assert offsets("keys", 0) is offsets("keys", 0) and len(held) == 1
    torch.testing.assert_close(offsets("keys", 0), ECSQ.ecsq["keys"][0].offsets)
    codec = KVTCCodec(ECSQ, mode="ecsq", backend="torch")
    codec.decode(codec.encode(*synthetic_cache(ECSQ, 9, torch.float32)))
    assert codec._offsets and all(isinstance(t, torch.Tensor) for t in codec._offsets.values())


def test_no_mode_reaches_into_the_codec_and_nothing_outside_them_branches_on_a_mode_name():
    """A mode gets tensors, the spec and a BlobContext, never the codec's (or coder's) private methods; the codec,
    the chunk transform and vLLM's chunk codec ask the mode (bound_bytes, fallback, exact, admit) instead of
    comparing its name."""
    codec_dir = REPO / "kernels" / "codec"
    for path in [codec_dir / "mode.py", codec_dir / "ecsq_mode.py", codec_dir / "fixed_mode.py"]:
        assert not re.findall(r"\b(?:codec|coder)\._\w+", path.read_text()), path.name
    branch = re.compile(r"""(?:==|!=)\s*["'](?:ecsq|fixed)["']|["'](?:ecsq|fixed)["']\s*(?:==|!=)""")
    for path in [codec_dir / "chunk_serde.py", codec_dir / "kvtc_codec.py",
                 REPO / "kernels" / "integrations" / "vllm_offload.py"]:
        assert not branch.findall(path.read_text()), path.name


def test_each_mode_owns_its_size_bound_and_fallback():
    fixed, ecsq = FixedMode(), EcsqMode()
    assert (fixed.sizes.fallback, ecsq.sizes.fallback) == (None, FixedMode())
    assert (fixed.sizes.exact, ecsq.sizes.exact) == (True, False)
    assert (fixed.label, ecsq.label) == ("fixed-rate", "ECSQ")
    keys, values = synthetic_cache(ECSQ, 9, torch.float32)
    for mode, codec in ((fixed, KVTCCodec(ECSQ, mode="fixed", backend="torch", level=0)),
                        (ecsq, KVTCCodec(ECSQ, mode="ecsq", backend="torch", level=0))):
        assert mode.sizes.bound_bytes(ECSQ, 0) == 0
        header, sections = read_blob(codec.encode(keys, values, start=3))
        _, mid, _ = codec.split(9, 3)
        coded = sum(s.raw_len for s in sections if s.key.tag not in (blob.TAG_RAW_HEAD, blob.TAG_RAW_TAIL))
        if mode.sizes.exact:  # fixed: the exact size of its sections, as section_bounds gives them
            assert mode.sizes.bound_bytes(ECSQ, mid) == coded == sum(b.max_raw for b in
                                                                     mode.blob.section_bounds(ECSQ, mid, {}, header))
        else:  # ECSQ: the rate control's budget per (stream, group)
            assert mode.sizes.bound_bytes(ECSQ, mid) == sum(g.budget_bytes(ECSQ.ratio, mid) for gs in ECSQ.ecsq.values()
                                                      for g in gs)
    spike = torch.zeros(2, 3)
    spike[0, 1] = 3 * EXTREME
    assert float(fixed.admit(spike, "keys").max()) == pytest.approx(EXTREME)  # saturated: never a transform that overflows
    with pytest.raises(ValueError, match="too large for the ECSQ mode"):
        ecsq.admit(spike, "keys")


def test_the_codec_resolves_its_mode():
    assert default_mode(ECSQ) == EcsqMode() and default_mode(PLAIN) == FixedMode()
    assert resolve_mode(ECSQ, None) == EcsqMode() and resolve_mode(ECSQ, "fixed") == FixedMode()
    with pytest.raises(ValueError, match="no ECSQ tables"):
        resolve_mode(PLAIN, "ecsq")
    for spec, mode, want in ((ECSQ, None, "ecsq"), (PLAIN, None, "fixed"), (ECSQ, "fixed", "fixed")):
        codec = KVTCCodec(spec, mode=mode)
        assert type(codec.mode) is str and codec.mode == want  # the public attribute stays a plain string
        assert codec.coding == mode_for(want)  # the mode object travels: the chunk transform's is the codec's
        assert read_blob(codec.encode(*synthetic_cache(spec, 9, torch.float32)))[0].mode == want


@pytest.mark.parametrize("name", NAMES)
def test_resident_form(name):
    coder = CoefficientCoder(ECSQ, "torch", name)
    assert coder.mode == name
    keys, values = synthetic_cache(ECSQ, 5, torch.float32)
    coded = coder.encode(torch.stack([keys, keys.flip(2)], 1), torch.stack([values, values.flip(2)], 1), 3)
    assert coded.mode == name and coded.coding is coder.coding and coded.nbytes > 0
    assert CoefficientCoder(ECSQ, "torch", mode_for(name)).coding is coder.coding  # a mode object or its name
    swapped = coded.select_batch(torch.tensor([1, 0, 1]))
    assert (swapped.batch, swapped.mode, swapped.device) == (3, name, coded.device)
    z, w = coder.coefficients(coded, "keys", 0), coder.coefficients(swapped, "keys", 0)
    assert torch.equal(w, torch.cat([z[5:], z[:5], z[5:]]))
    if name == "ecsq":
        assert coded.nbytes == sum(len(a) + len(b) for gs in coded.blocks.values() for seqs in gs for a, b in seqs)
    with pytest.raises(ValueError, match="no ECSQ tables"):
        CoefficientCoder(dataclasses.replace(ECSQ, ecsq=None), "torch", "ecsq")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn])
def test_the_one_pass_finite_check_finds_every_nan_and_infinity(dtype):
    from kvtc.kernels.codec.extremes import all_finite

    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, 37, 19, generator=g).to(dtype)
    assert all_finite(x) and all_finite(x[:, :, :0])
    bad = [float("nan"), float("inf"), -float("inf")] if dtype != torch.float8_e4m3fn else [float("nan")]
    for value in bad:
        for where in [(0, 0, 0, 0), (1, 2, 36, 18), (1, 1, 17, 3)]:
            y = x.clone()
            y[where] = value
            assert not all_finite(y), (value, where)
            assert bool(torch.isfinite(y.to(torch.float32)).all()) is False
