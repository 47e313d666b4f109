"""Token permutation: sort the (token, slot) assignments by expert, each expert's rows padded to the
GEMM block, on the GPU and without a host sync (so the layer can be captured in a CUDA graph).

The router gives ids (tokens, k). There are n = tokens * k assignments; assignment a = t * k + j
sends token t to expert ids[t, j]. The grouped GEMM wants every expert's assignments in one
contiguous run of rows, each run padded to a multiple of BLOCK_M rows so that no GEMM tile straddles
two experts:

    rows:  [ e0: a a a a a - - - | e1: (none) | e2: a a a a a a a a | e2: a - - - - - - - | ... ]
                                                   one BLOCK_M tile      next tile, mostly padding

The number of rows depends on the data, but a bound does not: at most n + E * (BLOCK_M - 1). The
buffers are allocated at that bound, so no count ever has to travel to the host; tiles past the real
end are marked expert -1 and the GEMM programs that get them return at once.

Three launches, like one pass of a radix sort (deterministic, stable, no atomics):
1. histogram: each program counts its block of assignments per expert -> block_counts (blocks, E);
2. scan (one program): per expert, an exclusive prefix sum over the blocks (where each block's run
   starts within the expert's rows); then the expert counts, their padded sizes, and the padded
   offsets by a prefix sum over experts; then each tile's expert;
3. place: each assignment's rank among the same expert's assignments in its block (a prefix sum of
   a one-hot matrix), plus the block's start and the expert's offset, is its row.
Stable: within an expert, rows keep the assignments' order. The CUDA C version (permute.cu) uses
atomics instead and gives the same rows in some order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import runtime
from kernels.moe.validate import check_ids

NUM_WARPS = runtime.pick(gpu=8, cpu=1)
BLOCK_B = runtime.pick(gpu=64, cpu=16)  # blocks per step of the scan
BLOCK_TILES = runtime.pick(gpu=256, cpu=64)  # tiles per step of the tile -> expert map


@dataclass
class Permutation:
    """Where every assignment goes; padding rows (no assignment) have sorted_ids == -1."""

    counts: torch.Tensor  # (E,) int32: assignments per expert
    padded_offsets: torch.Tensor  # (E + 1,) int32: first row of each expert; [E] = rows in use
    sorted_ids: torch.Tensor  # (max_rows,) int32: the assignment t * k + j in each row, or -1
    # (max_tiles,) int32: the expert of each BLOCK_M-row tile, or -1 past the end
    tile_expert: torch.Tensor
    # (tokens * k,) int32: the row of each assignment (the combine's gather index)
    row_of: torch.Tensor
    block_m: int
    top_k: int

    @property
    def max_tiles(self) -> int:
        return self.tile_expert.numel()


def max_tiles(assignments: int, experts: int, block_m: int) -> int:
    """Tiles the padded rows need at most: sum_e ceil(c_e / B) <= (sum_e c_e + E (B - 1)) / B."""
    return (assignments + experts * (block_m - 1)) // block_m


def empty_permutation(ids: torch.Tensor, experts: int, block_m: int) -> Permutation:
    """Output buffers at their data-independent sizes; sorted_ids starts as all padding."""
    n = ids.numel()
    tiles = max_tiles(n, experts, block_m)
    dev = ids.device
    return Permutation(
        counts=torch.empty(experts, dtype=torch.int32, device=dev),
        padded_offsets=torch.empty(experts + 1, dtype=torch.int32, device=dev),
        sorted_ids=torch.full((tiles * block_m,), -1, dtype=torch.int32, device=dev),
        tile_expert=torch.empty(tiles, dtype=torch.int32, device=dev),
        row_of=torch.empty(n, dtype=torch.int32, device=dev),
        block_m=block_m,
        top_k=ids.shape[1],
    )


@triton.jit
def histogram_kernel(ids_ptr, n, block_counts_ptr, E_PAD: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    a = b * BLOCK + tl.arange(0, BLOCK)
    e = tl.arange(0, E_PAD)
    ids = tl.load(ids_ptr + a, mask=a < n, other=-1).to(tl.int32)  # -1 matches no expert
    onehot = (ids[:, None] == e[None, :]).to(tl.int32)
    tl.store(block_counts_ptr + b * E_PAD + e, tl.sum(onehot, axis=0))


@triton.jit
def scan_kernel(
    block_counts_ptr,
    num_blocks,
    block_base_ptr,
    counts_ptr,
    offsets_ptr,
    tile_expert_ptr,
    experts,
    max_tiles,
    BLOCK_M: tl.constexpr,
    E_PAD: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_TILES: tl.constexpr,
):
    e = tl.arange(0, E_PAD)
    e_ok = e < experts
    # Per expert, where each block's assignments start among the expert's rows (exclusive prefix
    # sum).
    running = tl.zeros((E_PAD,), tl.int32)
    for b0 in range(0, num_blocks, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        where = b[:, None] * E_PAD + e[None, :]
        c = tl.load(block_counts_ptr + where, mask=b[:, None] < num_blocks, other=0)
        tl.store(
            block_base_ptr + where,
            tl.cumsum(c, axis=0) - c + running[None, :],
            mask=b[:, None] < num_blocks,
        )
        running += tl.sum(c, axis=0)
    tl.store(counts_ptr + e, running, mask=e_ok)
    # Each expert's rows rounded up to whole tiles, and where they start (exclusive prefix sum).
    padded = (running + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    tl.store(offsets_ptr + e, ends - padded, mask=e_ok)
    tl.store(offsets_ptr + experts, tl.sum(padded, axis=0))
    # Tile i belongs to the expert whose row range holds row i * BLOCK_M: the number of experts that
    # end at or before it (experts without rows end where they start and are counted, as they must
    # be).
    tile_end = tl.where(e_ok, ends // BLOCK_M, 2147483647)
    for t0 in range(0, max_tiles, BLOCK_TILES):
        tile = t0 + tl.arange(0, BLOCK_TILES)
        expert = tl.sum((tile[:, None] >= tile_end[None, :]).to(tl.int32), axis=1)
        tl.store(
            tile_expert_ptr + tile, tl.where(expert < experts, expert, -1), mask=tile < max_tiles
        )


@triton.jit
def place_kernel(
    ids_ptr,
    n,
    block_base_ptr,
    offsets_ptr,
    sorted_ids_ptr,
    row_of_ptr,
    E_PAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    a = b * BLOCK + tl.arange(0, BLOCK)
    e = tl.arange(0, E_PAD)
    ok = a < n
    ids = tl.load(ids_ptr + a, mask=ok, other=-1).to(tl.int32)
    onehot = (ids[:, None] == e[None, :]).to(tl.int32)
    # rank of each assignment among the earlier ones of its block with the same expert
    rank = tl.sum((tl.cumsum(onehot, axis=0) - onehot) * onehot, axis=1)
    safe = tl.where(ok, ids, 0)
    row = (
        tl.load(offsets_ptr + safe, mask=ok, other=0)
        + tl.load(block_base_ptr + b * E_PAD + safe, mask=ok, other=0)
        + rank
    )
    tl.store(sorted_ids_ptr + row, a, mask=ok)
    tl.store(row_of_ptr + a, row, mask=ok)


def _block(e_pad: int) -> int:
    # The one-hot matrix (BLOCK x E_PAD) lives in registers: about 16K entries per program on the
    # GPU.
    return runtime.pick(gpu=max(32, 16384 // e_pad), cpu=256)


def permute(ids: torch.Tensor, experts: int, block_m: int) -> Permutation:
    """Sort the assignments of `ids` (tokens, k) by expert, rows padded to `block_m`. Three
    launches, no host sync. Expert ids outside [0, experts) are not checked (that would need the
    host) and are dropped.
    """
    check_ids("permute", ids, experts)
    if block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"permute: block_m must be a power of two, got {block_m}")
    out = empty_permutation(ids, experts, block_m)
    n = ids.numel()
    e_pad = triton.next_power_of_2(experts)
    block = _block(e_pad)
    blocks = max(1, triton.cdiv(n, block))
    block_counts = torch.empty(blocks, e_pad, dtype=torch.int32, device=ids.device)
    block_base = torch.empty_like(block_counts)
    histogram_kernel[(blocks,)](ids, n, block_counts, E_PAD=e_pad, BLOCK=block, num_warps=NUM_WARPS)
    scan_kernel[(1,)](
        block_counts,
        blocks,
        block_base,
        out.counts,
        out.padded_offsets,
        out.tile_expert,
        experts,
        out.max_tiles,
        BLOCK_M=block_m,
        E_PAD=e_pad,
        BLOCK_B=BLOCK_B,
        BLOCK_TILES=BLOCK_TILES,
        num_warps=NUM_WARPS,
    )
    if n:
        place_kernel[(blocks,)](
            ids,
            n,
            block_base,
            out.padded_offsets,
            out.sorted_ids,
            out.row_of,
            E_PAD=e_pad,
            BLOCK=block,
            num_warps=NUM_WARPS,
        )
    return out


def permute_reference(ids: torch.Tensor, experts: int, block_m: int) -> Permutation:
    """The same permutation by PyTorch ops (stable sort by expert; syncs): the tests' spec."""
    flat = ids.flatten().long()
    n = flat.numel()
    counts = torch.bincount(flat, minlength=experts)
    padded = (counts + block_m - 1) // block_m * block_m
    offsets = torch.zeros(experts + 1, dtype=torch.int64, device=ids.device)
    offsets[1:] = torch.cumsum(padded, 0)
    order = torch.sort(flat, stable=True).indices
    rank = torch.arange(n, device=ids.device) - (torch.cumsum(counts, 0) - counts)[flat[order]]
    rows = offsets[flat[order]] + rank
    out = empty_permutation(ids, experts, block_m)
    out.counts.copy_(counts)
    out.padded_offsets.copy_(offsets)
    out.sorted_ids[rows] = order.to(torch.int32)
    out.row_of[order] = rows.to(torch.int32)
    tile_starts = torch.arange(out.max_tiles, device=ids.device) * block_m
    expert = torch.searchsorted(offsets[1:], tile_starts, right=True)
    out.tile_expert.copy_(torch.where(expert < experts, expert, -1))
    return out
