"""`kvtc list | show | pull | verify | alias | export`: the registry from the command line.

Every command takes --registry URI (default $KVTC_REGISTRY or ./registry) and --json.
Only argparse/json are imported here; the artifact modules load inside the handlers.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile


def _print(args: argparse.Namespace, data: object, text: str) -> int:
    print(json.dumps(data, indent=2, sort_keys=True) if args.json else text)
    return 0


def _registry(args: argparse.Namespace):
    from kvtc.artifacts.registry import Registry

    return Registry(args.registry)


def cmd_list(args: argparse.Namespace) -> int:
    reg = _registry(args)
    if not args.name:
        names = {n: {"versions": len(reg.versions(n)), "aliases": reg.aliases(n)} for n in reg.names()}
        lines = [f"{n}  {v['versions']} version(s)  latest={v['aliases'].get('latest', '-')}" for n, v in names.items()]
        return _print(args, names, "\n".join(lines) or f"(no artifacts in {reg.uri})")
    aliases = reg.aliases(args.name)
    rows = [{"version": v, "created": reg.read_manifest(args.name, v)["created"],
             "aliases": sorted(a for a, t in aliases.items() if t == v)} for v in reg.versions(args.name)]
    rows.sort(key=lambda r: (r["created"], r["version"]))
    lines = [f"{r['version']}  {r['created']}  {' '.join(r['aliases'])}".rstrip() for r in rows]
    return _print(args, rows, "\n".join(lines) or f"(no versions of {args.name})")


def cmd_show(args: argparse.Namespace) -> int:
    from kvtc.artifacts.registry import split_ref

    reg = _registry(args)
    name, ref = split_ref(args.ref)
    manifest = reg.read_manifest(name, reg.resolve(name, ref))
    cal, model = manifest["calibration"], manifest["model"]
    text = "\n".join([
        f"{manifest['name']}@{manifest['version']}  created {manifest['created']}  parent {manifest.get('parent') or '-'}",
        f"model: {model.get('spec')}  layers {model.get('num_layers')}  kv heads {model.get('num_kv_heads')}  "
        f"head_dim {model.get('head_dim')}",
        f"calibration: sinks {cal['sinks']}  window {cal['window']}  seq_len {cal['seq_len']}  tokens {cal['tokens']}  "
        f"groups {cal['groups']}  ratios {cal['ratios']}",
        f"corpus: {manifest['corpus'].get('spec')}",
        "bases: " + ", ".join(f"{e['stream']}/g{e['group']} p={e['p']} k={e['k']}" for e in manifest["bases"]["entries"]),
        f"curves: {', '.join(manifest.get('curves', {})) or '-'}  extras: {', '.join(manifest.get('extras', [])) or '-'}",
        f"code {manifest['code_version']}  kernels {manifest.get('kernel_bundle_hash')}  files {len(manifest['files'])}",
    ])
    return _print(args, manifest, text)


def cmd_pull(args: argparse.Namespace) -> int:
    from kvtc.artifacts.pull import copy_to, pull

    artifact = pull(args.ref, registry=_registry(args), cache_dir=args.cache_dir)
    path = copy_to(artifact, args.to) if args.to else artifact.path
    return _print(args, {"name": artifact.name, "version": artifact.version, "path": str(path)}, str(path))


def cmd_verify(args: argparse.Namespace) -> int:
    from kvtc.artifacts.pull import pull

    with tempfile.TemporaryDirectory(prefix="kvtc-verify-") as scratch:
        artifact = pull(args.ref, registry=_registry(args), cache_dir=scratch)
        n = len(artifact.manifest["files"])
        data = {"name": artifact.name, "version": artifact.version, "files": n, "ok": True}
        return _print(args, data, f"ok: {artifact.name}@{artifact.version}, {n} files match their sha256 and size")


def cmd_alias(args: argparse.Namespace) -> int:
    from kvtc.artifacts.registry import split_ref

    reg = _registry(args)
    name, ref = split_ref(args.ref)
    version = reg.resolve(name, ref)
    reg.set_alias(name, args.alias, version)
    return _print(args, {"name": name, "alias": args.alias, "version": version}, f"{name}@{args.alias} -> {version}")


def cmd_export(args: argparse.Namespace) -> int:
    from kvtc.artifacts.export import DynamoExportOptions, export_dynamo
    from kvtc.artifacts.pull import pull

    options = DynamoExportOptions(fp8=args.fp8, layout=args.layout, allow_rope_removed=args.allow_rope_removed)
    artifact = pull(args.ref, registry=_registry(args), cache_dir=args.cache_dir)
    path = export_dynamo(artifact, args.ratio, args.to, options)
    real = json.loads(path.read_text())["dynamo_ratio"]
    return _print(args, {"name": artifact.name, "version": artifact.version, "ratio": args.ratio, "path": str(path),
                         "dynamo_ratio": real},
                  f"{path}\nratio {args.ratio:g} as allocated; {real}x with Dynamo's 64-bit min/max per range per row")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the registry commands to the `kvtc` parser."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--registry", default=None, help="registry root: path or fsspec URI (default $KVTC_REGISTRY or ./registry)")
    common.add_argument("--json", action="store_true", help="machine-readable output")
    ref_help = "NAME, NAME@VERSION or NAME@ALIAS (default alias: latest)"
    p = subparsers.add_parser("list", parents=[common], help="list artifacts, or the versions of one")
    p.add_argument("name", nargs="?", help="artifact name")
    p.set_defaults(func=cmd_list)
    p = subparsers.add_parser("show", parents=[common], help="summarise a version's manifest")
    p.add_argument("ref", help=ref_help)
    p.set_defaults(func=cmd_show)
    p = subparsers.add_parser("pull", parents=[common], help="fetch and verify a version into the cache")
    p.add_argument("ref", help=ref_help)
    p.add_argument("--to", help="also copy the verified folder here")
    p.add_argument("--cache-dir", help="cache directory (default $KVTC_CACHE or ~/.cache/kvtc)")
    p.set_defaults(func=cmd_pull)
    p = subparsers.add_parser("verify", parents=[common], help="check every file of a version against its manifest")
    p.add_argument("ref", help=ref_help)
    p.set_defaults(func=cmd_verify)
    p = subparsers.add_parser("alias", parents=[common], help="point an alias (production, ...) at a version")
    p.add_argument("ref", help=ref_help)
    p.add_argument("alias", help="alias name")
    p.set_defaults(func=cmd_alias)
    p = subparsers.add_parser("export", parents=[common], help="export one ratio for a runtime (dynamo)")
    p.add_argument("ref", help=ref_help)
    p.add_argument("--ratio", type=float, required=True, help="compression ratio to export")
    p.add_argument("--format", choices=["dynamo"], default="dynamo", help="target runtime format")
    p.add_argument("--to", required=True, help="output directory")
    p.add_argument("--fp8", choices=["int8", "refuse"], default="int8",
                   help="scaled fp8 blocks: export as 8-bit IntX (default) or refuse (Dynamo's Fp8 has no scale)")
    p.add_argument("--layout", choices=["paged", "token-major"], default="paged",
                   help="paged (default): only per-layer groups; token-major: all layers of a token contiguous")
    p.add_argument("--allow-rope-removed", action="store_true",
                   help="export a RoPE-removed key basis (the consumer removes and re-applies RoPE itself)")
    p.add_argument("--cache-dir", help="cache directory (default $KVTC_CACHE or ~/.cache/kvtc)")
    p.set_defaults(func=cmd_export)


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (`python -m artifacts.cli`), same error handling as `kvtc`."""
    parser = argparse.ArgumentParser(prog="kvtc")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, PermissionError, RuntimeError) as exc:
        print(f"kvtc {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
