"""FlashAttention-3's forward schedule on Hopper, written in Gluon: one level below Triton.

Triton decides for us how warps share the work: every warp loads, multiplies and exponentiates, in
turn. On Hopper the fastest attention kernels (FlashAttention-3, Shah et al. 2024, arXiv
2407.08608; cuDNN) instead give warps *roles* and run the roles concurrently:

* a producer warp only issues TMA copies: K and V tiles stream into a ring of STAGES shared-memory
  slots, each guarded by mbarriers ("K ready", "V ready", "slot free");
* two consumer warpgroups (4 warps each) own 64 query rows apiece and only compute: S = Q K^T
  with wgmma, the online softmax in registers, O += P V with wgmma (P straight from registers);
* while one consumer warpgroup runs its softmax (exp2 on the multi-function units), the other's
  matrix products keep the tensor cores busy. FlashAttention-3 calls this ping-pong.

Gluon (`triton.experimental.gluon`, shipped with Triton) exposes exactly these pieces: explicit
layouts, shared-memory allocation, TMA copies, mbarriers, wgmma and `warp_specialize`, which forks
the CTA into partitions of given warp counts and register budgets.

Scope: the forward, head_dim 64 and 128, fp16 and bf16, causal (bottom-right aligned, as in
`reference.py`) or not, grouped-query attention, any lengths; q, k and v contiguous (B, H, N, D)
(a 2-D TMA descriptor over all rows). Rows of a tile past the end of a head read the next head's
rows (or zeros past the tensor): their scores are masked and their outputs never stored.
"""

from __future__ import annotations

import inspect

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from kernels.flash_attention.triton_flash import LOG2E, check_inputs, output_buffers, softmax_scale

HEAD_DIMS = (64, 128)
WG_M = gl.constexpr(64)  # query rows per consumer warpgroup (one wgmma M); a CTA owns 2 x 64
BLOCK_N = 128  # keys per K/V tile
# K/V ring depth: 3 stages of K and V tiles are 192 KiB at D = 128, plus Q (32 KiB): 224 KiB of the
# 227 KiB a CTA may use. 3 measured faster than 2 (PERFORMANCE.md).
STAGES = 3
PINGPONG = True  # the two consumer warpgroups take turns on the tensor cores (FlashAttention-3)
CONSUMER_REGS = gl.constexpr(240)  # registers per thread: the consumers hold S, P and O
PRODUCER_REGS = gl.constexpr(24)  # the producer holds a few scalars
CTA_M = 2 * WG_M.value  # query rows per CTA
# Triton 3.6 takes `warp_specialize([(function, args), ...], warps, regs)`; older releases took
# (default_args, default_fn, worker_args, worker_fns, warps, regs). A constexpr picks the form.
LIST_API = next(iter(inspect.signature(gl.warp_specialize).parameters)) == "functions_and_args"
GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}
# TMA global-to-shared copy: `async_load` in newer releases, `async_copy_global_to_shared` before.
tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
# Where the decorator for functions evaluated at compile time lives differs between releases.
constexpr_function = getattr(gl, "constexpr_function", None) or gluon.constexpr_function


@constexpr_function
def accumulator_layout(width):
    """The wgmma accumulator layout of a 64 x width tile: the 4 warps of a warpgroup stacked along
    M; instruction shape m16 x n(width) x k16 (16-bit inputs)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                     instr_shape=[16, int(width), 16])  # fmt: skip


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, slot_free,
              q_row, kv_row, n_blocks):  # fmt: skip
    """One warp: Q once (both consumers' tiles), then K and V block by block into the ring."""
    STAGES: gl.constexpr = k_smem.shape[0]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    mbarrier.expect(q_ready, 2 * q_desc.block_type.nbytes)
    tma_load(q_desc, [q_row, 0], q_ready, q_smem.index(0))
    tma_load(q_desc, [q_row + WG_M, 0], q_ready, q_smem.index(1))
    for j in range(n_blocks):
        slot = j % STAGES
        # Wait until both consumers released this slot's K (its previous use, STAGES blocks ago;
        # slot_free[slot]) and, before V, its V (slot_free[STAGES + slot]). A fresh barrier counts
        # as released for parity 1, so the first pass does not wait.
        free_phase = ((j // STAGES) & 1) ^ 1
        mbarrier.wait(slot_free.index(slot), free_phase)
        mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
        tma_load(k_desc, [kv_row + j * BLOCK_N, 0], k_ready.index(slot), k_smem.index(slot))
        mbarrier.wait(slot_free.index(STAGES + slot), free_phase)
        mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
        tma_load(v_desc, [kv_row + j * BLOCK_N, 0], v_ready.index(slot), v_smem.index(slot))


@gluon.jit
def _consumer(WG: gl.constexpr, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, slot_free,
              out_ptr, lse_ptr, q_row, m0, n_q, n_k, qk_scale, n_blocks, unmasked_blocks,
              diagonal):  # fmt: skip
    """One warpgroup, 64 query rows: the FlashAttention-2 loop with wgmma, fed by the producer.
    Query i sees keys j <= i + diagonal (diagonal = Nk - Nq when causal, Nk when not)."""
    dtype: gl.constexpr = q_smem.dtype
    STAGES: gl.constexpr = k_smem.shape[0]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    HEAD_DIM: gl.constexpr = k_smem.shape[2]
    s_layout: gl.constexpr = accumulator_layout(BLOCK_N)  # S: 64 x BLOCK_N
    o_layout: gl.constexpr = accumulator_layout(HEAD_DIM)  # O: 64 x D
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)

    rows = m0 + WG * WG_M + gl.arange(0, WG_M, layout=row_layout)  # query index in the head
    cols0 = gl.arange(0, BLOCK_N, layout=col_layout)
    m_i = gl.full([WG_M], float("-inf"), gl.float32, layout=row_layout)
    l_i = gl.zeros([WG_M], gl.float32, layout=row_layout)
    acc = gl.zeros([WG_M, HEAD_DIM], gl.float32, layout=o_layout)
    zero_s = gl.zeros([WG_M, BLOCK_N], gl.float32, layout=s_layout)

    mbarrier.wait(q_ready, 0)
    q = q_smem.index(WG)
    for j in range(n_blocks):
        slot = j % STAGES
        phase = (j // STAGES) & 1
        mbarrier.wait(k_ready.index(slot), phase)
        s = warpgroup_mma(q, k_smem.index(slot).permute((1, 0)), zero_s, use_acc=False,
                          is_async=True)  # fmt: skip
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        mbarrier.arrive(slot_free.index(slot), count=1)  # K consumed
        if j >= unmasked_blocks:  # the diagonal (causal) and the keys past Nk
            cols = j * BLOCK_N + cols0
            keep = (gl.expand_dims(cols, 0) <= gl.expand_dims(rows, 1) + diagonal) & (
                gl.expand_dims(cols < n_k, 0)
            )
            s = gl.where(keep, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
        m_shift = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row that saw no key yet
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_shift, 1))
        alpha = gl.exp2(m_i - m_shift)
        l_i = l_i * alpha + gl.sum(p, axis=1)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        p_op = gl.convert_layout(p.to(dtype), p_layout)  # P stays in registers: wgmma's A operand
        mbarrier.wait(v_ready.index(slot), phase)
        acc = warpgroup_mma(p_op, v_smem.index(slot), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(slot_free.index(STAGES + slot), count=1)  # V consumed
        m_i = m_new

    # Epilogue: normalize, store the rows that exist; a row that saw no key gets 0 and lse -inf.
    seen = l_i > 0.0
    l_safe = gl.where(seen, l_i, 1.0)
    lse = gl.where(seen, (m_i + gl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    gl.store(lse_ptr + (q_row + WG * WG_M) + gl.arange(0, WG_M, layout=row_layout), lse,
             mask=rows < n_q)  # fmt: skip
    out = acc / gl.expand_dims(gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout)), 1)
    o_rows = gl.arange(0, WG_M, layout=gl.SliceLayout(1, o_layout))
    o_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    offsets = (gl.expand_dims((q_row + WG * WG_M + o_rows).to(gl.int64), 1) * HEAD_DIM
               + gl.expand_dims(o_cols, 0))  # fmt: skip
    row_ok = gl.expand_dims(m0 + WG * WG_M + o_rows < n_q, 1)
    gl.store(out_ptr + offsets, out.to(dtype), mask=row_ok & gl.expand_dims(o_cols < HEAD_DIM, 0))


@gluon.jit
def _softmax_step(s, j, m_i, l_i, acc, rows, cols0, n_k, qk_scale, unmasked_blocks, diagonal,
                  BLOCK_N: gl.constexpr, dtype: gl.constexpr, p_layout: gl.constexpr,
                  o_layout: gl.constexpr):  # fmt: skip
    """The online softmax of key block j's scores s: masks (diagonal, keys past Nk), the new row
    maximum, P (as the next product's register operand), the running sum, and O rescaled."""
    if j >= unmasked_blocks:
        cols = j * BLOCK_N + cols0
        keep = (gl.expand_dims(cols, 0) <= gl.expand_dims(rows, 1) + diagonal) & (
            gl.expand_dims(cols < n_k, 0)
        )
        s = gl.where(keep, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
    m_shift = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row that saw no key yet
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_shift, 1))
    alpha = gl.exp2(m_i - m_shift)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
    p_op = gl.convert_layout(p.to(dtype), p_layout)  # P stays in registers: wgmma's A operand
    return p_op, m_new, l_i, acc


@gluon.jit
def _consumer_pingpong(WG: gl.constexpr, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready,
                       slot_free, turn, out_ptr, lse_ptr, q_row, m0, n_q, n_k, qk_scale, n_blocks,
                       unmasked_blocks, diagonal):  # fmt: skip
    """The same warpgroup loop in FlashAttention-3's ping-pong order.

    Iteration j waits for its turn, queues this warpgroup's two matrix products, S_j = Q K_j^T and
    O += P_{j-1} V_{j-1}, passes the turn to the other warpgroup (the `turn` barriers), then waits
    for S_j and runs its softmax while the other warpgroup's products run. The products of the two
    warpgroups alternate instead of colliding, and each softmax hides behind the other's GEMMs."""
    dtype: gl.constexpr = q_smem.dtype
    STAGES: gl.constexpr = k_smem.shape[0]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    HEAD_DIM: gl.constexpr = k_smem.shape[2]
    s_layout: gl.constexpr = accumulator_layout(BLOCK_N)
    o_layout: gl.constexpr = accumulator_layout(HEAD_DIM)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)

    rows = m0 + WG * WG_M + gl.arange(0, WG_M, layout=row_layout)
    cols0 = gl.arange(0, BLOCK_N, layout=col_layout)
    m_i = gl.full([WG_M], float("-inf"), gl.float32, layout=row_layout)
    l_i = gl.zeros([WG_M], gl.float32, layout=row_layout)
    acc = gl.zeros([WG_M, HEAD_DIM], gl.float32, layout=o_layout)
    zero_s = gl.zeros([WG_M, BLOCK_N], gl.float32, layout=s_layout)
    p_op = gl.zeros([WG_M, BLOCK_N], dtype, layout=p_layout)  # P of the previous block

    mbarrier.wait(q_ready, 0)
    q = q_smem.index(WG)
    # Turn parity: warpgroup 0 goes first (a fresh barrier passes parity 1), then they alternate.
    if n_blocks > 0:  # block 0 has only its S = Q K^T: there is no P V yet
        mbarrier.wait(turn.index(WG), 1 - WG)
        mbarrier.wait(k_ready.index(0), 0)
        s = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), zero_s, use_acc=False,
                          is_async=True)  # fmt: skip
        mbarrier.arrive(turn.index(1 - WG), count=1)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        mbarrier.arrive(slot_free.index(0), count=1)  # K_0 consumed
        p_op, m_i, l_i, acc = _softmax_step(s, 0, m_i, l_i, acc, rows, cols0, n_k, qk_scale,
                                            unmasked_blocks, diagonal, BLOCK_N, dtype,
                                            p_layout, o_layout)  # fmt: skip
    for j in range(1, n_blocks):
        slot = j % STAGES
        prev = (j - 1) % STAGES
        mbarrier.wait(turn.index(WG), (j & 1) ^ (1 - WG))
        mbarrier.wait(k_ready.index(slot), (j // STAGES) & 1)
        s = warpgroup_mma(q, k_smem.index(slot).permute((1, 0)), zero_s, use_acc=False,
                          is_async=True)  # fmt: skip
        mbarrier.wait(v_ready.index(prev), ((j - 1) // STAGES) & 1)
        acc = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
        # Both products are queued on the tensor cores: the other warpgroup may queue its own
        # (they run after these), while this one waits for its S and runs the softmax.
        mbarrier.arrive(turn.index(1 - WG), count=1)
        s, acc = warpgroup_mma_wait(num_outstanding=0, deps=(s, acc))
        mbarrier.arrive(slot_free.index(slot), count=1)  # K_j consumed
        mbarrier.arrive(slot_free.index(STAGES + prev), count=1)  # V_{j-1} consumed
        p_op, m_i, l_i, acc = _softmax_step(s, j, m_i, l_i, acc, rows, cols0, n_k, qk_scale,
                                            unmasked_blocks, diagonal, BLOCK_N, dtype,
                                            p_layout, o_layout)  # fmt: skip
    if n_blocks > 0:  # the last block's P V
        last = (n_blocks - 1) % STAGES
        mbarrier.wait(v_ready.index(last), ((n_blocks - 1) // STAGES) & 1)
        acc = warpgroup_mma(p_op, v_smem.index(last), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))

    seen = l_i > 0.0
    l_safe = gl.where(seen, l_i, 1.0)
    lse = gl.where(seen, (m_i + gl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    gl.store(lse_ptr + (q_row + WG * WG_M) + gl.arange(0, WG_M, layout=row_layout), lse,
             mask=rows < n_q)  # fmt: skip
    out = acc / gl.expand_dims(gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout)), 1)
    o_rows = gl.arange(0, WG_M, layout=gl.SliceLayout(1, o_layout))
    o_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    offsets = (gl.expand_dims((q_row + WG * WG_M + o_rows).to(gl.int64), 1) * HEAD_DIM
               + gl.expand_dims(o_cols, 0))  # fmt: skip
    row_ok = gl.expand_dims(m0 + WG * WG_M + o_rows < n_q, 1)
    gl.store(out_ptr + offsets, out.to(dtype), mask=row_ok & gl.expand_dims(o_cols < HEAD_DIM, 0))


@gluon.jit
def _pingpong_0(q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, slot_free, turn, out_ptr,
                lse_ptr, q_row, m0, n_q, n_k, qk_scale, n_blocks, unmasked_blocks,
                diagonal):  # fmt: skip
    _consumer_pingpong(0, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, slot_free, turn,
                       out_ptr, lse_ptr, q_row, m0, n_q, n_k, qk_scale, n_blocks, unmasked_blocks,
                       diagonal)  # fmt: skip


@gluon.jit
def _pingpong_1(q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, slot_free, turn, out_ptr,
                lse_ptr, q_row, m0, n_q, n_k, qk_scale, n_blocks, unmasked_blocks,
                diagonal):  # fmt: skip
    _consumer_pingpong(1, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, slot_free, turn,
                       out_ptr, lse_ptr, q_row, m0, n_q, n_k, qk_scale, n_blocks, unmasked_blocks,
                       diagonal)  # fmt: skip


@gluon.jit
def _consumer_0(q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, slot_free, out_ptr, lse_ptr,
                q_row, m0, n_q, n_k, qk_scale, n_blocks, unmasked_blocks, diagonal):  # fmt: skip
    _consumer(0, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, slot_free, out_ptr, lse_ptr,
              q_row, m0, n_q, n_k, qk_scale, n_blocks, unmasked_blocks, diagonal)  # fmt: skip


@gluon.jit
def _consumer_1(q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, slot_free, out_ptr, lse_ptr,
                q_row, m0, n_q, n_k, qk_scale, n_blocks, unmasked_blocks, diagonal):  # fmt: skip
    _consumer(1, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, slot_free, out_ptr, lse_ptr,
              q_row, m0, n_q, n_k, qk_scale, n_blocks, unmasked_blocks, diagonal)  # fmt: skip


# The sizes are not specialized on (Triton would compile again for every length divisible by 16
# or equal to 1): they only enter address arithmetic, TMA coordinates and masks.
@gluon.jit(do_not_specialize=["n_heads", "group", "n_q", "n_k"])
def gluon_fwd_kernel(q_desc, k_desc, v_desc, out_ptr, lse_ptr, n_heads, group, n_q, n_k,
                     qk_scale, CAUSAL: gl.constexpr, STAGES: gl.constexpr,
                     PINGPONG: gl.constexpr, LIST_API: gl.constexpr):  # fmt: skip
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    pid_m = gl.program_id(0)
    if CAUSAL:  # the last query blocks see the most keys: start them first
        pid_m = gl.num_programs(0) - 1 - pid_m
    bh = gl.program_id(1)
    kv_bh = (bh // n_heads) * (n_heads // group) + (bh % n_heads) // group
    m0 = pid_m * (2 * WG_M)
    q_row = bh * n_q + m0  # rows of the flattened (B * H * N, D) views
    kv_row = kv_bh * n_k

    # The key blocks this CTA visits, and how many of them every one of its rows sees whole.
    if CAUSAL:
        diagonal = n_k - n_q  # bottom-right aligned: query i sees keys j <= i + Nk - Nq
        hi = gl.minimum(n_k, gl.maximum(0, m0 + 2 * WG_M + diagonal))
        unmasked_blocks = gl.maximum(0, gl.minimum(n_k, m0 + diagonal + 1)) // BLOCK_N
    else:
        diagonal = n_k
        hi = n_k
        unmasked_blocks = n_k // BLOCK_N
    n_blocks = gl.cdiv(hi, BLOCK_N)

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [2, WG_M, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    # slot_free[s]: K of slot s consumed; slot_free[STAGES + s]: V of slot s consumed.
    slot_free = gl.allocate_shared_memory(gl.int64, [2 * STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_ready, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(slot_free.index(i), count=2)  # both consumers release each K and V
        mbarrier.init(slot_free.index(STAGES + i), count=2)

    # The kernel's own 4 warps run consumer 0; a second warpgroup runs consumer 1; one warp loads.
    producer_args = (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready,
                     slot_free, q_row, kv_row, n_blocks)  # fmt: skip
    if PINGPONG:
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(turn.index(0), count=1)
        mbarrier.init(turn.index(1), count=1)
        args = (q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, slot_free, turn, out_ptr,
                lse_ptr, q_row, m0, n_q, n_k, qk_scale, n_blocks, unmasked_blocks,
                diagonal)  # fmt: skip
        if LIST_API:
            gl.warp_specialize([(_pingpong_0, args), (_pingpong_1, args),
                                (_producer, producer_args)], [4, 1],
                               [CONSUMER_REGS, PRODUCER_REGS])  # fmt: skip
        else:
            gl.warp_specialize(args, _pingpong_0, args, [_pingpong_1, _producer], [4, 1],
                               [CONSUMER_REGS, PRODUCER_REGS])  # fmt: skip
    else:
        args = (q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, slot_free, out_ptr, lse_ptr,
                q_row, m0, n_q, n_k, qk_scale, n_blocks, unmasked_blocks, diagonal)  # fmt: skip
        if LIST_API:
            gl.warp_specialize([(_consumer_0, args), (_consumer_1, args),
                                (_producer, producer_args)], [4, 1],
                               [CONSUMER_REGS, PRODUCER_REGS])  # fmt: skip
        else:
            gl.warp_specialize(args, _consumer_0, args, [_consumer_1, _producer], [4, 1],
                               [CONSUMER_REGS, PRODUCER_REGS])  # fmt: skip


def gluon_attention_forward(q, k, v, causal: bool = False, scale: float | None = None, *,
                            out=None, lse=None, pingpong: bool | None = None,
                            stages: int | None = None):  # fmt: skip
    """(out, lse) as `triton_flash.flash_attention_forward`, with the warp-specialized kernel.
    `pingpong` (None: PINGPONG) orders the two warpgroups' products by turns; `stages` (None:
    STAGES) is the depth of the K/V ring."""
    check_inputs("gluon_attention_forward", q, k, v)
    head_dim = q.shape[-1]
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"gluon_attention_forward: head_dim {head_dim}; supported: 64, 128")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not t.is_contiguous():
            raise ValueError(f"gluon_attention_forward: {name} must be contiguous (B, H, N, D)")
    scale = softmax_scale(scale, head_dim)
    out, lse = output_buffers("gluon_attention_forward", q, out, lse)
    if not out.is_contiguous():
        raise ValueError("gluon_attention_forward: out must be contiguous")
    batch, n_heads, n_q, _ = q.shape
    n_kv_heads, n_k = k.shape[1], k.shape[2]
    if out.numel() == 0:
        return out, lse
    dtype = GL_DTYPES[q.dtype]
    q_layout = gl.NVMMASharedLayout.get_default_for([WG_M.value, head_dim], dtype)
    kv_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_N, head_dim], dtype)
    q2, k2, v2 = (t.view(-1, head_dim) for t in (q, k, v))
    q_desc = TensorDescriptor(
        q2, list(q2.shape), list(q2.stride()), [WG_M.value, head_dim], q_layout
    )
    k_desc = TensorDescriptor(k2, list(k2.shape), list(k2.stride()), [BLOCK_N, head_dim], kv_layout)
    v_desc = TensorDescriptor(v2, list(v2.shape), list(v2.stride()), [BLOCK_N, head_dim], kv_layout)
    grid = (triton.cdiv(n_q, CTA_M), batch * n_heads)
    gluon_fwd_kernel[grid](q_desc, k_desc, v_desc, out, lse, n_heads, n_heads // n_kv_heads, n_q,
                           n_k, scale * LOG2E, CAUSAL=bool(causal), STAGES=stages or STAGES,
                           PINGPONG=PINGPONG if pingpong is None else bool(pingpong),
                           LIST_API=LIST_API, num_warps=4)  # fmt: skip
    return out, lse


def compile_for_hopper(head_dim: int = 128, dtype: torch.dtype = torch.float16,
                       causal: bool = False, pingpong: bool = True, stages: int = 3):  # fmt: skip
    """Compile the kernel for sm_90 without a GPU (the CPU test): the front end, the layouts, the
    warp specialization and ptxas all run; returns the compiled kernel (its .asm has the PTX)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    gdt = GL_DTYPES[dtype]
    rows = torch.empty((1, head_dim), dtype=dtype)
    q_layout = gl.NVMMASharedLayout.get_default_for([WG_M.value, head_dim], gdt)
    kv_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_N, head_dim], gdt)
    q_desc = TensorDescriptor(rows, [1, head_dim], [head_dim, 1], [WG_M.value, head_dim], q_layout)
    kv_desc = TensorDescriptor(rows, [1, head_dim], [head_dim, 1], [BLOCK_N, head_dim], kv_layout)
    element = {torch.float16: "*fp16", torch.bfloat16: "*bf16"}[dtype]
    signature = {"q_desc": q_desc.__mangle__(), "k_desc": kv_desc.__mangle__(),
                 "v_desc": kv_desc.__mangle__(), "out_ptr": element, "lse_ptr": "*fp32",
                 "n_heads": "i32", "group": "i32", "n_q": "i32", "n_k": "i32", "qk_scale": "fp32",
                 "CAUSAL": "constexpr", "STAGES": "constexpr", "PINGPONG": "constexpr",
                 "LIST_API": "constexpr"}  # fmt: skip
    names = list(signature)
    constants = {"CAUSAL": causal, "STAGES": stages, "PINGPONG": pingpong, "LIST_API": LIST_API}
    constexprs = {(names.index(n),): value for n, value in constants.items()}
    source = GluonASTSource(gluon_fwd_kernel, signature, constexprs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})


_OFFLINE = """
import os, sys
import kernels  # CPU mode sets TRITON_INTERPRET=1 before Triton is imported
os.environ.pop("TRITON_INTERPRET", None)  # compile for real: nothing here launches a kernel
import torch
from kernels.flash_attention import gluon_flash
head_dim, dtype, causal = int(sys.argv[1]), getattr(torch, sys.argv[2]), sys.argv[3] == "1"
kernel = gluon_flash.compile_for_hopper(head_dim, dtype, causal)
ptx = kernel.asm["ptx"]
print(kernel.metadata.num_warps, kernel.metadata.shared, ptx.count("wgmma.mma_async"),
      ptx.count("cp.async.bulk.tensor"), ptx.count("setmaxnreg"))
"""


def compile_offline(head_dim: int = 128, dtype: str = "float16", causal: bool = True) -> dict:
    """`compile_for_hopper` in a fresh process (a process running Triton's interpreter cannot
    compile Gluon): what the compiler emitted, counted in the PTX."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _OFFLINE, str(head_dim), dtype, str(int(causal))],
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError("compiling for sm_90 failed:\n" + done.stderr[-3000:])
    warps, shared, wgmma, tma_copies, setmaxnreg = map(int, done.stdout.split()[-5:])
    return {"warps": warps, "shared_bytes": shared, "wgmma": wgmma, "tma_copies": tma_copies,
            "setmaxnreg": setmaxnreg}  # fmt: skip
