"""The matrix product in CUDA C, five steps from one thread per output to the tensor cores, launched
through CuPy. The CUDA C is in the .cu files beside this one:

| step | kernel | file | block | tile of C |
|---|---|---|---|---|
| 1 | one thread per output | matmul_naive.cu | 256 threads | 8 x 32 |
| 2 | shared-memory tiles | matmul_shared.cu | 1024 | 32 x 32 |
| 3 | register tiles (8 x 8 per thread) | matmul_register.cu | 256 | 128 x 128 |
| 4 | 16-byte loads | matmul_register.cu | 256 | 128 x 128 |
| 5 | tensor cores (mma.sync) | matmul_mma.cu | 256 | 128 x 128 |

Every step takes the same arguments: the operands' strides (a transposed operand is a view, never a
copy) and whether each operand's rows can be read 16 bytes at a time. M, N and K need not be
multiples of any tile: loads past the edges read zeros and stores are masked. Step 5 has a second
kernel for B = W.T (W (N, K) with contiguous rows, as nn.Linear stores it), which keeps B's tile
k-major and reads it 16 bytes at a time along k.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kernels import cuda, runtime
from kernels.matmul.reference import check_matmul_args

SUFFIX = {torch.float16: "f16", torch.bfloat16: "bf16"}


@dataclass(frozen=True)
class Step:
    source: str  # the .cu file, relative to kernels/
    kernel: str  # the extern "C" name, less its _f16 / _bf16 suffix
    threads: int
    tile_m: int  # rows of C per block
    tile_n: int  # columns of C per block


STEPS: dict[str, Step] = {
    "naive": Step("matmul/matmul_naive.cu", "matmul_naive", 256, 8, 32),
    "shared": Step("matmul/matmul_shared.cu", "matmul_shared", 1024, 32, 32),
    "register": Step("matmul/matmul_register.cu", "matmul_register", 256, 128, 128),
    "vectorized": Step("matmul/matmul_register.cu", "matmul_vectorized", 256, 128, 128),
    "mma": Step("matmul/matmul_mma.cu", "matmul_mma", 256, 128, 128),
}


def rows_are_16_byte_packs(t: torch.Tensor) -> bool:
    """Whether 8 neighbouring elements of a row of t are one aligned 16-byte load: unit column
    stride, a row stride of whole packs and an aligned start."""
    pack = 16 // t.element_size()
    return t.stride(1) == 1 and t.stride(0) % pack == 0 and t.data_ptr() % 16 == 0


def matmul(
    a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None, *, step: str = "mma"
) -> torch.Tensor:
    """C = a @ b by one of the STEPS (fp16 or bf16 in, float32 accumulation, C in a's dtype)."""
    runtime.require_cupy()
    if step not in STEPS:
        raise ValueError(f"matmul: step must be one of {list(STEPS)}, got {step!r}")
    M, N, K = check_matmul_args(a, b, out, op=f"matmul[{step}]", device_type="cuda")
    if step == "mma" and a.dtype == torch.bfloat16:
        runtime.require("bf16", "matmul[mma] on bfloat16")
    out = torch.empty(M, N, dtype=a.dtype, device=a.device) if out is None else out
    spec = STEPS[step]
    name, vec_b = spec.kernel, rows_are_16_byte_packs(b)
    if step == "mma" and rows_are_16_byte_packs(b.T):  # B = W.T, W's rows 16-byte packs
        name, vec_b = "matmul_mma_kmajor", True
    kernel = cuda.load_kernel(spec.source, f"{name}_{SUFFIX[a.dtype]}")
    grid = cuda.cdiv(M, spec.tile_m) * cuda.cdiv(N, spec.tile_n)
    args = (
        cuda.pointer(a),
        cuda.pointer(b),
        cuda.pointer(out),
        *map(np.int32, (M, N, K, *a.stride(), *b.stride(), out.stride(0))),
        np.int32(rows_are_16_byte_packs(a)),
        np.int32(vec_b),
    )
    cuda.launch(kernel, grid, spec.threads, args, a.device)
    return out
