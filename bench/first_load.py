"""A model's first load on a fresh cache: what a first `kvtc calibrate` pays before its fold.

Each spec is loaded as the job does, into an empty cache folder: its config and tokenizer (`load_spec`, which for a
GGUF converts the tokenizer once), the weights' conversion (`prepare_weights`, the driver's, once per node) and the
model itself (`load_model`, as each worker loads it). Prints seconds per step.

    .venv/bin/python -P bench/first_load.py smollm2-135m gemma3-270m
"""
from __future__ import annotations

import sys
import tempfile
import time


def first_load(spec: str) -> dict[str, float]:
    from kvtc.workers.models import load_model, load_spec, prepare_weights

    with tempfile.TemporaryDirectory(prefix="kvtc-first-load-") as cache:
        t0 = time.perf_counter()
        load_spec(spec, cache)
        t1 = time.perf_counter()
        prepare_weights(spec, cache)
        t2 = time.perf_counter()
        load_model(spec, cache_dir=cache)
        t3 = time.perf_counter()
    return {"spec": t1 - t0, "convert": t2 - t1, "load": t3 - t2, "total": t3 - t0}


def main(specs: list[str]) -> None:
    import kvtc.workers.models  # noqa: F401 - imported before the clock: each spec's steps alone are timed

    for spec in specs or ["smollm2-135m"]:
        s = first_load(spec)
        print(f"{spec}: config and tokenizer {s['spec']:.1f} s, conversion {s['convert']:.1f} s, "
              f"load {s['load']:.1f} s, total {s['total']:.1f} s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
