"""Test hook: hold a stage's work on one Ray node, so that a test can remove that node while the work
is in flight (mid-fold or mid-reduce) and check that the job recovers on the nodes left.

`HOLD_ENV` = "<stage>:<node id>:<marker file>": every unit of `stage` that runs on that node touches
the marker and waits there (at most `HOLD_SECONDS`): a training shard once folded and checkpointed,
before its result returns ("fold"), a group task before it starts ("reduce"); on any other node it
runs as usual. Unset: nothing.
"""
from __future__ import annotations

import os
import time

HOLD_ENV = "KVTC_TEST_HOLD_ON_NODE"
HOLD_SECONDS = 300.0


def current_node() -> str:
    """The Ray node this process runs on ("" outside Ray)."""
    try:
        import ray  # noqa: PLC0415 - only inside a Ray run; this module stays Ray-free

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
    except Exception:  # a Ray without a runtime context here: no node to report
        return ""


def hold_if_asked(stage: str) -> None:
    """Wait here when `HOLD_ENV` names `stage` and this process's node (see the module's doc)."""
    spec = os.environ.get(HOLD_ENV)
    if not spec:
        return
    wanted, node, marker = spec.split(":", 2)
    if wanted != stage or node != current_node():
        return
    with open(marker, "a") as f:  # one line per unit held
        f.write(f"{stage} {os.getpid()}\n")
    time.sleep(HOLD_SECONDS)
