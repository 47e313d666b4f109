"""RMSNorm in Triton: forward (any width, strided rows, fp8 input), fused add, backward.

Each program normalizes ROWS rows at once: a [ROWS, BLOCK] tile, BLOCK the width rounded up to a
power of two and masked, so any width works (1000, 5120, ...). The tile is loaded once, reduced
along its rows with `tl.sum`, scaled and stored: the row is read from memory once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import runtime
from kernels.rmsnorm.validate import check_rmsnorm_args, rows_view
from kernels.validate import FLOAT_DTYPES

FP8_DTYPES = (torch.float8_e4m3fn,)
# Elements one program holds: a 4096-element tile (several narrow rows, or one wide row) with a warp
# per 512 elements of real data measured best on an H200 (a sweep of ROWS x num_warps at 64M
# elements, kernels/rmsnorm/PERFORMANCE.md). On the CPU the interpreter's cost grows with the number
# of programs, so it gets few, large ones.
TILE_ELEMENTS = runtime.pick(gpu=4096, cpu=65536)


def tile(
    rows: int, width: int, rows_per_program: int | None = None, num_warps: int | None = None
) -> tuple[int, int, int]:
    """(ROWS, BLOCK, num_warps) for rows of `width` elements; arguments override the defaults."""
    block = triton.next_power_of_2(width)
    if rows_per_program is None:
        rows_per_program = max(1, min(triton.next_power_of_2(rows), TILE_ELEMENTS // block))
    if num_warps is None:
        warps = max(1, min(16, rows_per_program * width // 512))
        # a power of two, rounded down
        num_warps = runtime.pick(gpu=1 << (warps.bit_length() - 1), cpu=1)
    return rows_per_program, block, num_warps


@triton.jit
def rmsnorm_fwd_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    rstd_ptr,
    rows,
    width,
    x_row_stride,
    y_row_stride,
    eps,
    x_scale,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    STORE_RSTD: tl.constexpr,
    ACC: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    col = tl.arange(0, BLOCK)
    mask = (row[:, None] < rows) & (col[None, :] < width)
    x = tl.load(x_ptr + row[:, None] * x_row_stride + col[None, :], mask=mask, other=0.0).to(ACC)
    x = x * x_scale  # 1.0 except for fp8 inputs, which carry a per-tensor scale
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / width + eps)
    w = tl.load(w_ptr + col, mask=col < width, other=0.0).to(ACC)
    y = x * rstd[:, None] * w[None, :]
    tl.store(
        y_ptr + row[:, None] * y_row_stride + col[None, :], y.to(y_ptr.dtype.element_ty), mask=mask
    )
    if STORE_RSTD:  # saved for the backward pass: one float per row
        tl.store(rstd_ptr + row, rstd, mask=row < rows)


@triton.jit
def fused_add_rmsnorm_kernel(
    x_ptr, res_ptr, w_ptr, y_ptr, h_ptr, rows, width, eps, ROWS: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    col = tl.arange(0, BLOCK)
    mask = (row[:, None] < rows) & (col[None, :] < width)
    offsets = row[:, None] * width + col[None, :]
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    residual = tl.load(res_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    h = x + residual
    # The model stores h in its dtype and the next layer normalizes what it stored: round first, so
    # y equals rmsnorm(x + residual) computed unfused.
    h = h.to(h_ptr.dtype.element_ty)
    tl.store(h_ptr + offsets, h, mask=mask)
    h = h.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=1) / width + eps)
    w = tl.load(w_ptr + col, mask=col < width, other=0.0).to(tl.float32)
    tl.store(
        y_ptr + offsets, (h * rstd[:, None] * w[None, :]).to(y_ptr.dtype.element_ty), mask=mask
    )


def _acc(dtype: torch.dtype):
    """Accumulate in float32, or in float64 for float64 inputs (torch.autograd.gradcheck)."""
    return tl.float64 if dtype == torch.float64 else tl.float32


def _forward(x, w, eps, out, *, x_scale=1.0, rstd=None, **tiling):
    """y = rmsnorm(x * x_scale) * w into `out`; the per-row 1/rms into `rstd` if given."""
    x2d, y2d = rows_view(x), rows_view(out)
    rows, width = x2d.shape
    rows_per_program, block, num_warps = tile(rows, width, **tiling)
    rmsnorm_fwd_kernel[(triton.cdiv(rows, rows_per_program),)](
        x2d,
        w,
        y2d,
        rstd if rstd is not None else y2d,  # not written unless STORE_RSTD
        rows,
        width,
        x2d.stride(0),
        y2d.stride(0),
        eps,
        x_scale,
        ROWS=rows_per_program,
        BLOCK=block,
        STORE_RSTD=rstd is not None,
        ACC=_acc(x.dtype),
        num_warps=num_warps,
    )
    return out


def rms_norm(
    x: torch.Tensor,
    w: torch.Tensor,
    eps: float = 1e-6,
    out: torch.Tensor | None = None,
    *,
    rows_per_program: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """y = x / sqrt(mean(x^2, -1) + eps) * w; x of any width, rows may be strided (stride > width).

    `rows_per_program` (a power of two) and `num_warps` override the tiling, for sweeps.
    (triton_pdl.rms_norm_pdl is this kernel launched to overlap the GEMM before it.)"""
    check_rmsnorm_args("rms_norm", x, w, eps, out, device_type=runtime.DEVICE)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
    if not x.numel():
        return out
    return _forward(x, w, eps, out, rows_per_program=rows_per_program, num_warps=num_warps)


def rms_norm_fp8(
    x: torch.Tensor,
    x_scale: float,
    w: torch.Tensor,
    eps: float = 1e-6,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """RMSNorm of an fp8 (e4m3) tensor that represents x * x_scale, in float32, to `out_dtype`.
    Where Triton has no e4m3 (GPUs before sm_89), PyTorch converts x to float32 first: exact, so
    the same result, for 4 more bytes read per element."""
    if not isinstance(x, torch.Tensor) or x.dtype not in FP8_DTYPES:
        raise TypeError(
            f"rms_norm_fp8: x must be a float8_e4m3fn tensor, got "
            f"{getattr(x, 'dtype', type(x).__name__)}"
        )
    if not x_scale > 0:
        raise ValueError(f"rms_norm_fp8: x_scale must be positive, got {x_scale}")
    if out_dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"rms_norm_fp8: out_dtype must be one of float32, float16, bfloat16, not {out_dtype}"
        )
    check_rmsnorm_args(
        "rms_norm_fp8",
        x,
        w,
        eps,
        None,
        device_type=runtime.DEVICE,
        dtypes=FLOAT_DTYPES + FP8_DTYPES,
    )
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    if not runtime.has("fp8"):
        x = x.float()
    return _forward(x, w, eps, out, x_scale=float(x_scale)) if x.numel() else out


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    w: torch.Tensor,
    eps: float = 1e-6,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """h = x + residual; y = rmsnorm(h) * w, in one pass: returns (y, h), written into `out` if
    given. Reads x, residual and w once, writes y and h once (vLLM's fused_add_rms_norm, not in
    place)."""
    check_rmsnorm_args("fused_add_rms_norm", x, w, eps, None, device_type=runtime.DEVICE)
    check_rmsnorm_args("fused_add_rms_norm", residual, w, eps, None, device_type=runtime.DEVICE)
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(
            f"fused_add_rms_norm: residual {tuple(residual.shape)} {residual.dtype} must match "
            f"x {tuple(x.shape)} {x.dtype}"
        )
    if not (x.is_contiguous() and residual.is_contiguous()):
        raise ValueError("fused_add_rms_norm: x and residual must be contiguous")
    if out is not None and not all(
        isinstance(t, torch.Tensor)
        and t.shape == x.shape
        and t.dtype == x.dtype
        and t.is_contiguous()
        for t in out
    ):
        raise ValueError(
            "fused_add_rms_norm: out must be a pair of contiguous tensors shaped like x"
        )
    y, h = (torch.empty_like(x), torch.empty_like(x)) if out is None else out
    if x.numel():
        width = x.shape[-1]
        rows = x.numel() // width
        rows_per_program, block, num_warps = tile(rows, width)
        fused_add_rmsnorm_kernel[(triton.cdiv(rows, rows_per_program),)](
            x,
            residual,
            w,
            y,
            h,
            rows,
            width,
            eps,
            ROWS=rows_per_program,
            BLOCK=block,
            num_warps=num_warps,
        )
    return y, h


# --------------------------------------------------------------------------------------------------
# Backward. With r = rstd of a row, y = x * r * w:
#   dx = r * (dy * w - x * r^2 * mean(dy * w * x))        (per row)
#   dw = sum over rows of dy * x * r                        (a reduction across rows)
# dw is the hard part: every row contributes to every element. Atomics on bf16 are slow and
# non-deterministic, so each program accumulates its rows' contributions in float32 registers and
# writes one partial row; a second kernel adds the partials.


@triton.jit
def rmsnorm_bwd_kernel(
    dy_ptr,
    x_ptr,
    w_ptr,
    rstd_ptr,
    dx_ptr,
    dw_partial_ptr,
    rows,
    width,
    rows_per_program,
    BLOCK: tl.constexpr,
    ACC: tl.constexpr,
):
    pid = tl.program_id(0)
    col = tl.arange(0, BLOCK)
    cmask = col < width
    w = tl.load(w_ptr + col, mask=cmask, other=0.0).to(ACC)
    dw = tl.zeros([BLOCK], dtype=ACC)
    first = pid.to(tl.int64) * rows_per_program
    for i in range(0, rows_per_program):
        row = first + i
        if row < rows:
            x = tl.load(x_ptr + row * width + col, mask=cmask, other=0.0).to(ACC)
            dy = tl.load(dy_ptr + row * width + col, mask=cmask, other=0.0).to(ACC)
            r = tl.load(rstd_ptr + row)
            dyw = dy * w
            dx = r * (dyw - x * (r * r) * (tl.sum(dyw * x, axis=0) / width))
            tl.store(dx_ptr + row * width + col, dx.to(dx_ptr.dtype.element_ty), mask=cmask)
            dw += dy * x * r
    tl.store(dw_partial_ptr + pid.to(tl.int64) * width + col, dw, mask=cmask)


@triton.jit
def sum_partials_kernel(
    partial_ptr,
    out_ptr,
    n_partials,
    width,
    BLOCK_P: tl.constexpr,
    BLOCK_W: tl.constexpr,
    ACC: tl.constexpr,
):
    col = tl.program_id(0) * BLOCK_W + tl.arange(0, BLOCK_W)
    acc = tl.zeros([BLOCK_W], dtype=ACC)
    for p0 in range(0, n_partials, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        partials = tl.load(
            partial_ptr + p[:, None] * width + col[None, :],
            mask=(p[:, None] < n_partials) & (col[None, :] < width),
            other=0.0,
        )
        acc += tl.sum(partials, axis=0)
    tl.store(out_ptr + col, acc.to(out_ptr.dtype.element_ty), mask=col < width)


BWD_PROGRAMS_PER_SM = (
    2  # H200, 32768x4096 bf16: 2 per SM 255 us, 4: 280, 8: 348 (data/results/h200)
)


def rms_norm_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    w: torch.Tensor,
    rstd: torch.Tensor,
    *,
    programs_per_sm: int = BWD_PROGRAMS_PER_SM,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dw) for contiguous dy and x of shape (rows, width); rstd from the forward pass."""
    rows, width = x.shape
    block = triton.next_power_of_2(width)
    # A few programs per SM on a GPU: each walks a slice of the rows; fewer programs = fewer
    # partials.
    programs = (
        min(rows, programs_per_sm * runtime.gpu_info().sm_count) if runtime.ON_GPU else min(rows, 4)
    )
    rows_per_program = triton.cdiv(rows, programs)
    programs = triton.cdiv(rows, rows_per_program)
    dx = torch.empty_like(x)
    partial = torch.empty(programs, width, dtype=rstd.dtype, device=x.device)
    rmsnorm_bwd_kernel[(programs,)](
        dy,
        x,
        w,
        rstd,
        dx,
        partial,
        rows,
        width,
        rows_per_program,
        BLOCK=block,
        ACC=_acc(x.dtype),
        num_warps=runtime.pick(gpu=max(1, min(16, block // 256)), cpu=1),
    )
    dw = torch.empty_like(w)
    # Narrow column strips, so the second pass has enough programs to fill the GPU.
    block_w = min(block, runtime.pick(gpu=32, cpu=256))
    sum_partials_kernel[(triton.cdiv(width, block_w),)](
        partial,
        dw,
        programs,
        width,
        BLOCK_P=runtime.pick(gpu=64, cpu=8),
        BLOCK_W=block_w,
        ACC=_acc(x.dtype),
    )
    return dx, dw


class RMSNormFunction(torch.autograd.Function):
    """RMSNorm with the Triton forward and backward, for `loss.backward()`."""

    @staticmethod
    def forward(ctx, x, w, eps):
        check_rmsnorm_args(
            "RMSNormFunction",
            x,
            w,
            eps,
            None,
            device_type=runtime.DEVICE,
            dtypes=FLOAT_DTYPES + (torch.float64,),
        )
        x2d = rows_view(x.contiguous())
        y = torch.empty_like(x2d)
        rstd = torch.empty(
            x2d.shape[0],
            dtype=torch.float64 if x.dtype == torch.float64 else torch.float32,
            device=x.device,
        )
        if x.numel():
            _forward(x2d, w, eps, y, rstd=rstd)
        ctx.save_for_backward(x2d, w, rstd)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2d, w, rstd = ctx.saved_tensors
        dx, dw = rms_norm_backward(dy.contiguous().view(x2d.shape), x2d, w, rstd)
        return dx.view(dy.shape), dw, None


def rms_norm_autograd(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return RMSNormFunction.apply(x, w, eps)
