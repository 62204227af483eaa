"""`kvtc report NAME[@REF]`: its options and its handler, which writes the charts and report.md that
kvtc.pipeline.evaluation.report builds from a pulled artifact (imported by the handler: matplotlib)."""
from __future__ import annotations

import argparse
import json
import sys

from kvtc.pipeline.commands import module_doc

BUILDER = "kvtc.pipeline.evaluation.report"
QUALITY_LIMIT = 64 << 20  # a `kvtc eval --json` result: tables of a few thousand numbers


def _handler(args: argparse.Namespace) -> int:
    from kvtc.artifacts.local_files import write_outputs
    from kvtc.artifacts.pull import pull
    from kvtc.artifacts.safe_io import read_limited
    from kvtc.artifacts.names import check_name
    from kvtc.pipeline.evaluation import report

    ref = args.artifact if "@" in args.artifact else f"{args.artifact}@latest"
    art = pull(ref, registry=args.registry)
    quality = None
    if args.quality:
        quality = json.loads(read_limited(None, True, args.quality, QUALITY_LIMIT, "--quality file", links="follow"))
    out = args.out or f"kvtc-report-{check_name('artifact name', art.name)}-{check_name('version', art.version)}"
    for path in write_outputs(out, report.build_from_artifact(art, quality)):  # whole, never through a planted link
        print(path)
    print(f"kvtc report: wrote {out}", file=sys.stderr)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="diagnostic charts and report.md of an artifact", description=module_doc(BUILDER),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("artifact", help="NAME[@REF] (default ref: latest)")
    p.add_argument("--registry", default=None, help="registry root: a path or fsspec URI (default $KVTC_REGISTRY or ./registry)")
    p.add_argument("--out", default=None, help="output directory (default ./kvtc-report-NAME-VERSION)")
    p.add_argument("--quality", default=None, help="a `kvtc eval --json` result to add as a table")
    p.set_defaults(func=_handler)
