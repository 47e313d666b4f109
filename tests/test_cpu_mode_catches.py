"""CPU mode fails what a GPU would fail, and says why.

* A masked `tl.load` without `other=` reads NaN in the interpreter (kernels/interpreter_poison.py),
  so a kernel that sums those lanes fails its check there, with a message naming the load; on a
  GPU the lanes are undefined, and the same kernel is wrong by luck.
* Lab 02's fused add must normalize h as rounded to the dtype: a kernel that skips the
  rounding fails.
* Lab 02's rms_norm with the mean divided by BLOCK instead of the width is told that only widths
  that are not powers of two fail, not that its precision is low.
"""

import pytest
import torch
import triton
import triton.language as tl

from grading.harness import check_function
from grading.labs import get_lab
from kernels import interpreter_poison, runtime
from kernels.rmsnorm.validate import check_rmsnorm_args, rows_view
from kernels.testing import random_tensor

LAB = get_lab("02_rmsnorm")


@triton.jit
def _row_sum(x_ptr, y_ptr, n, BLOCK: tl.constexpr, OTHER: tl.constexpr):
    col = tl.arange(0, BLOCK)
    if OTHER:
        x = tl.load(x_ptr + col, mask=col < n, other=0.0)
    else:
        x = tl.load(x_ptr + col, mask=col < n)  # the masked lanes are undefined on a GPU
    tl.store(y_ptr, tl.sum(x.to(tl.float32), axis=0).to(y_ptr.dtype.element_ty))


@pytest.mark.cpu
def test_masked_lanes_without_other_read_nan_in_cpu_mode():
    x = random_tensor((100,), torch.float32, "cpu", torch.Generator().manual_seed(0))
    y = torch.empty(1)
    interpreter_poison.clear()
    _row_sum[(1,)](x, y, 100, BLOCK=128, OTHER=True)
    assert torch.allclose(y, x.sum()) and interpreter_poison.unfilled_loads() == []
    _row_sum[(1,)](x, y, 100, BLOCK=128, OTHER=False)
    assert torch.isnan(y).all()
    (site,) = interpreter_poison.unfilled_loads()
    assert site.startswith("test_cpu_mode_catches.py:")
    assert "masked lanes read without other=" in interpreter_poison.hint()
    # no lane masked: nothing to poison (on a tensor of the block's length: reading past x's 100
    # elements would sum whatever memory follows it, NaN included)
    full = random_tensor((128,), torch.float32, "cpu", torch.Generator().manual_seed(1))
    _row_sum[(1,)](full, y, 128, BLOCK=128, OTHER=False)
    assert torch.allclose(y, full.sum())


@triton.jit
def _rmsnorm(x_ptr, w_ptr, y_ptr, width, xs, ys, eps, BLOCK: tl.constexpr, MISTAKE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    col = tl.arange(0, BLOCK)
    mask = col < width
    if MISTAKE == "load_without_other":
        x = tl.load(x_ptr + row * xs + col, mask=mask).to(tl.float32)
    else:
        x = tl.load(x_ptr + row * xs + col, mask=mask, other=0.0).to(tl.float32)
    if MISTAKE == "mean_over_block":
        mean_sq = tl.sum(x * x, axis=0) / BLOCK
    else:
        mean_sq = tl.sum(x * x, axis=0) / width
    rstd = 1.0 / tl.sqrt(mean_sq + eps)
    w = tl.load(w_ptr + col, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * ys + col, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)


def _rms_norm(mistake: str):
    def rms_norm(x, w, eps=1e-6, out=None):
        check_rmsnorm_args("rms_norm", x, w, eps, out, device_type=runtime.DEVICE)
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
        if x.numel():
            x2d, y2d = rows_view(x), rows_view(out)
            width = x2d.shape[1]
            _rmsnorm[(x2d.shape[0],)](x2d, w, y2d, width, x2d.stride(0), y2d.stride(0), eps,
                                      BLOCK=triton.next_power_of_2(width), MISTAKE=mistake)
        return out

    return rms_norm


@pytest.mark.cpu
def test_the_grader_names_a_load_without_other():
    result = check_function(LAB, "rms_norm", _rms_norm("load_without_other"), seed=7, perf=False)
    assert result.status == "fail", result.message
    assert "masked lanes read without other=" in result.message, result.message
    assert "test_cpu_mode_catches.py:" in result.message, result.message


def test_a_mean_over_block_is_told_only_non_power_of_two_widths_fail():
    result = check_function(LAB, "rms_norm", _rms_norm("mean_over_block"), seed=7, perf=False)
    assert result.status == "fail", result.message
    assert "only widths that are not powers of two" in result.message, result.message
    assert "lower precision" not in result.message, result.message


@triton.jit
def _fused(x_ptr, res_ptr, w_ptr, y_ptr, h_ptr, width, eps, BLOCK: tl.constexpr,
           ROUND_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    col = tl.arange(0, BLOCK)
    mask = col < width
    offsets = row * width + col
    h = (tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
         + tl.load(res_ptr + offsets, mask=mask, other=0.0).to(tl.float32))
    tl.store(h_ptr + offsets, h.to(h_ptr.dtype.element_ty), mask=mask)
    if ROUND_H:  # normalize h as the model stores it
        h = h.to(h_ptr.dtype.element_ty).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / width + eps)
    w = tl.load(w_ptr + col, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offsets, (h * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)


def _fused_add_rms_norm(round_h: bool):
    def fused_add_rms_norm(x, residual, w, eps=1e-6, out=None):
        y, h = (torch.empty_like(x), torch.empty_like(x)) if out is None else out
        if x.numel():
            width = x.shape[-1]
            _fused[(x.numel() // width,)](x, residual, w, y, h, width, eps,
                                          BLOCK=triton.next_power_of_2(width), ROUND_H=round_h)
        return y, h

    return fused_add_rms_norm


def test_a_fused_add_that_normalizes_h_before_rounding_it_fails():
    skipped = check_function(LAB, "fused_add_rms_norm", _fused_add_rms_norm(False), seed=7,
                             perf=False)
    assert skipped.status == "fail", skipped.message
    rounded = check_function(LAB, "fused_add_rms_norm", _fused_add_rms_norm(True), seed=7,
                             perf=False)
    assert rounded.status == "pass", rounded.message


def test_the_course_kernels_pass_with_the_tolerances_and_the_poison():
    for name in ("rms_norm", "fused_add_rms_norm"):
        result = check_function(LAB, name, LAB.function(name).course_kernel, seed=7, perf=False)
        assert result.status == "pass", (name, result.message)


@pytest.mark.cpu
def test_a_poisoned_nan_is_told_from_an_unwritten_one():
    x = random_tensor((100,), torch.float32, "cpu", torch.Generator().manual_seed(1))
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        y = torch.full((1,), float("nan"), dtype=dtype)
        assert interpreter_poison.computed_nans(y) == 0  # never written
        _row_sum[(1,)](x.to(dtype), y, 100, BLOCK=128, OTHER=False)
        assert interpreter_poison.computed_nans(y) == 1, dtype


@triton.jit
def _copy_scalar_with_zero_other(x_ptr, y_ptr, n):
    i = tl.program_id(0)
    x = tl.load(x_ptr + i, mask=i < n, other=0.0)  # a scalar other=0.0 is still an other=
    tl.store(y_ptr + i, x)


@pytest.mark.cpu
def test_other_zero_is_not_taken_for_no_other():
    x = random_tensor((100,), torch.float32, "cpu", torch.Generator().manual_seed(2))
    y = torch.empty(128)
    interpreter_poison.clear()
    _copy_scalar_with_zero_other[(128,)](x, y, 100)
    assert torch.equal(y[:100], x) and (y[100:] == 0).all()
    assert interpreter_poison.unfilled_loads() == []
