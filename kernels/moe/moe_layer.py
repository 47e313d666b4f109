"""The MoE layer from the pieces, five steps, no host sync (so `torch.cuda.graphs` can capture it):

    router   (triton_router)        x -> probs, ids (tokens, k), weights (tokens, k)     1 launch
    permute  (triton_permute or     ids -> counts, padded offsets, sorted rows, tile ->   3 launches
              cupy_permute)          expert map, row of each assignment                  (+1 fill)
    gate_up  (grouped GEMM)         h = silu(x_e W_gate[e]^T) * (x_e W_up[e]^T)           1 launch
    down     (grouped GEMM)         y = h_e W_down[e]^T                                   1 launch
    combine  (triton_combine)       out[t] = sum_j weights[t, j] y[row of (t, j)]         1 launch

Every buffer has a size known from the shapes alone (the padded-row bound), so nothing is read back.
"""

from __future__ import annotations

import functools

import torch

from kernels import runtime
from kernels.moe import (
    triton_combine,
    triton_grouped_gemm,
    triton_grouped_gemm_tma,
    triton_permute,
    triton_router,
)
from kernels.moe.reference import MoEWeights
from kernels.moe.validate import check_expert_weights, check_router_args

# Rows per expert (tokens * top_k / experts) from which the layer's grouped GEMMs are the persistent
# TMA kernel on rows gathered into expert order first, with gate and up as one interleaved product.
# Measured on an H100 (`python -m kernels.moe.benchmark variants`, PERFORMANCE.md): at 128 rows
# (2048 tokens) the pointer kernel, its gather fused into the A loads, and the TMA kernels tie
# (3.66-3.73 ms) and the separate gather costs 8-10%; at 512 rows (8192 tokens) and beyond the
# persistent TMA kernel on gathered rows is 1.27-1.34x faster, and interleaving gate and up adds
# 2-5% to gate_up.
PREGATHER_MIN_ROWS = 256
LARGE_BATCH_VARIANT = "persistent_pregathered_interleaved"


def grouped_gemm_for(tokens: int, experts: int, top_k: int) -> str:
    """The grouped-GEMM variant for this batch: a shape bucket, as the autotuner's keys are. Without
    TMA (GPUs before Hopper) always the pointer kernel."""
    large = tokens * top_k >= PREGATHER_MIN_ROWS * experts
    return LARGE_BATCH_VARIANT if large and runtime.has("tma") else "pointer"


def grouped_gemm_functions(variant: str):
    """(gate_up_swiglu, down) of a grouped-GEMM variant, called as the pointer kernel's are."""
    if variant == "pointer":
        return triton_grouped_gemm.gate_up_swiglu, triton_grouped_gemm.down
    if variant not in triton_grouped_gemm_tma.VARIANTS:
        raise ValueError(
            f"grouped GEMM variant must be 'pointer' or one of "
            f"{list(triton_grouped_gemm_tma.VARIANTS)}, got {variant!r}"
        )
    runtime.require("tma", f"the grouped GEMM variant {variant!r}")
    return (
        functools.partial(triton_grouped_gemm_tma.gate_up_swiglu, variant=variant),
        functools.partial(triton_grouped_gemm_tma.down, variant=variant),
    )


def _permute(ids, experts, block_m, permutation: str):
    if permutation == "triton":
        return triton_permute.permute(ids, experts, block_m)
    if permutation == "cuda":
        from kernels.moe import cupy_permute

        return cupy_permute.permute(ids, experts, block_m)
    raise ValueError(f"moe_forward: permutation must be 'triton' or 'cuda', got {permutation!r}")


def moe_forward(
    x: torch.Tensor,
    w: MoEWeights,
    top_k: int,
    *,
    permutation: str = "triton",
    fuse_swiglu: bool = True,
    block_m: int | None = None,
    grouped_gemm: str | None = None,
    return_routing: bool = False,
):
    """out (tokens, hidden) in x's dtype; with `return_routing`, also (probs, ids, weights,
    Permutation). `grouped_gemm` names the variant ("pointer" or one of
    triton_grouped_gemm_tma.VARIANTS); by default `grouped_gemm_for` picks it from the batch's
    shape."""
    check_router_args("moe_forward", x, w.router, top_k)
    check_expert_weights("moe_forward", x, w.gate, w.up, w.down)
    if w.router.shape[0] != w.experts:
        raise ValueError(
            f"moe_forward: the router has {w.router.shape[0]} experts but the expert weights "
            f"{w.experts}"
        )
    block_m = block_m or triton_grouped_gemm.block_m_for(x.shape[0], w.experts, top_k)
    probs, ids, weights = triton_router.route(x, w.router, top_k)
    perm = _permute(ids, w.experts, block_m, permutation)
    gate_up, down = grouped_gemm_functions(
        grouped_gemm or grouped_gemm_for(x.shape[0], w.experts, top_k)
    )
    # the lab's base task: two pointer-kernel products and an element-wise SwiGLU
    if not fuse_swiglu:
        gate_up, down = triton_grouped_gemm.gate_up_unfused, triton_grouped_gemm.down
    h = gate_up(x, w.gate, w.up, perm)
    y = down(h, w.down, perm)
    out = triton_combine.combine(y, weights, perm)
    return (out, (probs, ids, weights, perm)) if return_routing else out
