"""Checkpoint conversion: NVIDIA's release or an MLX conversion into a precision profile."""
