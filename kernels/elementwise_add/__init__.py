"""Element-wise add: the reference, CUDA C kernels through CuPy, and Triton kernels."""
