"""RMSNorm forward in CUDA C (rmsnorm.cu), launched through CuPy.

The wrapper's job is the launch configuration: how many threads share a row, and how many 16-byte
packs each keeps in registers. Narrow rows get a warp each (8 rows per block); wide rows a block
each.
"""

from __future__ import annotations

import numpy as np
import torch

from kernels import cuda, runtime
from kernels.rmsnorm.validate import check_rmsnorm_args, rows_view

SUFFIX = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
WARP_PER_ROW_MAX_ITEMS = 4  # rows of up to 32 * 4 packs get a warp each
MAX_THREADS = 512
# Packs per thread: two or more loads in flight per thread before the reduction, and at most four,
# so the row's slice stays in registers and 512 threads fit the 64K-register file (a test checks
# this against ptxas).
ITEM_CHOICES = (2, 4)
# Wider than 512 packs (4096 bf16, 2048 fp32), a register-resident row needs 512 threads, one or two
# rows per SM, and measured slower than staging the row in shared memory (H200, 64M bf16 elements:
# 8192 wide 85% of copy in registers, 90% staged with 256 threads; 16384 wide 71% in registers, 85%
# staged with 512 threads; kernels/rmsnorm/PERFORMANCE.md). A block gets 48 KB of shared memory
# without an opt-in, static and dynamic together; the reduction's warp sums take 128 bytes, so
# staged rows get up to 47 KB (16384 bf16, 8192 fp32 and up to 12032); wider rows are read twice
# (the two-pass kernel, the second read from L2).
REGISTER_MAX_PACKS = 512
STAGED_MAX_BYTES = 47 * 1024
STAGED_UNROLL = 4


def launch_config(
    width: int, pack: int, element_size: int, threads: int | None = None
) -> tuple[str, int, int]:
    """(kind, threads per block, ITEMS) for a row of `width` elements read in packs of `pack`.

    kind "warp": a warp per row, 8 rows per block. "block": a block per row holding the row in
    registers, the fewest packs per thread (at least 2) and the thread count rounded up to whole
    warps (a 5120-wide bf16 row of 640 packs gets 320 threads, all busy); ITEMS = 0 is the two-pass
    kernel. "staged": a block per row staging it in shared memory, 256 to 512 threads, ITEMS = packs
    per thread in flight per pass (the kernel's unroll factor). `threads` forces a block per row in
    registers with that many threads (for sweeps).
    """
    packs = cuda.cdiv(width, pack)
    if threads is not None:
        items = next((i for i in (1,) + ITEM_CHOICES if i * threads >= packs), 0)
        return "block", threads, items
    if packs <= 32 * WARP_PER_ROW_MAX_ITEMS:
        return "warp", 256, cuda.next_pow2(cuda.cdiv(packs, 32))
    if packs <= REGISTER_MAX_PACKS:
        return "block", 32 * cuda.cdiv(packs, 32 * ITEM_CHOICES[0]), ITEM_CHOICES[0]
    if width * element_size <= STAGED_MAX_BYTES:
        return (
            "staged",
            min(MAX_THREADS, max(256, 32 * cuda.cdiv(packs, 32 * STAGED_UNROLL))),
            STAGED_UNROLL,
        )
    return "block", MAX_THREADS, 0


def _can_use_16_byte_packs(x2d: torch.Tensor, w: torch.Tensor, y2d: torch.Tensor) -> bool:
    size = x2d.element_size()
    pack = 16 // size
    return (
        x2d.shape[1] % pack == 0
        and x2d.stride(0) % pack == 0
        and y2d.stride(0) % pack == 0
        and all(t.data_ptr() % 16 == 0 for t in (x2d, w, y2d))
    )


def rms_norm(
    x: torch.Tensor,
    w: torch.Tensor,
    eps: float = 1e-6,
    out: torch.Tensor | None = None,
    *,
    threads: int | None = None,
    staged: bool | None = None,
    unroll: int | None = None,
) -> torch.Tensor:
    """y = x / sqrt(mean(x^2, -1) + eps) * w over the last dimension; rows may be strided.

    `threads`, `staged` and `unroll` override the launch configuration (for sweeps and tests):
    `staged=True` stages the row in shared memory whatever its width (with `threads` threads and
    `unroll` packs per thread in flight, 4 or 8), `staged=False` never does."""
    runtime.require_cupy()
    check_rmsnorm_args("rms_norm", x, w, eps, out, device_type="cuda")
    out = torch.empty_like(x, memory_format=torch.contiguous_format) if out is None else out
    if x.numel() == 0:
        return out
    x2d, y2d = rows_view(x), rows_view(out)
    rows, width = x2d.shape
    vec = _can_use_16_byte_packs(x2d, w, y2d)
    pack = 16 // x.element_size() if vec else 1
    kind, block, items = launch_config(width, pack, x.element_size(), threads)
    if staged:
        if width * x.element_size() > STAGED_MAX_BYTES:
            raise ValueError(
                f"rms_norm: staged=True holds a row in at most {STAGED_MAX_BYTES // 1024} KB of "
                "shared "
                f"memory; a row of {width} {str(x.dtype).removeprefix('torch.')} needs "
                f"{width * x.element_size() // 1024} KB"
            )
        kind, block, items = (
            "staged",
            threads or (block if kind == "staged" else 256),
            unroll or STAGED_UNROLL,
        )
    elif staged is False and kind == "staged":
        kind, block, items = launch_config(width, pack, x.element_size(), MAX_THREADS)
    variant = f"{SUFFIX[x.dtype]}_{'v' if vec else 's'}"
    if kind == "staged":
        cuda.launch(
            cuda.load_kernel("rmsnorm/rmsnorm.cu", f"rmsnorm_staged_{variant}{items}"),
            rows,
            block,
            (
                cuda.pointer(x2d),
                cuda.pointer(w),
                cuda.pointer(y2d),
                np.int32(width),
                np.int64(x2d.stride(0)),
                np.int64(y2d.stride(0)),
                np.float32(eps),
            ),
            x.device,
            shared_mem=width * x.element_size(),
        )
        return out
    kernel = cuda.load_kernel("rmsnorm/rmsnorm.cu", f"rmsnorm_{kind}_{variant}{items}")
    grid = rows if kind == "block" else cuda.cdiv(rows, block // 32)
    cuda.launch(
        kernel,
        grid,
        block,
        (
            cuda.pointer(x2d),
            cuda.pointer(w),
            cuda.pointer(y2d),
            np.int64(rows),
            np.int32(width),
            np.int64(x2d.stride(0)),
            np.int64(y2d.stride(0)),
            np.float32(eps),
        ),
        x.device,
    )
    return out
