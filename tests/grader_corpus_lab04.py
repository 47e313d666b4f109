"""Known-wrong lab 04 submissions, as plain Triton functions, and what the grader must say.

Each is the lab's solution with one mistake a student makes."""

import torch
import triton
import triton.language as tl

from kernels import runtime
from kernels.mixed_precision.triton_fp8 import round_to_fp8

BLOCK = runtime.pick(gpu=1024, cpu=16384)


@triton.jit
def _kahan(x_ptr, out_ptr, n, row_stride, BLOCK: tl.constexpr, MISTAKE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK)
    s = tl.zeros([BLOCK], dtype=tl.float32)
    c = tl.zeros([BLOCK], dtype=tl.float32)
    end = n
    if MISTAKE == "skips_last_full_block":
        # full blocks up to n - BLOCK, then a masked tail at n // BLOCK * BLOCK, empty when n is a
        # multiple of BLOCK: the last full block is never added
        end = tl.where(n % BLOCK == 0, n - BLOCK, n)
    for start in range(0, end, BLOCK):
        idx = start + lanes
        x = tl.load(x_ptr + row * row_stride + idx, mask=idx < n, other=0.0)
        y = x - c
        t = s + y
        if MISTAKE == "compensation_in_one_expression":
            c = t - (
                s + y
            )  # "simplified": s + y rounds exactly as t did, so c is always 0: a naive sum
        else:
            c = (t - s) - y
        s = t
    tl.store(out_ptr + row, tl.sum(s.to(tl.float64) - c.to(tl.float64), axis=0).to(tl.float32))


def kahan_submission(mistake: str):
    def kahan_sum(x, out=None):
        if x.dim() != 2 or x.stride(1) != 1:
            raise ValueError("kahan_sum: x must be rows (rows, n) with contiguous rows")
        out = torch.empty(x.shape[0], dtype=torch.float32, device=x.device) if out is None else out
        if x.shape[0]:
            # rows_at_stride_n: row r read at r * n, as if the rows were back to back
            stride = x.shape[1] if mistake == "rows_at_stride_n" else x.stride(0)
            _kahan[(x.shape[0],)](x, out, x.shape[1], stride, BLOCK=BLOCK, MISTAKE=mistake)
        return out

    return kahan_sum


@triton.jit
def _fake_quant(
    x_ptr, out_ptr, n, GROUPS: tl.constexpr, BLOCK: tl.constexpr, MISTAKE: tl.constexpr
):
    blk = tl.program_id(0).to(tl.int64) * GROUPS + tl.arange(0, GROUPS)
    offsets = blk[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if MISTAKE == "scale_from_mean":
        amax = (
            tl.sum(tl.abs(x), axis=1) / BLOCK
        )  # the mean |x|: most blocks' large values overflow it
    else:
        amax = tl.max(tl.abs(x), axis=1)
    exponent = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
    scale = tl.where(amax > 0, ((exponent - 8) << 23).to(tl.float32, bitcast=True), 1.0)[:, None]
    v = tl.math.div_rn(x, scale)
    if MISTAKE != "no_clamp":
        v = tl.minimum(tl.maximum(v, -448.0), 448.0)
    q = round_to_fp8(v, 3, 2.0**-6, 2.0**14)
    tl.store(out_ptr + offsets, (q * scale).to(out_ptr.dtype.element_ty), mask=mask)


def fp8_submission(mistake: str):
    def fp8_block_fake_quant(x, out=None):
        if not x.is_contiguous():
            raise ValueError("fp8_block_fake_quant: x must be contiguous")
        out = torch.empty_like(x) if out is None else out
        n = x.numel()
        if mistake == "zero_dimensions_mishandled":
            n = len(x) * x[0].numel()  # rows times a row's elements: a 0-d tensor has no len()
        if mistake == "three_dimensions_mishandled" and x.dim() == 3:
            n = x.shape[0] * x.shape[1]  # (a, b, c) taken for a matrix (a, b)
        if n:
            blocks = triton.cdiv(n, 128)
            groups = min(runtime.pick(gpu=32, cpu=256), triton.next_power_of_2(blocks))
            programs = triton.cdiv(blocks, groups)
            if mistake == "last_program_skipped" and n % (groups * 128) == 0:
                programs -= 1  # the tail program, empty when the programs divide n evenly
            _fake_quant[(programs,)](x, out, n, GROUPS=groups, BLOCK=128, MISTAKE=mistake)
        return out

    return fp8_block_fake_quant


# function graded, submission factory, and the failure message's expected beginning and diagnosis
CORPUS = {
    "compensation_in_one_expression": (
        "kahan_sum",
        kahan_submission,
        "1 float32 drift n=10000000: n=1: 1 of 1 elements wrong",
        "(hint: keep a compensation per lane",
    ),
    # the largest values of a block whose amax has a mantissa above 1.8125 land above 464: 480
    # or 512, not 448
    # which case first holds a value the missing clamp rounds past 448 depends on the random inputs,
    # which differ between the CPU and CUDA generators: the CPU's first is 3x5000, the H100's 1000
    "no_clamp": (
        "fp8_block_fake_quant",
        fp8_submission,
        "elements wrong; first bad index",
        "(hint: scale",
    ),
    "scale_from_mean": (
        "fp8_block_fake_quant",
        fp8_submission,
        "1 float32: n=1: 1 of 1 elements wrong",
        "(hint: scale",
    ),
}


# Wrong submissions that every fixed case lets through, caught by the class of cases drawn per run
# (draw_sum_cases, draw_fp8_cases): mistake -> (function, submission factory, the index of that
# class among the drawn cases, what the grader says there).
DRAWN_CORPUS = {
    # n a multiple of 16384: the last 16384 (CPU) or 1024 (GPU) elements of each row left out
    "skips_last_full_block": ("kahan_sum", kahan_submission, 0, "elements wrong"),
    # rows 40 elements apart more than n: every row after the first summed from the wrong place
    "rows_at_stride_n": ("kahan_sum", kahan_submission, 2, "elements wrong; first bad index 1"),
    # a multiple of 32768 elements: the last 256 (CPU) or 32 (GPU) blocks never written
    "last_program_skipped": (
        "fp8_block_fake_quant", fp8_submission, 0, "NaN: elements never written"
    ),
    "three_dimensions_mishandled": (
        "fp8_block_fake_quant", fp8_submission, 1, "NaN: elements never written"
    ),
    "zero_dimensions_mishandled": (
        "fp8_block_fake_quant", fp8_submission, 3, "TypeError: len() of a 0-d tensor"
    ),
}
