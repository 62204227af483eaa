"""The math of a calibration: PCA bases, error tables and the DP bit allocator."""
