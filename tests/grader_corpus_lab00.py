"""Known-wrong answers and fixes for lab 00 (profiling), and what the grader must say about each.

Each entry is a function a student might write, and a phrase of the message the grader must give."""

import torch
import triton
import triton.language as tl

from kernels import runtime
from kernels.profiling import lab, transpose
from kernels.profiling.transpose import check_transpose

BLOCK_R, BLOCK_C, BLOCK = 64, 64, 1024


def answer(reading, value_of):
    """A `bottleneck` that names `reading` and gives reading `value_of`'s value."""

    def bottleneck(readings, out=None):
        out = torch.empty(2, dtype=torch.float64, device=readings.device) if out is None else out
        return lab.store_answer(out, reading, readings[value_of].item())

    return bottleneck


BOTTLENECK = {
    "the_symptom": (answer(1, 1), "low DRAM throughput is the symptom"),
    "occupancy": (answer(3, 3), "occupancy is not what keeps this kernel from moving bytes"),
    "right_reading_wrong_value": (
        answer(6, 5),
        "the reading is right; its value in the profile is",
    ),
    "not_a_reading": (answer(8, 0), "must be the number of a reading, 0 to 7"),
}


@triton.jit
def _untransposed_kernel(x_ptr, out_ptr, rows, cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Loads the tile right, stores it without tl.trans: out[c, r] gets x[c', r'] of the wrong
    place."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (r[:, None] < rows) & (c[None, :] < cols)
    tile = tl.load(x_ptr + r[:, None] * cols + c[None, :], mask=mask)
    tl.store(out_ptr + c[:, None] * rows + r[None, :], tile, mask=tl.trans(mask))


@triton.jit
def _tiled_kernel(x_ptr, out_ptr, rows, cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """The fix, as the solution writes it."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (r[:, None] < rows) & (c[None, :] < cols)
    tile = tl.load(x_ptr + r[:, None] * cols + c[None, :], mask=mask)
    tl.store(out_ptr + c[:, None] * rows + r[None, :], tl.trans(tile), mask=tl.trans(mask))


@triton.jit
def _naive_kernel(x_ptr, out_ptr, rows, cols, BLOCK: tl.constexpr):
    """The slow kernel, written again by the student: correct, and no faster."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < rows * cols
    tl.store(
        out_ptr + offsets,
        tl.load(x_ptr + (offsets % rows) * cols + offsets // rows, mask=mask),
        mask=mask,
    )


def _fix(kernel_launch):
    def fn(x, out=None):
        check_transpose("transpose", x, out)
        rows, cols = x.shape
        out = torch.empty(cols, rows, dtype=x.dtype, device=x.device) if out is None else out
        if x.numel():
            kernel_launch(x, out, rows, cols)
        return out

    return fn


def _tiles(kernel):
    def launch(x, out, rows, cols):
        grid = (triton.cdiv(rows, BLOCK_R), triton.cdiv(cols, BLOCK_C))
        kernel[grid](
            x,
            out,
            rows,
            cols,
            BLOCK_R=BLOCK_R,
            BLOCK_C=BLOCK_C,
            num_warps=runtime.pick(gpu=4, cpu=1),
        )

    return launch


def _naive(x, out, rows, cols):
    _naive_kernel[(triton.cdiv(rows * cols, BLOCK),)](
        x, out, rows, cols, BLOCK=BLOCK, num_warps=runtime.pick(gpu=4, cpu=1)
    )


TRANSPOSE = {
    "untransposed_tile": (_fix(_tiles(_untransposed_kernel)), "elements wrong"),
    "calls_the_course_kernel": (
        lambda x, out=None: transpose.transpose_tiled(x, out),
        "launches the course's kernel instead of its own",
    ),
    "torch_copy": (_fix(lambda x, out, rows, cols: out.copy_(x.t())), "launched no Triton kernel"),
}
RIGHT_FIX = _fix(_tiles(_tiled_kernel))
# Correct, and graded as such; on a GPU its speed is the slow kernel's: far below the course's fix.
NOT_FASTER = _fix(_naive)
