"""Lab 02: RMSNorm as a CUDA C row reduction, in Triton, and fused with the residual add."""

from __future__ import annotations

import torch

from grading.spec import Case, GradedFunction, LabSpec, PerfConfig
from kernels import runtime
from kernels.rmsnorm import cupy_rmsnorm, reference, triton_rmsnorm
from kernels.testing import random_tensor

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Widths 1, 1000 (not a multiple of any block), 4096 and 5120 (not a power of two); rows 1, 3 and
# MANY_ROWS, in one dtype each: a partial last block of rows, after one or more full ones for a
# program of up to 4096 rows (256 on a CPU). On a CPU 257: the interpreter pays per program, and
# 4097 rows made this lab take two minutes to grade there, nearly all of it in these two cases.
MANY_ROWS = runtime.pick(gpu=4097, cpu=257)
SHAPES = ((1, 1), (3, 1000), (1, 4096), (3, 5120))
EPS = 1e-6
CASES = tuple(Case(shape, dtype) for shape in SHAPES for dtype in DTYPES) + (
    Case((MANY_ROWS, 64), torch.float32),
    Case((MANY_ROWS, 1), torch.bfloat16),
    # rows 1000 wide inside a 1024-wide buffer: the row stride is not the width
    Case((33, 1000), torch.bfloat16, "strided_rows"),
    Case((33, 1000), torch.float32, "strided_rows"),
    # values around 1e-3, so mean(x^2) is about eps: a kernel that drops eps is 40% off
    Case((5, 1000), torch.float32, "tiny"),
    Case((5, 4096), torch.bfloat16, "tiny"),
    # a non-default eps, passed by keyword
    Case((3, 1000), torch.float32, "contiguous", params=(("eps", 0.5),)),
)


def draw_cases(rng) -> tuple[Case, ...]:
    """Shapes drawn per run from the secret seed, one per class a wrong kernel can hide in: an even
    width, a multiple of the 4096-wide block, rows wider than 16384 and rows wider than 65536 (any
    width is promised), more than 2**17 elements, and x of three dimensions (x is (..., width))."""
    dtype = rng.choice(DTYPES)
    return (
        Case((rng.randrange(2, 6), 2 * rng.randrange(2, 2048)), dtype),
        Case((rng.randrange(1, 4), 4096 * rng.randrange(2, 4)), rng.choice(DTYPES)),
        Case((rng.randrange(1, 3), rng.randrange(2**14 + 1, 2**16)), torch.float32),
        Case((rng.randrange(2, 4), rng.randrange(2**14 + 1, 2**16)), torch.bfloat16),
        Case((1, rng.randrange(2**16 + 1, 2**17)), torch.float32),
        Case((rng.randrange(40, 64), 2 * rng.randrange(2048, 4096) + 1), rng.choice(DTYPES)),
        Case((2, rng.randrange(2, 5), rng.randrange(100, 1000)), rng.choice(DTYPES)),
    )


FUSED_CASES = tuple(c for c in CASES if c.layout != "strided_rows")  # x and residual are contiguous
PERF_SHAPE = (32768, 4096)


def _rmsnorm_inputs(shape, dtype, device, gen):
    return random_tensor(shape, dtype, device, gen), random_tensor(shape[-1:], dtype, device, gen)


def _fused_inputs(shape, dtype, device, gen):
    return (
        random_tensor(shape, dtype, device, gen),
        random_tensor(shape, dtype, device, gen),
        random_tensor(shape[-1:], dtype, device, gen),
    )


def _layout(layout, inputs):
    """x is the first input: make its rows strided, or its values tiny."""
    x, *rest = inputs
    if layout == "strided_rows":
        wide = torch.empty(x.shape[0], x.shape[1] + 24, dtype=x.dtype, device=x.device)
        view = wide[:, : x.shape[1]]
        view.copy_(x)
        return (view, *rest)
    if layout == "tiny":
        return (x * 1e-3, *rest)
    return inputs


def _fused_layout(layout, inputs):
    if layout == "tiny":
        x, res, w = inputs
        return x * 1e-3, res * 1e-3, w
    return inputs


def _torch_rms_norm(x, w, eps=EPS, out=None):
    return reference.rms_norm(
        x, w, eps
    )  # F.rms_norm has no out=: timed as PyTorch runs it, allocating


def _course_fused(x, residual, w, eps=EPS, out=None):
    return triton_rmsnorm.fused_add_rms_norm(x, residual, w, eps, out=out)


def _torch_fused(x, residual, w, eps=EPS, out=None):
    return reference.fused_add_rms_norm(x, residual, w, eps)


def _rmsnorm_bytes(x, w, eps=EPS):
    return 2 * x.numel() * x.element_size() + w.numel() * w.element_size()


def _fused_bytes(x, residual, w, eps=EPS):
    return (
        4 * x.numel() * x.element_size() + w.numel() * w.element_size()
    )  # read x, residual; write y, h


def _mean_over_block(oname, result, want, bad, x, w, eps=EPS) -> str:
    """Every row off by one factor, sqrt(BLOCK / width), and only where the width is not a power
    of two: the mean of the squares was divided by the block, not by the width."""
    width = x.shape[-1]
    block = 1 << max(0, width - 1).bit_length()
    if block == width or not bool(bad.any()):
        return ""
    ratio = result.double() / want.double()
    ratio = ratio[torch.isfinite(ratio) & (want.abs() > 1e-3)]
    if not ratio.numel() or abs(float(ratio.median()) - (block / width) ** 0.5) > 0.01:
        return ""
    return (f"every y is {float(ratio.median()):.4f}x too large, the square root of "
            f"{block}/{width}, and only widths that are not powers of two fail (here {width}): "
            f"is the mean of the squares divided by BLOCK instead of the width?")


def _rmsnorm_function(name, backend, course_kernel, points, description, hint):
    return GradedFunction(
        name=name,
        points=points,
        backend=backend,
        description=description,
        make_inputs=_rmsnorm_inputs,
        prepare=_layout,
        reference_fp64=reference.rms_norm_fp64,
        tolerance=reference.tolerance,
        course_kernel=course_kernel,
        torch_native=_torch_rms_norm,
        bytes_moved=_rmsnorm_bytes,
        cases=CASES,
        perf=(PerfConfig(f"{name}/bf16/32768x4096", PERF_SHAPE, torch.bfloat16),),
        hint=hint,
        input_names=("x", "w"),
        draw_cases=draw_cases,
        diagnose=_mean_over_block,
    )


LAB = LabSpec(
    id="02_rmsnorm",
    title="RMSNorm: a row reduction in CUDA C and Triton, and the fused residual add",
    functions=(
        _rmsnorm_function(
            "rms_norm_cuda",
            "cupy",
            cupy_rmsnorm.rms_norm,
            4,
            "CuPy RawKernel: one block per row, warp shuffle + shared-memory reduction",
            "every thread must add its partial sum, and the block must add every warp's",
        ),
        _rmsnorm_function(
            "rms_norm",
            "triton",
            triton_rmsnorm.rms_norm,
            3,
            "Triton: any width, strided rows",
            "mask the columns past the width, find a row with its stride, add eps under the "
            "square root, and sum the squares in float32",
        ),
        GradedFunction(
            name="fused_add_rms_norm",
            points=3,
            backend="triton",
            description="Triton: h = x + residual; y = rmsnorm(h) * w in one pass, returning "
            "(y, h)",
            make_inputs=_fused_inputs,
            prepare=_fused_layout,
            reference_fp64=reference.fused_add_rms_norm_fp64,
            tolerance=reference.fused_tolerance,
            n_outputs=2,
            output_names=("y", "h"),
            bit_exact=lambda x, residual, w, eps=EPS: (None, x + residual),
            exact_dtypes=(
                torch.float32,
                torch.float16,
            ),  # the interpreter truncates float32 -> bfloat16
            course_kernel=_course_fused,
            torch_native=_torch_fused,
            bytes_moved=_fused_bytes,
            cases=FUSED_CASES,
            perf=(PerfConfig("fused_add_rms_norm/bf16/32768x4096", PERF_SHAPE, torch.bfloat16),),
            hint="round x + residual to the dtype before normalizing it, and return (y, h)",
            input_names=("x", "residual", "w"),
            draw_cases=draw_cases,
        ),
    ),
)
