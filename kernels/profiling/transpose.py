"""Transpose: the profiling lab's slow kernel and its fix.

`out = x.T`, written into a new row-major (cols, rows) tensor, moves every byte once in and once
out: nothing to compute, so the floor is 2 * x.nbytes over the copy bandwidth. Attention's K^T and
every weight-layout conversion do this.

* `transpose_naive` gives each program BLOCK consecutive elements of `out`. Its stores are
coalesced,
  but out[c, r] comes from x[r, c]: neighbouring threads read addresses `cols` elements apart, so
  each thread's 2 or 4 bytes arrive in a 32-byte sector of their own. Nsight Compute shows it as
  global load sectors per request: 32 (one sector per thread of the warp) instead of a handful.
* `transpose_tiled` loads a (BLOCK_R, BLOCK_C) tile along x's rows and stores its transpose along
  out's rows: both sides coalesced; Triton moves the tile between the two layouts through shared
  memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import runtime
from kernels.validate import FLOAT_DTYPES


def check_transpose(op: str, x: torch.Tensor, out: torch.Tensor | None) -> None:
    """A 2-D contiguous float tensor, and `out` of the transposed shape, same dtype and device."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{op}: x has dtype {str(x.dtype).removeprefix('torch.')}; supported: "
            "float32, float16, bfloat16"
        )
    if x.dim() != 2:
        raise ValueError(f"{op}: x must be 2-D (rows, cols), got shape {tuple(x.shape)}")
    if not x.is_contiguous():
        raise ValueError(f"{op}: x must be contiguous (row-major); call .contiguous() first")
    if x.device.type != runtime.DEVICE:
        raise ValueError(f"{op}: x is on {x.device}, this mode runs on {runtime.DEVICE}")
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"{op}: out must be a torch.Tensor, got {type(out).__name__}")
        if out.shape != (x.shape[1], x.shape[0]) or out.dtype != x.dtype or out.device != x.device:
            raise ValueError(
                f"{op}: out must be {x.shape[1]}x{x.shape[0]} {x.dtype} on {x.device}, "
                f"got {tuple(out.shape)} {out.dtype} on {out.device}"
            )
        if not out.is_contiguous():
            raise ValueError(f"{op}: out must be contiguous")


def reference_fp64(x: torch.Tensor) -> torch.Tensor:
    return x.double().t()


def bytes_moved(x: torch.Tensor) -> int:
    return 2 * x.numel() * x.element_size()  # every element read once and written once


def _launch_metadata(grid, kernel, args):
    """What proton (triton.profiler) shows per launch: a name with the shape, and the bytes
    moved."""
    rows, cols, x = args["rows"], args["cols"], args["x_ptr"]
    return {"name": f"{kernel.name} {rows}x{cols}", "bytes": 2 * rows * cols * x.element_size()}


# --------------------------------------------------------------------------------------------------
# The slow kernel


@triton.jit(launch_metadata=_launch_metadata)
def transpose_naive_kernel(x_ptr, out_ptr, rows, cols, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < rows * cols
    c = offsets // rows  # out is (cols, rows): element `offsets` is out[c, r] = x[r, c]
    r = offsets % rows
    value = tl.load(x_ptr + r * cols + c, mask=mask)  # lanes `cols` elements apart: one sector each
    tl.store(out_ptr + offsets, value, mask=mask)  # lanes side by side: coalesced


NAIVE_BLOCK = runtime.pick(gpu=1024, cpu=4096)


def transpose_naive(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """out = x.T (contiguous), one program per BLOCK consecutive elements of out: uncoalesced
    loads."""
    check_transpose("transpose_naive", x, out)
    rows, cols = x.shape
    out = torch.empty(cols, rows, dtype=x.dtype, device=x.device) if out is None else out
    if x.numel():
        transpose_naive_kernel[(triton.cdiv(x.numel(), NAIVE_BLOCK),)](
            x, out, rows, cols, BLOCK=NAIVE_BLOCK, num_warps=runtime.pick(gpu=4, cpu=1)
        )
    return out


# --------------------------------------------------------------------------------------------------
# The fix


@triton.jit(launch_metadata=_launch_metadata)
def transpose_tiled_kernel(
    x_ptr, out_ptr, rows, cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr
):
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (r[:, None] < rows) & (c[None, :] < cols)
    tile = tl.load(x_ptr + r[:, None] * cols + c[None, :], mask=mask)  # along x's rows
    # along out's rows: out[c, r] for the tile's transpose
    tl.store(out_ptr + c[:, None] * rows + r[None, :], tl.trans(tile), mask=tl.trans(mask))


TILE = runtime.pick(gpu=(64, 64), cpu=(64, 64))


def transpose_tiled(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """out = x.T (contiguous), one program per (64, 64) tile: coalesced loads and stores."""
    check_transpose("transpose_tiled", x, out)
    rows, cols = x.shape
    out = torch.empty(cols, rows, dtype=x.dtype, device=x.device) if out is None else out
    if x.numel():
        block_r, block_c = TILE
        grid = (triton.cdiv(rows, block_r), triton.cdiv(cols, block_c))
        transpose_tiled_kernel[grid](
            x,
            out,
            rows,
            cols,
            BLOCK_R=block_r,
            BLOCK_C=block_c,
            num_warps=runtime.pick(gpu=4, cpu=1),
        )
    return out
