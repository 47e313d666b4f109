"""Mixture of experts: the pieces that together make one layer fast.

Top-k routing, load balance, token permutation, a Triton grouped GEMM with the gather and SwiGLU
fused in, and the weighted combine."""
