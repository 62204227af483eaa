"""Calibration pipeline: `job` (the Ray calibration job: corpus, shards, store, workers, reduce),
`fit` (the math: PCA, bit allocator, error tables), `evaluation` (metrics, baselines, reports,
`kvtc eval`) and `operations` (drift, recalibration, schedule). `cli` is the `kvtc` command."""
import os as _os
import sys as _sys


def _checkout_off_path() -> None:
    """Run from the checkout's root (`ray job submit --working-dir .` puts it on every process's path, as
    `python -m` does its cwd), its top-level folders would shadow real packages: `kernels/` hides Hugging
    Face's `kernels`, which transformers imports. The installed project is `kvtc.*` wherever it runs, so a
    path entry holding this checkout's layout never serves an import: drop it before anything imports."""
    if "kernels" in _sys.modules:
        return

    def checkout(entry: str) -> bool:
        root = _os.path.abspath(entry or _os.curdir)
        return all(_os.path.exists(_os.path.join(root, *p)) for p in (("kernels", "codec", "__init__.py"),
                                                                       ("pipeline", "calibrate_job.py")))

    _sys.path[:] = [p for p in _sys.path if not (isinstance(p, str) and checkout(p))]


_checkout_off_path()
