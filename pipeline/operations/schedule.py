"""`kvtc schedule (--cron EXPR | --every SECONDS) [--max-runs N] -- COMMAND [ARGS...]`: run a kvtc
command on a schedule, in a long-running process (a container's main process, a systemd unit).

    kvtc schedule --cron "0 3 * * *" -- recalibrate smollm2-135m --corpus data/ --if-drift 0.10
    kvtc schedule --every 3600 -- drift smollm2-135m --corpus data/

--cron takes 5 fields (minute hour day month weekday, local time) or 6 with a leading seconds
field ("*/10 * * * * *" = every 10 s). --every N fires at wall-clock multiples of N seconds.
Runs never overlap: a run that outlasts its slot skips the fires it missed (no catch-up burst).
Each run is a fresh `python -m kvtc.pipeline.cli COMMAND ...` process (--in-process: a call in this
process, sharing its Ray connection); a failing run is logged and the schedule goes on. One JSON
line per run goes to stdout: {"run", "fired_at", "started", "seconds", "rc"}. SIGTERM/SIGINT stop
the scheduler after the current run; its exit code is the last run's.
Where a platform scheduler exists (cron with `ray job submit`, KubeRay RayCronJob), prefer it:
see deploy/.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable

from croniter import croniter


@dataclass(frozen=True)
class Schedule:
    """Exactly one of `cron` (5 fields, or 6 with leading seconds) and `every` (seconds > 0)."""

    cron: str | None = None
    every: float | None = None

    def __post_init__(self) -> None:
        if (self.cron is None) == (self.every is None):
            raise ValueError("give exactly one of --cron EXPR and --every SECONDS")
        if self.every is not None and not 0 < self.every < float("inf"):
            raise ValueError(f"--every must be a positive, finite number of seconds, got {self.every}")
        if self.cron is not None:
            fields = self.cron.split()
            if len(fields) not in (5, 6) or not croniter.is_valid(self.cron, second_at_beginning=len(fields) == 6):
                raise ValueError(f"--cron {self.cron!r} is not a cron expression; use 5 fields (minute hour day month "
                                 "weekday, e.g. '0 3 * * *') or 6 with leading seconds (e.g. '*/10 * * * * *')")

    def next_after(self, t: float) -> float:
        """The first fire time strictly after epoch seconds `t`."""
        if self.every is not None:
            return (int(t // self.every) + 1) * self.every
        return float(croniter(self.cron, t, second_at_beginning=len(self.cron.split()) == 6).get_next(float))


class Scheduler:
    """Fire `job` (-> exit code) at each schedule time, sequentially; `clock`/`sleep` are injectable."""

    def __init__(self, schedule: Schedule, job: Callable[[], int], max_runs: int | None = None,
                 clock: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep,
                 report: Callable[[dict], None] | None = None) -> None:
        if max_runs is not None and max_runs < 1:
            raise ValueError(f"--max-runs must be >= 1, got {max_runs}")
        self.schedule, self.job, self.max_runs = schedule, job, max_runs
        self.clock, self.sleep = clock, sleep
        self.report = report or (lambda rec: print(json.dumps(rec), flush=True))
        self.stopping = False
        self.runs: list[dict] = []

    def stop(self, *_: object) -> None:
        self.stopping = True

    def _wait_until(self, t: float) -> None:
        while not self.stopping and (left := t - self.clock()) > 0:
            self.sleep(min(left, 1.0))

    def run(self) -> list[dict]:
        """Loop until max_runs runs have finished or stop() is called; returns the run records."""
        while not self.stopping and (self.max_runs is None or len(self.runs) < self.max_runs):
            fire = self.schedule.next_after(self.clock())
            self._wait_until(fire)
            if self.stopping:
                break
            started = self.clock()
            try:
                rc = int(self.job())
            except Exception as exc:  # a failed run must not end the schedule
                print(f"kvtc schedule: run failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
                rc = 2
            record = {"run": len(self.runs) + 1, "fired_at": fire, "started": started,
                      "seconds": round(self.clock() - started, 3), "rc": rc}
            self.runs.append(record)
            self.report(record)
        return self.runs


def command_job(command: list[str], main: Callable[[list[str]], int] | None = None,
                timeout: float | None = None) -> Callable[[], int]:
    """A job running `kvtc COMMAND...`: with `main` (the `kvtc` entry point, which the CLI hands its
    commands), a call in this process; without, a fresh `python -m kvtc.pipeline.cli` subprocess."""
    if main is not None:
        def job() -> int:
            return main(list(command))
        return job

    def run_subprocess() -> int:
        try:
            return subprocess.run([sys.executable, "-m", "kvtc.pipeline.cli", *command], timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            print(f"kvtc schedule: run exceeded --timeout {timeout} s and was killed", file=sys.stderr, flush=True)
            return 124
    return run_subprocess


def parse_command(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """`-- [kvtc] COMMAND ARGS...` -> [COMMAND, ARGS...], checked against the `kvtc` parser now, not at 3 am."""
    command = argv[1:] if argv[:1] == ["--"] else list(argv)
    command = command[1:] if command[:1] == ["kvtc"] else command
    if not command:
        raise ValueError("no command to schedule; put it after '--', e.g. kvtc schedule --every 60 -- drift NAME")
    if command[0] == "schedule":
        raise ValueError("kvtc schedule cannot schedule itself")
    try:
        parser.parse_args(command)
    except SystemExit:
        raise ValueError(f"the scheduled command `kvtc {' '.join(command)}` does not parse (see the message above)") from None
    return command
