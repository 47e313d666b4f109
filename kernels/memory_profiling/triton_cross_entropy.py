"""Fused linear + cross-entropy, forward and backward, without the (tokens x vocab) logits.

PyTorch's `F.cross_entropy(x @ w.T, targets)` at tokens 8192, vocab 128256 in bf16 keeps 2 GiB of
logits, 2 GiB of log-softmax (saved for backward) and, in backward, two more 2 GiB gradients alive
at once: 6 GiB for a scalar. Here the tokens are processed in chunks of `chunk` rows:

    logits_c = x_c @ w.T               cuBLAS, (chunk, vocab), into one reused buffer
    loss_c, dlogits_c  (in place)      the Triton kernel below: two sweeps over the vocabulary
    dx_c  = dlogits_c @ w              cuBLAS
    dw   += dlogits_c.T @ x_c          cuBLAS, accumulated in the output

Because the loss is the last node of the graph, its gradient is known in the forward (d loss = 1):
the gradients are computed in the forward and only scaled in the backward. Extra memory: one (chunk,
vocab) buffer, plus dx and dw, which every method must return.

Why cuBLAS for the three products and Triton only for the softmax part: the products are 98% of the
flops and cuBLAS runs them near the matrix-unit peak; the softmax part is memory-bound and is where
PyTorch spends its extra passes and memory. Why chunk the tokens and sweep the vocabulary inside the
kernel, not chunk the vocabulary outside: a token's gradient needs the log-sum-exp over the *whole*
vocabulary, so vocabulary chunks would need a first pass for the log-sum-exp and a second that
recomputes every logit -- four products instead of three, 1.33x the time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import runtime
from kernels.memory_profiling.reference import IGNORE_INDEX
from kernels.memory_profiling.validate import check_linear_ce_args

# Bytes of the (chunk, vocab) logits buffer the default chunk aims at: at vocab 128256 in bf16 that
# is 1024 tokens, 8 chunks for 8192 tokens; each chunk re-reads and re-writes dw (2 GiB of traffic
# in bf16), so smaller chunks cost time, larger ones memory.
CHUNK_BYTES = 256 * 2**20
BLOCK_V = runtime.pick(gpu=4096, cpu=1024)  # vocabulary entries per step of a sweep
NUM_WARPS = runtime.pick(gpu=8, cpu=1)


@triton.jit
def _softmax_loss_grad_kernel(
    logits_ptr,
    stride_row,
    targets_ptr,
    losses_ptr,
    n_valid_ptr,
    vocab,
    ignore_index,
    BLOCK_V: tl.constexpr,
):
    """One program per row: loss = logsumexp(z) - z[target], and the gradient in place:

    z <- (softmax(z) - onehot(target)) / n_valid.

    Sweep 1 keeps a running maximum and a running sum of exponentials (rescaled when the maximum
    grows), so the row is read in BLOCK_V pieces and never held whole; sweep 2 reads it again and
    overwrites it with the gradient. Everything is float32; only the stored gradient is rounded to
    the logits' dtype.
    """
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    target = tl.load(targets_ptr + row)
    ignored = target == ignore_index
    cols = tl.arange(0, BLOCK_V)
    running_max = tl.full((BLOCK_V,), float("-inf"), tl.float32)
    running_sum = tl.zeros((BLOCK_V,), tl.float32)
    for start in range(0, vocab, BLOCK_V):
        z = tl.load(row_ptr + start + cols, mask=start + cols < vocab, other=float("-inf")).to(
            tl.float32
        )
        new_max = tl.maximum(running_max, z)
        # lanes still at -inf (only masked columns so far) must add 0, not exp(-inf - -inf) = NaN
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        running_sum = running_sum * tl.exp(running_max - safe_max) + tl.exp(z - safe_max)
        running_max = new_max
    row_max = tl.max(running_max, axis=0)
    lse = row_max + tl.log(tl.sum(running_sum * tl.exp(running_max - row_max), axis=0))
    safe_target = tl.where(ignored, 0, target)
    z_target = tl.load(row_ptr + safe_target).to(tl.float32)
    tl.store(losses_ptr + row, tl.where(ignored, 0.0, lse - z_target))
    # mean over the non-ignored tokens of the whole batch, not of this chunk
    scale = tl.where(ignored, 0.0, 1.0 / tl.load(n_valid_ptr).to(tl.float32))
    for start in range(0, vocab, BLOCK_V):
        mask = start + cols < vocab
        z = tl.load(row_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
        grad = tl.exp(z - lse) - tl.where(start + cols == target, 1.0, 0.0)
        tl.store(row_ptr + start + cols, (grad * scale).to(logits_ptr.dtype.element_ty), mask=mask)


def default_chunk(tokens: int, vocab: int, element_size: int) -> int:
    """Rows per chunk: a power of two, (chunk, vocab) about CHUNK_BYTES, at most `tokens`."""
    rows = max(1, CHUNK_BYTES // (vocab * element_size))
    return min(tokens, 1 << (rows.bit_length() - 1))


def linear_cross_entropy_with_grads(
    x: torch.Tensor,
    w: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = IGNORE_INDEX,
    chunk: int | None = None,
    need_grads: bool = True,
):
    """(mean loss as float32, dx, dw) of `F.cross_entropy(x @ w.T, targets, ignore_index=...)`.

    dx and dw are in x's dtype (None when `need_grads` is False); only a (chunk, vocab) buffer of
    logits exists at a time. With every target ignored the loss is NaN (0/0) and the gradients are
    zero, as in PyTorch.
    """
    check_linear_ce_args("linear_cross_entropy", x, w, targets, device_type=runtime.DEVICE)
    tokens, vocab = x.shape[0], w.shape[0]
    chunk = chunk or default_chunk(tokens, vocab, x.element_size())
    if chunk < 1:
        raise ValueError(
            f"linear_cross_entropy: chunk must be a positive number of tokens, got {chunk}"
        )
    # a device tensor: the kernel reads it, so nothing waits for the count on the host
    n_valid = (targets != ignore_index).sum()
    losses = torch.empty(tokens, dtype=torch.float32, device=x.device)
    dx = torch.empty_like(x) if need_grads else None
    dw = torch.empty_like(w) if need_grads else None
    if need_grads and tokens == 0:
        dw.zero_()
    logits = torch.empty(min(chunk, tokens), vocab, dtype=x.dtype, device=x.device)
    for start in range(0, tokens, chunk):
        end = min(start + chunk, tokens)
        x_c, z = x[start:end], logits[: end - start]
        torch.matmul(x_c, w.t(), out=z)
        _softmax_loss_grad_kernel[(end - start,)](
            z,
            z.stride(0),
            targets[start:end],
            losses[start:end],
            n_valid,
            vocab,
            ignore_index,
            BLOCK_V=BLOCK_V,
            num_warps=NUM_WARPS,
        )
        if need_grads:
            torch.matmul(z, w, out=dx[start:end])
            if start == 0:
                torch.matmul(z.t(), x_c, out=dw)
            else:
                dw.addmm_(z.t(), x_c)
    loss = losses.sum() / n_valid
    return loss, dx, dw


class LinearCrossEntropy(torch.autograd.Function):
    """Autograd wrapper: gradients computed in the forward, scaled by d(output) in backward."""

    @staticmethod
    def forward(ctx, x, w, targets, ignore_index=IGNORE_INDEX, chunk=None):
        need = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        loss, dx, dw = linear_cross_entropy_with_grads(
            x.detach(), w.detach(), targets, ignore_index, chunk, need
        )
        # kept as attributes, not save_for_backward, and dropped in backward: autograd then hands dx
        # and dw to .grad as they are; a second reference would make it copy dw (1 GiB at vocab
        # 128k, bf16)
        ctx.grads = (dx, dw)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        dx, dw = ctx.grads
        ctx.grads = None
        # the usual case, loss.backward(), needs no extra pass
        if dx is not None and grad_loss.item() != 1.0:
            dx, dw = dx * grad_loss.to(dx.dtype), dw * grad_loss.to(dw.dtype)
        return dx, dw, None, None, None


def linear_cross_entropy(
    x: torch.Tensor,
    w: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = IGNORE_INDEX,
    chunk: int | None = None,
) -> torch.Tensor:
    """Drop-in for `F.cross_entropy(x @ w.T, targets, ignore_index=...)` (mean), chunked.

    It never holds all the logits.

    The loss is float32 (PyTorch returns x's dtype). Call `.backward()` on it as usual.
    """
    return LinearCrossEntropy.apply(x, w, targets, ignore_index, chunk)
