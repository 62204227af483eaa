"""Artifact format, validation, Dynamo export, CLI and import weight (local and memory:// registries)."""
from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from kvtc.artifacts import ArtifactContent, IntegrityError, Registry, publish, pull
from kvtc.artifacts.artifact import Artifact
from kvtc.pipeline.cli import main as cli
from helpers.toy_artifacts import toy_content

REPO = Path(__file__).resolve().parents[2]


def test_import_loads_no_heavy_modules():
    code = ("import sys, artifacts, artifacts.export; "
            "print(sorted(m for m in ('torch', 'ray', 'transformers', 'triton', 'kernels') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert out.stdout.strip() == "[]"


def test_manifest_and_parquet_layout(tmp_path):
    ref = publish(toy_content(), tmp_path / "reg")
    folder = Path(ref.path)
    manifest = json.loads((folder / "manifest.json").read_text())
    for key in ("schema_version", "name", "version", "created", "model", "calibration", "corpus", "code_version",
                "kernel_bundle_hash", "files", "parent"):
        assert key in manifest
    for key in ("sinks", "window", "seq_len", "tokens", "groups", "seed", "allocator", "ratios"):
        assert key in manifest["calibration"]
    listed = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    assert listed - set(manifest["files"]) == {"manifest.json", "manifest.sha256"}
    assert not any(name.endswith((".pkl", ".pickle", ".pt")) for name in listed)
    table = pq.read_table(folder / "bases/keys-g0.components.parquet")
    assert str(table.schema.field("component").type).startswith("extension<arrow.fixed_shape_tensor")
    assert set(manifest["kernels"]["files"]) >= {"__init__.py", "reference.py"}


def test_float16_bases_record_dtype_and_stay_close(tmp_path):
    content = toy_content(bases_dtype="float16")
    art = pull("toy", registry=publish(content, tmp_path / "reg").registry)
    assert art.manifest["bases"]["dtype"] == "float16"
    mean, eig, comp = art.basis("values", 0)
    k = comp.shape[1]
    assert comp.dtype == np.float32 and mean.tobytes() == content.bases[("values", 0)][0].tobytes()
    np.testing.assert_array_equal(comp, content.bases[("values", 0)][2][:, :k].astype(np.float16).astype(np.float32))


@pytest.mark.parametrize("change, message", [
    (lambda c: c.bases.update({("keys", 0): (np.zeros(3), np.zeros(2), np.zeros((3, 2)))}), "expected mean"),
    (lambda c: c.allocations[(4.0, "keys", 0)]["blocks"].insert(0, (0, 2, "int4", 4, 32)), "contiguous"),
    (lambda c: c.allocations.update({(3.0, "keys", 0): {"budget_bits": 1, "blocks": []}}), "not in calibration ratios"),
    (lambda c: c.allocations[(4.0, "keys", 0)]["blocks"].insert(0, (0, 2, "int4", 3, 32)), "has 4 bits"),
    (lambda c: c.extra_files.update({"manifest.json": b"{}"}), "reserved"),
    (lambda c: c.extra_files.update({"../x": b"{}"}), "relative path"),
    (lambda c: c.model.pop("rope"), "lacks rope"),
])
def test_invalid_content_is_refused_with_a_clear_error(change, message):
    content = toy_content()
    fields = {f: getattr(content, f) for f in content.__dataclass_fields__}
    change(content)
    with pytest.raises(ValueError, match=message):
        ArtifactContent(**fields)
    with pytest.raises(ValueError, match="invalid artifact name"):
        ArtifactContent(**{**fields, "name": "a/b"})


def test_memory_registry_round_trip_and_tamper(tmp_path):
    reg = Registry(f"memory://kvtc-{uuid.uuid4().hex[:8]}")
    content = toy_content()
    ref = publish(content, reg)
    art = pull("toy", registry=reg, cache_dir=tmp_path / "c")
    assert art.basis("keys", 0)[0].tobytes() == content.bases[("keys", 0)][0].tobytes()
    assert Artifact(art.path).version == ref.version
    path = f"{reg.version_path('toy', ref.version)}/report.md"
    reg.fs.pipe_file(path, b"# tampered report\n")
    with pytest.warns(UserWarning, match="report.md"):  # optional files never stop a decoder
        damaged = pull("toy", registry=reg, cache_dir=tmp_path / "c2")
    assert damaged.damaged == ["report.md"] and damaged.basis("keys", 0)[0].shape
    with pytest.raises(IntegrityError, match="report.md"):
        damaged.file("report.md")
    reg.fs.pipe_file(f"{reg.version_path('toy', ref.version)}/bases/keys-g0.mean.parquet", b"x")
    with pytest.raises(IntegrityError, match="keys-g0.mean.parquet"):
        pull("toy", registry=reg, cache_dir=tmp_path / "c3")


def test_cli_commands(tmp_path, capsys):
    reg = str(tmp_path / "reg")
    first = publish(toy_content(seed=1), reg, version="v1")
    publish(toy_content(seed=2, parent="v1"), reg)

    def run(*argv: str) -> object:
        assert cli([*argv, "--registry", reg, "--json"]) == 0
        return json.loads(capsys.readouterr().out)

    assert run("list")["toy"]["versions"] == 2
    assert [r["version"] for r in run("list", "toy")][0] == "v1"
    assert run("show", "toy")["parent"] == "v1"
    assert run("alias", "toy@v1", "production")["version"] == "v1"
    assert run("show", "toy@production")["version"] == first.version
    pulled = run("pull", "toy@production", "--to", str(tmp_path / "copy"))
    assert Artifact(pulled["path"]).version == "v1"
    assert run("verify", "toy")["ok"] is True
    assert Path(run("export", "toy", "--ratio", "8", "--format", "dynamo", "--to", str(tmp_path / "dyn"),
                    "--layout", "token-major", "--allow-rope-removed")["path"]).is_file()
    assert cli(["show", "toy@nope", "--registry", reg]) == 2
    assert "nope" in capsys.readouterr().err
    assert cli(["list", "--registry", reg]) == 0 and "toy" in capsys.readouterr().out
