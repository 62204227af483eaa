"""Evaluation and reports: metrics, diagnostic curves, baselines and `kvtc report` (never the job itself)."""
