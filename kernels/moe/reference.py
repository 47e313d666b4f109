"""The MoE layer in plain PyTorch: the spec every kernel in this package is checked against.

    probs   = softmax(x @ w_router.T)          (tokens, experts), float32 (float64 for checks)
    ids, p  = top-k of probs per token          k experts per token
    weights = p / p.sum(-1)                     renormalized: each token's k weights sum to 1
    out[t]  = sum_j weights[t, j] * expert_{ids[t, j]}(x[t])
    expert_e(x) = (silu(x @ w_gate[e].T) * (x @ w_up[e].T)) @ w_down[e].T       (SwiGLU)

Shapes: x (tokens, hidden); w_router (experts, hidden); w_gate, w_up (experts, inter, hidden);
w_down (experts, hidden, inter) -- each expert's matrices in nn.Linear's (out, in) layout.

`moe_loop` is the slow per-expert loop: gather the tokens routed to expert e, run its SwiGLU,
scatter the weighted rows back. With `fp64=True` every product and sum is done in float64 from the
same low-precision inputs, so what remains between it and a kernel is the kernel's own rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.testing import tolerance


@dataclass
class MoEWeights:
    router: torch.Tensor  # (experts, hidden)
    gate: torch.Tensor  # (experts, inter, hidden)
    up: torch.Tensor  # (experts, inter, hidden)
    down: torch.Tensor  # (experts, hidden, inter)

    @property
    def experts(self) -> int:
        return self.gate.shape[0]

    @property
    def hidden(self) -> int:
        return self.gate.shape[2]

    @property
    def inter(self) -> int:
        return self.gate.shape[1]

    def expert_bytes(self) -> int:
        """Bytes of all experts' three matrices: what a small batch must read at least."""
        return sum(t.numel() * t.element_size() for t in (self.gate, self.up, self.down))


def init_weights(
    experts: int, hidden: int, inter: int, dtype, device, generator=None
) -> MoEWeights:
    """Random weights scaled like nn.Linear's (std 1/sqrt(fan_in)): activations near unit size."""

    def randn(*shape, fan_in):
        return (torch.randn(shape, device=device, generator=generator) / fan_in**0.5).to(dtype)

    return MoEWeights(
        router=randn(experts, hidden, fan_in=hidden),
        gate=randn(experts, inter, hidden, fan_in=hidden),
        up=randn(experts, inter, hidden, fan_in=hidden),
        down=randn(experts, hidden, inter, fan_in=inter),
    )


def route(x: torch.Tensor, w_router: torch.Tensor, top_k: int, *, fp64: bool = False):
    """Softmax, top-k, renormalize: (probs (tokens, experts), ids (tokens, k) int64, weights).

    Logits and softmax in float32 (the kernels' accumulator), or float64 for checks.
    """
    acc = torch.float64 if fp64 else torch.float32
    probs = torch.softmax(x.to(acc) @ w_router.to(acc).T, dim=-1)
    top_p, ids = torch.topk(probs, top_k, dim=-1)
    return probs, ids, top_p / top_p.sum(dim=-1, keepdim=True)


def swiglu_expert(
    x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    return (F.silu(x @ gate.T) * (x @ up.T)) @ down.T


def swiglu_carried_error(
    gate: torch.Tensor, up: torch.Tensor, gate_terms: torch.Tensor, up_terms: torch.Tensor
) -> torch.Tensor:
    """How errors of gate and up proportional to their term sums (gate_terms = |x| @ |w_gate|.T,
    likewise up_terms) reach h = silu(gate) * up: through |silu'(gate)| <= 1.1 and |silu(gate)|.
    Times the relative accumulation error, a bound on h's error from float32 accumulation."""
    return 1.1 * up.abs() * gate_terms + F.silu(gate).abs() * up_terms


def swiglu_with_error_scale(
    gate: torch.Tensor,
    up: torch.Tensor,
    gate_terms: torch.Tensor,
    up_terms: torch.Tensor,
    *,
    fused: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """h = silu(gate) * up in float64, from the float64 products gate = x @ w_gate.T and up = x @
    w_up.T, and the scale a kernel's h is compared against (|h_kernel - h| <= atol + rtol * scale):
    * |h|: h is rounded once to the output dtype;
    * 2**-8 of the products' term sums (gate_terms = |x| @ |w_gate|.T, likewise up_terms): the
      float32 accumulations' error, which does not shrink with gate or up (the down product's checks
      allow the same), reaching h through |silu'(gate)| <= 1.1 and |silu(gate)|. Without it, an h
      near zero fails on accumulation noise alone (the H100 at hidden 1024: 3 of 2.8M elements, 5%
      off an h of 3e-5);
    * unfused: gate and up are rounded to the dtype too, carried by the same factors."""
    h = F.silu(gate) * up
    scale = h.abs() + 2**-8 * swiglu_carried_error(gate, up, gate_terms, up_terms)
    if not fused:
        scale = scale + 1.1 * (gate * up).abs()
    return h, scale


def moe_loop(
    x: torch.Tensor,
    w: MoEWeights,
    top_k: int,
    *,
    fp64: bool = False,
    ids: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """The spec: route, then one expert at a time over the tokens routed to it.

    Pass `ids` and `weights` to check the expert part under a given routing. The result has x's
    dtype (float64 with `fp64=True`). This is also the 'naive loop' of the benchmark; it syncs with
    the host (boolean indexing needs the count), which a real layer must not.
    """
    if ids is None:
        _, ids, weights = route(x, w.router, top_k, fp64=fp64)
    acc = torch.float64 if fp64 else x.dtype
    xs = x.to(acc)
    out = torch.zeros(x.shape, dtype=torch.float64 if fp64 else torch.float32, device=x.device)
    for e in range(w.experts):
        token, slot = torch.nonzero(ids == e, as_tuple=True)
        if token.numel() == 0:
            continue
        y = swiglu_expert(xs[token], w.gate[e].to(acc), w.up[e].to(acc), w.down[e].to(acc))
        out.index_add_(0, token, y.to(out.dtype) * weights[token, slot, None].to(out.dtype))
    return out if fp64 else out.to(x.dtype)


def layer_tolerance(dtype: torch.dtype, *, fused: bool = True) -> tuple[float, float]:
    """(atol, rtol) of the layer's output against `moe_loop(..., fp64=True)`, relative to
    `output_scale`: h rounded to the dtype (twice more when gate and up are separate products), y
    and the output rounded once each. atol: fp16 outputs can be subnormal."""
    return tolerance(dtype, roundings=3 if fused else 5)


def down_tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(atol, rtol) of the down product's rows against float64 h @ w_down[e].T, relative to |y|
    plus 2**-8 of the term sums (float32 accumulation): two roundings."""
    return tolerance(dtype, roundings=2)


def combine_tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(atol, rtol) of the combine against the float64 weighted sum of each token's rows, relative
    to the sum of |weight * row|: two roundings."""
    return tolerance(dtype, roundings=2)


def output_scale(
    x: torch.Tensor, w: MoEWeights, ids: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """sum_j weights[t, j] * (|h_j| @ |w_down[e_j]|.T) in float64, h_j the expert's SwiGLU
    activations: the magnitude of the terms each output sums. Rounding h (the kernel stores it in
    x's dtype) moves the output by at most an ulp of this, however much the terms cancel; tests
    scale their tolerance by it."""
    xs = x.double()
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for e in range(w.experts):
        token, slot = torch.nonzero(ids == e, as_tuple=True)
        if token.numel() == 0:
            continue
        h = F.silu(xs[token] @ w.gate[e].double().T) * (xs[token] @ w.up[e].double().T)
        out.index_add_(
            0, token, (h.abs() @ w.down[e].double().abs().T) * weights[token, slot, None].double()
        )
    return out


# --------------------------------------------------------------------------------------------------
# Load balance (Switch Transformer, Fedus et al. 2021; GShard): the auxiliary loss and what it
# watches.


def load_balancing_loss(probs: torch.Tensor, counts: torch.Tensor, top_k: int) -> torch.Tensor:
    """E * sum_e f_e * P_e, f_e = share of the (tokens * k) assignments that went to expert e and
    P_e = mean router probability of e. 1.0 when perfectly balanced, E when everything goes to one
    expert. (Some papers report it times a coefficient such as 0.01; this is the unscaled term.)
    """
    experts = probs.shape[-1]
    f = counts.to(probs.dtype) / (probs.shape[0] * top_k)
    return experts * (f * probs.mean(dim=0)).sum()


def capacity(tokens: int, experts: int, top_k: int, capacity_factor: float) -> int:
    """Rows an expert may take in a capacity-limited layer (GShard): ceil(factor * T * k / E)."""
    return int(-(-capacity_factor * tokens * top_k // experts))


def utilization(
    counts: torch.Tensor, tokens: int, top_k: int, capacity_factor: float = 1.25
) -> dict:
    """Tokens per expert and what they say, as tensors (no host sync: a layer can call this).

    cv: coefficient of variation of the counts (std / mean; 0 when balanced), a measure of usage
    variance; dropped: assignments above each expert's capacity, which a capacity-limited layer
    would drop (this layer drops nothing: it computes every assignment).
    """
    c = counts.to(torch.float32)
    cap = capacity(tokens, counts.numel(), top_k, capacity_factor)
    return {
        "tokens_per_expert": counts,
        "cv": c.std(correction=0) / c.mean(),
        "max_over_mean": c.max() / c.mean(),
        "dropped": (counts - cap).clamp_min(0).sum(),
        "capacity": cap,
    }


def flops_per_token(hidden: int, inter: int, experts: int, top_k: int) -> int:
    """Router (2*H*E) plus k experts of three (H x I) products each (2 flops per multiply-add)."""
    return 2 * hidden * experts + top_k * 3 * 2 * hidden * inter
