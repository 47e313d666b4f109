"""The token permutation in CUDA C (permute.cu) through CuPy: histogram with atomics, one-block
scan, scatter with atomics. Same outputs as triton_permute.permute, except that rows within an
expert come in the order the atomics ran (the grouped GEMM and the combine do not depend on it)."""

from __future__ import annotations

import numpy as np
import torch

from kernels import cuda, runtime
from kernels.moe.triton_permute import Permutation, empty_permutation
from kernels.moe.validate import check_ids

SOURCE = "moe/permute.cu"
MAX_EXPERTS = 1024  # permute.cu's shared-memory bins and one scan thread per expert
THREADS = 256
SCAN_THREADS = 1024


def permute(ids: torch.Tensor, experts: int, block_m: int) -> Permutation:
    """Sort the assignments of `ids` (tokens, k) by expert, rows padded to `block_m`; no sync."""
    runtime.require_cupy()
    check_ids("cupy permute", ids, experts)
    if ids.dtype != torch.int32 or ids.device.type != "cuda":
        raise TypeError(
            f"cupy permute: ids must be an int32 CUDA tensor, got {ids.dtype} on {ids.device}"
        )
    if experts > MAX_EXPERTS:
        raise ValueError(f"cupy permute: at most {MAX_EXPERTS} experts, got {experts}")
    if block_m < 1:
        raise ValueError(f"cupy permute: block_m must be positive, got {block_m}")
    out = empty_permutation(ids, experts, block_m)
    out.counts.zero_()
    n = ids.numel()
    cursor = torch.empty(experts, dtype=torch.int32, device=ids.device)
    sms = torch.cuda.get_device_properties(ids.device).multi_processor_count
    blocks = max(1, min(cuda.cdiv(n, THREADS), 4 * sms))
    i32 = np.int32
    cuda.launch(
        cuda.load_kernel(SOURCE, "moe_histogram"),
        blocks,
        THREADS,
        (cuda.pointer(ids), i32(n), i32(experts), cuda.pointer(out.counts)),
        ids.device,
    )
    cuda.launch(
        cuda.load_kernel(SOURCE, "moe_scan"),
        1,
        SCAN_THREADS,
        (
            cuda.pointer(out.counts),
            i32(experts),
            i32(block_m),
            i32(out.max_tiles),
            cuda.pointer(out.padded_offsets),
            cuda.pointer(cursor),
            cuda.pointer(out.tile_expert),
        ),
        ids.device,
    )
    cuda.launch(
        cuda.load_kernel(SOURCE, "moe_scatter"),
        blocks,
        THREADS,
        (
            cuda.pointer(ids),
            i32(n),
            i32(experts),
            cuda.pointer(cursor),
            cuda.pointer(out.sorted_ids),
            cuda.pointer(out.row_of),
        ),
        ids.device,
    )
    return out
