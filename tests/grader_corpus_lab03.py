"""Known-wrong FlashAttention forwards (lab 03), as plain Triton functions, and what the grader must
say.

Each is the lab's `flash_attention` with one mistake a student makes."""

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels import runtime
from kernels.flash_attention.validate import check_attention_inputs

UPCAST = not runtime.ON_GPU


@triton.jit
def _forward(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    lse_ptr,
    scores_ptr,
    sqb,
    sqh,
    sqn,
    skb,
    skh,
    skn,
    svb,
    svh,
    svn,
    sob,
    soh,
    son,
    n_heads,
    group,
    n_q,
    n_k,
    n_batch,
    scale_log2,
    CAUSAL: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    MISTAKE: tl.constexpr,
):
    block_m, batch_head = tl.program_id(0), tl.program_id(1)
    batch, head = batch_head // n_heads, batch_head % n_heads
    kv_head = head // group
    rows = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(
        q_ptr + batch * sqb + head * sqh + rows[:, None] * sqn + dims[None, :],
        mask=rows[:, None] < n_q,
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    diagonal = n_k - n_q
    n_keys = n_k
    if MISTAKE == "mixes_batches":
        # a bug of a real kernel: every batch's keys in one flattened sequence
        # (key j of batch b is key b * n_k + j)
        n_keys = n_batch * n_k
    end = n_keys
    if CAUSAL:
        end = tl.minimum(n_keys, (block_m + 1) * BLOCK_M + diagonal)
    if MISTAKE == "skips_last_full_key_block":
        # full blocks up to n_k - BLOCK_N, then a masked tail block at n_k // BLOCK_N * BLOCK_N:
        # when n_k is a multiple of BLOCK_N the tail is empty and the last full block never seen
        end = tl.where(n_k % BLOCK_N == 0, tl.minimum(end, n_k - BLOCK_N), end)
    if MISTAKE == "keys_past_1024_ignored":  # one tile of at most 1024 keys, no loop beyond it
        end = tl.minimum(end, 1024)
    for start in range(0, end, BLOCK_N):
        keys = start + cols
        if MISTAKE == "mixes_batches":
            k_rows = (keys // n_k) * skb + (keys % n_k) * skn
            v_rows = (keys // n_k) * svb + (keys % n_k) * svn
        else:
            k_rows = batch * skb + keys * skn
            v_rows = batch * svb + keys * svn
        k = tl.load(
            k_ptr + kv_head * skh + k_rows[None, :] + dims[:, None],
            mask=keys[None, :] < n_keys,
            other=0.0,
        )
        v = tl.load(
            v_ptr + kv_head * svh + v_rows[:, None] + dims[None, :],
            mask=keys[:, None] < n_keys,
            other=0.0,
        )
        if UPCAST:
            k, v = k.to(tl.float32), v.to(tl.float32)
        s = tl.dot(q, k) * scale_log2
        if MISTAKE == "materializes_scores":  # the (Nq, Nk) scores of every head written out
            tl.store(
                scores_ptr + batch_head * n_q * n_k + rows[:, None] * n_k + keys[None, :],
                s,
                mask=(rows[:, None] < n_q) & (keys[None, :] < n_k),
            )
        visible = keys[None, :] < n_keys
        if (
            CAUSAL and MISTAKE != "no_diagonal_mask"
        ):  # the block bound alone leaves the diagonal block unmasked
            visible = visible & (keys[None, :] <= rows[:, None] + diagonal)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        if (
            MISTAKE == "no_max_subtraction"
        ):  # exp2 of the raw scores: overflows once a score passes ~88
            m_ref = tl.zeros((BLOCK_M,), tl.float32)
        alpha = tl.exp2(m_i - m_ref)
        if MISTAKE == "no_max_subtraction":
            alpha = tl.full((BLOCK_M,), 1.0, tl.float32)
        p = tl.exp2(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    if MISTAKE == "nan_for_rows_without_keys":  # 0 / 0 where a row sees no key
        out = acc / l_i[:, None]
    tl.store(
        out_ptr + batch * sob + head * soh + rows[:, None] * son + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=rows[:, None] < n_q,
    )
    if MISTAKE == "no_max_subtraction":
        m_i = tl.zeros((BLOCK_M,), tl.float32)
    lse = tl.where(seen, (m_i + tl.log2(l_i)) / 1.4426950408889634, float("-inf"))
    tl.store(lse_ptr + batch_head * n_q + rows, lse, mask=rows < n_q)


def submission(mistake: str):
    def flash_attention(q, k, v, causal=False, out=None):
        check_attention_inputs(q, k, v, device=runtime.DEVICE)
        b, n_heads, n_q, d = q.shape
        out, lse = (
            (
                torch.empty(q.shape, dtype=q.dtype, device=q.device),
                torch.empty(q.shape[:3], dtype=torch.float32, device=q.device),
            )
            if out is None
            else out
        )
        if not out.numel():
            return out, lse
        scores = lse  # unused unless the mistake is to materialize the scores
        if mistake == "materializes_scores":
            scores = torch.empty(
                (b, n_heads, n_q, k.shape[2]), dtype=torch.float32, device=q.device
            )
        block_m, block_n = runtime.pick(gpu=(64, 64), cpu=(64, 64))
        _forward[(triton.cdiv(n_q, block_m), b * n_heads)](
            q,
            k,
            v,
            out,
            lse,
            scores,
            *q.stride()[:3],
            *k.stride()[:3],
            *(k if mistake == "v_read_with_k_strides" else v).stride()[:3],
            *out.stride()[:3],
            n_heads,
            n_heads // k.shape[1],
            n_q,
            k.shape[2],
            b,
            math.log2(math.e) / math.sqrt(d),
            CAUSAL=causal,
            HEAD_DIM=d,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            UPCAST=UPCAST,
            MISTAKE=mistake,
        )
        if mistake == "calls_sdpa":  # the right numbers, from PyTorch's kernel instead of one's own
            out.copy_(
                F.scaled_dot_product_attention(
                    q, k, v, is_causal=causal, enable_gqa=n_heads != k.shape[1]
                )
            )
        return out, lse

    return flash_attention


# mistake -> (the case it first fails, what the grader says there, whether it fails only on a GPU).
# Cases are run in the spec's order up to that one; the earlier cases pass.
CORPUS = {
    # batch 1 attends to batch 0's keys too: every wrong element is in batch 1
    "mixes_batches": (
        "2x2x2x100x100x64 float16 causal=True",
        "first bad index (1, 0, 0, 0)",
        False,
    ),
    # the first row sees 64 keys instead of one
    "no_diagonal_mask": (
        "2x2x2x100x100x64 float16 causal=True",
        "first bad index (0, 0, 0, 0)",
        False,
    ),
    # scores in the hundreds: exp2 overflows to inf, inf / inf = NaN
    "no_max_subtraction": ("1x2x2x197x197x64 float16 large_logits", "NaN", False),
    "calls_sdpa": (
        "1x2x2x1x1x64 float16",
        (
            "computes with PyTorch instead of its own kernel: "
            "torch.nn.functional.scaled_dot_product_attention (aten."
        ),
        False,
    ),
    # Caught at the first case whose scores outgrow the O(N) budget (1 MiB + a copy of q, k and v):
    # on an H200, N = 1000 (7.4 MiB of scores against 1.7 MiB), before the N = 4096 case (256 MiB
    # against 7 MiB)
    "materializes_scores": (
        "1x2x2x1000x1000x64 float16 causal=True",
        ("of device memory beyond its inputs and outputs at its peak; the budget is 1.7 MiB"),
        True,
    ),
}

# Wrong forwards that every fixed case lets through, caught by the class of cases drawn per run
# (grading.labs.lab03_flash_attention.draw_cases): mistake -> (the index of that class among the
# drawn cases, what the grader says there).
DRAWN_CORPUS = {
    # Nq = Nk = 128: rows 64 to 127 never see keys 64 to 127 (the diagonal's block)
    "skips_last_full_key_block": (0, "elements wrong"),
    # the keys past 1024 of a cache of 2049 or more are left out of every row's softmax
    "keys_past_1024_ignored": (1, "elements wrong"),
    # causal with Nq > Nk: the first Nq - Nk rows see no key; out must be 0, not 0 / 0
    "nan_for_rows_without_keys": (2, "out: shape "),
    # k and v with different strides (a KV cache and a transposed v): v read at k's offsets
    "v_read_with_k_strides": (3, "elements wrong"),
}
DRAWN_DIAGNOSIS = {
    "nan_for_rows_without_keys": "NaN",
}

# --------------------------------------------------------------------------------------------------
# The extra-credit backward: delta pre-pass, a dK/dV kernel (a program per key block, summing over
# the group's query heads), a dQ kernel (a program per query block), with one mistake each.


@triton.jit
def _delta(o_ptr, do_ptr, delta_ptr, n_q, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(
        0, BLOCK_M
    )  # o and do contiguous (the wrapper checks)
    offsets = (
        tl.program_id(1) * n_q * HEAD_DIM
        + rows[:, None] * HEAD_DIM
        + tl.arange(0, HEAD_DIM)[None, :]
    )
    mask = rows[:, None] < n_q
    o = tl.load(o_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(do_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(delta_ptr + tl.program_id(1) * n_q + rows, tl.sum(o * do, 1), mask=rows < n_q)


@triton.jit
def _probabilities_and_ds(
    q,
    k,
    v,
    do,
    lse2,
    delta,
    rows,
    keys,
    n_q,
    n_k,
    scale_log2,
    CAUSAL: tl.constexpr,
    MISTAKE: tl.constexpr,
):
    visible = (rows[:, None] < n_q) & (keys[None, :] < n_k)
    if CAUSAL and MISTAKE != "backward_no_causal_mask":
        visible = visible & (keys[None, :] <= rows[:, None] + n_k - n_q)
    if MISTAKE == "backward_nan_for_rows_without_keys":
        # masked with -inf scores, as the forward does: where lse is -inf too, -inf - -inf = NaN
        s = tl.where(visible, tl.dot(q, tl.trans(k)) * scale_log2, float("-inf"))
        p = tl.exp2(s - lse2[:, None])
    else:
        p = tl.where(visible, tl.exp2(tl.dot(q, tl.trans(k)) * scale_log2 - lse2[:, None]), 0.0)
    dp = tl.dot(do, tl.trans(v))
    if MISTAKE == "backward_no_delta":  # the softmax's Jacobian without its rank-one term
        ds = p * dp
    else:
        ds = p * (dp - delta[:, None])
    return p, ds


@triton.jit
def _dkdv(
    q_ptr,
    k_ptr,
    v_ptr,
    do_ptr,
    lse_ptr,
    delta_ptr,
    dk_ptr,
    dv_ptr,
    n_heads,
    group,
    n_q,
    n_k,
    scale,
    CAUSAL: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    MISTAKE: tl.constexpr,
):
    batch_kv = tl.program_id(1)  # all tensors contiguous: (batch * heads) rows of (n, HEAD_DIM)
    keys = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    kv_offsets = batch_kv * n_k * HEAD_DIM + keys[:, None] * HEAD_DIM + dims[None, :]
    k = tl.load(k_ptr + kv_offsets, mask=keys[:, None] < n_k, other=0.0)
    v = tl.load(v_ptr + kv_offsets, mask=keys[:, None] < n_k, other=0.0)
    if UPCAST:
        k, v = k.to(tl.float32), v.to(tl.float32)
    dk = tl.zeros((BLOCK_N, HEAD_DIM), tl.float32)
    dv = tl.zeros((BLOCK_N, HEAD_DIM), tl.float32)
    heads = group
    if (
        MISTAKE == "backward_first_head_of_group"
    ):  # GQA: only the group's first query head contributes
        heads = 1
    for h in range(heads):
        batch_head = (
            batch_kv * group + h
        )  # (batch * n_kv_heads + kv) * group + h = batch * n_heads + head
        q_end = n_q
        if MISTAKE == "backward_skips_last_full_query_block":  # as the forward's key blocks
            q_end = tl.where(n_q % BLOCK_M == 0, n_q - BLOCK_M, n_q)
        for m0 in range(0, q_end, BLOCK_M):
            rows = m0 + tl.arange(0, BLOCK_M)
            q_offsets = batch_head * n_q * HEAD_DIM + rows[:, None] * HEAD_DIM + dims[None, :]
            q = tl.load(q_ptr + q_offsets, mask=rows[:, None] < n_q, other=0.0)
            do = tl.load(do_ptr + q_offsets, mask=rows[:, None] < n_q, other=0.0)
            if UPCAST:
                q, do = q.to(tl.float32), do.to(tl.float32)
            lse2 = (
                tl.load(lse_ptr + batch_head * n_q + rows, mask=rows < n_q, other=0.0)
                * 1.4426950408889634
            )
            delta = tl.load(delta_ptr + batch_head * n_q + rows, mask=rows < n_q, other=0.0)
            p, ds = _probabilities_and_ds(
                q,
                k,
                v,
                do,
                lse2,
                delta,
                rows,
                keys,
                n_q,
                n_k,
                scale * 1.4426950408889634,
                CAUSAL,
                MISTAKE,
            )
            dv += tl.dot(tl.trans(p.to(do.dtype)), do)
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q)
    tl.store(
        dk_ptr + kv_offsets, (dk * scale).to(dk_ptr.dtype.element_ty), mask=keys[:, None] < n_k
    )
    tl.store(dv_ptr + kv_offsets, dv.to(dv_ptr.dtype.element_ty), mask=keys[:, None] < n_k)


@triton.jit
def _dq(
    q_ptr,
    k_ptr,
    v_ptr,
    do_ptr,
    lse_ptr,
    delta_ptr,
    dq_ptr,
    n_heads,
    group,
    n_q,
    n_k,
    scale,
    CAUSAL: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    MISTAKE: tl.constexpr,
):
    batch_head = tl.program_id(1)
    batch_kv = batch_head // group
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    q_offsets = batch_head * n_q * HEAD_DIM + rows[:, None] * HEAD_DIM + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=rows[:, None] < n_q, other=0.0)
    do = tl.load(do_ptr + q_offsets, mask=rows[:, None] < n_q, other=0.0)
    if UPCAST:
        q, do = q.to(tl.float32), do.to(tl.float32)
    lse2 = (
        tl.load(lse_ptr + batch_head * n_q + rows, mask=rows < n_q, other=0.0) * 1.4426950408889634
    )
    delta = tl.load(delta_ptr + batch_head * n_q + rows, mask=rows < n_q, other=0.0)
    dq = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    k_end = n_k
    if MISTAKE == "backward_keys_past_1024_ignored":  # dQ from the first 1024 keys only
        k_end = tl.minimum(n_k, 1024)
    for n0 in range(0, k_end, BLOCK_N):
        keys = n0 + tl.arange(0, BLOCK_N)
        kv_offsets = batch_kv * n_k * HEAD_DIM + keys[:, None] * HEAD_DIM + dims[None, :]
        k = tl.load(k_ptr + kv_offsets, mask=keys[:, None] < n_k, other=0.0)
        v = tl.load(v_ptr + kv_offsets, mask=keys[:, None] < n_k, other=0.0)
        if UPCAST:
            k, v = k.to(tl.float32), v.to(tl.float32)
        _, ds = _probabilities_and_ds(
            q,
            k,
            v,
            do,
            lse2,
            delta,
            rows,
            keys,
            n_q,
            n_k,
            scale * 1.4426950408889634,
            CAUSAL,
            MISTAKE,
        )
        dq += tl.dot(ds.to(k.dtype), k)
    tl.store(dq_ptr + q_offsets, (dq * scale).to(dq_ptr.dtype.element_ty), mask=rows[:, None] < n_q)


def backward_submission(mistake: str):
    def flash_attention_backward(q, k, v, o, lse, do, causal=False, out=None):
        check_attention_inputs(q, k, v, device=runtime.DEVICE)
        if not all(t.is_contiguous() for t in (q, k, v, o, lse, do)):
            raise ValueError("flash_attention_backward: this version takes contiguous tensors only")
        dq, dk, dv = (
            (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)) if out is None else out
        )
        b, n_heads, n_q, d = q.shape
        n_kv_heads, n_k = k.shape[1], k.shape[2]
        delta = torch.empty((b, n_heads, n_q), dtype=torch.float32, device=q.device)
        _delta[(triton.cdiv(n_q, 64), b * n_heads)](o, do, delta, n_q, HEAD_DIM=d, BLOCK_M=64)
        args = (n_heads, n_heads // n_kv_heads, n_q, n_k, 1 / math.sqrt(d))
        meta = {
            "CAUSAL": causal,
            "HEAD_DIM": d,
            "BLOCK_M": 64,
            "BLOCK_N": 64,
            "UPCAST": UPCAST,
            "MISTAKE": mistake,
        }
        _dkdv[(triton.cdiv(n_k, 64), b * n_kv_heads)](
            q, k, v, do, lse, delta, dk, dv, *args, **meta
        )
        _dq[(triton.cdiv(n_q, 64), b * n_heads)](q, k, v, do, lse, delta, dq, *args, **meta)
        return dq, dk, dv

    return flash_attention_backward


# mistake -> (the case it first fails, what the grader says there); "none" is the control: it passes
BACKWARD_CORPUS = {
    "none": (None, None),
    # with one key the softmax is constant: dQ = 0 exactly, but P * dP is not
    "backward_no_delta": (
        "1x2x2x1x1x64 float16",
        "dq: shape 1x2x2x1x1x64: 128 of 128 elements wrong; first bad index (0, 0, 0, 0): "
        "expected ",
    ),  # 0 or -0
    # the first query row sees one key, so its dQ is 0; with the diagonal block unmasked it is not
    "backward_no_causal_mask": (
        "2x2x2x100x100x64 float16 causal causal=True",
        "dq: shape 2x2x2x100x100x64: ",
    ),
    # dK of KV head 0 gets query head 0's share, not heads 0 and 1's
    "backward_first_head_of_group": ("2x4x2x100x197x64 bfloat16", "dk: shape 2x4x2x100x197x64: "),
}

# Wrong backwards that every fixed case lets through, caught by the class drawn per run
# (draw_backward_cases): mistake -> (the index of that class among the drawn cases, what the grader
# says there).
BACKWARD_DRAWN_CORPUS = {
    # Nq a multiple of 128: the dK/dV kernel leaves out the last block of queries
    "backward_skips_last_full_query_block": (0, "elements wrong"),
    # causal with Nq > Nk: lse is -inf in the rows that see no key
    "backward_nan_for_rows_without_keys": (1, "NaN"),
    # more than 1024 keys: dQ misses the terms of the keys past 1024
    "backward_keys_past_1024_ignored": (2, "dq: shape "),
}
