"""Known-wrong chunked cross-entropy submissions (lab 05), and what the grader must say.

Each is the lab's `token_losses` with one mistake a student makes."""

import torch
import triton
import triton.language as tl

from kernels import runtime
from kernels.memory_profiling.validate import check_linear_ce_args

BLOCK_T, BLOCK_V, BLOCK_H = 64, 256, 64


@triton.jit
def _logits_kernel(
    x_ptr,
    w_ptr,
    z_ptr,
    tokens,
    vocab,
    hidden,
    BLOCK_T: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """The full (tokens, vocab) logits, written to global memory."""
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    vs = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    hs = tl.arange(0, BLOCK_H)
    acc = tl.zeros((BLOCK_T, BLOCK_V), tl.float32)
    for h0 in range(0, hidden, BLOCK_H):
        xb = tl.load(
            x_ptr + toks[:, None] * hidden + h0 + hs[None, :],
            mask=(toks[:, None] < tokens) & (h0 + hs[None, :] < hidden),
            other=0.0,
        ).to(tl.float32)
        wb = tl.load(
            w_ptr + vs[:, None] * hidden + h0 + hs[None, :],
            mask=(vs[:, None] < vocab) & (h0 + hs[None, :] < hidden),
            other=0.0,
        ).to(tl.float32)
        acc += tl.dot(xb, tl.trans(wb), input_precision="ieee")
    tl.store(
        z_ptr + toks[:, None] * vocab + vs[None, :],
        acc,
        mask=(toks[:, None] < tokens) & (vs[None, :] < vocab),
    )


@triton.jit
def _loss_kernel(
    z_ptr,
    t_ptr,
    loss_ptr,
    tokens,
    vocab,
    ignore_index,
    BLOCK_V: tl.constexpr,
    MISTAKE: tl.constexpr,
):
    """Online log-sum-exp over one row of stored logits."""
    row = tl.program_id(0)
    target = tl.load(t_ptr + row)
    cols = tl.arange(0, BLOCK_V)
    m = tl.full((BLOCK_V,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_V,), tl.float32)
    end = (
        vocab - BLOCK_V if MISTAKE == "off_by_one_chunk" else vocab
    )  # the last (partial) chunk is skipped
    for v0 in range(0, end, BLOCK_V):
        z = tl.load(z_ptr + row * vocab + v0 + cols, mask=v0 + cols < vocab, other=float("-inf"))
        new_m = tl.maximum(m, z)
        safe = tl.where(new_m == float("-inf"), 0.0, new_m)
        s = s * tl.exp(m - safe) + tl.exp(z - safe)
        m = new_m
    big = tl.max(m, axis=0)
    lse = big + tl.log(tl.sum(s * tl.exp(m - big), axis=0))
    zt = tl.load(z_ptr + row * vocab + tl.where(target == ignore_index, 0, target))
    loss = tl.where(target == ignore_index, 0.0, lse - zt)
    tl.store(loss_ptr + row, loss.to(loss_ptr.dtype.element_ty))


def submission(mistake: str):
    """ "full_logits": right values, but the (tokens, vocab) logits are stored in float32
    between two kernels.
    "off_by_one_chunk": the same, and the loop over vocabulary chunks stops one chunk early."""

    def token_losses(x, w, targets, ignore_index=-100, out=None):
        check_linear_ce_args("token_losses", x, w, targets, device_type=runtime.DEVICE)
        tokens, hidden = x.shape
        vocab = w.shape[0]
        out = torch.empty(tokens, dtype=x.dtype, device=x.device) if out is None else out
        logits = torch.empty(tokens, vocab, dtype=torch.float32, device=x.device)
        _logits_kernel[(triton.cdiv(tokens, BLOCK_T), triton.cdiv(vocab, BLOCK_V))](
            x, w, logits, tokens, vocab, hidden, BLOCK_T=BLOCK_T, BLOCK_V=BLOCK_V, BLOCK_H=BLOCK_H
        )
        _loss_kernel[(tokens,)](
            logits, targets, out, tokens, vocab, ignore_index, BLOCK_V=BLOCK_V, MISTAKE=mistake
        )
        return out

    return token_losses


# what check_function's message must contain (GPU and CPU), and on a GPU only
CORPUS = {"off_by_one_chunk": "1 float32: n=1: 1 of 1 elements wrong"}
# (the first case over budget is 100 tokens x vocab 4099: 1.6 MiB of float32 logits against the 1
# MiB floor)
GPU_ONLY = {
    "full_logits": "MiB of device memory beyond its inputs and outputs at its peak; the budget is"
}
