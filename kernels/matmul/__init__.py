"""The matrix product: the reference, CUDA C kernels through CuPy (one thread per output up to
tensor cores through mma.sync), Triton kernels (tiled, persistent, skinny) and their benchmark."""
