"""The decode GEMV with the small kernels around it folded in: residual add + RMSNorm before it,
SwiGLU after it. One launch where the layer used two or three.

A decode layer (triton_gemv.py streams the weights) launches, around its two big projections,

    y, r = fused_add_rms_norm(delta, r, norm_w)     y = rmsnorm(delta + r) * norm_w; r += delta
    out  = y @ W^T                                  (qkv; or gate_up, then)
    h    = silu(out[:, :I]) * out[:, I:]            swiglu

and each small kernel moves a few KB at batch 1, so it costs its launch, not its bytes: on the H100
the norms took 2.2 us and SwiGLU 1.2 us a launch (PERFORMANCE.md), against 2.8 us for the whole 8 MB
o projection at the copy rate. This file computes all of it in the GEMV's launch:

    r[m, k]   = round(delta[m, k] + residual[m, k])          (to the storage dtype, as module 02)
    rstd[m]   = 1 / sqrt(sum_k r[m, k]^2 / K + eps)
    out[m, n] = rstd[m] * sum_k (r[m, k] * norm_w[k]) * W[n, k]
    swiglu:     h[m, j] = silu(g) * u,  g = round(out[m, j]), u = round(out[m, I + j])

Every program walks all of K for its rows of W (as triton_gemv.py), so it reads all of x anyway:
it reads delta and residual instead, and sums r^2 in the same loop. rstd is one number per row,
which factors out of the sum over K: the program applies it to its accumulator at the end, so the
statistics cost no pass of their own and no program waits for another. The price is L2 traffic:
every program reads delta and residual (2 M K elements) where the unfused GEMV reads y (M K), next
to the 2 BLOCK_N K bytes of W it streams from HBM.

Numerics, against the unfused path (module 02's fused_add_rms_norm, then triton_gemv.linear):

* r is rounded to the storage dtype before its square is summed, as module 02 does and Hugging
  Face's Llama does (the residual stream is kept in bf16; the norm reads what was kept), so the new
  residual is the same bits as module 02's.
* the unfused path rounds y = r rstd norm_w to the dtype before the GEMV; here the GEMV's operand
  is r norm_w, rounded to the dtype only where the tensor cores need it (the `dot` programs) and
  not at all in the `broadcast` programs. Either way it is one rounding of the operand at most, the
  same size as the unfused path's: `check` allows it, and the two paths differ by about one ulp.
* fp16 cannot hold r norm_w: residual streams keep outliers of thousands, and an outlier of 40000
  times a norm weight of 2 is past fp16's 65504 (bf16 reaches 3e38). In fp16 each program first
  sums r^2 over K in a pass of its own (delta and residual read twice, from L2) and feeds the
  tensor cores r rstd norm_w, the unfused path's y; bf16 keeps the single pass.
* gate and up are rounded to the dtype before silu(g) u, as the unfused path stores them.

The new residual r is written by program 0 alone, into `residual_out`, a different buffer from the
`residual` it reads: the other programs may still be reading residual (and delta) when program 0
writes, so writing r in place would let them add delta twice. The wrapper refuses an overlap; the
model alternates between buffers (every call returns a new one).

`delta=None` is the first layer's norm (no add, nothing written but the output).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import runtime
from kernels.decoder import triton_gemv
from kernels.decoder.pdl import launch_options, wait_then_release
from kernels.testing import TINY, ULP, Comparison, compare
from kernels.validate import check_operands, check_rows_contiguous

# --------------------------------------------------------------------------------------------------
# The kernel


@triton.jit
def _multiply_accumulate(acc, w_ptrs, k_ok, x, USE_DOT: tl.constexpr, UPCAST: tl.constexpr):
    """acc += x (BLOCK_M, BLOCK_K) times one tile of W, as triton_gemv.skinny_linear_kernel."""
    if USE_DOT:  # acc (BLOCK_N, BLOCK_M) += W (BLOCK_N, BLOCK_K) @ x.T
        w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
        x = x.to(w.dtype)  # the tensor cores take the weight's dtype: the operand's one rounding
        if UPCAST:  # the CPU interpreter's tl.dot is wrong on bf16 tiles (runtime.UPCAST)
            w, x = w.to(tl.float32), x.to(tl.float32)
        acc = tl.dot(w, tl.trans(x), acc)
    else:  # acc (BLOCK_M, BLOCK_N, BLOCK_K) += x (BLOCK_M, 1, BLOCK_K) * W (1, BLOCK_N, BLOCK_K)
        w = tl.load(w_ptrs, mask=k_ok[None, None, :], other=0.0)
        acc += x[:, None, :] * w.to(tl.float32)
    return acc


@triton.jit
def _rows_of_output(acc, scale, USE_DOT: tl.constexpr):
    """(BLOCK_M, BLOCK_N) fp32 from the accumulator: the sum over K, times each row's scale."""
    if USE_DOT:
        y = tl.trans(acc)
    else:
        y = tl.sum(acc, axis=2)
    return y * scale[:, None]


@triton.jit
def _rstd(sum_sq, K, eps):
    """1 / rms of each row from its (BLOCK_M, BLOCK_K) partial sums of r^2: module 02's formula."""
    return 1.0 / tl.sqrt(tl.sum(sum_sq, axis=1) / K + eps)


@triton.jit
def _residual_tile(
    DELTA,
    RESIDUAL,
    offs_m,
    k,
    x_ok,
    stride_dm,
    stride_rm,
    HAS_DELTA: tl.constexpr,
    STORED: tl.constexpr,
):
    """r = delta + residual for rows offs_m, columns k, rounded to the dtype the residual stream is
    stored in (module 02's fused_add_rms_norm does the same: the statistics are those of what it
    keeps), as float32; or residual itself without delta."""
    r = tl.load(RESIDUAL + offs_m[:, None] * stride_rm + k[None, :], mask=x_ok, other=0.0)
    if HAS_DELTA:
        d = tl.load(DELTA + offs_m[:, None] * stride_dm + k[None, :], mask=x_ok, other=0.0)
        r = (r.to(tl.float32) + d.to(tl.float32)).to(STORED)
    return r.to(tl.float32)


@triton.jit
def add_norm_linear_kernel(
    DELTA,  # (M, K): the sublayer's output, added to the residual (unused unless HAS_DELTA)
    RESIDUAL,  # (M, K): the residual stream as it was
    NORM_W,  # (K,): the RMSNorm's weight
    RESIDUAL_OUT,  # (M, K): delta + residual, written by program 0 (unused unless HAS_DELTA)
    W,  # (N, K), or (2 N, K) = [gate; up] with SWIGLU: contiguous
    OUT,  # (M, N)
    M,
    N,  # output columns: rows of W, or half of them with SWIGLU
    K,
    stride_dm,
    stride_rm,
    stride_rom,
    stride_om,
    eps,
    HAS_DELTA: tl.constexpr,
    SWIGLU: tl.constexpr,
    STATISTICS_FIRST: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_then_release(PDL)  # launched with PDL: nothing is read before the previous kernel ends
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    # One writer of the new residual, program 0: the others may still be reading RESIDUAL.
    writes_r = offs_m < tl.where(pid == 0, M, 0)
    # As in triton_gemv.py: rows past N read row N - 1 again (never stored), so W's loads stay
    # unmasked along N.
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    if USE_DOT:
        w_ptrs = W + rows[:, None] * K + offs_k[None, :]
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        w_ptrs = W + rows[None, :, None] * K + offs_k[None, None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    if SWIGLU:
        up_acc = tl.zeros_like(acc)
        up_offset = N.to(tl.int64) * K  # up's row j is W's row N + j
    stored = RESIDUAL_OUT.dtype.element_ty
    sum_sq = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    if STATISTICS_FIRST:  # a pass over K for rstd alone, so that the operand is r rstd norm_w
        for k0 in range(0, K, BLOCK_K):
            k = k0 + offs_k
            x_ok = m_ok[:, None] & (k < K)[None, :]
            r = _residual_tile(
                DELTA, RESIDUAL, offs_m, k, x_ok, stride_dm, stride_rm, HAS_DELTA, stored
            )
            sum_sq += r * r
        rstd = _rstd(sum_sq, K, eps)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < K
        x_ok = m_ok[:, None] & k_ok[None, :]
        r = _residual_tile(
            DELTA, RESIDUAL, offs_m, k, x_ok, stride_dm, stride_rm, HAS_DELTA, stored
        )
        if HAS_DELTA:
            r_out = RESIDUAL_OUT + offs_m[:, None] * stride_rom + k[None, :]
            tl.store(r_out, r.to(stored), mask=writes_r[:, None] & k_ok[None, :])
        x = r * tl.load(NORM_W + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        if STATISTICS_FIRST:
            x = x * rstd[:, None]
        else:
            sum_sq += r * r
        acc = _multiply_accumulate(acc, w_ptrs, k_ok, x, USE_DOT, UPCAST)
        if SWIGLU:
            up_acc = _multiply_accumulate(up_acc, w_ptrs + up_offset, k_ok, x, USE_DOT, UPCAST)
        w_ptrs += BLOCK_K
    if STATISTICS_FIRST:
        scale = tl.full((BLOCK_M,), 1.0, tl.float32)  # rstd is in the operand already
    else:
        scale = _rstd(sum_sq, K, eps)  # factored out of the sum over K
    y = _rows_of_output(acc, scale, USE_DOT)
    if SWIGLU:
        # gate and up rounded as the unfused path stores them, then triton_ops.swiglu's formula
        gate = y.to(OUT.dtype.element_ty).to(tl.float32)
        up = _rows_of_output(up_acc, scale, USE_DOT).to(OUT.dtype.element_ty).to(tl.float32)
        y = gate / (1.0 + tl.exp(-gate)) * up
    out_ptrs = OUT + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, y.to(OUT.dtype.element_ty), mask=m_ok[:, None] & (offs_n[None, :] < N))


# --------------------------------------------------------------------------------------------------
# Configurations: measured again for this kernel by the autotuner (its accumulators are twice as
# many with SwiGLU, and every program reads two rows of x per row where the plain GEMV reads one)


def _dot_config(block_n, block_k, num_warps):
    return triton.Config(
        {"BLOCK_N": block_n, "BLOCK_K": block_k, "USE_DOT": True}, num_warps=num_warps, num_stages=3
    )


# The broadcast programs are triton_gemv.py's. The dot programs are not: there x goes from memory
# to tl.dot, here it is computed in registers, and each warp then holds the whole (BLOCK_M, BLOCK_K)
# operand. With triton_gemv's BLOCK_K of 256-512, ptxas -v for sm_90 (offline, Triton 3.9) reports
# 255 registers and 0.2-13 KB of spills; BLOCK_K = 64 with 4 warps, or 128 with 8, spill nothing at
# M = 1 and 8, and at M = 32 (SwiGLU: BLOCK_N = 16, BLOCK_K = 64 alone; the others 40-360 bytes).
GPU_CONFIGS = [c for c in triton_gemv.GPU_CONFIGS if not c.kwargs["USE_DOT"]] + [
    _dot_config(16, 64, 4),
    _dot_config(32, 64, 4),
    _dot_config(64, 64, 4),
    _dot_config(16, 128, 8),
    _dot_config(32, 128, 8),
    _dot_config(64, 128, 8),
]


def fits(config: triton.Config, m: int, swiglu: bool) -> bool:
    """Whether a configuration is worth timing: a broadcast program holds one accumulator, or two
    (gate and up), within triton_gemv.MAX_ACC_PER_THREAD registers a thread."""
    kw = config.kwargs
    if kw["USE_DOT"]:
        return True
    accumulators = 2 if swiglu else 1
    acc = accumulators * triton_gemv.rows_block(m, False) * kw["BLOCK_N"] * kw["BLOCK_K"]
    return acc <= triton_gemv.MAX_ACC_PER_THREAD * 32 * config.num_warps


def _prune(configs, named_args, **kwargs):
    kept = [c for c in configs if fits(c, named_args["M"], kwargs["SWIGLU"])]
    return kept or [c for c in configs if c.kwargs["USE_DOT"]]


tuned_kernel = triton.autotune(
    configs=GPU_CONFIGS,
    key=["M", "N", "K", "HAS_DELTA", "SWIGLU"],  # (the autotuner adds the tensors' dtypes)
    prune_configs_by={"early_config_prune": _prune},
)(
    triton.heuristics(
        {"BLOCK_M": lambda args: triton_gemv.rows_block(args["M"], args["USE_DOT"])},
    )(add_norm_linear_kernel)
)


# --------------------------------------------------------------------------------------------------
# The wrapper

OP = "triton_fused_gemv.add_rms_norm_linear"


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors' memory, from first to last element, intersects."""

    def span(t):
        last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()

    if a.numel() == 0 or b.numel() == 0:
        return False
    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def _check(delta, residual, norm_weight, weight, eps, residual_out, out, swiglu) -> None:
    named = {"delta": delta, "residual": residual, "norm_weight": norm_weight, "weight": weight}
    named.update(residual_out=residual_out, out=out)
    tensors = {name: t for name, t in named.items() if t is not None}
    check_operands(
        OP,
        tensors,
        device_type=runtime.DEVICE,
        like="residual",
        dims={"norm_weight": 1},
        float32_instead="fused_add_rms_norm and F.linear",
    )
    check_rows_contiguous(OP, tensors)
    (m, k), n_weight = residual.shape, weight.shape[0]
    if delta is not None and delta.shape != residual.shape:
        raise ValueError(
            f"{OP}: delta {tuple(delta.shape)} and residual {tuple(residual.shape)} must match"
        )
    if tuple(norm_weight.shape) != (k,) or not norm_weight.is_contiguous():
        raise ValueError(
            f"{OP}: norm_weight must be contiguous of shape ({k},), got {tuple(norm_weight.shape)} "
            f"strides {norm_weight.stride()}"
        )
    if weight.shape[1] != k:
        raise ValueError(
            f"{OP}: residual is {tuple(residual.shape)} and weight is {tuple(weight.shape)}: "
            f"weight must be (out_features, {k}), as nn.Linear stores it"
        )
    if not weight.is_contiguous():
        raise ValueError(
            f"{OP}: weight must be contiguous (strides {weight.stride()}): pass "
            "weight.contiguous() once, when the model is loaded"
        )
    if swiglu and n_weight % 2:
        raise ValueError(
            f"{OP}: with swiglu, weight is [gate; up] stacked: an even number of rows, got "
            f"{n_weight}"
        )
    if m > triton_gemv.MAX_ROWS:
        raise ValueError(
            f"{OP}: {m} rows; this kernel is for at most {triton_gemv.MAX_ROWS} (decode): use "
            "fused_add_rms_norm and torch.nn.functional.linear"
        )
    if not eps >= 0:
        raise ValueError(f"{OP}: eps must be >= 0, got {eps}")
    n = n_weight // 2 if swiglu else n_weight
    if out is not None and tuple(out.shape) != (m, n):
        raise ValueError(f"{OP}: out must have shape {(m, n)}, got {tuple(out.shape)}")
    if residual_out is not None:
        if delta is None:
            raise ValueError(f"{OP}: residual_out is written only when delta is added")
        if residual_out.shape != residual.shape:
            raise ValueError(
                f"{OP}: residual_out must have shape {tuple(residual.shape)}, got "
                f"{tuple(residual_out.shape)}"
            )
    for w_name in ("out", "residual_out"):
        for r_name in tensors.keys() - {w_name}:
            if w_name in tensors and _overlaps(tensors[w_name], tensors[r_name]):
                raise ValueError(
                    f"{OP}: {w_name} overlaps {r_name}. Every program reads the inputs while "
                    "program 0 writes the new residual and every program writes out: in place, a "
                    "program could read a value already updated. Pass a separate buffer "
                    "(alternate two residual buffers)."
                )


def add_rms_norm_linear(
    delta: torch.Tensor | None,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    swiglu: bool = False,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    config: triton.Config | None = None,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, r) with r = delta + residual and out = rmsnorm(r) * norm_weight @ weight.T, in one
    launch, for M <= 32 rows of K; or, with `swiglu=True` and weight = [gate; up] (2 I, K),
    out = silu(gate part) * up part (M, I). `delta=None` normalizes residual itself (r = residual,
    nothing written but out).

    bf16 or fp16; delta, residual, out and residual_out may be row-strided views (last stride 1);
    weight and norm_weight contiguous. r goes to `residual_out` (allocated if None), never in place.
    `config` runs one configuration (tests); otherwise the GPU's autotuned choice (its first call
    per shape synchronizes: make it before a CUDA graph capture), or the interpreter's on a CPU.
    `pdl`: launched with programmatic dependent launch where the GPU has it (pdl.py)."""
    _check(delta, residual, norm_weight, weight, eps, residual_out, out, swiglu)
    (m, k), n = residual.shape, weight.shape[0] // (2 if swiglu else 1)
    if out is None:
        out = torch.empty((m, n), dtype=residual.dtype, device=residual.device)
    if delta is None:
        residual_out = residual
    elif residual_out is None:
        residual_out = torch.empty_like(residual, memory_format=torch.contiguous_format)
    if m == 0 or n == 0:
        return out, residual_out
    has_delta = delta is not None
    # fp16 overflows past 65504: r norm_w may not fit (an outlier of 40000 times a weight of 2)
    statistics_first = residual.dtype == torch.float16
    args = (
        delta if has_delta else residual,  # not read unless HAS_DELTA
        residual,
        norm_weight,
        residual_out,  # not written unless HAS_DELTA
        weight,
        out,
        m,
        n,
        k,
        (delta if has_delta else residual).stride(0),
        residual.stride(0),
        residual_out.stride(0),
        out.stride(0),
        float(eps),
    )
    if config is None and runtime.ON_GPU:
        grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
        tuned_kernel[grid](
            *args,
            HAS_DELTA=has_delta,
            SWIGLU=swiglu,
            STATISTICS_FIRST=statistics_first,
            UPCAST=False,
            **launch_options(pdl),
        )
        return out, residual_out
    if config is None:
        config = triton_gemv.CPU_CONFIGS["broadcast" if m <= 4 else "dot"]
    kw = config.kwargs
    add_norm_linear_kernel[(triton.cdiv(n, kw["BLOCK_N"]),)](
        *args,
        HAS_DELTA=has_delta,
        SWIGLU=swiglu,
        STATISTICS_FIRST=statistics_first,
        UPCAST=runtime.UPCAST,
        BLOCK_M=triton_gemv.rows_block(m, kw["USE_DOT"]),
        **kw,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **launch_options(pdl),
    )
    return out, residual_out


# --------------------------------------------------------------------------------------------------
# The check: the float64 computation of the same formula, and how far a correct result may be


def check(
    out: torch.Tensor,
    delta: torch.Tensor | None,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    swiglu: bool = False,
) -> Comparison:
    """out against the formula in float64 from the same inputs (r rounded to the dtype, as stored).

    Before SwiGLU, a correct value is within (as triton_gemv.check) one ulp of |exact| and K fp32
    ulps of the magnitude sum_k |y_k W_nk|, plus one rounding of the GEMV's operand: one ulp of the
    magnitude (the unfused path rounds y, the tensor cores r norm_w). With SwiGLU, gate and up carry
    that bound e_g, e_u, are rounded (one ulp each), and silu(g) u moves by at most
    1.1 |u| e_g + |silu(g)| e_u (|silu'| <= 1.1), plus its own rounding. Tight enough that one
    missing block of K, a wrong eps or a gate paired with the wrong up fails
    (tests/test_decoder_fused_gemv.py makes sure)."""
    dtype = residual.dtype
    r = residual.double() if delta is None else (delta.double() + residual.double())
    r = r.to(dtype).double()
    rstd = 1.0 / torch.sqrt(r.pow(2).mean(dim=1, keepdim=True) + eps)
    y = r * rstd * norm_weight.double()
    exact = y @ weight.double().T
    magnitude = y.abs() @ weight.double().abs().T
    ulp = ULP[dtype]
    k = residual.shape[1]
    bound = ulp * exact.abs() + (ulp + k * ULP[torch.float32]) * magnitude
    if not swiglu:
        return compare(out, exact, atol=TINY[dtype], rtol=1.0, scale=bound)
    i = exact.shape[1] // 2
    gate, up = exact[:, :i], exact[:, i:]
    error_gate = bound[:, :i] + ulp * gate.abs()
    error_up = bound[:, i:] + ulp * up.abs()
    silu = gate * torch.sigmoid(gate)
    h = silu * up
    scale = ulp * h.abs() + 1.1 * up.abs() * error_gate + silu.abs() * error_up
    return compare(out, h, atol=TINY[dtype], rtol=1.0, scale=scale)
