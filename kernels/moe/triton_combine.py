"""Combine: out[t] = sum_j weights[t, j] * y[row_of[t * k + j]], back in token order.

The expert outputs y are in expert order; each token's k rows are somewhere in it. Scattering them
with atomic adds would need float32 atomics on a float32 copy (bf16 atomics are slow on the GPU and
missing in the interpreter) and would make the sum's order, so its rounding, change from run to run.
Gathering instead: one program owns BLOCK_T tokens x BLOCK_H columns, reads the token's k rows
through row_of (from the permutation), and sums them in float32 in slot order -- deterministic, no
atomics, one rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import runtime
from kernels.moe.triton_permute import Permutation

BLOCK_T = runtime.pick(gpu=4, cpu=64)
BLOCK_H = runtime.pick(gpu=1024, cpu=128)
NUM_WARPS = runtime.pick(gpu=4, cpu=1)


@triton.jit
def combine_kernel(
    y_ptr,
    row_of_ptr,
    weights_ptr,
    out_ptr,
    tokens,
    hidden,
    TOP_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    t_ok = t < tokens
    mask = t_ok[:, None] & (h < hidden)[None, :]
    acc = tl.zeros((BLOCK_T, BLOCK_H), tl.float32)
    for j in tl.static_range(TOP_K):
        row = tl.load(row_of_ptr + t * TOP_K + j, mask=t_ok, other=0)
        w = tl.load(weights_ptr + t * TOP_K + j, mask=t_ok, other=0.0)
        y = tl.load(y_ptr + row[:, None].to(tl.int64) * hidden + h[None, :], mask=mask, other=0.0)
        acc += w[:, None] * y.to(tl.float32)
    tl.store(
        out_ptr + t[:, None].to(tl.int64) * hidden + h[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=mask,
    )


def combine(y: torch.Tensor, weights: torch.Tensor, perm: Permutation) -> torch.Tensor:
    """(tokens, hidden) in y's dtype from expert rows y (rows, hidden) and weights (tokens, k)."""
    tokens, top_k = weights.shape
    if top_k != perm.top_k or weights.dtype != torch.float32:
        raise ValueError(
            f"combine: weights must be float32 (tokens, {perm.top_k}), got {weights.dtype} "
            f"{tuple(weights.shape)}"
        )
    hidden = y.shape[1]
    out = torch.empty(tokens, hidden, dtype=y.dtype, device=y.device)
    if tokens:
        grid = (triton.cdiv(tokens, BLOCK_T), triton.cdiv(hidden, BLOCK_H))
        combine_kernel[grid](
            y,
            perm.row_of,
            weights,
            out,
            tokens,
            hidden,
            TOP_K=top_k,
            BLOCK_T=BLOCK_T,
            BLOCK_H=BLOCK_H,
            num_warps=NUM_WARPS,
        )
    return out
