"""With `--json`, stdout holds the summary and nothing else: while the job runs, whatever else writes to
stdout (Ray prints its raylets' error lines there, such as a task retried after a node was lost, whatever
`log_to_driver` says; libraries print there too) goes to stderr, at the file-descriptor level, so that
writes from C code are caught as well; and a Ray connection the job opened and left open (a joined cluster) is
closed before the summary is printed, so that none of its lines can follow the summary."""
from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterator


def _fileno(stream) -> int | None:
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError):  # a stream without a descriptor (a test's capture)
        return None


def _ray_connected() -> bool:
    ray = sys.modules.get("ray")  # never imported here: a command that did not use Ray stays light
    return ray is not None and ray.is_initialized()


@contextlib.contextmanager
def stdout_to_stderr(enabled: bool = True) -> Iterator[None]:
    """While the body runs, stdout writes go to stderr (see the module's doc); at the end a Ray
    connection the body opened is closed. `enabled` False: nothing changes."""
    if not enabled:
        yield
        return
    connected = _ray_connected()
    sys.stdout.flush()
    out, err = _fileno(sys.stdout), _fileno(sys.stderr)
    saved = os.dup(out) if out is not None and err is not None else None
    if saved is not None:
        os.dup2(err, out)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            try:
                yield
            finally:
                if _ray_connected() and not connected:
                    sys.modules["ray"].shutdown()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        if saved is not None:
            os.dup2(saved, out)
            os.close(saved)
