"""`python -m kvtc.pipeline.calibrate_job ARGS`: `kvtc calibrate ARGS` as a module, for `ray job submit`
(a cluster's Python runs it whether or not the `kvtc` script is on its PATH). An entry point: nothing
imports it.

The arguments are parsed and checked before the job is imported: the `kvtc` parser is light
(kvtc.pipeline.commands), the shared checks run next (kvtc.pipeline.checks.words) and the settings are
built (and refused) by the calibrate handler before it imports kvtc.pipeline.job.calibrate, torch and
Ray; so a bad argument exits 2 in well under a second, not after the job's imports.
"""
from __future__ import annotations

import sys

from kvtc.pipeline.cli import main as cli_main


def main(argv: list[str] | None = None) -> int:
    return cli_main(["calibrate", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
