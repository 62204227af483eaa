"""Layering: dependencies run pipeline -> workers -> kernels -> artifacts, all under the kvtc namespace."""
from __future__ import annotations

import ast
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path


REPO = Path(__file__).resolve().parents[2]
LAYERS = {"artifacts": 0, "kernels": 1, "workers": 2, "pipeline": 3}


def _imports(path: Path) -> set[str]:
    """Every kvtc module a file imports, at module level or inside functions."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "kvtc":
            out.update(f"kvtc.{a.name}" for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m == "kvtc" or m.startswith("kvtc.")}


def _module_files():
    for top in LAYERS:
        for path in sorted((REPO / top).rglob("*.py")):
            yield top, path


def test_no_upward_dependency():
    bad = []
    for top, path in _module_files():
        for mod in _imports(path):
            parts = mod.split(".")
            target = parts[1] if len(parts) > 1 else None
            if target is None or LAYERS[target] > LAYERS[top]:
                bad.append(f"{path.relative_to(REPO)} imports {mod}")
    assert not bad, "upward or namespace-wide imports:\n" + "\n".join(bad)


def test_no_top_level_names_outside_kvtc():
    """Nothing imports the bare folder names: installed, they exist only under kvtc."""
    bad = []
    for path in [*REPO.glob("tests/*.py"), *REPO.glob("bench/*.py"), *(p for _, p in _module_files())]:
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            bad += [f"{path.relative_to(REPO)}: {n}" for n in names if n.split(".")[0] in LAYERS]
    assert not bad, "\n".join(bad)


def test_hugging_face_kernels_package_coexists(tmp_path):
    """Hugging Face's `kernels` package (installed by the test extra) and kvtc.kernels import side by side."""
    code = ("import kernels, kvtc.kernels; "
            "assert hasattr(kernels, 'get_kernel'), kernels.__file__; "
            "assert hasattr(kvtc.kernels, 'KVTCCodec'); print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path)  # outside the checkout, as in a server's environment
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def _module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(("kvtc", *parts))


def _module_level_imports(path: Path, modules: set[str]) -> set[str]:
    """kvtc modules a file imports when it is imported (statements outside functions and classes)."""
    out: set[str] = set()
    pending = list(ast.parse(path.read_text()).body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                out.add(full if full in modules else node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        pending.extend(n for n in ast.iter_child_nodes(node) if isinstance(n, ast.stmt))
    return {m for m in out if m in modules}


def test_no_import_cycle():
    """The module-level import graph of kvtc is acyclic (a package's __init__ may import its own modules)."""
    cycles = _cycles(_graph(_module_level_imports))
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


# within pipeline, sub-packages depend one way: commands -> operations -> job -> evaluation -> fit (a
# stage's measurement never imports the job that runs it; no domain module imports the command layer);
# the top-level modules (cli, settings) and checks/ are shared by all
PIPELINE_ORDER = {"fit": 0, "evaluation": 1, "job": 2, "operations": 3, "commands": 4}


def test_pipeline_sub_packages_depend_one_way():
    bad = []
    for path in sorted((REPO / "pipeline").rglob("*.py")):
        rel = path.relative_to(REPO / "pipeline").parts
        if len(rel) < 2 or rel[0] not in PIPELINE_ORDER:
            continue
        for mod in _imports(path):
            parts = mod.split(".")
            if len(parts) > 2 and parts[1] == "pipeline" and parts[2] in PIPELINE_ORDER \
                    and PIPELINE_ORDER[parts[2]] > PIPELINE_ORDER[rel[0]]:
                bad.append(f"pipeline/{'/'.join(rel)} imports {mod}")
    assert not bad, ("pipeline sub-packages import upward (commands -> operations -> job -> evaluation -> fit):\n"
                     + "\n".join(bad))


_LOADERS = {("importlib", "import_module"), ("runpy", "run_module"), (None, "__import__"), (None, "import_module"),
            (None, "run_module")}


def _loads_by_name(tree: ast.AST) -> bool:
    """Whether a file imports modules by name (importlib.import_module, runpy.run_module, __import__)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            key = ((f.value.id if isinstance(f.value, ast.Name) else None), f.attr) if isinstance(f, ast.Attribute) \
                else (None, f.id) if isinstance(f, ast.Name) else None
            if key in _LOADERS:
                return True
    return False


def _all_imports(path: Path, modules: set[str]) -> set[str]:
    """kvtc modules a file imports anywhere: at module level, inside functions and `if` blocks, and, where
    the file loads modules by name, every string constant that names a kvtc module."""
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                out.add(full if full in modules else node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    if _loads_by_name(tree):
        out.update(n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str))
    return {m for m in out if m in modules}


def _cycles(graph: dict[str, set[str]]) -> list[str]:
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                cycles.append(" -> ".join(stack[stack.index(t):] + [t]))
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    return cycles


def _graph(imports) -> dict[str, set[str]]:
    files = {_module_name(p): p for _, p in _module_files()}
    modules = set(files)
    return {m: {t for t in imports(p, modules) if t != m and not m.startswith(t + ".")} for m, p in files.items()}


def test_no_import_cycle_deferred_imports_included():
    """No cycle either through imports inside functions or modules loaded by name (a deferred import only
    postpones a cycle to the first call). A package's __init__ may import its own modules."""
    cycles = _cycles(_graph(_all_imports))
    assert not cycles, "import cycles (deferred imports included):\n" + "\n".join(cycles)


def test_all_imports_sees_deferred_and_by_name_imports(tmp_path):
    """The checker itself: a function-level import and a module named in a string loaded by importlib count."""
    f = tmp_path / "m.py"
    f.write_text("import importlib\nNAMES = ('kvtc.b',)\ndef g():\n    from kvtc.a import x\n"
                 "    return [importlib.import_module(n) for n in NAMES]\n")
    assert _all_imports(f, {"kvtc.a", "kvtc.b", "kvtc.c"}) == {"kvtc.a", "kvtc.b"}
    assert _cycles({"a": {"b"}, "b": {"a"}}) == ["a -> b -> a"]


# entry points that run the `kvtc` command as a module (`python -m ...`); nothing imports them
ENTRY_MODULES = {"kvtc.pipeline.calibrate_job"}


def test_no_module_imports_the_cli():
    """The `kvtc` command (kvtc.pipeline.cli) loads the command modules; none of them, nor any domain
    module, imports it back (a command that runs kvtc commands gets the entry point from the CLI)."""
    bad = [m for m, targets in _graph(_all_imports).items() if "kvtc.pipeline.cli" in targets and m not in ENTRY_MODULES]
    assert not bad, "modules importing kvtc.pipeline.cli: " + ", ".join(bad)


def test_calibrate_job_module_runs_the_command_and_the_former_entry_says_where_it_went():
    """`python -m kvtc.pipeline.calibrate_job` is `kvtc calibrate` (for `ray job submit`); the job module
    has no command line and says so instead of exiting 0 having done nothing."""
    out = subprocess.run([sys.executable, "-m", "kvtc.pipeline.calibrate_job", "--help"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and "--ratios" in out.stdout and "--groups" in out.stdout, out.stderr
    out = subprocess.run([sys.executable, "-m", "kvtc.pipeline.job.calibrate", "--help"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode != 0 and "kvtc.pipeline.calibrate_job" in out.stderr


# what the command layer may not load at import, nor while it parses and refuses arguments; numpy and pyarrow
# do load (the settings' option types come from kvtc.artifacts, whose package imports them)
HEAVY = ("torch", "ray", "transformers", "matplotlib", "triton", "scipy", "datasets", "numba")
# each command whose --help description is a domain module's docstring, read without importing it
DESCRIPTIONS = {"calibrate": "kvtc.pipeline.job.calibrate", "recalibrate": "kvtc.pipeline.operations.recalibrate",
                "drift": "kvtc.pipeline.operations.drift", "schedule": "kvtc.pipeline.operations.schedule",
                "report": "kvtc.pipeline.evaluation.report", "eval": "kvtc.pipeline.operations.quality"}
LIGHT = """
import importlib, json, sys
from kvtc.pipeline import cli
for name in cli.COMMAND_MODULES:
    importlib.import_module(name)
parser = cli.build_parser()
parser.parse_args(["calibrate", "--model", "tiny:llama", "--ratios", "8,16", "--groups", "layers:2"])
from kvtc.pipeline import calibrate_job
codes = []
for argv in (["--bad-arg"], ["--workers", "0"], ["--ratios", "0.5"], ["--groups", "bogus:3"], ["--dtype", "int3"]):
    try:
        codes.append(calibrate_job.main(argv))
    except SystemExit as exc:
        codes.append(exc.code)
choices = parser._subparsers._group_actions[0].choices
print(json.dumps({"heavy": sorted(m for m in HEAVY if m in sys.modules), "codes": codes,
                  "descriptions": {name: choices[name].description for name in DESCRIPTIONS}}))
"""


def _light_run(code: str, tmp_path) -> dict:
    prelude = f"HEAVY = {HEAVY!r}\nDESCRIPTIONS = {DESCRIPTIONS!r}\n"
    out = subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path, env={**os.environ, "KVTC_REGISTRY": str(tmp_path / "registry")})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_command_layer_imports_nothing_heavy(tmp_path):
    """kvtc.pipeline.cli, every command module and `python -m kvtc.pipeline.calibrate_job`'s argument parsing
    and refusals (argparse, the shared checks, the settings) load no torch, Ray, transformers or matplotlib;
    the parser builds, and each command's description is its domain module's docstring."""
    got = _light_run(LIGHT, tmp_path)
    assert got["heavy"] == [], f"the command layer imported {got['heavy']}"
    assert got["codes"] == [2] * 5, got["codes"]
    for command, module in DESCRIPTIONS.items():
        assert got["descriptions"][command] == importlib.import_module(module).__doc__, command


def test_every_command_module_is_in_the_cli_and_only_there():
    """pipeline/commands holds the commands (one module per command or family) and the CLI lists them all; no
    other pipeline module registers a command (the domain modules hold no argument parsing)."""
    from kvtc.pipeline import cli

    layer = {f"kvtc.pipeline.commands.{p.stem}" for p in (REPO / "pipeline" / "commands").glob("*.py") if p.stem != "__init__"}
    assert set(cli.COMMAND_MODULES) == layer
    defines_register = [path.relative_to(REPO).as_posix() for top, path in _module_files() if top == "pipeline"
                        and any(isinstance(n, ast.FunctionDef) and n.name == "register" for n in ast.parse(path.read_text()).body)]
    assert all(p.startswith("pipeline/commands/") for p in defines_register), defines_register


def test_kvtc_help_and_list_of_an_empty_registry_exit_0(tmp_path):
    help_ = subprocess.run([sys.executable, "-m", "kvtc.pipeline.cli", "--help"], capture_output=True, text=True,
                           timeout=300, cwd=tmp_path)
    assert help_.returncode == 0 and "calibrate" in help_.stdout and "list" in help_.stdout, help_.stderr
    (tmp_path / "empty").mkdir()
    code = f"""
import json, sys
from kvtc.pipeline import cli
rc = cli.main(["list", "--registry", {str(tmp_path / "empty")!r}])
print(json.dumps({{"rc": rc, "heavy": sorted(m for m in HEAVY if m in sys.modules)}}))
"""
    got = _light_run(code, tmp_path)
    assert got == {"rc": 0, "heavy": []}, got


def test_tests_mirror_the_packages():
    """tests/<package>/ for each kvtc package (and integrity/ for the hostile families that cross them), and
    tests/<package>/<sub-package>/ only for a sub-package that exists (kernels/codec, pipeline/job, ...); kernels'
    tests all sit in its sub-packages' folders; no test at the top, no test module named twice (pytest imports them
    by basename), and the tests that start a live server or job are marked."""
    tests = REPO / "tests"
    folders = {"artifacts", "kernels", "workers", "pipeline", "integrity"}
    assert not list(tests.glob("test_*.py"))
    found = sorted(p.relative_to(tests) for p in tests.rglob("test_*.py") if "__pycache__" not in p.parts)
    assert {p.parts[0] for p in found} == folders
    misplaced = [p.as_posix() for p in found if len(p.parts) > 3 or (len(p.parts) == 3 and (
        p.parts[0] not in LAYERS or not (REPO / p.parts[0] / p.parts[1] / "__init__.py").is_file()))]
    assert not misplaced, misplaced
    assert not [p.as_posix() for p in found if p.parts[0] == "kernels" and len(p.parts) == 2]
    assert len({p.name for p in found}) == len(found)
    for rel in ("kernels/integrations/test_lmcache_live.py", "kernels/integrations/test_vllm_offload.py",
                "pipeline/test_ray_job.py"):
        assert "pytest.mark.live" in (tests / rel).read_text()


def test_the_kernels_package_imports_nothing_heavy():
    """`import kvtc.kernels` loads neither torch nor triton; its public names load on first use."""
    code = ("import sys, kvtc.kernels as k; heavy = [m for m in ('torch', 'triton', 'transformers') if m in sys.modules]; "
            "assert not heavy, heavy; assert k.KVTCCodec.__name__ == 'KVTCCodec' and 'torch' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_the_codec_imports_no_integration():
    """kvtc/kernels/codec (the hashed bundle) imports no module of kvtc/kernels/integrations, at module level, inside
    functions or by name, nor the kvtc.kernels package (whose lazy names include the integrations'): integrations
    import the codec, never the reverse."""
    modules = {_module_name(p) for _, p in _module_files()}
    bad = []
    for path in sorted((REPO / "kernels" / "codec").rglob("*.py")):
        targets = _imports(path) | _all_imports(path, modules)
        bad += [f"{path.relative_to(REPO)} imports {m}" for m in sorted(targets)
                if m == "kvtc.kernels" or m.startswith("kvtc.kernels.integrations")]
    assert not bad, "\n".join(bad)


def test_the_codec_and_integrations_packages_import_nothing_heavy():
    """`import kvtc.kernels, kvtc.kernels.codec, kvtc.kernels.integrations` and the bundle hash load no torch, triton,
    transformers, numba, LMCache or vLLM; the lazy names resolve to the modules in the two folders."""
    code = ("import sys, kvtc.kernels as k, kvtc.kernels.codec as c, kvtc.kernels.integrations as i\n"
            "from kvtc.artifacts.bundle import kernel_bundle_hash\n"
            "assert kernel_bundle_hash() is not None\n"
            "heavy = [m for m in ('torch', 'triton', 'transformers', 'numba', 'lmcache', 'vllm') if m in sys.modules]\n"
            "assert not heavy, heavy\n"
            "assert k.KVTCCodec is c.KVTCCodec and k.KVTCCodec.__module__ == 'kvtc.kernels.codec.kvtc_codec'\n"
            "assert k.CodecSpec is c.CodecSpec and k.read_blob is c.read_blob and 'torch' in sys.modules\n"
            "assert 'transformers' not in sys.modules\n"
            "assert k.KVTCCache is i.KVTCCache and i.KVTCCache.__module__ == 'kvtc.kernels.integrations.kvtc_cache'\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
