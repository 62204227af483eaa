"""Calibration pipeline: `job` (the Ray calibration job: corpus, shards, store, workers, reduce),
`fit` (the math: PCA, bit allocator, error tables), `evaluation` (metrics, baselines, reports,
`kvtc eval`) and `operations` (drift, recalibration, schedule). `cli` is the `kvtc` command."""
