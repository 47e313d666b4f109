"""Grouped GEMM: every expert's product in one launch, with the token gather and SwiGLU fused in.

After the permutation (triton_permute.py) the rows of expert e are rows padded_offsets[e] ... of a
virtual (max_rows, hidden) matrix, each expert's run padded to BLOCK_M rows, and tile_expert says
which expert owns each BLOCK_M-row tile. One program computes one (BLOCK_M x BLOCK_N) output tile:

    expert = tile_expert[tile]          -1: a tile past the real rows; the program does nothing
    A rows = x[sorted_ids[rows] // k]   gathered in the A loads (GATHER); padding rows load 0
    gate = A @ w_gate[expert].T
    up = A @ w_up[expert].T             two accumulators sharing each A tile (SWIGLU)
    h = silu(gate) * up                 in the epilogue, float32, rounded once to the output dtype

The down projection is the same kernel without GATHER and SWIGLU: its A rows are h's rows, already
in expert order. Nothing depends on the host knowing the counts: the grid is max_tiles x N-tiles,
the bound from triton_permute.max_tiles, so the launch is the same for every routing and a CUDA
graph can hold it.

Program order: Triton's grouped ("swizzled") order over (M tiles, N tiles): GROUP_M consecutive M
tiles walk the N tiles together, so their A rows stay in L2 while the weight tiles stream by, and
the tiles of one expert (adjacent M tiles) read each weight tile at nearly the same time, from HBM
once. At 2048 tokens the layer is a weight read (8.7 GB at the benchmark's size); reading it twice
would double the time.

Autotuning: BLOCK_M is fixed by the permutation's padding (chosen per token-count bucket by
`block_m_for`); BLOCK_N, BLOCK_K, warps and stages are tuned per (token bucket, N, K, SWIGLU,
GATHER): decode-sized and prefill-sized batches want different tiles (shape buckets), and
bucketing by powers of two keeps the number of tuning runs small.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import runtime
from kernels.moe.triton_permute import Permutation
from kernels.runtime import UPCAST

# (BLOCK_N, BLOCK_K, num_warps, num_stages) for sm_90. Registers bound them: a configuration is
# pruned when its float32 accumulators (two for SwiGLU) exceed ACC_REGS per thread -- compiled
# offline for sm_90 (see PERFORMANCE.md), SwiGLU at 128 x 128 with 4 warps (256 accumulator
# registers a thread) spilled 520 bytes, every configuration at or under 128 spilled nothing. Shared
# memory (227 KB) bounds stages x (A tile + one or two B tiles); a configuration over it fails to
# compile and the autotuner skips it.
GPU_TUNING = [
    (128, 64, 8, 4),
    (128, 64, 4, 4),
    (128, 128, 8, 3),
    (64, 64, 4, 4),
    (64, 128, 4, 3),
    (256, 64, 8, 3),
]
# For GPUs whose shared memory holds none of the above (a T4's 64 KiB, an RTX 4090's 99 KiB with
# SwiGLU's two weight tiles): fewer stages and narrower tiles, tried only then.
SMALL_TUNING = [(64, 64, 4, 3), (64, 64, 4, 2), (64, 32, 4, 2), (32, 32, 4, 2)]
GROUP_M = 8


def _config(n: int, k: int, w: int, s: int) -> triton.Config:
    return triton.Config(
        {"BLOCK_N": n, "BLOCK_K": k, "GROUP_M": GROUP_M}, num_warps=w, num_stages=s
    )


def _configs() -> list[triton.Config]:
    if not runtime.ON_GPU:  # the interpreter: one configuration, few and large blocks
        return [
            triton.Config({"BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 4}, num_warps=1, num_stages=1)
        ]
    return [_config(*tile) for tile in GPU_TUNING + SMALL_TUNING]


# None: autotune over the configurations the pruner keeps. An integer i: use the i-th kept one alone
# (the GPU tests use 0, to compile one kernel per case). Set it before the first call of a shape:
# the autotuner remembers its choice per key.
TUNING_OVERRIDE: int | None = None
ACC_REGS = 128
# A block's shared memory with the opt-in Triton makes: sm_90's 227 KiB (also in CPU mode), an
# A100's 163 KiB, an RTX 4090's 99 KiB, a T4's 64 KiB (runtime.GPU_PROFILES).
SHARED_BYTES = runtime.shared_memory_budget()


def accumulator_registers(block_m: int, block_n: int, num_warps: int, swiglu: bool) -> int:
    return (2 if swiglu else 1) * block_m * block_n // (32 * num_warps)


def pipeline_bytes(
    block_m: int, block_n: int, block_k: int, num_stages: int, swiglu: bool, element_size=2
) -> int:
    """Shared memory of the software pipeline: per stage an A tile and one or two weight tiles."""
    return (
        num_stages * (block_m * block_k + (2 if swiglu else 1) * block_k * block_n) * element_size
    )


def _fits(c: triton.Config, block_m: int, swiglu: bool) -> bool:
    bn, bk = c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"]
    return (
        accumulator_registers(block_m, bn, c.num_warps, swiglu) <= ACC_REGS
        and pipeline_bytes(block_m, bn, bk, c.num_stages, swiglu) <= runtime.shared_memory_budget()
    )


def _prune(configs, named_args, **kwargs):
    args = {**named_args, **kwargs}
    bm, swiglu = args["BLOCK_M"], args["SWIGLU"]
    tuned = configs[: len(GPU_TUNING)] if len(configs) > 1 else configs
    kept = [c for c in tuned if _fits(c, bm, swiglu)]
    kept = kept or [c for c in configs[len(tuned) :] if _fits(c, bm, swiglu)][:1]
    if TUNING_OVERRIDE is not None:
        kept = [kept[min(TUNING_OVERRIDE, len(kept) - 1)]] if kept else kept
    return kept or configs[:1]


def fitting_configs(block_m: int, swiglu: bool) -> list[triton.Config]:
    """The GPU configurations the autotuner tries for this tile height here (`_prune`)."""
    every = [_config(*tile) for tile in GPU_TUNING + SMALL_TUNING]
    return _prune(every, {"BLOCK_M": block_m, "SWIGLU": swiglu})


def block_m_for(tokens: int, experts: int, top_k: int) -> int:
    """Rows per tile (and the permutation's padding), by the mean rows per expert: 128 (wgmma's most
    efficient shape) once an expert averages more than 64 rows, 64 below, where a 128-row tile would
    be mostly padding. Measured on an H100 at 2048 tokens (128 rows per expert, the benchmark's
    size): 128-row tiles took 2.41 + 1.27 ms for gate_up and down, 64-row tiles 2.75 + 1.47 ms (the
    best of 14 configs each): two 64-row tiles of one expert read its weights twice, and the weights
    are the floor here."""
    if not runtime.ON_GPU:
        return 16
    return 64 if tokens * top_k // max(experts, 1) <= 64 else 128


def token_bucket(max_tiles: int) -> int:
    return triton.next_power_of_2(max(max_tiles, 1))


@triton.autotune(
    configs=_configs(),
    key=["TOKEN_BUCKET", "N", "K", "SWIGLU", "GATHER"],
    prune_configs_by={"early_config_prune": _prune},
)
@triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})
@triton.jit
def grouped_gemm_kernel(
    a_ptr,
    w1_ptr,
    w2_ptr,
    c_ptr,
    sorted_ids_ptr,
    tile_expert_ptr,
    max_tiles,
    N,
    K,
    TOKEN_BUCKET,
    TOP_K: tl.constexpr,
    GATHER: tl.constexpr,
    SWIGLU: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """c[rows, n] = A[rows] @ w1[expert].T, or silu(A @ w1.T) * (A @ w2.T); w1, w2: (E, N, K)."""
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * n_tiles
    first_m = pid // per_group * GROUP_M
    group_m = min(max_tiles - first_m, GROUP_M)
    tile = first_m + (pid % per_group) % group_m
    n_tile = (pid % per_group) // group_m
    expert = tl.load(tile_expert_ptr + tile)
    if expert >= 0:
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        assignment = tl.load(sorted_ids_ptr + rows)
        real = assignment >= 0  # padding rows load zeros and so compute zeros
        if GATHER:
            a_rows = tl.where(real, assignment // TOP_K, 0)
        else:
            a_rows = rows
        n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N
        k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + a_rows[:, None].to(tl.int64) * K + k[None, :]
        # (BLOCK_K, BLOCK_N)
        w_offset = expert.to(tl.int64) * N * K + n[None, :].to(tl.int64) * K + k[:, None]
        w1_ptrs = w1_ptr + w_offset
        w2_ptrs = w2_ptr + w_offset
        acc1 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        acc2 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=real[:, None], other=0.0)
                b1 = tl.load(w1_ptrs, mask=n_ok[None, :], other=0.0)
            else:
                k_ok = k0 + k < K
                a = tl.load(a_ptrs, mask=real[:, None] & k_ok[None, :], other=0.0)
                b1 = tl.load(w1_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if UPCAST:
                a = a.to(tl.float32)
                b1 = b1.to(tl.float32)
            acc1 = tl.dot(a, b1, acc1)
            if SWIGLU:
                if EVEN_K:
                    b2 = tl.load(w2_ptrs, mask=n_ok[None, :], other=0.0)
                else:
                    b2 = tl.load(w2_ptrs, mask=(k0 + k < K)[:, None] & n_ok[None, :], other=0.0)
                if UPCAST:
                    b2 = b2.to(tl.float32)
                acc2 = tl.dot(a, b2, acc2)
                w2_ptrs += BLOCK_K
            a_ptrs += BLOCK_K
            w1_ptrs += BLOCK_K
        if SWIGLU:
            acc1 = acc1 * tl.sigmoid(acc1) * acc2  # silu(gate) * up
        tl.store(
            c_ptr + rows[:, None].to(tl.int64) * N + n[None, :],
            acc1.to(c_ptr.dtype.element_ty),
            mask=n_ok[None, :],
        )


def grouped_gemm(a, w1, w2, perm: Permutation, *, gather: bool, swiglu: bool) -> torch.Tensor:
    """c[rows] = A[rows] @ w1[expert].T, or silu(A @ w1[expert].T) * (A @ w2[expert].T) with
    `swiglu`, for the permuted rows of `perm`; A is gathered from a's token rows (`gather`) or is
    a itself, already in expert order. The products below are this launch with their arguments."""
    experts, n, k = w1.shape
    c = torch.empty(perm.sorted_ids.numel(), n, dtype=a.dtype, device=a.device)
    if perm.max_tiles == 0:
        return c

    def grid(meta):
        return (perm.max_tiles * triton.cdiv(n, meta["BLOCK_N"]),)

    grouped_gemm_kernel[grid](
        a,
        w1,
        w2,
        c,
        perm.sorted_ids,
        perm.tile_expert,
        perm.max_tiles,
        n,
        k,
        token_bucket(perm.max_tiles),
        TOP_K=perm.top_k,
        GATHER=gather,
        SWIGLU=swiglu,
        BLOCK_M=perm.block_m,
        UPCAST=UPCAST,
    )
    return c


def gate_up_swiglu(
    x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, perm: Permutation
) -> torch.Tensor:
    """h (max_rows, inter) = silu(x_e @ w_gate[e].T) * (x_e @ w_up[e].T) for each row's expert; one
    launch. Rows are in the permutation's order; padding rows are 0; rows of unused tiles are not
    written."""
    return grouped_gemm(x, w_gate, w_up, perm, gather=True, swiglu=True)


def gate_up_unfused(
    x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, perm: Permutation
) -> torch.Tensor:
    """The same h unfused: two grouped GEMMs and an element-wise SwiGLU (the lab's base task)."""
    gate = grouped_gemm(x, w_gate, w_gate, perm, gather=True, swiglu=False)
    up = grouped_gemm(x, w_up, w_up, perm, gather=True, swiglu=False)
    return (torch.nn.functional.silu(gate.float()) * up.float()).to(x.dtype)


def down(h: torch.Tensor, w_down: torch.Tensor, perm: Permutation) -> torch.Tensor:
    """y (max_rows, hidden) = h_e @ w_down[e].T, rows in the permutation's order (no gather)."""
    return grouped_gemm(h, w_down, w_down, perm, gather=False, swiglu=False)
