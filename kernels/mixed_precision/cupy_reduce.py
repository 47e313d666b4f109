"""The sums of reduce.cu (naive, pairwise, Kahan; fp32, fp16 or bf16 accumulator) through CuPy.

Launch: chunks x rows blocks of 256 threads; while a row needs more than one block, each block
writes a partial sum (and, for Kahan, minus its compensation) into a float32 buffer, and the same
kernel sums that buffer: 256M elements take three launches (8192 partials, then 1).
"""

from __future__ import annotations

import numpy as np
import torch

from kernels import cuda, runtime
from kernels.mixed_precision.validate import check_sum_args

SUFFIX = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
THREADS, UNROLL, TRIPS = 256, 8, 16  # as in reduce.cu
ELEMENTS_PER_BLOCK = {
    "naive": THREADS * UNROLL * TRIPS,
    "kahan": THREADS * UNROLL * TRIPS,
    "pairwise": THREADS * UNROLL,
}


def _launch(
    level: torch.Tensor,
    out: torch.Tensor,
    width: int,
    algorithm: str,
    acc: torch.dtype,
    chunks: int,
):
    kernel = cuda.load_kernel(
        "mixed_precision/reduce.cu", f"sum_{algorithm}_{SUFFIX[level.dtype]}_{SUFFIX[acc]}"
    )
    cuda.launch(
        kernel,
        chunks * level.shape[0],
        THREADS,
        (
            cuda.pointer(level),
            cuda.pointer(out),
            np.int64(width),
            np.int64(level.stride(0)),
            np.int64(out.stride(0)),
            np.int32(chunks),
        ),
        level.device,
    )


def sum(
    x: torch.Tensor, acc: torch.dtype = torch.float32, algorithm: str = "naive"
) -> torch.Tensor:
    """The sum of x (a vector) or of each row of x (rows, n), accumulated in `acc` with `algorithm`;
    a tensor of dtype `acc` and shape x.shape[:-1]."""
    runtime.require_cupy()
    check_sum_args("sum", x, acc, algorithm, device_type="cuda")
    x2d = x.view(1, -1) if x.dim() == 1 else x
    rows, n = x2d.shape
    if rows == 0 or n == 0:
        return torch.zeros(x.shape[:-1], dtype=acc, device=x.device)
    level, width = x2d, n
    while True:
        chunks = cuda.cdiv(width, ELEMENTS_PER_BLOCK[algorithm])
        if chunks == 1:
            result = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
            _launch(level, result, width, algorithm, acc, 1)
            # the value is already rounded to acc: this conversion is exact
            return result.view(x.shape[:-1]).to(acc)
        partials = torch.empty(
            rows, chunks * (2 if algorithm == "kahan" else 1), dtype=torch.float32, device=x.device
        )
        _launch(level, partials, width, algorithm, acc, chunks)
        level, width = partials, partials.shape[1]
