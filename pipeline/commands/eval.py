"""`kvtc eval NAME[@REF]`: its options, its handler and the tables it prints. The evaluation is
kvtc.pipeline.operations.quality (model quality with compressed caches; with --tasks the retrieval task suite,
`run_tasks`), imported by the handler once the options are checked."""
from __future__ import annotations

import argparse
import json
import os
import sys

from kvtc.pipeline.commands import module_doc
from kvtc.pipeline.evaluation.eval_settings import BASELINES  # light: no torch
from kvtc.pipeline.evaluation.tasks import TASKS  # light: no torch

TASK_PATHS = ("offline", "chunk", "cache")  # kvtc.pipeline.evaluation.task_suite.PATHS

OPERATION = "kvtc.pipeline.operations.quality"


def _handler(args: argparse.Namespace) -> int:
    if args.tasks is not None:
        return _tasks_handler(args)
    from kvtc.pipeline.checks.header import check_artifact_model

    check_artifact_model(args.artifact, args.registry, args.model, args.prefix, args.continuation)  # before torch loads
    from kvtc.pipeline.evaluation.report import limit_table, quality_table
    from kvtc.pipeline.operations.quality import EvalSettings, run

    try:
        ratios = tuple(float(x) for x in args.ratios.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--ratios must be comma-separated numbers, got {args.ratios!r}") from None
    base = () if args.baselines == "none" else BASELINES if args.baselines == "all" else tuple(args.baselines.split(","))
    settings = EvalSettings(ratios=ratios, continuation=args.continuation, sequences=args.sequences, baselines=base,
                            mode=args.mode, prefix=args.prefix)
    result = run(args.artifact, args.registry, settings, args.corpus, args.model, args.dtype,
                 progress=lambda msg: print(f"kvtc eval: {msg}", file=sys.stderr))
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
    else:
        print(f"{result['artifact']} on {result['corpus']}: {result['settings']['sequences']} sequences, "
              f"{settings.continuation} tokens scored each after {result['settings']['prefix']} prefix tokens; bytes "
              "are per middle token (both streams)\n")
        print(quality_table(result["rows"]))
        print()
        print(limit_table(result["limit"]))
    return 0


def _numbers(text: str, flag: str, kind: type) -> tuple:
    try:
        values = tuple(kind(x) for x in text.split(",") if x.strip())
    except ValueError:
        what = "integers" if kind is int else "numbers"
        raise ValueError(f"{flag} must be comma-separated {what}, got {text!r}") from None
    if not values:
        raise ValueError(f"{flag} is empty, got {text!r}")
    return values


def task_settings(args: argparse.Namespace) -> tuple:
    """`kvtc eval --tasks`'s options checked before anything heavy loads (torch is not imported): the task
    names, lengths and depths, the ratios and paths, the chart path, the model's context (its GGUF header or
    config, `model_facts`) and the haystack's text -> (TaskSettings, ratios, paths). ValueError names the value."""
    from kvtc.artifacts.names import split_ref
    from kvtc.artifacts.registry import Registry
    from kvtc.pipeline.evaluation.tasks import (DEFAULT_HAYSTACK, HAYSTACK_TASKS, HELDOUT_HAYSTACK, TaskSettings,
                                                pydoc_texts)
    from kvtc.pipeline.job.corpus import iter_documents
    from kvtc.workers.model_limits import model_facts

    tasks = tuple(t.strip() for t in args.tasks.split(",") if t.strip())
    depths = None if args.depths is None else _numbers(args.depths, "--depths", float)
    settings = TaskSettings(tasks=tasks, lengths=_numbers(args.lengths, "--lengths", int), samples=args.samples,
                            depths=depths, seed=args.seed)
    ratios = _numbers(args.ratios, "--ratios", float)
    paths = tuple(p.strip() for p in args.paths.split(",") if p.strip())
    bad = [p for p in paths if p not in TASK_PATHS]
    if bad or not paths:
        raise ValueError(f"unknown path {bad[0] if bad else '(none)'!r} in --paths; choose from {','.join(TASK_PATHS)}")
    if args.chart is not None and os.path.isdir(args.chart):
        raise ValueError(f"--chart {args.chart} is a directory; give the PNG file to write")
    reg = Registry(args.registry)
    name, version = split_ref(args.artifact)
    manifest = reg.read_manifest(name, *reg.resolve_pinned(name, version))
    have = (manifest.get("calibration") or {}).get("ratios")
    for r in ratios:
        if have and float(r) not in {float(x) for x in have}:
            raise ValueError(f"ratio {r:g} in --ratios: {args.artifact} holds ratios {','.join(f'{x:g}' for x in have)}")
    spec = args.model or (manifest.get("model") or {}).get("spec")
    if isinstance(spec, str):
        settings.check_context(model_facts(spec).context, spec)
    source = args.haystack or DEFAULT_HAYSTACK
    if source == HELDOUT_HAYSTACK:
        corpus = manifest.get("corpus") or {}
        held = sum(int((corpus.get("tokens") or {}).get(s, 0)) for s in corpus.get("heldout_shards") or ())
        if held < max(settings.lengths) and set(settings.tasks) & set(HAYSTACK_TASKS):
            raise ValueError(f"length {max(settings.lengths)}: --haystack heldout: {args.artifact} held out "
                             f"{held} tokens of its corpus, fewer than a prompt needs; use a shorter length or "
                             "another --haystack")
        return settings, ratios, paths
    texts = pydoc_texts() if source == DEFAULT_HAYSTACK else (d.text for d in iter_documents(source))
    settings.check_supply(texts, source)
    return settings, ratios, paths


def _tasks_handler(args: argparse.Namespace) -> int:
    settings, ratios, paths = task_settings(args)  # refused here, before torch loads
    from kvtc.pipeline.evaluation.task_suite import task_chart, task_table
    from kvtc.pipeline.operations.quality import run_tasks

    result = run_tasks(args.artifact, args.registry, settings, ratios, paths, args.haystack, args.model, args.dtype,
                       args.mode, progress=True if args.progress else None, all_cells=args.all_cells)
    if args.chart:
        os.makedirs(os.path.dirname(os.path.abspath(args.chart)), exist_ok=True)
        with open(args.chart, "wb") as f:
            f.write(task_chart(result["rows"], result["artifact"]))
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
        return 0
    print(f"{result['artifact']} ({result['model']}) on {result['haystack']}: {settings.samples} samples per task "
          f"and length, greedy answers from the raw cache and through {', '.join(result['settings']['paths'])}"
          + ("" if args.all_cells else " where the raw model can do the cell (raw >= 50%; --all-cells: every cell)")
          + "\n")
    print(task_table(result["rows"]))
    if args.chart:
        print(f"\nchart: {args.chart}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="model quality with compressed caches, and baselines at equal bytes",
                       description=module_doc(OPERATION), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("artifact", help="NAME[@REF] (default ref: latest)")
    p.add_argument("--registry", default=None, help="registry root: a path or fsspec URI (default $KVTC_REGISTRY or ./registry)")
    p.add_argument("--corpus", default=None, help="text to score (default: the calibration's held-out shards)")
    p.add_argument("--ratios", default="8,16,32", help="codec ratios, comma separated (default 8,16,32)")
    p.add_argument("--continuation", type=int, default=64, help="tokens scored per sequence (default 64)")
    p.add_argument("--sequences", type=int, default=4, help="held-out sequences (default 4)")
    p.add_argument("--prefix", type=int, default=None,
                   help="prefix tokens scored after (default: the calibration's --seq-len); longer prefixes read long "
                        "windows of the text, up to the model's context")
    p.add_argument("--baselines", default="all", help=f"all (default), none, or a comma list of {','.join(BASELINES)}")
    p.add_argument("--model", default=None, help="model spec (default: the one the artifact was calibrated on)")
    p.add_argument("--dtype", default=None, help="float32 (CPU default), bfloat16 or float16")
    p.add_argument("--mode", choices=("ecsq", "fixed"), default=None,
                   help="codec mode: ecsq (entropy-coded; the default where the artifact has its tables) or fixed")
    p.add_argument("--json", action="store_true", help="print a machine-readable result")
    t = p.add_argument_group("retrieval tasks (--tasks: the task suite instead of perplexity)")
    t.add_argument("--tasks", default=None, help=f"comma list of {','.join(TASKS)}: generated long-context "
                   "retrieval tasks decoded through the raw cache and each served path")
    t.add_argument("--lengths", default="1024,2048", help="prompt lengths in tokens, comma separated (default 1024,2048)")
    t.add_argument("--samples", type=int, default=8, help="samples per task and length (default 8)")
    t.add_argument("--depths", default=None, help="needle depths in [0,1], comma separated, taken in turn (default: "
                   "spread evenly over the samples)")
    t.add_argument("--seed", type=int, default=0, help="the task generator's seed (default 0)")
    t.add_argument("--haystack", default=None, help="the text the needles hide in: heldout (the artifact's held-out "
                   "text, which its calibration never saw), or a corpus spec (default: pydoc, Python's documentation "
                   "prose)")
    t.add_argument("--paths", default=",".join(TASK_PATHS), help="served paths: offline (KVTCCodec), chunk (as "
                   "kvtc lmcache-server stores it), cache (the live KVTCCache); default all")
    t.add_argument("--all-cells", action="store_true", help="code every cell through the paths, also where the raw "
                   "model is below 50%% (default: such cells show the raw cache only)")
    t.add_argument("--chart", default=None, help="write accuracy against context length here (PNG)")
    t.add_argument("--progress", action="store_true", help="a progress bar even when stderr is not a terminal")
    p.set_defaults(func=_handler)
