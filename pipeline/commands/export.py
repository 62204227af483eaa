"""`kvtc export NAME[@REF] --ratio R --to DIR`: one ratio of an artifact for a runtime, Dynamo (KVBM's
KvtcConfig arrays and JSON, kvtc.artifacts.export) or SGLang (its KVTC loader's per-rank file,
kvtc.artifacts.export_sglang); the exporters load inside the handler.
"""
from __future__ import annotations

import argparse
import json

from kvtc.pipeline.commands import with_one_line_warnings
from kvtc.pipeline.commands.registry import REF_HELP, print_result, registry, registry_options


def cmd_export(args: argparse.Namespace) -> int:
    from kvtc.artifacts.pull import pull

    artifact = pull(args.ref, registry=registry(args), cache_dir=args.cache_dir)
    if args.format == "sglang":
        from kvtc.artifacts.export_sglang import export_sglang

        partition = None
        if args.pp_partition:
            try:
                partition = tuple(int(v) for v in args.pp_partition.split(","))
            except ValueError:
                raise ValueError(f"--pp-partition must be layers per stage, e.g. 16,16; got {args.pp_partition!r}") from None
        path = export_sglang(artifact, args.ratio, args.to, tp=args.tp, pp=args.pp, pp_partition=partition)
        doc = json.loads(path.with_suffix(".json").read_text())
        workers = ", ".join(f"{w['worker']} {w['sglang_ratio']}x" for w in doc["workers"])
        return print_result(args, {"name": artifact.name, "version": artifact.version, "ratio": args.ratio,
                                   "path": str(path), "sglang_ratio": doc["sglang_ratio"], "tp": doc["tp"], "pp": doc["pp"],
                                   "workers": doc["workers"]},
                            f"{path}\nratio {args.ratio:g} as allocated; {doc['sglang_ratio']}x with SGLang's "
                            f"fp16 scale and offset per quantized group per token; serve at --tp {doc['tp']} "
                            f"--pp {doc['pp']}: {workers}")
    from kvtc.artifacts.export import DynamoExportOptions, export_dynamo

    options = DynamoExportOptions(fp8=args.fp8, layout=args.layout, allow_rope_removed=args.allow_rope_removed,
                                  ranges=args.ranges, batch=args.batch, tokens_per_block=args.tokens_per_block,
                                  max_projection_mb=args.max_projection_mb, tp=args.tp)
    path = export_dynamo(artifact, args.ratio, args.to, options)
    doc = json.loads(path.read_text())
    real = doc["dynamo_ratio"]
    return print_result(args, {"name": artifact.name, "version": artifact.version, "ratio": args.ratio, "path": str(path),
                               "dynamo_ratio": real, "dynamo_bytes_per_token": doc["dynamo_bytes_per_token"]},
                        f"{path}\nratio {args.ratio:g} as allocated; {real}x ({doc['dynamo_bytes_per_token']} bytes per "
                        f"token per rank) with Dynamo's 64-bit min/max per range per row ({args.layout} rows), per-row "
                        f"byte padding and 40-byte range headers per {args.batch}-row call; "
                        f"TP {doc['tensor_parallel']['tp']}")


def register(sub: argparse._SubParsersAction) -> None:
    """Add `kvtc export` to the `kvtc` parser."""
    p = sub.add_parser("export", parents=[registry_options()], help="export one ratio for a runtime (dynamo, sglang)")
    p.add_argument("ref", help=REF_HELP)
    p.add_argument("--ratio", type=float, required=True, help="compression ratio to export")
    p.add_argument("--format", choices=["dynamo", "sglang"], default="dynamo",
                   help="dynamo (KVBM KvtcConfig arrays + JSON) or sglang (its KVTC loader's per-rank file)")
    p.add_argument("--to", required=True, help="output directory")
    p.add_argument("--fp8", choices=["int8", "refuse"], default="int8",
                   help="scaled fp8 blocks: export as 8-bit IntX (default) or refuse (Dynamo's Fp8 has no scale)")
    p.add_argument("--layout", choices=["block", "token", "token-major"], default="block",
                   help="dynamo: what a row is: block (default; one KVBM block region of a layer's K or V, "
                   "--tokens-per-block tokens), token (one token of one layer: a pointer per token), token-major "
                   "(one token over a group's layers); block and token need per-layer groups")
    p.add_argument("--tokens-per-block", type=int, default=16,
                   help="dynamo --layout block: tokens per KV block (the engine's block size, KVBM's page_size)")
    p.add_argument("--max-projection-mb", type=float, default=1024.0,
                   help="dynamo --layout block: refuse a projection file larger than this")
    p.add_argument("--allow-rope-removed", action="store_true",
                   help="export a RoPE-removed key basis (the consumer removes and re-applies RoPE itself)")
    p.add_argument("--ranges", choices=["pad", "refuse"], default="pad",
                   help="dynamo: a range whose width x bits is not whole bytes per row: pad it with zero columns "
                   "(default) or refuse (Dynamo's buffer sizing would be overrun)")
    p.add_argument("--batch", type=int, default=256, help="dynamo: rows per compress call, for the real ratio")
    p.add_argument("--tp", type=int, default=None, help="the tensor-parallel size you serve at; must be the artifact's "
                   "(kvtc calibrate --tp N); default: the artifact's")
    p.add_argument("--pp", type=int, default=1, help="sglang: pipeline stages (one worker entry per rank and stage)")
    p.add_argument("--pp-partition", default=None, help="sglang: layers per stage, as SGLANG_PP_LAYER_PARTITION "
                   "(default: SGLang's even split)")
    p.add_argument("--cache-dir", help="cache directory (default $KVTC_CACHE or ~/.cache/kvtc)")
    p.set_defaults(func=with_one_line_warnings("export", cmd_export))
