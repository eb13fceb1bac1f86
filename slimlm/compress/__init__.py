"""Compression methods, the shared layer-by-layer calibration pipeline and the checkpoint writer."""
