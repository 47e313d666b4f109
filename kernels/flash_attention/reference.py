"""The specification: scaled dot-product attention in plain PyTorch.

    S = scale * Q K^T            (B, Hq, Nq, Nk); scale defaults to 1/sqrt(D)
    P = softmax(S) over keys     (masked keys get probability 0)
    O = P V                      (B, Hq, Nq, D)
    lse = log(sum_j exp(S_ij))   natural log, over the keys a query sees; (B, Hq, Nq)

Layout (batch, heads, seq, head_dim), as `F.scaled_dot_product_attention`. Grouped-query attention:
k and v have Hkv heads, Hq % Hkv == 0, and query head h reads KV head h // (Hq // Hkv).

Causal masking is aligned to the bottom right: query i sees keys j <= i + (Nk - Nq). With Nq == Nk
that is the usual lower triangle; with one query against a KV cache of Nk keys the query sees them
all (decode); FlashAttention-2 uses the same convention. If Nq > Nk, the first Nq - Nk queries see
no key: their output is 0 and their lse is -inf.

`attention_fp64` is the exact answer from the same (low-precision) inputs, to compare kernels with.
`naive_attention` is the textbook version in the input dtype: it materializes the Nq x Nk scores and
probabilities, which is what the flash kernels avoid (memory and time comparisons).
"""

from __future__ import annotations

import math

import torch


def _expand_kv(t: torch.Tensor, n_q_heads: int) -> torch.Tensor:
    """(B, Hkv, N, D) -> (B, Hq, N, D) by repeating each KV head for its group of query heads."""
    group = n_q_heads // t.shape[1]
    return t if group == 1 else t.repeat_interleave(group, dim=1)


def causal_mask(n_q: int, n_k: int, device=None) -> torch.Tensor:
    """(Nq, Nk) bool, True where query i may see key j: j <= i + Nk - Nq (bottom-right aligned)."""
    i = torch.arange(n_q, device=device)[:, None]
    j = torch.arange(n_k, device=device)[None, :]
    return j <= i + (n_k - n_q)


def attention_fp64(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) in float64 from inputs upcast to float64. Differentiable (for gradient checks)."""
    q64, k64, v64 = q.double(), k.double(), v.double()
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    k64, v64 = _expand_kv(k64, q.shape[1]), _expand_kv(v64, q.shape[1])
    s = torch.matmul(q64, k64.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(~causal_mask(q.shape[2], k.shape[2], q.device), float("-inf"))
    # Softmax with the row maximum subtracted (the shift cancels, so it is detached: exact
    # gradients). A row that sees no key has max -inf and sum 0: shift by 0 and divide by 1 so it
    # gives 0, not NaN, in the output and in the gradients.
    m = s.amax(dim=-1, keepdim=True).detach()
    m = m.masked_fill(torch.isinf(m), 0.0)
    e = torch.exp(s - m)
    denom = e.sum(dim=-1, keepdim=True)
    out = torch.matmul(e, v64) / torch.where(denom > 0, denom, torch.ones_like(denom))
    lse = (m + torch.log(denom)).squeeze(-1)
    return out, lse


def naive_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """The textbook version in the input dtype: scores and probabilities as full (Nq, Nk)
    tensors."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    k, v = _expand_kv(k, q.shape[1]), _expand_kv(v, q.shape[1])
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(~causal_mask(q.shape[2], k.shape[2], q.device), float("-inf"))
    p = torch.softmax(s, dim=-1)
    if causal and q.shape[2] > k.shape[2]:
        p = p.nan_to_num(0.0)  # the first Nq - Nk rows see no key: 0, not NaN
    return torch.matmul(p, v)
