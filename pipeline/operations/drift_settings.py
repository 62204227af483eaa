"""The drift check's defaults, exit codes and model-mismatch error (kvtc.pipeline.operations.drift uses them).
Light, for the command line: `kvtc drift` builds its options from them and `kvtc drift` / `kvtc recalibrate`
map the error to an exit code, without importing the check (it loads torch)."""
from __future__ import annotations

EXIT_OK, EXIT_DRIFT, EXIT_MODEL = 0, 3, 4
DEFAULT_THRESHOLD = 0.10
DEFAULT_TOKENS = 16 * 1024  # sampled by default: 16 sequences of 1,024, as many tokens of longer ones
MIN_SEQUENCES = 4  # and at least this many of the artifact's sequences


def default_tokens(seq_len: int) -> int:
    """What `kvtc drift` samples without --tokens: DEFAULT_TOKENS, at least MIN_SEQUENCES sequences of `seq_len`."""
    return max(DEFAULT_TOKENS, MIN_SEQUENCES * seq_len)


class ModelMismatchError(ValueError):
    """The loaded model's fingerprint differs from the artifact's."""
