"""RMSNorm forward in CUDA C (rmsnorm.cu), launched through CuPy.

The wrapper's job is the launch configuration: how many threads share a row, and how many 16-byte packs
each keeps in registers. Narrow rows get a warp each (8 rows per block); wide rows a block each.
"""
from __future__ import annotations

import numpy as np
import torch

from kernels import cuda, runtime
from kernels.rmsnorm.validate import check_rmsnorm_args, rows_view

SUFFIX = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
WARP_PER_ROW_MAX_ITEMS = 4  # rows of up to 32 * 4 packs get a warp each
MAX_THREADS = 512
# Packs per thread: two or more loads in flight per thread before the reduction, and at most four, so
# the row's slice stays in registers and 512 threads fit the 64K-register file (a test checks this
# against ptxas): rows up to 512 * 4 packs (16384 bf16, 8192 fp32) are read once; wider rows take the
# two-pass kernel.
ITEM_CHOICES = (2, 4)


def launch_config(width: int, pack: int, threads: int | None = None) -> tuple[str, int, int]:
    """(kind, threads per block, ITEMS) for a row of `width` elements read in packs of `pack`.

    Block per row: the fewest packs per thread (at least 2) that fit in MAX_THREADS threads, the thread
    count rounded up to whole warps (it need not be a power of two: a 5120-wide bf16 row of 640 packs
    gets 320 threads, all busy). ITEMS = 0 (two passes over the row) only for rows too wide for that.
    """
    packs = -(-width // pack)
    if threads is None and packs <= 32 * WARP_PER_ROW_MAX_ITEMS:
        return "warp", 256, 1 << max(0, (-(-packs // 32) - 1).bit_length())
    if threads is not None:
        items = next((i for i in (1,) + ITEM_CHOICES if i * threads >= packs), 0)  # for sweeps
        return "block", threads, items
    for items in ITEM_CHOICES:
        threads = 32 * -(-packs // (32 * items))
        if threads <= MAX_THREADS:
            return "block", threads, items
    return "block", MAX_THREADS, 0


def _can_use_16_byte_packs(x2d: torch.Tensor, w: torch.Tensor, y2d: torch.Tensor) -> bool:
    size = x2d.element_size()
    pack = 16 // size
    return (x2d.shape[1] % pack == 0 and x2d.stride(0) % pack == 0 and y2d.stride(0) % pack == 0
            and all(t.data_ptr() % 16 == 0 for t in (x2d, w, y2d)))


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6, out: torch.Tensor | None = None, *,
             threads: int | None = None) -> torch.Tensor:
    """y = x / sqrt(mean(x^2, -1) + eps) * w, over the last dimension. Rows may be strided (stride > width)."""
    runtime.require_cupy()
    check_rmsnorm_args("rms_norm", x, w, eps, out, device_type="cuda")
    out = torch.empty_like(x, memory_format=torch.contiguous_format) if out is None else out
    if x.numel() == 0:
        return out
    x2d, y2d = rows_view(x), rows_view(out)
    rows, width = x2d.shape
    vec = _can_use_16_byte_packs(x2d, w, y2d)
    pack = 16 // x.element_size() if vec else 1
    kind, block, items = launch_config(width, pack, threads)
    name = f"rmsnorm_{kind}_{SUFFIX[x.dtype]}_{'v' if vec else 's'}{items}"
    kernel = cuda.load_kernel("rmsnorm/rmsnorm.cu", name)
    grid = rows if kind == "block" else -(-rows // (block // 32))
    cuda.launch(kernel, grid, block,
                (cuda.pointer(x2d), cuda.pointer(w), cuda.pointer(y2d), np.int64(rows), np.int32(width),
                 np.int64(x2d.stride(0)), np.int64(y2d.stride(0)), np.float32(eps)), x.device)
    return out
