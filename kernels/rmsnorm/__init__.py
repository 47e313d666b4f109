"""RMSNorm: the reference, a CUDA C row reduction through CuPy, and Triton forward, backward, fused
residual add and fp8-input kernels."""
