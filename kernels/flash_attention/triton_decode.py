"""Flash-decoding in Triton: a few queries against a long KV cache, split over the KV length.

At decode time each sequence brings one new query (q_len = 1, or a few with speculative decoding)
and attends to its whole KV cache. The FlashAttention forward gives each (batch, head, query block)
one program: batch 1 with 8 KV heads is 32 programs on a 132-SM GPU, each walking 32k keys alone.
The work is a pure memory stream (K and V are read once, about 2 flops per byte), so what matters is
keeping every SM's memory pipeline full.

So the KV length is split: program (split, batch, KV head) folds keys [split * L, (split + 1) * L)
into a partial output and its log-sum-exp, for *all* the query heads that share the KV head
(grouped-query attention: K and V are read once, not once per query head), and the partials are
combined: out = sum_s exp(lse_s - lse) out_s,  lse = log sum_s exp(lse_s).

The textbook combine is a second, tiny kernel. At a 4k cache the whole read is 16 MiB, 4-6 us of HBM
traffic, and a launch costs a few microseconds of its own. So by default there is no second launch:
each program, once its partial is stored, counts itself in with an atomic add on its (batch, KV
head)'s arrival counter, and the program that arrives last combines the partials of all the splits
(split-K's "last block reduces" pattern). The atomic is acquire-release: the partials stored before
the others' increments are visible to the last program's loads after its own. `fuse_combine=False`
keeps the two launches, for comparison.

Rows of a program: the group's query heads times the queries, padded to 16 (the smallest `tl.dot`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import runtime
from kernels.flash_attention.fast_launch import LaunchCache
from kernels.flash_attention.triton_flash import (
    LOG2E,
    check_inputs,
    head_tile,
    load_tile,
    output_buffers,
    softmax_scale,
    tile_mask,
)
from kernels.runtime import UPCAST

# Memory-bound: what matters is bytes in flight per SM. Measured on an H100 (the split sweep,
# kernels/flash_attention/PERFORMANCE.md): 128-key blocks, three stages in flight (136 KB of shared
# memory) and one program per SM beat 64-key blocks with three programs per SM at every cache length
# from 4k to 32k keys; more programs meant more partials to combine, for no more bandwidth. In CPU
# mode the interpreter's cost is per program and per loop trip, so few splits with large blocks.
BLOCK_N = runtime.pick(gpu=128, cpu=64)
NUM_WARPS = runtime.pick(gpu=4, cpu=1)
NUM_STAGES = runtime.pick(gpu=3, cpu=1)
PROGRAMS_PER_SM = 1
# Shared memory for the K/V pipeline: what the default (3 stages of 128-key K and V tiles at
# head_dim 128, fp16) takes; wider head tiles get fewer stages, then shorter key blocks.
PIPELINE_BYTES = runtime.pick(gpu=192 * 1024, cpu=1 << 40)
# The combine's round: up to 64 (row, split) partials at once, a (64, D) float32 tile (64 registers
# a thread at D 128 and 4 warps). Splits first, up to 32 (one round for every default split count),
# then rows: at 16 splits the 4 rows of a GQA 4:1 group are one round.
COMBINE_PARTIALS = 64
MAX_COMBINE_SPLITS = 32
# query heads per KV head x queries; beyond that a query block is big enough for flash_attention
MAX_ROWS = 64


@triton.jit
def _combine_rows(
    O_PART,
    LSE_PART,
    OUT,
    LSE,
    first_row,
    n_rows,
    n_q_heads,
    n_q,
    n_splits,
    stride_ob,
    stride_oh,
    stride_om,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """out = sum_s w_s out_s / sum_s w_s, w_s = 2^(lse_s - max lse), for the (batch, head, query)
    rows first_row ... first_row + n_rows - 1 (flattened), BLOCK_R rows and BLOCK_S splits per round
    with the maximum carried online: every load of a round is issued at once, so a round costs one
    trip to L2 and the rows of a group do not wait on each other. The float32 partials are read past
    L1 (.cg): in the fused kernel other SMs wrote them during this launch."""
    r0 = tl.arange(0, BLOCK_R)
    s0 = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, HEAD_PAD)
    for r_start in range(0, n_rows, BLOCK_R):
        row_ok = r_start + r0 < n_rows
        row = (first_row + r_start + r0).to(tl.int64)  # (b, h, i) flattened
        m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
        total = tl.zeros([BLOCK_R], dtype=tl.float32)
        acc = tl.zeros([BLOCK_R, HEAD_PAD], dtype=tl.float32)
        for start in range(0, n_splits, BLOCK_S):
            s = start + s0
            ok = row_ok[:, None] & (s < n_splits)[None, :]
            part = row[:, None] * n_splits + s[None, :]  # (BLOCK_R, BLOCK_S)
            lse_s = tl.load(LSE_PART + part, mask=ok, other=float("-inf"), cache_modifier=".cg")
            o_s = tl.load(
                O_PART + part[:, :, None] * HEAD_DIM + dims[None, None, :],
                mask=ok[:, :, None] & (dims < HEAD_DIM)[None, None, :],
                other=0.0,
                cache_modifier=".cg",
            )
            m_new = tl.maximum(m, tl.max(lse_s, 1))
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.math.exp2(m - m_shift)
            w = tl.math.exp2(lse_s - m_shift[:, None])  # 0 for a split where the row saw no key
            total = total * alpha + tl.sum(w, 1)
            acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * o_s, 1)
            m = m_new
        total_safe = tl.where(total > 0.0, total, 1.0)
        b = row // (n_q_heads * n_q)
        h = (row // n_q) % n_q_heads
        i = row % n_q
        out_row = b * stride_ob + h * stride_oh + i * stride_om
        tl.store(
            OUT + out_row[:, None] + dims[None, :],
            (acc / total_safe[:, None]).to(OUT.dtype.element_ty),
            mask=tile_mask(row_ok, dims, HEAD_DIM),
        )
        tl.store(
            LSE + row,
            tl.where(
                total > 0.0, (m + tl.math.log2(total_safe)) * 0.6931471805599453, float("-inf")
            ),
            mask=row_ok,
        )


@triton.jit
def flash_decode_split_kernel(
    Q,
    K,
    V,
    O_PART,
    LSE_PART,
    OUT,
    LSE,
    ARRIVALS,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_ob,
    stride_oh,
    stride_om,
    n_kv_heads,
    group,
    n_q,
    n_k,
    split_len,
    n_splits,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr,
    FUSE_COMBINE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    split = tl.program_id(0)
    b = tl.program_id(1) // n_kv_heads
    kv_h = tl.program_id(1) % n_kv_heads
    r = tl.arange(0, BLOCK_H)  # row r is query r % n_q of query head kv_h * group + r // n_q
    row_ok = r < group * n_q
    h = kv_h * group + r // n_q
    i = r % n_q
    dims = tl.arange(0, HEAD_PAD)
    q_ptrs = (
        Q
        + b.to(tl.int64) * stride_qb
        + h[:, None].to(tl.int64) * stride_qh
        + i[:, None] * stride_qm
        + dims[None, :]
    )
    q = load_tile(q_ptrs, row_ok, dims, HEAD_DIM, HEAD_PAD, True)
    if UPCAST:
        q = q.to(tl.float32)
    k_base = K + b.to(tl.int64) * stride_kb + kv_h.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + kv_h.to(tl.int64) * stride_vh

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_PAD], dtype=tl.float32)
    lo = split * split_len
    hi = tl.minimum(lo + split_len, n_k)
    cols0 = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        # Decode is memory-bound: masking every block costs nothing measurable, so there is one
        # loop.
        cols = start + cols0
        in_range = cols < hi
        k = load_tile(
            k_base + cols[:, None] * stride_kn + dims[None, :],
            in_range,
            dims,
            HEAD_DIM,
            HEAD_PAD,
            True,
        )
        v = load_tile(
            v_base + cols[:, None] * stride_vn + dims[None, :],
            in_range,
            dims,
            HEAD_DIM,
            HEAD_PAD,
            True,
        )
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
    lse2 = tl.where(
        seen, m_i + tl.math.log2(l_safe), float("-inf")
    )  # base 2; -inf: no key in this split
    # partials: (B, Hq, Nq, n_splits, D) and (B, Hq, Nq, n_splits), float32
    row = ((b * n_kv_heads * group + h) * n_q + i).to(tl.int64) * n_splits + split
    tl.store(
        O_PART + row[:, None] * HEAD_DIM + dims[None, :],
        acc / l_safe[:, None],
        mask=tile_mask(row_ok, dims, HEAD_DIM),
    )
    tl.store(LSE_PART + row, lse2, mask=row_ok)
    if FUSE_COMBINE:
        # The barrier puts every thread's partial stores before the (single-thread) release of the
        # increment; the last program to arrive owns all the partials and combines them.
        tl.debug_barrier()
        arrived = tl.atomic_add(ARRIVALS + tl.program_id(1), 1, sem="acq_rel")
        if (
            arrived == n_splits - 1
        ):  # the group's rows are consecutive in the flattened (b, h, i) order
            _combine_rows(
                O_PART,
                LSE_PART,
                OUT,
                LSE,
                (b * n_kv_heads + kv_h) * group * n_q,
                group * n_q,
                n_kv_heads * group,
                n_q,
                n_splits,
                stride_ob,
                stride_oh,
                stride_om,
                HEAD_DIM,
                HEAD_PAD,
                BLOCK_R,
                BLOCK_S,
            )
            tl.store(
                ARRIVALS + tl.program_id(1), 0
            )  # ready for the next call, which runs after this one


@triton.jit
def flash_decode_combine_kernel(
    O_PART,
    LSE_PART,
    OUT,
    LSE,
    n_rows,
    n_q_heads,
    n_q,
    n_splits,
    stride_ob,
    stride_oh,
    stride_om,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """The second launch of the unfused path: one program per BLOCK_R (batch, head, query) rows."""
    first_row = tl.program_id(0) * BLOCK_R
    _combine_rows(
        O_PART,
        LSE_PART,
        OUT,
        LSE,
        first_row,
        tl.minimum(n_rows - first_row, BLOCK_R),
        n_q_heads,
        n_q,
        n_splits,
        stride_ob,
        stride_oh,
        stride_om,
        HEAD_DIM,
        HEAD_PAD,
        BLOCK_R,
        BLOCK_S,
    )


# The split kernel's compiled versions per call signature, launched without Triton's per-call
# binding.
SPLIT_LAUNCHES = LaunchCache(flash_decode_split_kernel)


def default_num_splits(batch: int, n_kv_heads: int, n_k: int, block_n: int = BLOCK_N) -> int:
    """Enough (split, batch, KV head) programs to give every SM PROGRAMS_PER_SM of them, but at
    least one key block per split. Batch 1, 8 KV heads on a 132-SM GPU: 50 splits."""
    sms = runtime.gpu_info().sm_count if runtime.ON_GPU else 2
    wanted = triton.cdiv(PROGRAMS_PER_SM * sms, batch * n_kv_heads)
    return max(1, min(wanted, triton.cdiv(n_k, block_n)))


_ARRIVALS: dict = {}


def _arrival_counters(device: torch.device, programs: int) -> torch.Tensor:
    """Zeroed int32 counters, one per (batch, KV head) program group, kept for the next call: the
    last program of each group sets its counter back to 0. Allocated outside any CUDA-graph capture
    (a buffer made during capture belongs to the graph's pool), so the first call must come before a
    capture, as the autotuner of any Triton kernel already demands."""
    counters = _ARRIVALS.get(device)
    if counters is None or counters.numel() < programs:
        if runtime.ON_GPU and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "flash_decode: call it once before capturing a CUDA graph (it allocates its "
                f"arrival counters for {programs} batch x KV-head groups then)"
            )
        counters = torch.zeros(max(programs, 1024), dtype=torch.int32, device=device)
        _ARRIVALS[device] = counters
    return counters


def flash_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
    return_lse: bool = False,
    *,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_stages: int | None = None,
    num_warps: int | None = None,
    fuse_combine: bool = True,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
):
    """Attention for a few queries (q: (B, Hq, Nq, D), Nq small) against a KV cache (B, Hkv, Nk, D).

    Same contract as `flash_attention` (bottom-right causal, GQA, fp16/bf16, lse); forward only.
    `num_splits`, `block_n`, `num_stages` and `num_warps` override the defaults, for sweeps;
    `fuse_combine=False` combines the splits in a second launch; `out` and `lse` are buffers to
    write into. The fused combine shares one set of arrival counters per device: calls on one device
    run one at a time (one stream, or synchronized).
    """
    signature = check_inputs("flash_decode", q, k, v)
    options = (bool(causal), num_splits, block_n, num_stages, num_warps, bool(fuse_combine))
    plan = _PLANS.get((signature, options))
    if plan is None:
        plan = _plan(signature, options, q, k, v)
    qk_scale = plan.qk_scale if scale is None else softmax_scale(scale, q.shape[-1]) * LOG2E
    # Outputs: new ones (contiguous, aligned: nothing to key on), or the caller's, checked. Without
    # return_lse the log-sum-exp goes to the plan's scratch row instead of a new tensor.
    if out is None and lse is None:
        out_key = None
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        lse = torch.empty_like(plan.lse_scratch) if return_lse else plan.lse_scratch
    else:
        out, lse = output_buffers("flash_decode", q, out, lse)
        out_key = (out.stride(), out.data_ptr() % 16, lse.data_ptr() % 16)
    if plan.empty:
        return (out, lse) if return_lse else out
    out_strides = plan.out_strides if out_key is None else out.stride()[:3]
    key = (signature, options, out_key, q.data_ptr() % 16, k.data_ptr() % 16, v.data_ptr() % 16)
    args = (q, k, v, plan.o_part, plan.lse_part, out, lse, plan.arrivals, *plan.strides,
            *out_strides, *plan.sizes, qk_scale)  # fmt: skip
    SPLIT_LAUNCHES.launch(key, plan.grid, args, plan.constants)
    if not fuse_combine:
        rows = plan.partial_shape[0] * plan.partial_shape[1] * plan.partial_shape[2]
        flash_decode_combine_kernel[(triton.cdiv(rows, plan.constants["BLOCK_R"]),)](
            plan.o_part,
            plan.lse_part,
            out,
            lse,
            rows,
            q.shape[1],
            q.shape[2],
            plan.splits,
            *out_strides,
            HEAD_DIM=plan.constants["HEAD_DIM"],
            HEAD_PAD=plan.constants["HEAD_PAD"],
            BLOCK_R=plan.constants["BLOCK_R"],
            BLOCK_S=plan.constants["BLOCK_S"],
            num_warps=runtime.pick(gpu=4, cpu=1),
        )
    return (out, lse) if return_lse else out


@dataclass(frozen=True)
class DecodePlan:
    """What a flash_decode call needs beyond its tensors, worked out once per input signature,
    with its scratch: the float32 partial outputs and log-sum-exps of the splits, a log-sum-exp
    row for calls that do not return it, and the arrival counters. Scratch is reused by the next
    call with the same signature, which runs after this one on the stream (like the counters)."""

    empty: bool  # nothing to compute (a zero-sized dimension)
    splits: int
    programs: int  # (batch, KV head) groups: the grid's second axis
    partial_shape: tuple  # (B, Hq, Nq, splits, D)
    strides: tuple  # q's, k's and v's (batch, head, seq) strides
    out_strides: tuple  # (batch, head, seq) strides of a new contiguous output
    sizes: tuple  # n_kv_heads, group, n_q, n_k, split_len, splits
    qk_scale: float  # the default scale 1/sqrt(D), times log2(e)
    constants: dict  # the kernel's constexprs and launch options
    o_part: torch.Tensor
    lse_part: torch.Tensor
    lse_scratch: torch.Tensor
    arrivals: torch.Tensor  # the arrival counters (the fused combine), or any tensor

    def grid(self, meta) -> tuple:
        return self.splits, self.programs, 1


def _pipeline(head_pad: int, element_size: int) -> tuple[int, int]:
    """(key block, stages) of the default pipeline, shrunk until its K and V tiles fit in
    PIPELINE_BYTES of shared memory: 3 x 128 keys up to head tiles of 128; at 256 (head_dim 136 to
    256), 2 stages of 64 keys (3 x 128 would need 384 KiB)."""
    block_n, stages = BLOCK_N, NUM_STAGES
    while stages * 2 * block_n * head_pad * element_size > PIPELINE_BYTES:
        if stages > 2:
            stages -= 1
        elif block_n > 16:
            block_n //= 2
        else:
            break
    return block_n, stages


_PLANS: dict = {}
_MAX_PLANS = 64  # plans remembered (each holds its scratch); a growing KV cache adds one per step


def _plan(signature, options, q, k, v) -> DecodePlan:
    """Work out a call's launch and allocate its scratch; remembered per (signature, options),
    except during a CUDA-graph capture (scratch made then belongs to the graph's memory pool)."""
    causal, num_splits, block_n, num_stages, num_warps, fuse_combine = options
    batch, n_heads, n_q, head_dim = q.shape
    n_kv_heads, n_k = k.shape[1], k.shape[2]
    group = n_heads // n_kv_heads
    if group * n_q > MAX_ROWS:
        raise ValueError(
            f"flash_decode: {n_q} queries x {group} query heads per KV head = {group * n_q} rows "
            f"per program, more than {MAX_ROWS}; use flash_attention for long queries"
        )
    head_pad = head_tile(head_dim)
    if block_n is None and num_stages is None:
        block_n, num_stages = _pipeline(head_pad, q.element_size())
    block_n = block_n or BLOCK_N
    splits = num_splits or default_num_splits(batch, n_kv_heads, n_k, block_n)
    # Each split gets a whole number of key blocks; recount so no split is empty.
    split_len = triton.cdiv(triton.cdiv(max(n_k, 1), block_n), splits) * block_n
    splits = max(1, triton.cdiv(n_k, split_len))
    block_s = min(MAX_COMBINE_SPLITS, triton.next_power_of_2(splits))
    constants = {
        "HEAD_DIM": head_dim,
        "HEAD_PAD": head_pad,
        "BLOCK_H": max(16, triton.next_power_of_2(group * n_q)),
        "BLOCK_N": block_n,
        "CAUSAL": causal,
        "UPCAST": UPCAST,
        "FUSE_COMBINE": fuse_combine,
        "BLOCK_R": min(COMBINE_PARTIALS // block_s, triton.next_power_of_2(group * n_q)),
        "BLOCK_S": block_s,
        "num_warps": num_warps or NUM_WARPS,
        "num_stages": num_stages or NUM_STAGES,
    }
    partial_shape = (batch, n_heads, n_q, splits, head_dim)
    f32 = {"dtype": torch.float32, "device": q.device}
    lse_part = torch.empty(partial_shape[:4], **f32)
    programs = batch * n_kv_heads
    plan = DecodePlan(
        empty=q.numel() == 0,
        splits=splits,
        programs=programs,
        partial_shape=partial_shape,
        strides=(*q.stride()[:3], *k.stride()[:3], *v.stride()[:3]),
        out_strides=(n_heads * n_q * head_dim, n_q * head_dim, head_dim),
        sizes=(n_kv_heads, group, n_q, n_k, split_len, splits),
        qk_scale=softmax_scale(None, head_dim) * LOG2E,
        constants=constants,
        o_part=torch.empty(partial_shape, **f32),
        lse_part=lse_part,
        lse_scratch=torch.empty(q.shape[:3], **f32),
        arrivals=_arrival_counters(q.device, programs) if fuse_combine else lse_part,
    )
    if not (runtime.ON_GPU and torch.cuda.is_current_stream_capturing()):
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[(signature, options)] = plan
    return plan


def kv_bytes(k: torch.Tensor, v: torch.Tensor) -> int:
    """The bytes decode must read: the whole K and V cache (q and out are negligible beside
    them)."""
    return k.numel() * k.element_size() + v.numel() * v.element_size()
