"""Per-token cross-entropy of `x @ w.T` in one Triton kernel (the lab's chunked forward).

Flash attention's trick applied to the vocabulary: a program owns BLOCK_T tokens and walks the
vocabulary in BLOCK_V chunks. For each chunk it computes the (BLOCK_T, BLOCK_V) logits with `tl.dot`
(looping over the hidden size in BLOCK_H steps), folds them into a running maximum and a running sum
of exponentials per token (the online log-sum-exp), picks out the target's logit if it lies in the
chunk, and forgets them. Memory: the output, (tokens,). The (tokens, vocab) logits never exist, not
even in pieces in global memory.

Forward only: the gradient needs every logit again (`triton_cross_entropy.py` does forward and
backward with cuBLAS for the products).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import runtime
from kernels.memory_profiling.reference import IGNORE_INDEX
from kernels.memory_profiling.validate import check_linear_ce_args

# GPU: 64 tokens per program gives 128 programs at 8192 tokens (an H200 has 132 SMs).
# CPU: the interpreter pays per program and per loop trip, so few, large blocks.
BLOCK_T = runtime.pick(gpu=64, cpu=64)
BLOCK_V = runtime.pick(gpu=128, cpu=256)
BLOCK_H = runtime.pick(gpu=64, cpu=64)
NUM_WARPS = runtime.pick(gpu=4, cpu=1)
NUM_STAGES = runtime.pick(gpu=3, cpu=1)


@triton.jit
def _token_loss_kernel(
    x_ptr,
    w_ptr,
    targets_ptr,
    loss_ptr,
    tokens,
    vocab,
    hidden,
    ignore_index,
    BLOCK_T: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = toks < tokens
    targets = tl.load(targets_ptr + toks, mask=tok_ok, other=ignore_index)
    running_max = tl.full((BLOCK_T,), float("-inf"), tl.float32)
    running_sum = tl.zeros((BLOCK_T,), tl.float32)
    target_logit = tl.zeros((BLOCK_T,), tl.float32)
    hs = tl.arange(0, BLOCK_H)
    for v0 in range(0, vocab, BLOCK_V):
        vs = v0 + tl.arange(0, BLOCK_V)
        v_ok = vs < vocab
        logits = tl.zeros((BLOCK_T, BLOCK_V), tl.float32)
        for h0 in range(0, hidden, BLOCK_H):
            h_ok = h0 + hs < hidden
            xb = tl.load(
                x_ptr + toks[:, None].to(tl.int64) * hidden + h0 + hs[None, :],
                mask=tok_ok[:, None] & h_ok[None, :],
                other=0.0,
            )
            wb = tl.load(
                w_ptr + vs[:, None].to(tl.int64) * hidden + h0 + hs[None, :],
                mask=v_ok[:, None] & h_ok[None, :],
                other=0.0,
            )
            if UPCAST:  # the interpreter's bf16 tl.dot is wrong: multiply in float32 there
                xb, wb = xb.to(tl.float32), wb.to(tl.float32)
            if IEEE:  # float32 inputs: true float32 products, not TF32's 10-bit mantissa
                logits += tl.dot(xb, tl.trans(wb), input_precision="ieee")
            else:
                logits += tl.dot(xb, tl.trans(wb))
        logits = tl.where(v_ok[None, :], logits, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(logits, axis=1))
        chunk_sum = tl.sum(tl.exp(logits - new_max[:, None]), axis=1)
        running_sum = running_sum * tl.exp(running_max - new_max) + chunk_sum
        running_max = new_max
        target_logit += tl.sum(tl.where(vs[None, :] == targets[:, None], logits, 0.0), axis=1)
    loss = running_max + tl.log(running_sum) - target_logit
    loss = tl.where(targets == ignore_index, 0.0, loss)
    tl.store(loss_ptr + toks, loss.to(loss_ptr.dtype.element_ty), mask=tok_ok)


def token_losses(
    x: torch.Tensor,
    w: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = IGNORE_INDEX,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token losses of `F.cross_entropy(x @ w.T, targets, reduction="none")`, in x's dtype (0
    where ignored). Mean loss: `token_losses(...).float().sum() / (targets !=
    ignore_index).sum()`."""
    check_linear_ce_args("token_losses", x, w, targets, device_type=runtime.DEVICE)
    tokens, hidden = x.shape
    if out is None:
        out = torch.empty(tokens, dtype=x.dtype, device=x.device)
    elif (
        out.shape != (tokens,)
        or out.dtype != x.dtype
        or out.device != x.device
        or not out.is_contiguous()
    ):
        raise ValueError(
            f"token_losses: out must be a contiguous ({tokens},) "
            f"{str(x.dtype).removeprefix('torch.')} "
            f"tensor on {x.device}"
        )
    if tokens:
        _token_loss_kernel[(triton.cdiv(tokens, BLOCK_T),)](
            x,
            w,
            targets,
            out,
            tokens,
            w.shape[0],
            hidden,
            ignore_index,
            BLOCK_T=BLOCK_T,
            BLOCK_V=BLOCK_V,
            BLOCK_H=BLOCK_H,
            UPCAST=not runtime.ON_GPU and x.dtype == torch.bfloat16,
            IEEE=x.dtype == torch.float32,
            num_warps=NUM_WARPS,
            num_stages=NUM_STAGES,
        )
    return out
