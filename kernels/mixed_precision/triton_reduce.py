"""Sums in Triton with a chosen accumulator dtype (float32, float16, bfloat16) and algorithm.

* **naive**: every lane of a program adds its elements one after another (a sequential sum per
  lane), then the lanes are added in a tree, then the programs' partial sums the same way (a second
  launch).
* **pairwise**: a balanced binary tree over the whole row: adjacent pairs, then pairs of pairs, ...
* **kahan**: the naive structure, but each lane carries a compensation c, the low-order bits its
  last addition lost, and subtracts it from the next element. Lanes and programs are combined with
  an exact two-sum, so the compensations survive to the end.

**Low precision made explicit.** Values live in float32 registers and are rounded to the accumulator
dtype after *every* operation (`_round`): an fp16/bf16 operation done in float32 and rounded once is
the correctly rounded fp16/bf16 result, the interpreter does not emulate fp16 arithmetic, and it
truncates float32 -> bfloat16 casts; so bfloat16 is rounded to nearest-even by hand on the bits. The
order of every addition is fixed by the code (the lane trees are explicit levels of adjacent pairs,
not one `tl.sum`, whose order differs between the interpreter and the GPU), so CPU and GPU return
the same bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import runtime
from kernels.mixed_precision.validate import check_sum_args

ACC_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
ALGO_CODE = {"naive": 0, "pairwise": 1, "kahan": 2}
# One program reads BLOCK elements per trip for TRIPS trips (128K elements, 512 KB of float32):
# enough per program to amortize its final lane tree, and 2048 programs at 256M elements to fill 132
# SMs. The same tiling in both modes, so CPU and GPU add in the same order and agree bit for bit.
BLOCK, TRIPS = 4096, 32
NUM_WARPS = runtime.pick(gpu=8, cpu=1)
# The pairwise variant loads one tile per program and adds it as a tree.
PAIRWISE_BLOCK = 4096


@triton.jit
def _round(v, ACC: tl.constexpr):
    """v (float32) rounded to the accumulator dtype, as float32 again."""
    if ACC == 1:
        v = v.to(tl.float16).to(tl.float32)
    elif ACC == 2:
        # round to nearest even on the bits: add 0x7FFF plus the lowest kept bit, drop 16 bits
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
        v = bits.to(tl.float32, bitcast=True)
    return v


@triton.jit
def _pair_sums(v, HALF: tl.constexpr):
    """v[0] + v[1], v[2] + v[3], ...: the sums of adjacent pairs, as a reduction over an axis of
    two. A sum of two values does not depend on their order, so this is the same on CPU and GPU;
    splitting the pairs apart with tl.split instead takes Triton 3.6 over a minute to compile at
    4096 lanes."""
    return tl.sum(tl.reshape(v, (HALF, 2)), axis=1)


@triton.jit
def _tree_sum(v, N: tl.constexpr, LOG2N: tl.constexpr, ACC: tl.constexpr):
    """Sum of the N (a power of two) values of v: adjacent pairs, level by level, each rounded."""
    for level in tl.static_range(LOG2N):
        v = _round(_pair_sums(v, N >> (level + 1)), ACC)
    return tl.sum(v, axis=0)  # one value left: exact


@triton.jit
def _two_sum_tree(s, c, N: tl.constexpr, LOG2N: tl.constexpr, ACC: tl.constexpr):
    """Add N (sum, compensation) pairs, where each represents sum - compensation, keeping the error
    of every addition: a + b = t + e exactly (Knuth's two-sum), and e joins the compensation. e is
    exact, so it is the same whichever of the pair is called a: the larger one is, with no tl.split
    needed."""
    for level in tl.static_range(LOG2N):
        pairs = tl.reshape(s, (N >> (level + 1), 2))
        sa = tl.max(pairs, axis=1)
        sb = tl.min(pairs, axis=1)
        # a NaN in the pair stays in t (tl.max may drop it)
        t = _round(_pair_sums(s, N >> (level + 1)), ACC)
        b_virtual = _round(t - sa, ACC)
        e = _round(_round(sa - _round(t - b_virtual, ACC), ACC) + _round(sb - b_virtual, ACC), ACC)
        c = _round(_pair_sums(c, N >> (level + 1)) - e, ACC)
        s = t
    return tl.sum(s, axis=0), tl.sum(c, axis=0)


@triton.jit
def sum_kernel(
    x_ptr,
    out_ptr,
    n,
    x_row_stride,
    out_row_stride,
    chunks,
    ALGO: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK: tl.constexpr,
    LOG2_BLOCK: tl.constexpr,
    TRIPS: tl.constexpr,
    FINAL: tl.constexpr,
):
    """Program p sums elements [chunk * BLOCK * TRIPS, ...) of row p // chunks, chunk = p % chunks.
    FINAL (one chunk): store the row's sum. Otherwise store the partial sum at [row, chunk] and, for
    Kahan, minus the compensation at [row, chunks + chunk]: the next launch sums those 2 * chunks
    values."""
    pid = tl.program_id(0).to(tl.int64)
    chunk = pid % chunks
    row = pid // chunks
    start = chunk * (BLOCK * TRIPS)
    x_row = x_ptr + row * x_row_stride
    lanes = tl.arange(0, BLOCK)
    comp = 0.0
    if ALGO == 1:  # pairwise: one tile, one tree
        idx = start + lanes
        v = _round(tl.load(x_row + idx, mask=idx < n, other=0.0).to(tl.float32), ACC)
        total = _tree_sum(v, BLOCK, LOG2_BLOCK, ACC)
    else:
        s = tl.zeros([BLOCK], dtype=tl.float32)
        c = tl.zeros([BLOCK], dtype=tl.float32)
        for trip in range(TRIPS):
            idx = start + trip * BLOCK + lanes
            v = _round(tl.load(x_row + idx, mask=idx < n, other=0.0).to(tl.float32), ACC)
            if ALGO == 2:
                y = _round(v - c, ACC)  # the element, corrected by what the last addition lost
                t = _round(s + y, ACC)
                # (t - s) is what was really added; minus y: the loss
                c = _round(_round(t - s, ACC) - y, ACC)
                s = t
            else:
                s = _round(s + v, ACC)
        if ALGO == 2:
            total, comp = _two_sum_tree(s, c, BLOCK, LOG2_BLOCK, ACC)
        else:
            total = _tree_sum(s, BLOCK, LOG2_BLOCK, ACC)
    out_row = out_ptr + row * out_row_stride
    if FINAL:
        tl.store(out_row, _round(total - comp, ACC).to(out_ptr.dtype.element_ty))
    else:
        tl.store(out_row + chunk, total)
        if ALGO == 2:
            tl.store(out_row + chunks + chunk, -comp)


def _launch(x2d, out, n, algorithm, acc, block, trips, final, chunks):
    sum_kernel[(chunks * x2d.shape[0],)](
        x2d,
        out,
        n,
        x2d.stride(0),
        out.stride(0) if out.dim() == 2 else 1,
        chunks,
        ALGO=ALGO_CODE[algorithm],
        ACC=ACC_CODE[acc],
        BLOCK=block,
        LOG2_BLOCK=block.bit_length() - 1,
        TRIPS=trips,
        FINAL=final,
        num_warps=NUM_WARPS,
    )


def sum(
    x: torch.Tensor,
    acc: torch.dtype = torch.float32,
    algorithm: str = "naive",
    *,
    block: int | None = None,
    trips: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The sum of x (a vector) or of each row of x (rows, n), accumulated in `acc` with `algorithm`.

    Returns a tensor of dtype `acc` and shape x.shape[:-1]. `block` (a power of two; 1 makes every
    program a single sequential lane) and `trips` (elements per lane per launch) override the
    tiling; the result depends on them, and only on them, in both modes."""
    check_sum_args("sum", x, acc, algorithm, device_type=runtime.DEVICE)
    block = block or (PAIRWISE_BLOCK if algorithm == "pairwise" else BLOCK)
    trips = 1 if algorithm == "pairwise" else (trips or TRIPS)
    # Kahan passes two values (sum, compensation) per chunk to the next launch: with fewer than 4
    # elements per chunk that level is no shorter than the last one and the launches would never
    # end.
    least = 4 if algorithm == "kahan" else 2
    if block & (block - 1) or block * trips < least:
        raise ValueError(
            f"sum: block must be a power of two and block * trips at least {least} for "
            f"{algorithm}, "
            f"got {block} x {trips}"
        )
    x2d = x.view(1, -1) if x.dim() == 1 else x
    rows, n = x2d.shape
    out = torch.empty(x.shape[:-1], dtype=acc, device=x.device) if out is None else out
    if rows == 0:
        return out
    if n == 0:
        return out.fill_(0.0)
    level, width = x2d, n
    while True:
        chunks = triton.cdiv(width, block * trips)
        if chunks == 1:
            _launch(level, out.view(rows), width, algorithm, acc, block, trips, True, 1)
            return out
        partials = torch.empty(
            rows, chunks * (2 if algorithm == "kahan" else 1), dtype=torch.float32, device=x.device
        )
        _launch(level, partials, width, algorithm, acc, block, trips, False, chunks)
        level, width = partials, partials.shape[1]
