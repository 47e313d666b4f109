import kernels  # noqa: F401  - first, so TRITON_INTERPRET is set before any test imports triton
