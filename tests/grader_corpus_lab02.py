"""Known-wrong RMSNorm submissions (lab 02), as plain Triton functions, and what the grader must
say.

Each is the lab's `rms_norm` with one mistake a student makes."""

import torch
import triton
import triton.language as tl

from kernels import runtime
from kernels.rmsnorm.validate import check_rmsnorm_args, rows_view


@triton.jit
def _rmsnorm(x_ptr, w_ptr, y_ptr, width, xs, ys, eps, BLOCK: tl.constexpr, MISTAKE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    col = tl.arange(0, BLOCK)
    mask = col < width
    x = tl.load(x_ptr + row * xs + col, mask=mask, other=0.0).to(tl.float32)
    if MISTAKE == "bf16_accumulation":
        # every square rounded to bfloat16 before it is summed: 8 significant bits
        squares = (x * x).to(tl.bfloat16).to(tl.float32)
    else:
        squares = x * x
    mean_sq = tl.sum(squares, axis=0) / width
    if MISTAKE == "missing_eps":
        rstd = 1.0 / tl.sqrt(mean_sq)
    else:
        rstd = 1.0 / tl.sqrt(mean_sq + eps)
    w = tl.load(w_ptr + col, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * ys + col, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)


def submission(mistake: str):
    def rms_norm(x, w, eps=1e-6, out=None):
        check_rmsnorm_args("rms_norm", x, w, eps, out, device_type=runtime.DEVICE)
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
        if x.numel():
            x2d, y2d = rows_view(x), rows_view(out)
            width = x2d.shape[1]
            block = triton.next_power_of_2(width)
            if mistake == "block_not_multiple" and block != width:
                block //= 2  # the width rounded down: a 1000-wide row's last columns untouched
            if mistake == "wide_rows_cut" and block > 8192:
                block = 8192  # rows up to 8192 wide are right; wider ones lose their last columns
            if mistake == "rows_cut_at_65536" and block > 65536:
                block = 65536  # a limit of its own: right for every width below 2**16
            _rmsnorm[(x2d.shape[0],)](
                x2d, w, y2d, width, x2d.stride(0), y2d.stride(0), eps, BLOCK=block, MISTAKE=mistake
            )
        return out

    return rms_norm


CORPUS = {
    # the reduction misses the last columns (every y is off) and they are never written (NaN)
    "block_not_multiple": "3x1000 float32: n=3000: 3000 of 3000 elements wrong; "
    "first bad index (0, 0)",
    "bf16_accumulation": "1x1 float32: n=1: 1 of 1 elements wrong",
    # without eps a single element normalizes to exactly +-w; with eps=1e-6 it does not
    "missing_eps": "1x1 float32: n=1: 1 of 1 elements wrong",
    # every fixed case is at most 5120 wide: only the rows drawn wider than 16384 show it
    "wide_rows_cut": "elements wrong",
    # every fixed case and every other drawn class is narrower than 65536
    "rows_cut_at_65536": "elements wrong",
}
DIAGNOSIS = {
    "block_not_multiple": "(1464 NaN: elements never written",
    "bf16_accumulation": "ulp of float32 where",
    "missing_eps": "ulp of float32 where",
    "wide_rows_cut": "NaN: elements never written",
    "rows_cut_at_65536": "NaN: elements never written",
}
