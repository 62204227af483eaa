"""Evaluation and reports: metrics, diagnostic curves, baselines, `kvtc eval` and `kvtc report`."""
