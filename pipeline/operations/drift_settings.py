"""The drift check's defaults, exit codes and model-mismatch error (kvtc.pipeline.operations.drift uses them).
Light, for the command line: `kvtc drift` builds its options from them and `kvtc drift` / `kvtc recalibrate`
map the error to an exit code, without importing the check (it loads torch)."""
from __future__ import annotations

EXIT_OK, EXIT_DRIFT, EXIT_MODEL = 0, 3, 4
DEFAULT_THRESHOLD = 0.10
DEFAULT_SEQUENCES = 16


class ModelMismatchError(ValueError):
    """The loaded model's fingerprint differs from the artifact's."""
