"""The matrix product in Triton: tiles with tl.dot, a grouped launch order, autotuning, and a
persistent variant.

One program computes a BLOCK_M x BLOCK_N tile of C:

    acc = 0                                          (float32, in registers)
    for k0 in 0, BLOCK_K, ...:                       (Triton pipelines these loads num_stages deep)
        acc += A[tile rows, k0 : k0 + BLOCK_K] @ B[k0 : k0 + BLOCK_K, tile columns]   (tl.dot)
    C[tile] = acc rounded to the dtype

What CUDA C's step 5 did by hand (shared-memory staging, ldmatrix, mma.sync, double buffering)
Triton does from the two loads and the tl.dot: wgmma on sm_90 (fed by cp.async; TMA is
triton_matmul_tma.py's step), mma.sync on sm_80. What is left to the kernel writer is the choice
of tiles and the order of the programs.

**Launch order.** Program ids are handed out roughly in order, so the programs resident at one time
are consecutive ids. Row-major order (id -> row id // tiles_n, column id % tiles_n) makes those
programs share one row of A tiles and read every column of B: at N = 8192 and 128-wide tiles, a
wave of 132 programs touches 1 + 64 B column panels, each K x 128. Grouped order walks GROUP_M rows
of tiles column by column, so a wave touches ~GROUP_M A panels and ~132 / GROUP_M B panels: fewer
bytes, more of them found in L2. `group_m=1` gives row-major order, to measure the difference
(benchmark.py's "launch-order" section reads ncu's L2 hit rate for both).

**Persistent.** `matmul_persistent` launches one program per SM; each walks the tiles id, id +
programs, ... in the same grouped order. No wave quantization tail from launching thousands of
programs, and the next tile's loads can start while the last one's epilogue is stored.

Any strides: a transposed operand is a view. M, N and K need not be multiples of the blocks: loads
past the edges are masked to zeros and so are stores.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import runtime
from kernels.matmul.reference import check_matmul_args

GROUP_M = 8  # rows of tiles per group: 8 x 128 = 1024 rows of A stay in L2 while B streams past

# --------------------------------------------------------------------------------------------------
# The kernels


@triton.jit
def tile_coordinates(tile, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """(row, column) of tile number `tile` in grouped order: GROUP_M tile rows, column by column."""
    per_group = GROUP_M * tiles_n
    first_m = tile // per_group * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (tile % per_group) % group_rows, (tile % per_group) // group_rows


@triton.jit
def tile_product(
    a_ptr,
    b_ptr,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    tile_m,
    tile_n,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """A[tile rows, :] @ B[:, tile columns] in float32."""
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + ks[None, :] * stride_ak
    b_ptrs = b_ptr + ks[:, None] * stride_bk + cols[None, :] * stride_bn
    # Masks, not clamped or wrapped offsets: offsets stay `start + arange`, so Triton still sees
    # runs of contiguous elements and loads them 16 bytes at a time (a mask against an N that is a
    # multiple of 16 is constant over each run; Triton specializes such arguments).
    row_ok = rows[:, None] < M
    col_ok = cols[None, :] < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = ks < K - k0  # K's tail reads zeros, which add nothing
        a = tl.load(a_ptrs, mask=row_ok & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok, other=0.0)
        if UPCAST:  # the CPU interpreter's tl.dot is wrong on bf16 tiles (runtime.UPCAST)
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    return acc


@triton.jit
def store_tile(c_ptr, acc, M, N, stride_cm, tile_m, tile_n, BLOCK_M: tl.constexpr, BLOCK_N):
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    tl.store(
        c_ptr + rows[:, None] * stride_cm + cols[None, :], acc.to(c_ptr.dtype.element_ty), mask=mask
    )


@triton.jit
def matmul_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_cm,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One program, one tile of C."""
    tile_m, tile_n = tile_coordinates(
        tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M
    )
    acc = tile_product(
        a_ptr, b_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, tile_m, tile_n,
        BLOCK_M, BLOCK_N, BLOCK_K, UPCAST,
    )  # fmt: skip
    store_tile(c_ptr, acc, M, N, stride_cm, tile_m, tile_n, BLOCK_M, BLOCK_N)


@triton.jit
def matmul_persistent_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_cm,
    PROGRAMS: tl.constexpr,  # how many programs were launched: one per SM (or fewer tiles)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Each program walks tiles program_id, program_id + PROGRAMS, ... in grouped order."""
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, PROGRAMS, flatten=True):
        tile_m, tile_n = tile_coordinates(tile, tiles_m, tiles_n, GROUP_M)
        acc = tile_product(
            a_ptr, b_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, tile_m, tile_n,
            BLOCK_M, BLOCK_N, BLOCK_K, UPCAST,
        )  # fmt: skip
        store_tile(c_ptr, acc, M, N, stride_cm, tile_m, tile_n, BLOCK_M, BLOCK_N)


# --------------------------------------------------------------------------------------------------
# Configurations: a short list the autotuner times per (M, N, K, dtype), pruned to this GPU's
# shared memory. Each stage holds a BLOCK_M x BLOCK_K tile of A and a BLOCK_K x BLOCK_N one of B.


def _config(block_m, block_n, block_k, num_warps, num_stages):
    return triton.Config(
        {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k},
        num_warps=num_warps,
        num_stages=num_stages,
    )


GPU_CONFIGS = [
    # Large square-ish C: the biggest tile two warpgroups hold (128 x 256 x fp32 = 128 registers a
    # thread), the most reuse per byte loaded; 3 stages = 144 KB (Hopper, A100).
    _config(128, 256, 64, 8, 3),
    _config(256, 128, 64, 8, 3),  # the same, tall: for M > N
    # 128 x 128, 4 stages (128 KB): more programs per wave, for 4096-sized shapes (256 tiles).
    _config(128, 128, 64, 8, 4),
    _config(128, 128, 64, 4, 4),  # one warpgroup: fewer registers, two programs per SM
    # 64 KB of stages: GPUs with ~100 KB of shared memory per block (sm_86, sm_89, sm_120).
    _config(128, 128, 32, 4, 4),
    _config(64, 128, 64, 4, 4),  # small shapes: twice the programs, to fill the SMs
]
# The interpreter: one configuration, large blocks (its cost grows with programs and loop trips).
CPU_CONFIG = _config(32, 32, 32, 1, 1)


def stage_bytes(config: triton.Config, element_size: int = 2) -> int:
    """Shared memory of the software pipeline: num_stages x (A tile + B tile)."""
    kw = config.kwargs
    return config.num_stages * (kw["BLOCK_M"] + kw["BLOCK_N"]) * kw["BLOCK_K"] * element_size


# The persistent kernel's epilogue takes up to 32 KB of shared memory on top of the stages
# (compiled offline for sm_90: 128 x 256 x 64 in 3 stages, 144 KB plain, 176 KB persistent).
PERSISTENT_EPILOGUE_BYTES = 32 * 1024


def fitting_configs(
    configs: list[triton.Config] = GPU_CONFIGS, reserve: int = 0
) -> list[triton.Config]:
    """The configurations whose stages (plus `reserve` bytes) fit this device's shared memory per
    block."""
    budget = runtime.shared_memory_budget() - reserve
    return [c for c in configs if stage_bytes(c) <= budget] or [CPU_CONFIG]


KEY = ["M", "N", "K"]  # (the autotuner adds the tensors' dtypes)


def _prune(configs, named_args, **kwargs):
    return fitting_configs(configs)


def _prune_persistent(configs, named_args, **kwargs):
    return fitting_configs(configs, reserve=PERSISTENT_EPILOGUE_BYTES)


tuned_matmul_kernel = triton.autotune(
    GPU_CONFIGS, key=KEY, prune_configs_by={"early_config_prune": _prune}
)(matmul_kernel)
tuned_persistent_kernel = triton.autotune(
    GPU_CONFIGS, key=KEY, prune_configs_by={"early_config_prune": _prune_persistent}
)(matmul_persistent_kernel)


def sm_programs() -> int:
    """Persistent programs: one per SM (4 in CPU mode, so the interpreter walks several tiles)."""
    found = runtime.features()
    return found.sm_count if found is not None else 4


# --------------------------------------------------------------------------------------------------
# The wrappers


def _launch(a, b, out, op, config, group_m, persistent) -> torch.Tensor:
    M, N, K = check_matmul_args(a, b, out, op=op)
    if not isinstance(group_m, int) or group_m < 1:
        raise ValueError(f"{op}: group_m must be a positive integer, got {group_m!r}")
    out = torch.empty(M, N, dtype=a.dtype, device=a.device) if out is None else out
    args = (a, b, out, M, N, K, *a.stride(), *b.stride(), out.stride(0))
    # A persistent kernel's loop strides by PROGRAMS; the grid is never larger (fewer tiles than
    # SMs: one program per tile, each loop runs once).
    programs = sm_programs()
    extra = {"PROGRAMS": programs} if persistent else {}

    def grid(meta):
        tiles = triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"])
        return (min(tiles, programs) if persistent else tiles,)

    if config is None and runtime.ON_GPU:
        tuned = tuned_persistent_kernel if persistent else tuned_matmul_kernel
        tuned[grid](*args, **extra, GROUP_M=group_m, UPCAST=False)
        return out
    config = CPU_CONFIG if config is None else config
    kernel = matmul_persistent_kernel if persistent else matmul_kernel
    kernel[grid(config.kwargs)](
        *args,
        **extra,
        **config.kwargs,
        GROUP_M=group_m,
        UPCAST=runtime.UPCAST,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out


def matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    config: triton.Config | None = None,
    group_m: int = GROUP_M,
) -> torch.Tensor:
    """C = a @ b, one program per tile. fp16 or bf16 in, float32 accumulation, C in a's dtype;
    a and b of any strides. `config` runs one configuration (tests); otherwise the autotuned one
    on a GPU, CPU_CONFIG in the interpreter. `group_m=1` launches in row-major order."""
    return _launch(a, b, out, "triton_matmul.matmul", config, group_m, persistent=False)


def matmul_persistent(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    config: triton.Config | None = None,
    group_m: int = GROUP_M,
) -> torch.Tensor:
    """C = a @ b with one program per SM walking the tiles; arguments as `matmul`."""
    return _launch(a, b, out, "triton_matmul.matmul_persistent", config, group_m, persistent=True)
