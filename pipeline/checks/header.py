"""What a calibration's command line can refuse before torch, transformers or Ray load (well under two seconds):
the checks the plan stage would otherwise make only after loading the model's config and tokenizer.

`check_calibration(settings)`: the model spec's form and, where its GGUF header, tiny preset or folder tells
them cheaply (`workers.model_limits.model_facts`), the tensor-parallel size against its KV heads, the ratios
against its largest group, a basis budget against its parameters; the sequence against the sinks and window;
the KL sensitivity against the balance that needs it; corpus specs whose every file is missing.
`check_model_spec(spec)`: the spec alone (`kvtc eval`, `drift`); `check_recalibration`: the settings a
recalibration will run (its parent's, validated naming the manifest field, with the options given), then as a
calibration's.

Each refusal is the plan stage's own rule with its message; what cannot be told cheaply is left to the plan
stage, as before. Imports nothing heavy.
"""
from __future__ import annotations

import glob
from pathlib import Path

from kvtc.artifacts.blocks import check_payable
from kvtc.artifacts.names import split_ref
from kvtc.artifacts.tensor_parallel import TensorParallelLayout
from kvtc.pipeline.fit.basis_budget import BasisBudget
from kvtc.pipeline.settings import JobSettings, settings_from_manifest
from kvtc.workers.capture_settings import CaptureSettings
from kvtc.workers.model_limits import ModelFacts, model_facts

FILE_SUFFIXES = (".txt", ".jsonl", ".parquet")  # kvtc.pipeline.job.corpus.FILE_SUFFIXES


def check_model_spec(spec: str) -> ModelFacts:
    """The spec's form (`model_facts`): FileNotFoundError or ValueError naming it."""
    return model_facts(spec)


def check_calibration(cfg: JobSettings) -> ModelFacts:
    """ValueError (or FileNotFoundError) naming the first input the plan stage would refuse, where it can be told
    without loading anything (module docstring); -> what was told of the model."""
    capture, plan, alloc = cfg.capture, cfg.plan, cfg.allocator
    _check_positions(plan.seq_len, capture)
    capture.objective.check_options(cfg.reduce.attention_balance, capture.sensitivity)  # before its resolution
    for spec in filter(None, (plan.corpus, plan.eval_corpus)):
        check_corpus_files(spec)
    facts = check_model_spec(cfg.model.model)
    if plan.seq_len is None:  # the default, now the model's limit is told
        seq_len = plan.resolved(facts.context).seq_len
        if seq_len <= capture.sinks + capture.window:
            least = 4 * (capture.sinks + capture.window + 1)
            raise ValueError(f"--tokens {plan.tokens} is too few: the default sequence (a quarter of --tokens, {seq_len} "
                             f"tokens) leaves no position after sinks={capture.sinks} and window={capture.window}; "
                             f"pass --tokens {least} or more, or --seq-len")
    if facts.context is not None and plan.seq_len is not None and plan.seq_len > facts.context:
        raise ValueError(f"seq_len {plan.seq_len} exceeds the model's limit of {facts.context} positions; use a "
                         "shorter seq_len")
    if facts.kv_heads:
        TensorParallelLayout(capture.tp, facts.kv_heads, facts.attention_heads or 0)
    p = facts.features
    if p:  # no group is wider than every layer's KV heads: a ratio that starves it starves every group
        check_payable(cfg.reduce.ratios, p, alloc.types, alloc.block_sizes)
    if p and facts.parameters and alloc.basis_budget:
        BasisBudget(alloc.basis_budget).cap(facts.parameters, p)  # the widest split: fewer features only raise it
    return facts


def check_corpus_files(spec: str) -> None:
    """Refuse a corpus spec whose every part names a local file or glob that does not exist or matches nothing
    (the workers would start and read nothing); names and folders are left to the corpus reader."""
    parts = [p.strip() for part in spec.split(",") for p in _plus_parts(part.strip())]
    files = [p for p in parts if _is_file_part(p)]
    if parts and len(files) == len(parts) and not any(_exists(p) for p in files):
        raise ValueError(f"corpus {spec!r} has no usable document: {', '.join(files)} "
                         f"{'does' if len(files) == 1 else 'do'} not exist or match no file; check the path")


def _plus_parts(part: str) -> list[str]:
    if "+" not in part or Path(part).exists() or glob.has_magic(part):
        return [part]
    return part.split("+")


def _is_file_part(part: str) -> bool:
    path = part.split("#", 1)[0] if not Path(part).exists() else part
    return not part.startswith("hf:") and (glob.has_magic(path) or Path(path).suffix in FILE_SUFFIXES)


def _exists(part: str) -> bool:
    path = part if Path(part).exists() else part.split("#", 1)[0]
    if glob.has_magic(path):
        return any(Path(p).suffix in FILE_SUFFIXES for p in glob.iglob(path, recursive=True))
    return Path(path).exists()


def check_artifact_model(ref: str, registry: str | None, model: str | None, prefix: int | None = None,
                         continuation: int = 0) -> None:
    """The model spec a command on a published artifact will load (`model`, else the artifact's manifest's), checked
    before anything loads it (`check_model_spec`); with `prefix` (`kvtc eval --prefix`), the prefix against what the
    manifest and the model's header tell: it must leave a coded middle after the artifact's raw sinks and window,
    and with the `continuation` scored after it fit the model's context."""
    manifest: dict = {}
    if model is None or prefix is not None:
        from kvtc.artifacts.registry import Registry  # noqa: PLC0415 - pyarrow: only where a manifest is read

        reg = Registry(registry)
        name, version = split_ref(ref)
        manifest = reg.read_manifest(name, *reg.resolve_pinned(name, version))
    spec = model if model is not None else (manifest.get("model") or {}).get("spec")
    facts = check_model_spec(spec) if isinstance(spec, str) else None
    if prefix is None:
        return
    cal = manifest.get("calibration") or {}
    raw = int(cal.get("sinks") or 0) + int(cal.get("window") or 0)
    if prefix <= raw:
        raise ValueError(f"--prefix {prefix} leaves nothing to code: the artifact keeps {cal.get('sinks')} sink and "
                         f"{cal.get('window')} window tokens raw; use --prefix {raw + 1} or more")
    context = facts.context if facts is not None else None
    if context is not None and prefix + continuation + 1 > context:
        raise ValueError(f"--prefix {prefix} with --continuation {continuation} needs {prefix + continuation + 1} "
                         f"positions, beyond model {spec}'s limit of {context}: lower --prefix to at most "
                         f"{context - continuation - 1}")


def check_recalibration(target: str, given: dict) -> None:
    """`kvtc recalibrate`: the parent's recorded settings (validated naming the manifest field) with the options
    `given`, checked as a calibration's (`check_calibration`) before anything loads."""
    from kvtc.artifacts.registry import Registry  # noqa: PLC0415 - pyarrow: only where a manifest is read

    reg = Registry(given.get("registry"))
    name, version = split_ref(target)
    manifest = reg.read_manifest(name, *reg.resolve_pinned(name, version))
    cfg = settings_from_manifest(manifest)
    check_calibration(cfg.replace(**{k: v for k, v in given.items() if k != "name"}))


def _check_positions(seq_len: int | None, capture: CaptureSettings) -> None:
    if seq_len is not None and seq_len <= capture.sinks + capture.window:
        raise ValueError(f"seq_len {seq_len} leaves no position after excluding sinks={capture.sinks} and "
                         f"window={capture.window}; use seq_len > {capture.sinks + capture.window}")
