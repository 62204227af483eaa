"""`kvtc schedule (--cron EXPR | --every SECONDS) -- COMMAND ...`: its options and its handler, which runs
the scheduler of kvtc.pipeline.operations.schedule until it stops (SIGTERM/SIGINT or --max-runs)."""
from __future__ import annotations

import argparse
import signal
import sys
import time

from kvtc.pipeline.commands import module_doc

OPERATION = "kvtc.pipeline.operations.schedule"


def _handler(args: argparse.Namespace) -> int:
    from kvtc.pipeline.operations.schedule import Schedule, Scheduler, command_job, parse_command

    schedule = Schedule(cron=args.cron, every=args.every)
    command = parse_command(args.command, args.kvtc_parser())  # the CLI's own entry points (kvtc.pipeline.cli)
    scheduler = Scheduler(schedule, command_job(command, args.kvtc_main if args.in_process else None, args.timeout),
                          args.max_runs)
    previous = {sig: signal.signal(sig, scheduler.stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    print(f"kvtc schedule: `kvtc {' '.join(command)}` {'every ' + str(args.every) + ' s' if args.every else 'at ' + repr(args.cron)}"
          f"; next run at {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(schedule.next_after(time.time())))}",
          file=sys.stderr, flush=True)
    try:
        runs = scheduler.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return runs[-1]["rc"] if runs else 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("schedule", help="run a kvtc command on a cron schedule (long-running)",
                       description=module_doc(OPERATION), formatter_class=argparse.RawDescriptionHelpFormatter)
    when = p.add_mutually_exclusive_group(required=True)
    when.add_argument("--cron", default=None, help="cron expression: 5 fields, or 6 with leading seconds")
    when.add_argument("--every", type=float, default=None, metavar="SECONDS", help="fire every SECONDS seconds")
    p.add_argument("--max-runs", type=int, default=None, help="exit after this many runs (default: run forever)")
    p.add_argument("--timeout", type=float, default=None, help="kill a run after this many seconds (subprocess runs)")
    p.add_argument("--in-process", action="store_true", help="run each command in this process instead of a subprocess")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]: the kvtc command to run")
    p.set_defaults(func=_handler)
