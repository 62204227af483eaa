"""Calibration workers: model loading (models, tiny), RoPE (rope), KV capture (capture), statistics (stats).

Import the submodules directly; this package imports nothing heavy at top level.
"""
