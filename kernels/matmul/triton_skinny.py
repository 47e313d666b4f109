"""Skinny products: A with 1 to 32 rows (decode), where C = A @ B is a stream of B.

At M rows the bytes that must move are 2 K N (B, once) + 2 M K + 2 M N, and B is nearly all of it;
the flops, 2 M N K, are M flops per byte of B: at M = 32 a tenth of an H100's tensor-core ridge
point. So the floor is B's bytes over the copy bandwidth (M = 1, N = 8192, K = 2048: 34 MB), and a
kernel is good when it streams B at close to that rate.

The tiled kernel of triton_matmul.py is the wrong shape for it. Its tiles cut N = 8192 into 64
programs (128 wide) for 132 SMs, and each program walks all of K alone: half the chip idles and
the other half has too few loads in flight. Two ways out:

* **Split-K** (`matmul_split_k`, below): cut K into `splits` pieces as well. splits x N / BLOCK_N
  programs each multiply their piece into a float32 partial (M x BLOCK_N); a second kernel adds the
  partials in a fixed order (the same bits on every run, unlike atomic adds) and rounds once. The
  price: the partials' round trip, splits x M x N x 4 bytes written and read again: under 1% of
  B's bytes at M = 1, a fifth of them at M = 32 (N = 8192, K = 2048, 3 splits).
* **Narrow programs** (`kernels.decoder.triton_gemv.linear`, the decoder's GEMV): a few rows of
  nn.Linear's W = B.T per program and all of K, so N alone gives hundreds of programs and no
  reduction is needed. It wants B as W.T of a contiguous W (layout "nt"), which is how a model
  stores its weights.

`skinny_matmul` takes the GEMV where B has that layout and split-K otherwise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import runtime
from kernels.decoder import triton_gemv
from kernels.matmul.reference import check_matmul_args
from kernels.matmul.triton_matmul import sm_programs, tile_product

MAX_ROWS = triton_gemv.MAX_ROWS  # 32: past this, a tiled GEMM fills the chip without split-K


@triton.jit
def split_k_kernel(
    a_ptr,
    b_ptr,
    partial_ptr,  # float32 (splits, M, N)
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    K_PER_SPLIT,  # a multiple of BLOCK_K
    BLOCK_M: tl.constexpr,  # all of A's rows, padded to tl.dot's 16
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """partial[split, :, n0 : n0 + BLOCK_N] = A[:, piece] @ B[piece, n0 : n0 + BLOCK_N]: the tiled
    kernel's tile product, on the operands shifted to the piece's first k."""
    split, tile_n = tl.program_id(1), tl.program_id(0)
    k_first = split * K_PER_SPLIT
    acc = tile_product(
        a_ptr + k_first * stride_ak, b_ptr + k_first * stride_bk, M, N,
        tl.minimum(K_PER_SPLIT, K - k_first), stride_am, stride_ak, stride_bk, stride_bn,
        0, tile_n, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST,
    )  # fmt: skip
    rows = tl.arange(0, BLOCK_M)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    out = partial_ptr + split * M * N + rows[:, None] * N + cols[None, :]
    tl.store(out, acc, mask=(rows[:, None] < M) & (cols[None, :] < N))


@triton.jit
def sum_splits_kernel(
    partial_ptr, c_ptr, M, N, stride_cm, SPLITS: tl.constexpr, BLOCK: tl.constexpr
):
    """c = sum over splits of partial, in split order, rounded once to c's dtype."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < M * N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for split in tl.static_range(SPLITS):
        acc += tl.load(partial_ptr + split * M * N + offs, mask=ok, other=0.0)
    c = c_ptr + (offs // N) * stride_cm + offs % N
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=ok)


# B tiles of BLOCK_K x BLOCK_N = 128 x 64 (16 KB) and 4 stages: 64 KB of B in flight per program,
# within every GPU's shared memory (the ~100 KB of sm_86/89/120 included). 8 warps: compiled
# offline for sm_90 (Triton 3.9), 4 warps spilled 20-24 bytes at BLOCK_M = 16 and 32, 8 spill
# nothing. The interpreter: larger N blocks, fewer programs.
BLOCK_N, BLOCK_K, NUM_WARPS, NUM_STAGES = runtime.pick((64, 128, 8, 4), (32, 64, 1, 1))
SUM_BLOCK = 1024


def default_splits(N: int, K: int) -> int:
    """Enough pieces of K for two programs per SM, each at least BLOCK_K deep."""
    programs_along_n = triton.cdiv(N, BLOCK_N)
    return max(1, min(triton.cdiv(2 * sm_programs(), programs_along_n), triton.cdiv(K, BLOCK_K)))


def matmul_split_k(
    a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None, *, splits: int | None = None
) -> torch.Tensor:
    """C = a @ b for a of at most MAX_ROWS rows, K cut into `splits` pieces (default_splits if
    None). fp16 or bf16, any strides, float32 accumulation and partial sums."""
    op = "triton_skinny.matmul_split_k"
    M, N, K = check_matmul_args(a, b, out, op=op)
    if M > MAX_ROWS:
        raise ValueError(f"{op}: a has {M} rows; this kernel is for at most {MAX_ROWS}")
    splits = default_splits(N, K) if splits is None else splits
    if not isinstance(splits, int) or not 1 <= splits <= K:
        raise ValueError(f"{op}: splits must be an integer from 1 to K = {K}, got {splits!r}")
    # Each piece a whole number of BLOCK_K steps; rounding may leave fewer pieces than asked.
    k_per_split = triton.cdiv(triton.cdiv(K, splits), BLOCK_K) * BLOCK_K
    splits = triton.cdiv(K, k_per_split)
    out = torch.empty(M, N, dtype=a.dtype, device=a.device) if out is None else out
    partial = torch.empty(splits, M, N, dtype=torch.float32, device=a.device)
    split_k_kernel[(triton.cdiv(N, BLOCK_N), splits)](
        a, b, partial, M, N, K, *a.stride(), *b.stride(), k_per_split,
        BLOCK_M=triton_gemv.rows_block(M, use_dot=True), BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        UPCAST=runtime.UPCAST, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )  # fmt: skip
    sum_splits_kernel[(triton.cdiv(M * N, SUM_BLOCK),)](
        partial, out, M, N, out.stride(0), SPLITS=splits, BLOCK=SUM_BLOCK
    )
    return out


def takes_gemv(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the decoder's GEMV can compute a @ b without a copy: at most MAX_ROWS rows of a,
    a's rows contiguous, and b the transpose of a contiguous (N, K) weight."""
    return a.shape[0] <= MAX_ROWS and (a.stride(1) == 1 or a.shape[1] == 1) and b.T.is_contiguous()


def skinny_matmul(
    a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """C = a @ b for a of at most MAX_ROWS rows: the decoder's GEMV where `takes_gemv`, split-K
    otherwise."""
    check_matmul_args(a, b, out, op="triton_skinny.skinny_matmul")
    if takes_gemv(a, b):
        return triton_gemv.linear(a, b.T, out)
    return matmul_split_k(a, b, out)
