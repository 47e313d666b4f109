"""The matrix product in CUDA C, five steps from one thread per output to the tensor cores, launched
through CuPy. The CUDA C is in the .cu files beside this one:

| step | kernel | file | block | tile of C |
|---|---|---|---|---|
| 1 | one thread per output | matmul_naive.cu | 256 threads | 8 x 32 |
| 2 | shared-memory tiles | matmul_shared.cu | 1024 | 32 x 32 |
| 3 | register tiles (8 x 8 per thread) | matmul_register.cu | 256 | 128 x 128 |
| 4 | 16-byte loads | matmul_register.cu | 256 | 128 x 128 |
| 5 | tensor cores (mma.sync) | matmul_mma.cu | 256 | 128 x 256 |

Every step takes the same arguments: the operands' strides (a transposed operand is a view, never a
copy) and whether each operand's rows can be read 16 bytes at a time. M, N and K need not be
multiples of any tile: loads past the edges read zeros and stores are masked. Step 5 has a second
kernel for B = W.T (W (N, K) with contiguous rows, as nn.Linear stores it), which keeps B's tile
k-major and reads it 16 bytes at a time along k.

Step 5 is a template over its tiles and pipeline depth (`MmaConfig`): `MMA_DEFAULT` is the
configuration the step runs; `MMA_VARIANTS` holds those the benchmark compares, and the smaller
ones serve GPUs that cannot give a block the default's shared memory. They copy tiles by cp.async
and need both operands' rows to be 16-byte packs. `MMA_FALLBACK` (32 KB of shared memory, any
strides, its `_general` kernels) takes the other operands (a transposed A, a misaligned view).
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
    "mma": Step("matmul/matmul_mma.cu", "matmul_mma", 256, 128, 256),  # MMA_DEFAULT's tile
}


@dataclass(frozen=True)
class MmaConfig:
    """One instantiation of matmul_mma.cuh's template: a block_m x block_n tile of C per block,
    block_k of K per step, warps of warp_m x warp_n, `stages` tiles of A and B in flight."""

    block_m: int
    block_n: int
    block_k: int
    warp_m: int
    warp_n: int
    stages: int
    persistent: bool = False  # as many blocks as fit on the GPU at once, each looping over tiles

    @property
    def name(self) -> str:
        return self._dims + ("_persistent" if self.persistent else "")

    @property
    def _dims(self) -> str:
        m, n, k = self.block_m, self.block_n, self.block_k
        return f"{m}x{n}x{k}_w{self.warp_m}x{self.warp_n}_s{self.stages}"

    @property
    def threads(self) -> int:
        return (self.block_m // self.warp_m) * (self.block_n // self.warp_n) * 32

    def kernel(self, b_kmajor: bool, dtype: torch.dtype) -> str:
        general = "_general" if self == MMA_FALLBACK else ""
        return f"matmul_mma_{self._dims}{'_kmajor' if b_kmajor else ''}{general}_{SUFFIX[dtype]}"

    def blocks(self, tiles: int) -> int:
        """The grid for `tiles` tiles of C: a block a tile, or, persistent, as many blocks as the
        SMs hold at once (each thread keeps ~255 registers: one block of 8 warps an SM)."""
        if not self.persistent:
            return tiles
        by_registers = 65536 // (self.threads * 256)
        by_shared = runtime.shared_memory_budget() // self.shared_bytes()
        return min(tiles, max(1, min(by_registers, by_shared)) * runtime.features().sm_count)

    def shared_bytes(self) -> int:
        """As MmaTiles lays them out: `stages` tiles of A and of B, unpadded (swizzled), two
        bytes an element; the same for either layout of B."""
        return 2 * self.stages * (self.block_m + self.block_n) * self.block_k


# 32-deep K steps, 4 stages: the fastest configuration measured (PERFORMANCE.md, step 5), and at
# 96 KB one that an RTX 4090's 99 KB a block also holds.
MMA_DEFAULT = MmaConfig(128, 256, 32, 64, 64, 4)
MMA_FALLBACK = MmaConfig(128, 128, 32, 64, 32, 2)
MMA_VARIANTS: dict[str, MmaConfig] = {
    c.name: c
    for c in (
        MMA_DEFAULT,
        MmaConfig(128, 256, 32, 64, 64, 4, persistent=True),
        MmaConfig(128, 256, 64, 64, 64, 3),
        MmaConfig(128, 128, 32, 64, 64, 4),
    )
}


def rows_are_16_byte_packs(t: torch.Tensor) -> bool:
    """Whether 8 neighbouring elements of a row of t are one aligned 16-byte load: unit column
    stride, a row stride of whole packs and an aligned start."""
    pack = 16 // t.element_size()
    return t.stride(1) == 1 and t.stride(0) % pack == 0 and t.data_ptr() % 16 == 0


def mma_config_for(packed: bool, mma: MmaConfig | None = None) -> MmaConfig:
    """For operands whose rows are all 16-byte packs (`packed`): `mma` if given, else the first of
    MMA_VARIANTS (MMA_DEFAULT first) whose shared memory this GPU gives a block. MMA_FALLBACK for
    other operands, and where none fits."""
    budget = runtime.shared_memory_budget()
    candidates = [mma] if mma else list(MMA_VARIANTS.values())
    fitting = [c for c in candidates if packed and c.shared_bytes() <= budget]
    return fitting[0] if fitting else MMA_FALLBACK


def matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    step: str = "mma",
    mma: MmaConfig | None = None,
) -> torch.Tensor:
    """C = a @ b by one of the STEPS (fp16 or bf16 in, float32 accumulation, C in a's dtype).
    Step 5 runs `mma` (one of MMA_VARIANTS, MMA_DEFAULT if None), or MMA_FALLBACK where the
    operands or the GPU need it (`mma_config_for`)."""
    runtime.require_cupy()
    if step not in STEPS:
        raise ValueError(f"matmul: step must be one of {list(STEPS)}, got {step!r}")
    M, N, K = check_matmul_args(a, b, out, op=f"matmul[{step}]", device_type="cuda")
    if step == "mma" and a.dtype == torch.bfloat16:
        runtime.require("bf16", "matmul[mma] on bfloat16")
    out = torch.empty(M, N, dtype=a.dtype, device=a.device) if out is None else out
    spec, vec_a, vec_b, shared = (
        STEPS[step],
        rows_are_16_byte_packs(a),
        rows_are_16_byte_packs(b),
        0,
    )
    if step == "mma":
        b_kmajor = rows_are_16_byte_packs(b.T)  # B = W.T, W's rows 16-byte packs
        vec_b = vec_b or b_kmajor
        config = mma_config_for(vec_a and vec_b, mma)
        source, name, threads = spec.source, config.kernel(b_kmajor, a.dtype), config.threads
        grid = config.blocks(cuda.cdiv(M, config.block_m) * cuda.cdiv(N, config.block_n))
        shared = config.shared_bytes()
    else:
        source, name, threads = spec.source, f"{spec.kernel}_{SUFFIX[a.dtype]}", spec.threads
        grid = cuda.cdiv(M, spec.tile_m) * cuda.cdiv(N, spec.tile_n)
    args = (
        cuda.pointer(a),
        cuda.pointer(b),
        cuda.pointer(out),
        *map(np.int32, (M, N, K, *a.stride(), *b.stride(), out.stride(0))),
        np.int32(vec_a),
        np.int32(vec_b),
    )
    cuda.launch(cuda.load_kernel(source, name), grid, threads, args, a.device, shared)
    return out
