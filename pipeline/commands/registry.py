"""`kvtc list | show | pull | verify | alias | sign | keygen`: the registry from the command line
(`kvtc export` is kvtc.pipeline.commands.export).

Every registry command takes --registry URI (default $KVTC_REGISTRY or ./registry) and --json.
Only argparse/json are imported here; the artifact modules (pyarrow, fsspec) load inside the handlers.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile

from kvtc.pipeline.commands import with_one_line_warnings

REF_HELP = "NAME, NAME@VERSION, NAME@ALIAS or NAME@sha256:HEX (default alias: latest)"


def registry_options() -> argparse.ArgumentParser:
    """The parent parser of every registry command: --registry and --json."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--registry", default=None, help="registry root: path or fsspec URI (default $KVTC_REGISTRY or ./registry)")
    common.add_argument("--json", action="store_true", help="machine-readable output")
    return common


def print_result(args: argparse.Namespace, data: object, text: str) -> int:
    """`data` as JSON with --json, else `text`; exit code 0."""
    print(json.dumps(data, indent=2, sort_keys=True) if args.json else text)
    return 0


def registry(args: argparse.Namespace):
    """The kvtc.artifacts.registry.Registry that --registry names."""
    from kvtc.artifacts.registry import Registry

    return Registry(args.registry)


def cmd_list(args: argparse.Namespace) -> int:
    import os

    reg = registry(args)
    if reg.local and not os.path.isdir(reg.root):  # a typo lists nothing: refused, not "(no artifacts)"
        raise FileNotFoundError(f"registry {reg.uri} does not exist (a local path with no folder there); pass the "
                                "registry's path with --registry or $KVTC_REGISTRY")
    if not args.name:
        names = {}
        for n in reg.names():
            names[n] = {"versions": len(reg.versions(n)), "aliases": {}}
            try:
                names[n]["aliases"] = reg.aliases(n)
            except (ValueError, OSError, RuntimeError) as exc:  # one bad alias must not hide the other artifacts
                names[n]["error"] = str(exc)
        lines = [f"{n}  {v['versions']} version(s)  latest={v['aliases'].get('latest', '-')}"
                 + (f"  UNREADABLE ALIASES: {v['error']}" if "error" in v else "") for n, v in names.items()]
        return print_result(args, names, "\n".join(lines) or f"(no artifacts in {reg.uri})")
    try:
        aliases = reg.aliases(args.name)
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"kvtc list: warning: {exc}", file=sys.stderr)
        aliases = {}
    rows = []
    for v in reg.versions(args.name):
        row = {"version": v, "created": "", "aliases": sorted(a for a, t in aliases.items() if t == v)}
        try:
            row["created"] = reg.read_manifest(args.name, v)["created"]
        except (ValueError, OSError, RuntimeError) as exc:  # one bad version must not hide the others
            row["error"] = str(exc)
        rows.append(row)
    rows.sort(key=lambda r: (r["created"], r["version"]))
    lines = [f"{r['version']}  {r['created'] or 'UNREADABLE: ' + r.get('error', '')}  {' '.join(r['aliases'])}".rstrip()
             for r in rows]
    return print_result(args, rows, "\n".join(lines) or f"(no versions of {args.name})")


def cmd_show(args: argparse.Namespace) -> int:
    from kvtc.artifacts.calibration import CalibrationRecord
    from kvtc.artifacts.groups import groups_json
    from kvtc.artifacts.names import split_ref

    reg = registry(args)
    name, ref = split_ref(args.ref)
    manifest = reg.read_manifest(name, *reg.resolve_pinned(name, ref))
    cal, model = CalibrationRecord.from_manifest(manifest), manifest["model"]
    text = "\n".join([
        f"{manifest['name']}@{manifest['version']}  created {manifest['created']}  parent {manifest.get('parent') or '-'}",
        f"model: {model.get('spec')}  layers {model.get('num_layers')}  kv heads {model.get('num_kv_heads')}  "
        f"head_dim {model.get('head_dim')}",
        f"calibration: sinks {cal.sinks}  window {cal.window}  seq_len {cal.seq_len}  tokens {cal.tokens}  "
        f"groups {groups_json(cal.groups)}  ratios {list(cal.ratios)}  keys {cal.keys}",
        f"corpus: {manifest['corpus'].get('spec')}",
        "bases: " + ", ".join(f"{e['stream']}/g{e['group']} p={e['p']} k={e['k']}" for e in manifest["bases"]["entries"]),
        f"curves: {', '.join(manifest.get('curves', {})) or '-'}  extras: {', '.join(manifest.get('extras', [])) or '-'}",
        f"code {manifest['code_version']}  kernels {manifest.get('kernel_bundle_hash')}  files {len(manifest['files'])}",
    ])
    return print_result(args, manifest, text)


def cmd_pull(args: argparse.Namespace) -> int:
    from kvtc.artifacts.pull import copy_to, pull

    artifact = pull(args.ref, registry=registry(args), cache_dir=args.cache_dir, public_key=args.key,
                    require_signature=args.require_signature or None)
    path = copy_to(artifact, args.to) if args.to else artifact.path
    return print_result(args, {"name": artifact.name, "version": artifact.version, "path": str(path)}, str(path))


def cmd_verify(args: argparse.Namespace) -> int:
    from kvtc.artifacts.errors import IntegrityError
    from kvtc.artifacts.manifest import SIGNATURE_FILE
    from kvtc.artifacts.pull import pull

    reg = registry(args)
    adopted = None
    if args.adopt:
        from kvtc.artifacts.names import split_ref

        name, ref = split_ref(args.ref)
        version = reg.resolve(name, ref)
        adopted = reg.adopt(name, version)
    try:
        with tempfile.TemporaryDirectory(prefix="kvtc-verify-") as scratch:
            artifact = pull(args.ref, registry=reg, cache_dir=scratch, public_key=args.key,
                            require_signature=args.require_signature or None)
            artifact.allocations()  # their budgets against the manifest's joint split (bit_split.check_table_budgets)
            artifact.ecsq_tables()
    except Exception:
        if adopted:
            reg.fs.rm_file(f"{reg.version_path(name, version)}/manifest.sha256")  # adopt only what verifies
        raise
    if artifact.damaged:
        raise IntegrityError(f"{artifact.name}@{artifact.version}: optional files fail their sha256 check: "
                             f"{', '.join(artifact.damaged)} (decoding does not need them)")
    n = len(artifact.manifest["files"])
    unlisted = reg.unlisted(artifact.name, artifact.version, artifact.manifest)
    digest = artifact.digest
    has_signature = (artifact.path / SIGNATURE_FILE).is_file()
    signed = "signature checked" if artifact.signed_by else \
        "signature not checked (pass --key or set $KVTC_PUBLIC_KEY)" if has_signature else "unsigned"
    data = {"name": artifact.name, "version": artifact.version, "digest": digest, "files": n, "ok": True,
            "signature": signed, "signed_by": artifact.signed_by, "unlisted": unlisted}
    key = f" (key {artifact.signed_by[:16]})" if artifact.signed_by else ""
    text = f"ok: {artifact.name}@{artifact.version} ({digest}), {n} files match their sha256 and size; {signed}{key}"
    if unlisted:
        text += f"\nwarning: {len(unlisted)} file(s) not in the manifest, ignored by pull: {', '.join(unlisted)}"
    return print_result(args, data, text)


def cmd_sign(args: argparse.Namespace) -> int:
    from kvtc.artifacts.names import split_ref

    reg = registry(args)
    name, ref = split_ref(args.ref)
    version = reg.resolve(name, ref)
    key_id = reg.sign(name, version, args.key)
    return print_result(args, {"name": name, "version": version, "key_id": key_id}, f"signed {name}@{version} (key {key_id[:16]})")


def cmd_keygen(args: argparse.Namespace) -> int:
    from kvtc.artifacts.signing import generate_keypair

    private, public = generate_keypair(args.out)
    return print_result(args, {"private": str(private), "public": str(public)},
                        f"private key {private} (keep it secret; mode 0600)\npublic key {public} (give it to servers: --key)")


def cmd_alias(args: argparse.Namespace) -> int:
    from kvtc.artifacts.names import split_ref

    reg = registry(args)
    name, ref = split_ref(args.ref)
    version = reg.resolve(name, ref)
    reg.set_alias(name, args.alias, version)
    return print_result(args, {"name": name, "alias": args.alias, "version": version}, f"{name}@{args.alias} -> {version}")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the registry commands to the `kvtc` parser."""
    common = registry_options()
    p = subparsers.add_parser("list", parents=[common], help="list artifacts, or the versions of one")
    p.add_argument("name", nargs="?", help="artifact name")
    p.set_defaults(func=with_one_line_warnings("list", cmd_list))
    p = subparsers.add_parser("show", parents=[common], help="summarise a version's manifest")
    p.add_argument("ref", help=REF_HELP)
    p.set_defaults(func=with_one_line_warnings("show", cmd_show))
    signed = argparse.ArgumentParser(add_help=False)
    signed.add_argument("--key", default=None, help="Ed25519 public key (PEM) to check the signature with "
                        "(default $KVTC_PUBLIC_KEY)")
    signed.add_argument("--require-signature", action="store_true", help="refuse a version without a valid signature")
    p = subparsers.add_parser("pull", parents=[common, signed], help="fetch and verify a version into the cache")
    p.add_argument("ref", help=REF_HELP)
    p.add_argument("--to", help="also copy the verified folder here")
    p.add_argument("--cache-dir", help="cache directory (default $KVTC_CACHE or ~/.cache/kvtc)")
    p.set_defaults(func=with_one_line_warnings("pull", cmd_pull))
    p = subparsers.add_parser("verify", parents=[common, signed],
                              help="check a version's manifest digest, every file, the kernel bundle and the signature")
    p.add_argument("ref", help=REF_HELP)
    p.add_argument("--adopt", action="store_true", help="record the manifest digest of a version published before "
                   "digests existed, if all its files verify (trust on first use)")
    p.set_defaults(func=with_one_line_warnings("verify", cmd_verify))
    p = subparsers.add_parser("alias", parents=[common], help="point an alias (production, ...) at a version")
    p.add_argument("ref", help=REF_HELP)
    p.add_argument("alias", help="alias name")
    p.set_defaults(func=with_one_line_warnings("alias", cmd_alias))
    p = subparsers.add_parser("sign", parents=[common], help="sign a published version's manifest (Ed25519)")
    p.add_argument("ref", help=REF_HELP)
    p.add_argument("--key", required=True, help="Ed25519 private key (PEM, e.g. from `kvtc keygen`)")
    p.set_defaults(func=with_one_line_warnings("sign", cmd_sign))
    p = subparsers.add_parser("keygen", help="write an Ed25519 key pair for signing artifacts")
    p.add_argument("--out", required=True, help="path prefix: writes PREFIX.pem (private) and PREFIX.pub.pem")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=with_one_line_warnings("keygen", cmd_keygen))
