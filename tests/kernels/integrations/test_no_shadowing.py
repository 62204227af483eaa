"""The checkout's `kernels/` (installed as `kvtc.kernels`) never hides Hugging Face's `kernels` package.

Run from the repository root without -P, Python puts the root on sys.path, so the bare name `kernels` finds the
checkout's folder first; transformers imports `kernels` (Hugging Face's) while it builds a model. Each case runs the
venv's interpreter in a fresh process with cwd = the repository root and no -P, in either import order."""
from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest


REPO = Path(__file__).resolve().parents[3]
TINY_LLAMA = ("from transformers import LlamaConfig, LlamaForCausalLM\n"
              "LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,\n"
              "                             num_attention_heads=4, num_key_value_heads=2, vocab_size=100))\n")
KVTC_CODEC = "import kvtc.kernels\nassert kvtc.kernels.KVTCCodec.__name__ == 'KVTCCodec'\n"


def _hf_kernels_installed() -> bool:
    try:
        importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _run(code: str) -> subprocess.CompletedProcess:
    """`python -c code` from the repository root, without -P: the root is on sys.path, as in a user's shell."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONSAFEPATH", "PYTHONPATH")}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    return out


def test_the_root_is_on_the_path_and_finds_the_checkouts_kernels():
    """The premise of the cases below: without -P the bare name resolves to this checkout's kernels/ folder first."""
    out = _run("import importlib.machinery; print(importlib.machinery.PathFinder.find_spec('kernels').origin)")
    assert Path(out.stdout.strip()) == REPO / "kernels" / "__init__.py"


@pytest.mark.timeout(900)
def test_transformers_first_then_kvtc_kernels():
    _run(TINY_LLAMA + KVTC_CODEC)


@pytest.mark.timeout(900)
def test_kvtc_kernels_first_then_transformers():
    _run(KVTC_CODEC + TINY_LLAMA)


@pytest.mark.skipif(not _hf_kernels_installed(), reason="Hugging Face's kernels package is not installed (test extra)")
def test_bare_kernels_is_hugging_faces():
    out = _run("import kernels, kvtc.kernels\nprint(kernels.__file__)\nprint(kvtc.kernels.__file__)")
    bare, ours = (Path(line).resolve() for line in out.stdout.split())
    assert (REPO / "kernels") not in bare.parents, bare
    assert ours == (REPO / "kernels" / "__init__.py").resolve()


def test_bare_kernels_without_hugging_faces_names_the_clash():
    """Hugging Face's package off the path (every site-packages entry dropped): `import kernels` is refused in one
    ImportError that names kvtc.kernels, not half-imported as the kvtc runtime."""
    code = ("import sys\nsys.path[:] = [p for p in sys.path if 'site-packages' not in p]\n"
            "try:\n    import kernels\nexcept ImportError as e:\n    print(e)\nelse:\n    raise SystemExit('imported')\n"
            "assert 'kernels' not in sys.modules\n")
    out = _run(code)
    assert "importable as kvtc.kernels" in out.stdout and "kernels package is not installed" in out.stdout


def test_kvtc_kernels_loads_no_torch():
    out = _run("import kvtc.kernels, sys; print('torch' in sys.modules)")
    assert out.stdout.strip() == "False"
