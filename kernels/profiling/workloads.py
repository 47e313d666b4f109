"""The course's kernels as named workloads, for profilers that run a whole process (Nsight Compute).

Each workload builds its inputs, warms up (compilation, autotuning, cuBLAS set-up), then makes
exactly one call between `torch.cuda.profiler.start()` and `stop()`. `ncu --profile-from-start off`
profiles only the kernels launched in between: the timed call, not the warm-up, the autotuner's
trials or the allocations.

    python -m kernels.profiling.workloads add      # what `python -m kernels.profiling.ncu add` runs

`bytes` and `flops` are the compulsory counts (notebook 00, section 1): every input read once, every
output written once, the arithmetic the result needs. Nsight Compute's counters say what the kernel
really moved and did; the roofline compares the two.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable

import torch

from kernels import runtime

ADD_N = runtime.pick(gpu=2**26, cpu=2**12)
NORM_ROWS, NORM_WIDTH = runtime.pick(gpu=(16384, 4096), cpu=(8, 256))
ATTN = runtime.pick(gpu=(16, 16, 2048, 64), cpu=(1, 2, 64, 16))  # batch, heads, sequence, head dim
MOE = runtime.pick(
    gpu=(2048, 32, 2, 4096, 11008), cpu=(16, 4, 2, 32, 64)
)  # tokens, E, k, hidden, inter
GEMM_N = runtime.pick(gpu=4096, cpu=64)
# Operands of 128 MiB each, well past the H200's 50 MiB of L2: the launch order decides what hits.
LAUNCH_ORDER_N = runtime.pick(gpu=8192, cpu=64)
COPY_BYTES = runtime.pick(gpu=2**30, cpu=2**16)
TRANSPOSE = runtime.pick(gpu=(8192, 8192), cpu=(64, 96))  # the lab's slow kernel and its fix
# cuBLAS's GEMM kernels as ncu's -k matches them: names with gemm, sm90, nvjet or cutlass in them.
CUBLAS_KERNELS = "gemm|sm90|nvjet|cutlass"
# The matrix multiply's targets that were missed (kernels/matmul/PERFORMANCE.md): CUDA C's mma.sync
# step at the shape its target names, the Hopper kernels at the model's MLP shape.
MMA_SHAPE = runtime.pick(gpu=(4096, 4096, 4096), cpu=(64, 64, 64))
MLP_SHAPE = runtime.pick(gpu=(8192, 11008, 4096), cpu=(64, 96, 128))
# Where a GEMM's cycles go: the warps' stall reasons, the schedulers' issue rate, the pipes' use
# and shared memory's bank conflicts (ldmatrix reads as ldsm).
WHY_SECTIONS = ("WarpStateStats", "SchedulerStats", "ComputeWorkloadAnalysis")
WHY_METRICS = (
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum",
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum",
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ldsm.sum",
    "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum",
    "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ldsm.sum",
    "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum",
    "smsp__inst_executed_op_ldsm.sum",
    "lts__t_sector_hit_rate.pct",
    "lts__throughput.avg.pct_of_peak_sustained_elapsed",
)


@dataclass(frozen=True)
class Workload:
    name: str
    what: str  # the call, its shape and dtype
    kernel: str  # regular expression of the kernel names this call launches (for ncu's -k)
    bytes: int  # compulsory bytes: inputs read once, outputs written once
    flops: int  # the arithmetic the result needs (a multiply-add is 2)
    tensor_cores: bool  # does the work belong on the tensor cores?
    build: Callable[[], Callable[[], object]]  # allocates the inputs, returns the call
    sections: tuple[str, ...] = ()  # ncu sections beyond ncu.SECTIONS
    metrics: tuple[str, ...] = ()  # metrics beyond ncu.METRICS


def _add():
    from kernels.elementwise_add import triton_add

    a = torch.randn(ADD_N, device=runtime.DEVICE, dtype=torch.float16)
    b, out = torch.randn_like(a), torch.empty_like(a)
    return lambda: triton_add.add(a, b, out)


def _rmsnorm():
    from kernels.rmsnorm import triton_rmsnorm

    x = torch.randn(NORM_ROWS, NORM_WIDTH, device=runtime.DEVICE, dtype=torch.bfloat16)
    w = torch.randn(NORM_WIDTH, device=runtime.DEVICE, dtype=torch.bfloat16)
    out = torch.empty_like(x)
    return lambda: triton_rmsnorm.rms_norm(x, w, out=out)


def _flash_forward():
    from kernels.flash_attention import triton_flash

    q, k, v = (torch.randn(ATTN, device=runtime.DEVICE, dtype=torch.float16) for _ in range(3))
    return lambda: triton_flash.flash_attention_forward(q, k, v)


def _grouped_gemm():
    from kernels.moe import reference, triton_grouped_gemm, triton_permute, triton_router

    tokens, experts, top_k, hidden, inter = MOE
    g = torch.Generator(device=runtime.DEVICE).manual_seed(0)
    w = reference.init_weights(experts, hidden, inter, torch.bfloat16, runtime.DEVICE, g)
    x = torch.randn(tokens, hidden, device=runtime.DEVICE, generator=g).to(torch.bfloat16)
    _, ids, _ = triton_router.route(x, w.router, top_k)
    block_m = triton_grouped_gemm.block_m_for(tokens, experts, top_k)
    perm = triton_permute.permute(ids, experts, block_m)
    return lambda: triton_grouped_gemm.gate_up_swiglu(x, w.gate, w.up, perm)


def _matmul():
    a, b = (
        torch.randn(GEMM_N, GEMM_N, device=runtime.DEVICE, dtype=torch.bfloat16) for _ in range(2)
    )
    return lambda: a @ b


def _triton_matmul(group_m: int):
    from kernels.matmul import reference, triton_matmul

    n = LAUNCH_ORDER_N
    a, b = reference.make_inputs(n, n, n, torch.bfloat16, seed=0)
    out = torch.empty(n, n, dtype=torch.bfloat16, device=runtime.DEVICE)
    return lambda: triton_matmul.matmul(a, b, out, group_m=group_m)


def _gemm_16bit(kernel: str, shape):
    from kernels.matmul import reference

    a, b = reference.make_inputs(*shape, torch.bfloat16, seed=0)
    if kernel == "cublas":
        return lambda: a @ b
    if kernel == "mma":
        from kernels.matmul import cupy_matmul

        return lambda: cupy_matmul.matmul(a, b)
    if kernel == "tma":
        from kernels.matmul import triton_matmul_tma

        return lambda: triton_matmul_tma.matmul_tma(a, b)
    from kernels.matmul import gluon_matmul

    return lambda: gluon_matmul.gluon_matmul(a, b)


def _gemm_fp8(kernel: str):
    from kernels.matmul import gluon_matmul, reference
    from kernels.matmul import triton_fp8_matmul as f8

    a, w_t = reference.make_inputs(*MLP_SHAPE, torch.bfloat16, layout="nt", seed=0)
    w = w_t.T  # (N, K), as nn.Linear stores it
    if kernel == "cublas":
        (a8, sa), (w8, sw) = f8.quantize_per_tensor(a), f8.quantize_per_tensor(w)
        return lambda: f8.fp8_matmul_scaled_mm(a8, w8, sa, sw)
    (a8, sa), (w8, sw) = f8.quantize_activation(a), f8.quantize_weight(w)
    return lambda: gluon_matmul.gluon_fp8_matmul_block_scaled(a8, sa, w8, sw)


def _gemm_counts(shape, itemsize: int):
    """Compulsory bytes (A and B at `itemsize` bytes an element, C in bf16) and flops of a GEMM."""
    m, n, k = shape
    return itemsize * (m * k + k * n) + 2 * m * n, 2 * m * n * k


def _copy():
    src = torch.randn(COPY_BYTES // 4, device=runtime.DEVICE)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def _transpose(fixed: bool):
    from kernels.profiling import transpose

    x = torch.randn(TRANSPOSE, device=runtime.DEVICE, dtype=torch.bfloat16)
    out = torch.empty(TRANSPOSE[::-1], device=runtime.DEVICE, dtype=torch.bfloat16)
    fn = transpose.transpose_tiled if fixed else transpose.transpose_naive
    return lambda: fn(x, out)


def _attention_counts():
    b, h, n, d = ATTN
    # Q, K, V read, O written (fp16), the float32 log-sum-exp written; QK^T and PV
    return 4 * 2 * b * h * n * d + 4 * b * h * n, 4 * b * h * n * n * d


def _moe_counts():
    tokens, experts, top_k, hidden, inter = MOE
    rows = tokens * top_k
    weights = 2 * experts * inter * hidden * 2  # gate and up of every expert (each is used), bf16
    return weights + 2 * tokens * hidden + 2 * rows * inter, 2 * 2 * rows * hidden * inter


WORKLOADS = {
    w.name: w
    for w in (
        Workload(
            "add", f"Triton add, {ADD_N} fp16", "add_kernel", 3 * 2 * ADD_N, ADD_N, False, _add
        ),
        Workload(
            "rmsnorm",
            f"Triton RMSNorm, {NORM_ROWS}x{NORM_WIDTH} bf16",
            "rmsnorm_fwd_kernel",
            2 * 2 * NORM_ROWS * NORM_WIDTH + 2 * NORM_WIDTH,
            4 * NORM_ROWS * NORM_WIDTH,
            False,
            _rmsnorm,
        ),
        Workload(
            "flash_attention",
            f"Triton FlashAttention-2 forward, {ATTN} fp16",
            "flash_fwd_kernel",
            *_attention_counts(),
            True,
            _flash_forward,
        ),
        Workload(
            "grouped_gemm",
            "Triton MoE grouped GEMM (gate and up, SwiGLU), {} tokens, {} experts, "
            "top-{}, {}->{} bf16".format(*MOE),
            "grouped_gemm_kernel",
            *_moe_counts(),
            True,
            _grouped_gemm,
        ),
        Workload(
            "matmul",
            f"cuBLAS {GEMM_N}^3 bf16 (the matmul ceiling)",
            CUBLAS_KERNELS,
            3 * 2 * GEMM_N**2,
            2 * GEMM_N**3,
            True,
            _matmul,
        ),
        # The same Triton GEMM in two launch orders: ncu's L2 hit rate says what grouping buys
        # (kernels/matmul/benchmark.py, section launch-order).
        *(
            Workload(
                f"triton_matmul_{order}",
                f"Triton tiled GEMM, {LAUNCH_ORDER_N}^3 bf16, {order} launch order",
                "matmul_kernel",
                3 * 2 * LAUNCH_ORDER_N**2,
                2 * LAUNCH_ORDER_N**3,
                True,
                lambda group_m=group_m: _triton_matmul(group_m),
            )
            for order, group_m in (("grouped", 8), ("row_major", 1))
        ),
        # The missed targets of the matrix multiply, each beside the cuBLAS call it is measured
        # against, with the sections that say where the cycles went.
        *(
            Workload(
                name,
                what,
                kernel,
                *_gemm_counts(shape, itemsize),
                True,
                build,
                WHY_SECTIONS,
                WHY_METRICS,
            )
            for name, what, kernel, shape, itemsize, build in (
                (
                    "matmul_mma",
                    "CUDA C step 5, mma.sync, {}x{}x{} bf16".format(*MMA_SHAPE),
                    "matmul_mma",
                    MMA_SHAPE,
                    2,
                    lambda: _gemm_16bit("mma", MMA_SHAPE),
                ),
                (
                    "cublas_mma_shape",
                    "cuBLAS {}x{}x{} bf16 (step 5's anchor)".format(*MMA_SHAPE),
                    CUBLAS_KERNELS,
                    MMA_SHAPE,
                    2,
                    lambda: _gemm_16bit("cublas", MMA_SHAPE),
                ),
                (
                    "matmul_tma",
                    "Triton persistent TMA GEMM, {}x{}x{} bf16".format(*MLP_SHAPE),
                    "matmul_tma_kernel",
                    MLP_SHAPE,
                    2,
                    lambda: _gemm_16bit("tma", MLP_SHAPE),
                ),
                (
                    "matmul_gluon",
                    "Gluon warp-specialized GEMM, {}x{}x{} bf16".format(*MLP_SHAPE),
                    "gluon_matmul_kernel",
                    MLP_SHAPE,
                    2,
                    lambda: _gemm_16bit("gluon", MLP_SHAPE),
                ),
                (
                    "cublas_mlp_shape",
                    "cuBLAS {}x{}x{} bf16 (the Hopper kernels' anchor)".format(*MLP_SHAPE),
                    CUBLAS_KERNELS,
                    MLP_SHAPE,
                    2,
                    lambda: _gemm_16bit("cublas", MLP_SHAPE),
                ),
                (
                    "matmul_fp8_block_scaled",
                    "Gluon fp8 GEMM, 1x128 and 128x128 scales, {}x{}x{}".format(*MLP_SHAPE),
                    "gluon_matmul_kernel",
                    MLP_SHAPE,
                    1,
                    lambda: _gemm_fp8("gluon"),
                ),
                (
                    "cublas_fp8_mlp_shape",
                    "cuBLAS fp8, per-tensor scales, {}x{}x{} (the fp8 anchor)".format(*MLP_SHAPE),
                    CUBLAS_KERNELS,
                    MLP_SHAPE,
                    1,
                    lambda: _gemm_fp8("cublas"),
                ),
            )
        ),
        Workload(
            "copy",
            f"torch copy_, {COPY_BYTES >> 20} MiB fp32 (the copy ceiling)",
            "copy|elementwise",
            2 * COPY_BYTES,
            0,
            False,
            _copy,
        ),
        Workload(
            "transpose_naive",
            f"the lab's slow transpose, {TRANSPOSE[0]}x{TRANSPOSE[1]} bf16",
            "transpose_naive_kernel",
            2 * 2 * TRANSPOSE[0] * TRANSPOSE[1],
            0,
            False,
            lambda: _transpose(False),
        ),
        Workload(
            "transpose_tiled",
            f"the lab's fixed transpose, {TRANSPOSE[0]}x{TRANSPOSE[1]} bf16",
            "transpose_tiled_kernel",
            2 * 2 * TRANSPOSE[0] * TRANSPOSE[1],
            0,
            False,
            lambda: _transpose(True),
        ),
    )
}
# The course's kernels (placed on the roofline) and cuBLAS's GEMM, which draws the compute roof.
COURSE = ("add", "rmsnorm", "flash_attention", "grouped_gemm", "transpose_naive", "transpose_tiled")
ANCHORS = ("matmul",)
# What ncu profiles: everything but `copy`, a cudaMemcpyAsync (no kernel for ncu to see). The lab's
# kernels first; the grouped GEMM, whose autotuning takes longest, last.
PROFILED = (
    "transpose_naive",
    "transpose_tiled",
    "add",
    "rmsnorm",
    "matmul",
    "flash_attention",
    "grouped_gemm",
)

# The matrix multiply's missed targets and their anchors (notebook 02b, part 7):
# `python -m kernels.profiling.ncu matmul` profiles these.
MATMUL_WHY = (
    "matmul_mma",
    "cublas_mma_shape",
    "matmul_tma",
    "matmul_gluon",
    "cublas_mlp_shape",
    "matmul_fp8_block_scaled",
    "cublas_fp8_mlp_shape",
)


def get(name: str) -> Workload:
    if name not in WORKLOADS:
        raise KeyError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    return WORKLOADS[name]


def run_once(name: str, warmup: int = 3) -> None:
    """Build, warm up, then one call inside the profiler range (what ncu sees)."""
    call = get(name).build()
    for _ in range(warmup):
        call()
    if runtime.ON_GPU:
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
    call()
    if runtime.ON_GPU:
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()


if __name__ == "__main__":
    for arg in sys.argv[1:] or ["--help"]:
        if arg in ("-h", "--help"):
            print(__doc__ + "\nworkloads: " + ", ".join(WORKLOADS))
            continue
        run_once(arg)
