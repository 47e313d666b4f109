"""Attention: the reference, Triton FlashAttention-2 forward and backward, flash-decoding, and a
tiled CUDA C forward through CuPy."""
