"""The router in one launch: logits = x @ w_router.T, softmax, top-k, renormalized weights.

At decode sizes (tens to hundreds of tokens) PyTorch's router is five small kernels (matmul,
softmax, topk, sum, divide), each a launch of a few microseconds around almost no work. Here one
program takes BLOCK_T tokens, accumulates their logits against all experts (the experts fit in one
tile: E <= 256), and finishes softmax, top-k and renormalization in registers. Top-k is k rounds of
"take the maximum, knock it out" (k is 1 or 2 in practice, so this beats a sort); ties go to the
lower expert id.

Also here: the load-balancing loss and utilization statistics from the router's probabilities and
the permutation's per-expert counts, as tensor arithmetic (no host sync).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import runtime
from kernels.moe import reference
from kernels.moe.validate import check_router_args
from kernels.runtime import UPCAST

BLOCK_T = runtime.pick(gpu=16, cpu=64)  # tokens per program; tl.dot needs at least 16
BLOCK_H = runtime.pick(gpu=128, cpu=128)  # hidden columns per step of the logits loop
NUM_WARPS = runtime.pick(gpu=4, cpu=1)
MAX_EXPERTS = 256


@triton.jit
def router_kernel(
    x_ptr,
    w_ptr,
    probs_ptr,
    ids_ptr,
    weights_ptr,
    tokens,
    hidden,
    experts,
    TOP_K: tl.constexpr,
    E_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    UPCAST: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.arange(0, E_PAD)
    h = tl.arange(0, BLOCK_H)
    t_ok = t < tokens
    e_ok = e < experts
    logits = tl.zeros((BLOCK_T, E_PAD), tl.float32)
    for h0 in range(0, hidden, BLOCK_H):
        h_ok = h0 + h < hidden
        xt = tl.load(
            x_ptr + t[:, None].to(tl.int64) * hidden + h0 + h[None, :],
            mask=t_ok[:, None] & h_ok[None, :],
            other=0.0,
        )
        wt = tl.load(
            w_ptr + e[None, :] * hidden + h0 + h[:, None],
            mask=e_ok[None, :] & h_ok[:, None],
            other=0.0,
        )
        if UPCAST:
            xt = xt.to(tl.float32)
            wt = wt.to(tl.float32)
        logits = tl.dot(xt, wt, logits)
    # Softmax over the real experts; padded columns get -inf, so probability 0.
    logits = tl.where(e_ok[None, :], logits, float("-inf"))
    z = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    probs = z / tl.sum(z, axis=1)[:, None]
    tl.store(
        probs_ptr + t[:, None] * experts + e[None, :], probs, mask=t_ok[:, None] & e_ok[None, :]
    )
    # Top-k by k rounds of argmax; knocked-out entries become -1, below any probability.
    remaining = tl.where(e_ok[None, :], probs, -1.0)
    total = tl.zeros((BLOCK_T,), tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.max(remaining, axis=1)
        best_id = tl.min(tl.where(remaining == best[:, None], e[None, :], E_PAD), axis=1)
        tl.store(ids_ptr + t * TOP_K + j, best_id, mask=t_ok)
        tl.store(weights_ptr + t * TOP_K + j, best, mask=t_ok)  # unnormalized for now
        total += best
        remaining = tl.where(e[None, :] == best_id[:, None], -1.0, remaining)
    # Renormalize: read back what this program just wrote (same threads, same addresses).
    for j in tl.static_range(TOP_K):
        p = tl.load(weights_ptr + t * TOP_K + j, mask=t_ok, other=1.0)
        tl.store(weights_ptr + t * TOP_K + j, p / total, mask=t_ok)


def route(x: torch.Tensor, w_router: torch.Tensor, top_k: int):
    """(probs (tokens, experts) fp32, ids (tokens, k) int32, weights (tokens, k) fp32) at once."""
    check_router_args("route", x, w_router, top_k)
    tokens, hidden = x.shape
    experts = w_router.shape[0]
    if experts > MAX_EXPERTS:
        raise ValueError(
            f"route: at most {MAX_EXPERTS} experts fit the router's single tile, got {experts}"
        )
    probs = torch.empty(tokens, experts, dtype=torch.float32, device=x.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=x.device)
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=x.device)
    if tokens == 0:
        return probs, ids, weights
    router_kernel[(triton.cdiv(tokens, BLOCK_T),)](
        x,
        w_router,
        probs,
        ids,
        weights,
        tokens,
        hidden,
        experts,
        TOP_K=top_k,
        E_PAD=max(16, triton.next_power_of_2(experts)),
        BLOCK_T=BLOCK_T,
        BLOCK_H=BLOCK_H,
        UPCAST=UPCAST,
        num_warps=NUM_WARPS,
    )
    return probs, ids, weights


def routing_stats(
    probs: torch.Tensor, counts: torch.Tensor, top_k: int, capacity_factor: float = 1.25
) -> dict:
    """Load-balancing loss and utilization from the router's probs and the counts (tensors)."""
    stats = reference.utilization(counts, probs.shape[0], top_k, capacity_factor)
    stats["load_balancing_loss"] = reference.load_balancing_loss(probs, counts, top_k)
    return stats
