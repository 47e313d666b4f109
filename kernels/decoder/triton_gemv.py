"""y = x @ W.T for a handful of rows: the decoder's projections at decode time, as a weight stream.

At decode time x has one row per sequence (M = batch, 1 to 32) and W is an nn.Linear weight (N, K),
row-major. The bytes that must move are

    2 N K (the weight, once)  +  2 M K (x)  +  2 M N (y)            bf16 or fp16

and the weight is all of it: o_proj of Llama-3.2-1B (N = K = 2048) reads 8.4 MB of weight and 4 KB
of x at M = 1. The flops, 2 M N K, are M flops per byte of weight: at M = 32 that is 32 flop/B,
under a tenth of the H100's tensor-core ridge (~300 flop/B), so the time to beat is the byte count
over the copy bandwidth (8.4 MB / 3.0 TB/s = 2.8 us), and a kernel is good when it streams W at
close to that rate.

What keeps a library GEMM from it at these shapes is parallelism, not arithmetic. Tiles made for
large matrices (128 x 128) cut N = 2048 into 16 programs for 132 SMs; the way out is to split K too
and reduce the pieces in a second kernel (cuBLAS does, for the down projection). Streaming at the
copy rate needs about bandwidth x latency = 3 TB/s x ~1 us = 3 MB of loads in flight, 20-25 KB per
SM, from the first microsecond: at 8.4 MB a slow ramp costs as much as the stream itself.

The kernel below gives each program BLOCK_N rows of W (all M rows of x) and walks all of K, so one
launch writes y with no reduction between programs, and the order of the additions is fixed (the
result does not change from run to run). BLOCK_N is small, so even N = 2048 gives many programs:

* `broadcast` programs (USE_DOT=False) multiply x (BLOCK_M, 1, BLOCK_K) by W (1, BLOCK_N, BLOCK_K)
  element-wise on the CUDA cores, summing into a 3-D fp32 accumulator that is reduced over K once,
  at the end. BLOCK_N = 2 or 4 gives 1024 or 512 programs at N = 2048, all resident at once (4 to
  8 per SM), each with a 4 KB tile of W in flight, loaded 16 bytes a thread along K (K a multiple
  of 16, as in every Llama shape, lets Triton prove the alignment). The multiply costs M FMAs per
  weight, so this is for small M only: at M = 32 and 3 TB/s it would need 48 T FMA/s, more than
  the H100's ~33 T fp32 FMA/s.
* `dot` programs (USE_DOT=True) hand the same product to the tensor cores with tl.dot, W's tile as
  the left operand: acc (BLOCK_N, BLOCK_M) += W (BLOCK_N, BLOCK_K) @ x.T (BLOCK_K, BLOCK_M), x's
  rows padded with zeros to 16 (tl.dot's smallest tile, free here: the tensor cores are idle
  anyway). BLOCK_N >= 16 gives 128 programs at N = 2048, one per SM, so depth must come from the
  software pipeline instead: num_stages tiles of W (8-16 KB each) are loaded ahead of the one being
  multiplied.

Which is faster for a given (M, N, K) is measured, not guessed: `triton.autotune` times every
configuration that fits (below) on the first call of each shape and keeps the fastest. On the CPU
the interpreter runs one fixed configuration per path (`linear(..., config=)` picks one), since
its timings say nothing about a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import runtime
from kernels.decoder.pdl import launch_options, wait_then_release
from kernels.testing import TINY, ULP, Comparison, compare
from kernels.validate import check_operands, check_rows_contiguous

MAX_ROWS = 32  # beyond this, x is a real matrix: cuBLAS's tiled GEMM is the right tool

# --------------------------------------------------------------------------------------------------
# The kernel


@triton.jit
def skinny_linear_kernel(
    X,
    W,
    Y,
    M,
    N,
    K,
    stride_xm,
    stride_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    UPCAST: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """One program: y[:, n0 : n0 + BLOCK_N] = x @ W[n0 : n0 + BLOCK_N].T, in fp32, over all of K."""
    wait_then_release(PDL)  # launched with PDL: nothing is read before the previous kernel ends
    n0 = tl.program_id(0) * BLOCK_N
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # The last program's rows past N read row N - 1 again instead of being masked: every load of W
    # stays unmasked along N, and those columns are never stored.
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    if USE_DOT:
        w_ptrs = W + rows[:, None] * K + offs_k[None, :]  # (BLOCK_N, BLOCK_K)
        x_ptrs = X + offs_m[:, None] * stride_xm + offs_k[None, :]  # (BLOCK_M, BLOCK_K)
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        w_ptrs = W + rows[None, :, None] * K + offs_k[None, None, :]  # (1, BLOCK_N, BLOCK_K)
        x_ptrs = X + offs_m[:, None, None] * stride_xm + offs_k[None, None, :]  # (BLOCK_M, 1, BK)
        acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        if USE_DOT:
            w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
            x = tl.load(x_ptrs, mask=(offs_m[:, None] < M) & k_ok[None, :], other=0.0)
            if UPCAST:  # the CPU interpreter's tl.dot is wrong on bf16 tiles (runtime.UPCAST)
                w, x = w.to(tl.float32), x.to(tl.float32)
            acc = tl.dot(w, tl.trans(x), acc)
        else:
            w = tl.load(w_ptrs, mask=k_ok[None, None, :], other=0.0)
            x = tl.load(x_ptrs, mask=(offs_m[:, None, None] < M) & k_ok[None, None, :], other=0.0)
            # Only element-wise products here: the sum over K waits until the loop is done, so no
            # iteration pays for a reduction across threads.
            acc += x.to(tl.float32) * w.to(tl.float32)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if USE_DOT:  # acc[n, m] is y[m, n]
        y_ptrs = Y + offs_m[None, :] * stride_ym + offs_n[:, None]
        y_ok = (offs_m[None, :] < M) & (offs_n[:, None] < N)
        tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=y_ok)
    else:
        y = tl.sum(acc, axis=2)  # (BLOCK_M, BLOCK_N)
        y_ptrs = Y + offs_m[:, None] * stride_ym + offs_n[None, :]
        y_ok = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        tl.store(y_ptrs, y.to(Y.dtype.element_ty), mask=y_ok)


def rows_block(m: int, use_dot: bool) -> int:
    """x's rows rounded up to a power of two; tl.dot's tiles are at least 16 on a side."""
    return max(16 if use_dot else 1, triton.next_power_of_2(m))


# --------------------------------------------------------------------------------------------------
# Configurations: the autotuner measures those that fit and keeps the fastest per (M, N, K, dtype)


def _config(block_n, block_k, use_dot, num_warps=4, num_stages=3):
    return triton.Config(
        {"BLOCK_N": block_n, "BLOCK_K": block_k, "USE_DOT": use_dot},
        num_warps=num_warps,
        num_stages=num_stages,
    )


GPU_CONFIGS = [
    # broadcast: 2-8 rows of W per program, a 4 KB tile of W per iteration (16 B per thread, twice)
    _config(2, 1024, False),
    _config(4, 512, False),
    _config(8, 256, False),
    _config(4, 256, False),  # for M up to 8: the accumulator is BLOCK_M x the tile
    _config(4, 128, False),  # for M up to 16
    # dot: 16-64 rows of W per program, num_stages tiles of W in flight
    _config(16, 256, True, num_stages=4),
    _config(16, 512, True, num_stages=3),
    _config(32, 256, True, num_stages=4),
    _config(64, 128, True, num_stages=4),  # wide N (lm_head): fewer, larger programs
]
# The interpreter's cost grows with programs and loop trips: large tiles, one per path.
CPU_CONFIGS = {
    "broadcast": _config(16, 128, False, num_warps=1, num_stages=1),
    "dot": _config(32, 64, True, num_warps=1, num_stages=1),
}
# fp32 accumulator elements per thread a broadcast program may hold (BLOCK_M x BLOCK_N x BLOCK_K
# over the threads): beyond 64 of the 255 registers a thread has, it spills to local memory.
MAX_ACC_PER_THREAD = 64


def fits(config: triton.Config, m: int) -> bool:
    """Whether a configuration is worth timing for m rows of x."""
    kw = config.kwargs
    if kw["USE_DOT"]:
        return True
    acc = rows_block(m, False) * kw["BLOCK_N"] * kw["BLOCK_K"]
    return acc <= MAX_ACC_PER_THREAD * 32 * config.num_warps


def _prune(configs, named_args, **kwargs):
    kept = [c for c in configs if fits(c, named_args["M"])]
    return kept or [c for c in configs if c.kwargs["USE_DOT"]]


tuned_kernel = triton.autotune(
    configs=GPU_CONFIGS,
    key=["M", "N", "K"],  # (the autotuner adds the tensors' dtypes)
    prune_configs_by={"early_config_prune": _prune},
)(
    triton.heuristics(
        {"BLOCK_M": lambda args: rows_block(args["M"], args["USE_DOT"])},
    )(skinny_linear_kernel)
)


# --------------------------------------------------------------------------------------------------
# The wrapper


def _check(x, weight, out) -> None:
    op = "triton_gemv.linear"
    named = {"x": x, "weight": weight} | ({"out": out} if out is not None else {})
    check_operands(op, named, device_type=runtime.DEVICE, float32_instead="F.linear")
    (m, k), (n, k_w) = x.shape, weight.shape
    if k != k_w:
        raise ValueError(
            f"{op}: x is {tuple(x.shape)} and weight is {tuple(weight.shape)}: weight must be "
            f"(out_features, {k}), as nn.Linear stores it (y = x @ weight.T)"
        )
    if m > MAX_ROWS:
        raise ValueError(
            f"{op}: x has {m} rows; this kernel is for at most {MAX_ROWS} (decode): use "
            "torch.nn.functional.linear"
        )
    if not weight.is_contiguous():
        raise ValueError(
            f"{op}: weight must be contiguous (strides {weight.stride()}): pass "
            "weight.contiguous() once, when the model is loaded"
        )
    check_rows_contiguous(op, {"x": x})
    if out is not None:
        if tuple(out.shape) != (m, n):
            raise ValueError(f"{op}: out must have shape {(m, n)}, got {tuple(out.shape)}")
        check_rows_contiguous(op, {"out": out})


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    config: triton.Config | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """x @ weight.T, as F.linear without bias, for x (M, K) with M <= 32 and weight (N, K).

    bf16 or fp16 in and out, fp32 accumulation in a fixed order (the same bits on every run). x may
    be any 2-D view whose rows are contiguous; weight must be contiguous. `config` runs one
    configuration (tests); otherwise the GPU's autotuned choice, or on the CPU the interpreter's
    configuration for this M. The first GPU call of a shape autotunes, which synchronizes: make
    it before capturing a CUDA graph (DecodeGraph's warm-up does). `pdl`: launched with
    programmatic dependent launch where the GPU has it (pdl.py), the same result."""
    _check(x, weight, out)
    (m, k), n = x.shape, weight.shape[0]
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    args = (x, weight, out, m, n, k, x.stride(0), out.stride(0))
    pdl_options = launch_options(pdl)
    if config is None and runtime.ON_GPU:
        grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
        tuned_kernel[grid](*args, UPCAST=False, **pdl_options)
        return out
    if config is None:
        config = CPU_CONFIGS["broadcast" if m <= 4 else "dot"]
    kw = config.kwargs
    skinny_linear_kernel[(triton.cdiv(n, kw["BLOCK_N"]),)](
        *args,
        BLOCK_M=rows_block(m, kw["USE_DOT"]),
        **kw,
        UPCAST=runtime.UPCAST,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **pdl_options,
    )
    return out


# --------------------------------------------------------------------------------------------------
# The check: how far from the exact product a correct result may be


def check(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> Comparison:
    """y against x @ weight.T computed in float64 from the same inputs.

    A correct y is the exact sum rounded once to y's dtype (half an ulp of |y|, one in the
    interpreter, which truncates) after an fp32 sum of K products, whose error is at most about
    K fp32 ulps of sum |x_k w_k| (twice that, for tensor cores that truncate). So the bound is
    ulp(dtype) * |exact| + K * 2**-23 * (|x| @ |weight|.T): tight enough that one missing product
    or a row of W paired with the wrong column of y fails (tests/test_decoder_gemv.py makes sure).
    """
    exact = x.double() @ weight.double().T
    magnitude = x.double().abs() @ weight.double().abs().T
    ulp = ULP[y.dtype]
    scale = exact.abs() + (x.shape[1] * ULP[torch.float32] / ulp) * magnitude
    return compare(y, exact, atol=TINY[y.dtype], rtol=ulp, scale=scale)
