"""Flash-decoding in Triton: a few queries against a long KV cache, split over the KV length.

At decode time each sequence brings one new query (q_len = 1, or a few with speculative decoding) and
attends to its whole KV cache. The FlashAttention forward gives each (batch, head, query block) one
program: batch 1 with 8 KV heads is 32 programs on a 132-SM GPU, each walking 32k keys alone. The work is
a pure memory stream (K and V are read once, about 2 flops per byte), so what matters is keeping every
SM's memory pipeline full.

So the KV length is split: program (split, batch, KV head) folds keys [split * L, (split + 1) * L) into a
partial output and its log-sum-exp, for *all* the query heads that share the KV head (grouped-query
attention: K and V are read once, not once per query head), and a second, tiny kernel combines the
partials:  out = sum_s exp(lse_s - lse) out_s,  lse = log sum_s exp(lse_s).

Rows of a program: the group's query heads times the queries, padded to 16 (the smallest `tl.dot`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import runtime
from kernels.attention.triton_flash import LOG2E, UPCAST, _check, _scale, output_buffers

# Memory-bound: a key block of 64 x D, three stages in flight, a few programs per SM. In CPU mode the
# interpreter's cost is per program and per loop trip, so few splits with large blocks.
BLOCK_N = runtime.pick(gpu=64, cpu=64)
NUM_WARPS = runtime.pick(gpu=4, cpu=1)
NUM_STAGES = runtime.pick(gpu=3, cpu=1)
PROGRAMS_PER_SM = 3  # a 64-key block, 3 stages: 70 KB of shared memory, 3 programs fit on an SM
MAX_ROWS = 64  # query heads per KV head x queries; beyond that a query block is big enough for flash_attention


@triton.jit
def flash_decode_split_kernel(Q, K, V, O_PART, LSE_PART,
                              stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                              stride_vb, stride_vh, stride_vn,
                              n_kv_heads, group, n_q, n_k, split_len, n_splits, qk_scale,
                              HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                              CAUSAL: tl.constexpr, UPCAST: tl.constexpr):
    split = tl.program_id(0)
    b = tl.program_id(1) // n_kv_heads
    kv_h = tl.program_id(1) % n_kv_heads
    r = tl.arange(0, BLOCK_H)  # row r is query r % n_q of query head kv_h * group + r // n_q
    row_ok = r < group * n_q
    h = kv_h * group + r // n_q
    i = r % n_q
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + b.to(tl.int64) * stride_qb + h[:, None].to(tl.int64) * stride_qh + i[:, None] * stride_qm
                + dims[None, :], mask=row_ok[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    k_base = K + b.to(tl.int64) * stride_kb + kv_h.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + kv_h.to(tl.int64) * stride_vh

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)
    lo = split * split_len
    hi = tl.minimum(lo + split_len, n_k)
    cols0 = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        # Decode is memory-bound: masking every block costs nothing measurable, so there is one loop.
        cols = start + cols0
        in_range = cols < hi
        k = tl.load(k_base + cols[:, None] * stride_kn + dims[None, :], mask=in_range[:, None], other=0.0)
        v = tl.load(v_base + cols[:, None] * stride_vn + dims[None, :], mask=in_range[:, None], other=0.0)
        dtype = v.dtype
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k))
        keep = in_range[None, :]
        if CAUSAL:  # bottom-right aligned: query i sees keys j <= i + n_k - n_q
            keep = keep & (cols[None, :] <= i[:, None] + (n_k - n_q))
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s * qk_scale - m_shift[:, None])
        alpha = tl.math.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        p = p.to(dtype)
        if UPCAST:
            p = p.to(tl.float32)
        acc = tl.dot(p, v, acc * alpha[:, None])
        m_i = m_new

    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    lse2 = tl.where(seen, m_i + tl.math.log2(l_safe), float("-inf"))  # base 2; -inf: no key in this split
    # partials: (B, Hq, Nq, n_splits, D) and (B, Hq, Nq, n_splits), float32
    row = ((b * n_kv_heads * group + h) * n_q + i).to(tl.int64) * n_splits + split
    tl.store(O_PART + row[:, None] * HEAD_DIM + dims[None, :], acc / l_safe[:, None], mask=row_ok[:, None])
    tl.store(LSE_PART + row, lse2, mask=row_ok)


@triton.jit
def flash_decode_combine_kernel(O_PART, LSE_PART, O, LSE, n_q_heads, n_q, n_splits,
                                stride_ob, stride_oh, stride_om,
                                HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # (b, h, i) flattened
    i = row % n_q
    h = (row // n_q) % n_q_heads
    b = row // (n_q * n_q_heads)
    s = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, HEAD_DIM)
    lse_s = tl.load(LSE_PART + row * n_splits + s, mask=s < n_splits, other=float("-inf"))
    m = tl.max(lse_s, 0)
    m_shift = tl.where(m == float("-inf"), 0.0, m)
    w = tl.math.exp2(lse_s - m_shift)  # 0 for splits the query saw no key in
    o_s = tl.load(O_PART + (row * n_splits + s)[:, None] * HEAD_DIM + dims[None, :], mask=(s < n_splits)[:, None],
                  other=0.0)
    total = tl.sum(w, 0)
    total_safe = tl.where(total > 0.0, total, 1.0)
    out = tl.sum(w[:, None] * o_s, 0) / total_safe
    tl.store(O + b * stride_ob + h * stride_oh + i * stride_om + dims, out.to(O.dtype.element_ty))
    lse = tl.where(total > 0.0, (m + tl.math.log2(total_safe)) * 0.6931471805599453, float("-inf"))
    tl.store(LSE + row, lse)


def default_num_splits(batch: int, n_kv_heads: int, n_k: int, block_n: int = BLOCK_N) -> int:
    """Enough (split, batch, KV head) programs to give every SM PROGRAMS_PER_SM of them, but at least one
    key block per split. Batch 1, 8 KV heads on a 132-SM GPU: 50 splits."""
    sms = runtime.gpu_info().sm_count if runtime.ON_GPU else 2
    wanted = triton.cdiv(PROGRAMS_PER_SM * sms, batch * n_kv_heads)
    return max(1, min(wanted, triton.cdiv(n_k, block_n)))


def flash_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                 scale: float | None = None, return_lse: bool = False, *, num_splits: int | None = None,
                 block_n: int | None = None, out: torch.Tensor | None = None, lse: torch.Tensor | None = None):
    """Attention for a few queries (q: (B, Hq, Nq, D), Nq small) against a KV cache (B, Hkv, Nk, D).

    Same contract as `flash_attention` (bottom-right causal, GQA, fp16/bf16, lse); forward only.
    `num_splits` and `block_n` override the defaults, for sweeps; `out` and `lse` are buffers to write into.
    """
    _check("flash_decode", q, k, v)
    scale = _scale(scale, q.shape[-1])
    batch, n_heads, n_q, head_dim = q.shape
    n_kv_heads, n_k = k.shape[1], k.shape[2]
    group = n_heads // n_kv_heads
    if group * n_q > MAX_ROWS:
        raise ValueError(f"flash_decode: {n_q} queries x {group} query heads per KV head = {group * n_q} rows "
                         f"per program, more than {MAX_ROWS}; use flash_attention for long queries")
    block_n = block_n or BLOCK_N
    out, lse = output_buffers("flash_decode", q, out, lse)
    if out.numel() == 0:
        return (out, lse) if return_lse else out
    splits = num_splits or default_num_splits(batch, n_kv_heads, n_k, block_n)
    # Each split gets a whole number of key blocks; recount so no split is empty.
    split_len = triton.cdiv(triton.cdiv(max(n_k, 1), block_n), splits) * block_n
    splits = max(1, triton.cdiv(n_k, split_len))
    o_part = torch.empty((batch, n_heads, n_q, splits, head_dim), dtype=torch.float32, device=q.device)
    lse_part = torch.empty((batch, n_heads, n_q, splits), dtype=torch.float32, device=q.device)
    flash_decode_split_kernel[(splits, batch * n_kv_heads)](
        q, k, v, o_part, lse_part, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
        n_kv_heads, group, n_q, n_k, split_len, splits, scale * LOG2E,
        HEAD_DIM=head_dim, BLOCK_H=max(16, triton.next_power_of_2(group * n_q)), BLOCK_N=block_n,
        CAUSAL=bool(causal), UPCAST=UPCAST, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    flash_decode_combine_kernel[(batch * n_heads * n_q,)](
        o_part, lse_part, out, lse, n_heads, n_q, splits, *out.stride()[:3],
        HEAD_DIM=head_dim, BLOCK_S=triton.next_power_of_2(splits), num_warps=runtime.pick(gpu=4, cpu=1))
    return (out, lse) if return_lse else out


def kv_bytes(k: torch.Tensor, v: torch.Tensor) -> int:
    """The bytes decode must read: the whole K and V cache (q and out are negligible beside them)."""
    return k.numel() * k.element_size() + v.numel() * v.element_size()
