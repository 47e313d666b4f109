"""The attention backward on Hopper in Gluon: warp roles for the five products of FlashAttention.

The backward of O = softmax(scale Q K^T) V, with P the softmax and dO the gradient of O, is five
matrix products per (query block, key block) pair: S = Q K^T and dP = dO V^T recomputed, then
dV += P^T dO, dK += dS^T Q and dQ += dS K, where dS = P * (dP - rowsum(dO * O)). The course's
Triton backward (`triton_flash.flash_attention_backward`) runs it as two kernels, one for dK and
dV and one for dQ, each recomputing S and dP: 7 products where 5 are counted. Here one kernel does
the 5, as FlashAttention-2 and -3 do, and adds dQ up across key blocks with float32 atomics.

The CTA's roles, as in the forward (`gluon_flash.py`):

* the CTA owns 128 keys of one KV head: two consumer warpgroups of 64 keys each hold their K and V
  in shared memory and their dK and dV in registers for the whole kernel;
* a producer warp streams the query side through a ring of STAGES shared-memory slots: for every
  query block (64 rows) of every query head that reads this KV head, its Q and dO tiles by TMA;
* each consumer warpgroup, per query block, computes S^T = K Q^T and dP^T = V dO^T with wgmma
  (keys on the M side, so P^T and dS^T come out in the layout the next products take from
  registers), the exponentials against the forward's log-sum-exp, dV += P^T dO and dK += dS^T Q
  with P^T and dS^T as register operands, and writes dS^T to shared memory;
* one warpgroup a step, in turn, then computes the CTA's share of dQ, dS K over all 128 keys (two
  wgmma reading both warpgroups' dS^T transposed), and adds it to a float32 dQ in global memory
  with atomics (`red.global.add`), which nobody waits for. Two mbarriers hand dS^T over: both
  halves written (`ds_ready`), and the product that read them retired (`ds_free`), with the
  buffer doubled by step parity so the next step's writes need not wait.

Why atomics: a key block's share of dQ is known only inside its CTA, and every key block of the
head adds to the same rows. FlashAttention-3 hands the share to a TMA bulk reduce-add
(`cp.reduce.async.bulk`); Gluon in Triton 3.6 has no such copy (3.9 has `tma.async_atomic_add`),
so each thread adds its own elements, as FlashAttention-2 does. A small torch step then scales
dQ and casts it to the input's dtype. Summing the two warpgroups' shares before the atomics
(half the atomics) made the kernel 1.31-1.39x faster on an H200; pairing two columns an atomic
(`red.global.add.v2.f32` in inline PTX), or both warpgroups computing half of dQ's columns every
step (fewer registers, but each waits for the other), made it slower (PERFORMANCE.md).

Budget at D = 128 (registers a thread of a consumer warpgroup): dK and dV 64 each for the whole
loop, S^T and dP^T 32 each, P^T and dS^T as 16-bit pairs 16 each, the dQ share 64: more than the
240 a thread gets, and ptxas spills about 4 KB a thread (32 bytes at D = 64 causal). Shared
memory: K and V 64 KiB, each ring slot (Q and dO) 32 KiB, dS^T 2 x 16 KiB.

Measured (PERFORMANCE.md, "A Gluon backward"; `python -m
kernels.flash_attention.benchmark_gluon_backward`): correct on an H100 and an H200; at 0.53-0.79x
cuDNN, about the Triton backward's rate (faster at D = 64, slower at D = 128 causal), short of the
0.8x of cuDNN aimed for at D = 128.

Scope: head_dim 64 and 128, fp16 and bf16, causal (bottom-right aligned, as `reference.py`) or
not, grouped-query attention, any lengths; q, k, v, out and dout contiguous (B, H, N, D). Rows of
a tile past the end of a head read the next head's rows (or zeros past the tensor): their
probabilities are masked to zero and their gradients never stored.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from kernels import runtime
from kernels.flash_attention.gluon_flash import (
    GL_DTYPES,
    HEAD_DIMS,
    SHARED_BYTES,
    accumulator_layout,
    check_tma_tensors,
    row_descriptors,
    tma_load,
)
from kernels.flash_attention.gluon_offline import compile_sm90, descriptor_type
from kernels.flash_attention.triton_flash import (
    LOG2E,
    backward_row_terms,
    check_inputs,
    softmax_scale,
)

# A barrier over the calling partition's threads: `thread_barrier` in Triton 3.6, `barrier` later.
thread_barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier
WG_N = gl.constexpr(64)  # keys per consumer warpgroup (one wgmma M)
NUM_WG = gl.constexpr(2)  # consumer warpgroups: a CTA owns NUM_WG * 64 keys
BLOCK_M = gl.constexpr(64)  # query rows a step (the N of S^T = K Q^T)
DEFAULT_STAGES = 2
CONSUMER_REGS = 240  # 2 x 128 x 240 + 128 x 24 = 64,512 of the SM's 65,536
PRODUCER_REGS = 24


def shared_bytes(head_dim: int, stages: int) -> int:
    """Shared memory of a CTA: K and V of its keys, the ring of Q and dO, dS^T (two buffers)."""
    kv = 2 * NUM_WG.value * WG_N.value * head_dim * 2
    ring = stages * 2 * BLOCK_M.value * head_dim * 2
    ds = 2 * NUM_WG.value * WG_N.value * BLOCK_M.value * 2
    return kv + ring + ds


@gluon.jit
def _steps(n_k0, n_q, n_k, group, CAUSAL: gl.constexpr):
    """The query blocks this CTA visits: from `first` (with a causal mask, the first block with a
    row that sees one of the CTA's keys) to the last, for each of the `group` query heads."""
    n_mb = gl.cdiv(n_q, BLOCK_M)
    if CAUSAL:
        # query i sees key j iff j <= i + n_k - n_q: the first row that sees key n_k0
        first_row = gl.maximum(n_k0 - (n_k - n_q), 0)
        first = gl.minimum(first_row // BLOCK_M, n_mb)
    else:
        first = n_mb * 0
    return first, n_mb - first, group * (n_mb - first)


@gluon.jit
def _step_row(i, first, per_head, q_head0, n_q):
    """Step i's query block: its first row in the flattened (B * H * Nq, D) views, and in its
    head."""
    m0 = (first + i % per_head) * BLOCK_M
    return (q_head0 + i // per_head) * n_q + m0, m0


@gluon.jit
def _bwd_producer(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, kv_ready,
                  ready, free, kv_row, q_head0, sizes, CAUSAL: gl.constexpr):  # fmt: skip
    """One warp: the CTA's K and V once, then Q and dO of each step into the ring."""
    STAGES: gl.constexpr = q_smem.shape[0]
    n_q, n_k, group = sizes[0], sizes[1], sizes[2]
    mbarrier.expect(kv_ready, 2 * NUM_WG * k_desc.block_type.nbytes)
    for w in gl.static_range(NUM_WG):
        tma_load(k_desc, [kv_row + w * WG_N, 0], kv_ready, k_smem.index(w))
        tma_load(v_desc, [kv_row + w * WG_N, 0], kv_ready, v_smem.index(w))
    first, per_head, n_steps = _steps(gl.program_id(0) * NUM_WG * WG_N, n_q, n_k, group, CAUSAL)
    for i in range(n_steps):
        slot = i % STAGES
        # the slot's previous Q and dO (STAGES steps ago) read by both warpgroups' last products;
        # a fresh barrier counts as released for parity 1
        mbarrier.wait(free.index(slot), ((i // STAGES) & 1) ^ 1)
        row, _ = _step_row(i, first, per_head, q_head0, n_q)
        mbarrier.expect(ready.index(slot), 2 * q_desc.block_type.nbytes)
        tma_load(q_desc, [row, 0], ready.index(slot), q_smem.index(slot))
        tma_load(do_desc, [row, 0], ready.index(slot), do_smem.index(slot))


@gluon.jit
def _bwd_consumer(WG: gl.constexpr, q_smem, do_smem, k_smem, v_smem, ds_smem, kv_ready, ready,
                  free, ds_ready, ds_free, lse2_ptr, delta_ptr, dq_ptr, dk_ptr, dv_ptr, kv_row,
                  q_head0, sizes, CAUSAL: gl.constexpr):  # fmt: skip
    """One warpgroup, 64 keys: dK and dV over every step; on every other step, the CTA's share
    of dQ."""
    STAGES: gl.constexpr = q_smem.shape[0]
    HEAD_DIM: gl.constexpr = q_smem.shape[2]
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = accumulator_layout(BLOCK_M)  # S^T, dP^T: 64 keys x 64 queries
    d_layout: gl.constexpr = accumulator_layout(HEAD_DIM)  # dK, dV (64 keys), dQ (64 queries) x D
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=d_layout, k_width=2)
    key_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    query_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    n_q, n_k, group, qk_scale, scale = sizes[0], sizes[1], sizes[2], sizes[3], sizes[4]
    zero_s = gl.zeros([WG_N, BLOCK_M], gl.float32, layout=s_layout)
    zero_dq = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=d_layout)
    dk = gl.zeros([WG_N, HEAD_DIM], gl.float32, layout=d_layout)
    dv = gl.zeros([WG_N, HEAD_DIM], gl.float32, layout=d_layout)

    k0 = gl.program_id(0) * NUM_WG * WG_N + WG * WG_N  # this warpgroup's first key in the head
    keys = k0 + gl.arange(0, WG_N, layout=key_layout)
    diagonal = n_k - n_q  # query i sees key j iff j <= i + diagonal (with CAUSAL)
    k_tile = k_smem.index(WG)
    v_tile = v_smem.index(WG)
    dq_rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, d_layout))
    dq_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, d_layout))
    mbarrier.wait(kv_ready, 0)
    first, per_head, n_steps = _steps(gl.program_id(0) * NUM_WG * WG_N, n_q, n_k, group, CAUSAL)
    for i in range(n_steps):
        slot = i % STAGES
        row, m0 = _step_row(i, first, per_head, q_head0, n_q)
        queries = m0 + gl.arange(0, BLOCK_M, layout=query_layout)
        # the forward's log-sum-exp (log2 units) and rowsum(dO * O) of this block's rows; rows
        # past the head's end read 0 and are masked below
        lse2 = gl.load(lse2_ptr + row - m0 + queries, mask=queries < n_q, other=0.0)
        delta = gl.load(delta_ptr + row - m0 + queries, mask=queries < n_q, other=0.0)
        mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
        q_tile = q_smem.index(slot)
        do_tile = do_smem.index(slot)
        s_t = warpgroup_mma(k_tile, q_tile.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        dp_t = warpgroup_mma(v_tile, do_tile.permute((1, 0)), zero_s, use_acc=False,
                             is_async=True)  # fmt: skip
        s_t = warpgroup_mma_wait(num_outstanding=1, deps=(s_t,))
        p_t = gl.exp2(s_t * qk_scale - gl.expand_dims(lse2, 0))
        # Which (key, query) pairs count: a key past the head's end, a query past it, or (causal)
        # a key after the query's diagonal gets P = 0, and so dS = 0. Only blocks at the edges
        # need it: a block wholly inside every bound skips the comparisons.
        edge = (k0 + WG_N > n_k) | (m0 + BLOCK_M > n_q)
        if CAUSAL:
            edge = edge | (k0 + WG_N - 1 > m0 + diagonal)
        if edge:
            valid = gl.expand_dims(keys < n_k, 1) & gl.expand_dims(queries < n_q, 0)
            if CAUSAL:
                valid = valid & (gl.expand_dims(keys, 1) <= gl.expand_dims(queries, 0) + diagonal)
            p_t = gl.where(valid, p_t, 0.0)
        dp_t = warpgroup_mma_wait(num_outstanding=0, deps=(dp_t,))
        ds_t = p_t * (dp_t - gl.expand_dims(delta, 0))
        p_op = gl.convert_layout(p_t.to(dtype), a_layout)
        ds_16 = ds_t.to(dtype)
        ds_op = gl.convert_layout(ds_16, a_layout)
        dv = warpgroup_mma(p_op, do_tile, dv, is_async=True)
        dk = warpgroup_mma(ds_op, q_tile, dk, is_async=True)
        # dQ's share, dS K over the CTA's 128 keys: both warpgroups put dS^T in shared memory
        # (buffer i % 2), and the warpgroup whose turn it is (step i: warpgroup i % 2) adds the
        # two 64-key products and issues the atomics: half the atomics of a share per warpgroup.
        # Before overwriting its half of buffer b, a warpgroup waits until the product that
        # read it two steps ago retired (ds_free[b]; a fresh barrier passes parity 1).
        buf = i % 2
        if buf != WG:
            mbarrier.wait(ds_free.index(buf), ((i // 2) & 1) ^ 1)
        ds_smem.index(buf * NUM_WG + WG).store(ds_16)
        fence_async_shared()  # the threads' writes, before the tensor cores read them
        thread_barrier()  # every thread of this warpgroup has written, before the arrive
        mbarrier.arrive(ds_ready.index(buf), count=1)
        dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk))
        mbarrier.arrive(free.index(slot), count=1)  # Q and dO of this slot read
        if buf == WG:
            mbarrier.wait(ds_ready.index(buf), (i // 2) & 1)  # both halves of dS^T written
            dq = warpgroup_mma(ds_smem.index(buf * NUM_WG).permute((1, 0)), k_smem.index(0),
                               zero_dq, use_acc=False, is_async=True)  # fmt: skip
            dq = warpgroup_mma(ds_smem.index(buf * NUM_WG + 1).permute((1, 0)), k_smem.index(1),
                               dq, is_async=True)  # fmt: skip
            dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq,))
            mbarrier.arrive(ds_free.index(buf), count=1)
            offsets = (gl.expand_dims((row + dq_rows).to(gl.int64), 1) * HEAD_DIM
                       + gl.expand_dims(dq_cols, 0))  # fmt: skip
            gl.atomic_add(dq_ptr + offsets, dq, mask=gl.expand_dims(m0 + dq_rows < n_q, 1),
                          sem="relaxed")  # fmt: skip

    # dK and dV of the keys that exist; dK takes the softmax scale here (S was scaled, Q was not)
    rows = gl.arange(0, WG_N, layout=gl.SliceLayout(1, d_layout))
    offsets = (gl.expand_dims((kv_row + WG * WG_N + rows).to(gl.int64), 1) * HEAD_DIM
               + gl.expand_dims(dq_cols, 0))  # fmt: skip
    exists = gl.expand_dims(k0 + rows < n_k, 1)
    gl.store(dv_ptr + offsets, dv.to(dtype), mask=exists)
    gl.store(dk_ptr + offsets, (dk * scale).to(dtype), mask=exists)


@gluon.jit
def _bwd_consumer_0(args, CAUSAL: gl.constexpr):
    _bwd_consumer(0, *args, CAUSAL)


@gluon.jit
def _bwd_consumer_1(args, CAUSAL: gl.constexpr):
    _bwd_consumer(1, *args, CAUSAL)


# The sizes are not specialized on: they only enter addresses, TMA coordinates and masks.
@gluon.jit(do_not_specialize=["n_heads", "group", "n_q", "n_k"])
def gluon_bwd_kernel(q_desc, do_desc, k_desc, v_desc, lse2_ptr, delta_ptr, dq_ptr, dk_ptr, dv_ptr,
                     n_heads, group, n_q, n_k, qk_scale, scale, CAUSAL: gl.constexpr,
                     STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                     PRODUCER_REGS: gl.constexpr):  # fmt: skip
    """CTA (key block of NUM_WG * 64 keys, batch x KV head): dK and dV of its keys, and its
    shares of dQ for every query head of the group."""
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
    dtype: gl.constexpr = q_desc.dtype
    kv_bh = gl.program_id(1)
    n_kv_heads = n_heads // group
    kv_row = kv_bh * n_k + gl.program_id(0) * NUM_WG * WG_N  # first K/V row in (B * Hkv * Nk, D)
    q_head0 = (kv_bh // n_kv_heads) * n_heads + (kv_bh % n_kv_heads) * group  # first query head
    sizes = (n_q, n_k, group, qk_scale, scale)

    k_smem = gl.allocate_shared_memory(dtype, [NUM_WG, WG_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_WG, WG_N, HEAD_DIM], v_desc.layout)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], do_desc.layout)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([WG_N, BLOCK_M], dtype)
    # dS^T of warpgroup w for steps of parity b: ds_smem[b * NUM_WG + w]
    ds_smem = gl.allocate_shared_memory(dtype, [2 * NUM_WG, WG_N, BLOCK_M], ds_layout)
    kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ds_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready, count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(free.index(s), count=NUM_WG)  # both warpgroups release each slot
    for b in gl.static_range(2):
        mbarrier.init(ds_ready.index(b), count=NUM_WG)  # both halves of dS^T written
        mbarrier.init(ds_free.index(b), count=1)  # the dQ product that read them retired

    args = (q_smem, do_smem, k_smem, v_smem, ds_smem, kv_ready, ready, free, ds_ready, ds_free,
            lse2_ptr, delta_ptr, dq_ptr, dk_ptr, dv_ptr, kv_row, q_head0, sizes)  # fmt: skip
    producer_args = (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, kv_ready,
                     ready, free, kv_row, q_head0, sizes, CAUSAL)  # fmt: skip
    gl.warp_specialize([(_bwd_consumer_0, (args, CAUSAL)), (_bwd_consumer_1, (args, CAUSAL)),
                        (_bwd_producer, producer_args)], [4, 1],
                       [CONSUMER_REGS, PRODUCER_REGS])  # fmt: skip


def gluon_attention_backward(do, q, k, v, out, lse, causal: bool = False,
                             scale: float | None = None, *, dk=None, dv=None,
                             stages: int = DEFAULT_STAGES):  # fmt: skip
    """(dq, dk, dv) from the forward's out and lse (natural log, float32, (B, H, Nq)), as
    `triton_flash.flash_attention_backward` computes them, with the warp-specialized kernel.
    `dk`, `dv`: buffers to write into (contiguous, k's shape and dtype), else new ones;
    `stages`: the depth of the Q/dO ring."""
    name = "gluon_attention_backward"
    runtime.require("wgmma", name)  # before anything compiles: LLVM aborts off sm_90
    check_inputs(name, q, k, v)  # types, dtypes, devices, shapes, grouped heads
    head_dim = q.shape[-1]
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"{name}: head_dim {head_dim}; supported: 64, 128")
    for label, t in (("out", out), ("dout", do)):
        if not isinstance(t, torch.Tensor) or t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{name}: {label} must be a {q.dtype} tensor on {q.device}")
    check_tma_tensors(name, q=q, k=k, v=v, out=out, dout=do)
    if do.shape != q.shape or out.shape != q.shape:
        raise ValueError(f"{name}: dout {tuple(do.shape)} and out {tuple(out.shape)} must have "
                         f"q's shape {tuple(q.shape)}")  # fmt: skip
    if lse.shape != q.shape[:3] or lse.dtype != torch.float32 or not lse.is_contiguous():
        raise ValueError(f"{name}: lse must be the forward's contiguous float32 "
                         f"{tuple(q.shape[:3])}, got {lse.dtype} {tuple(lse.shape)}")  # fmt: skip
    dk = torch.empty_like(k) if dk is None else dk
    dv = torch.empty_like(v) if dv is None else dv
    for label, t in (("dk", dk), ("dv", dv)):
        if t.shape != k.shape or t.dtype != k.dtype or not t.is_contiguous():
            raise ValueError(f"{name}: {label} must be contiguous {k.dtype} {tuple(k.shape)}")
    if shared_bytes(head_dim, stages) > SHARED_BYTES:
        need = shared_bytes(head_dim, stages)
        raise ValueError(f"{name}: {stages} stages need {need} bytes of shared memory at "
                         f"head_dim {head_dim}; a CTA has {SHARED_BYTES}")  # fmt: skip
    batch, n_heads, n_q, _ = q.shape
    n_kv_heads, n_k = k.shape[1], k.shape[2]
    scale = softmax_scale(scale, head_dim)
    dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    if q.numel() == 0 or k.numel() == 0:
        return dq_acc.to(q.dtype), dk.zero_(), dv.zero_()
    delta, lse2 = backward_row_terms(do, out, lse)
    dtype = GL_DTYPES[q.dtype]
    q_desc, do_desc = row_descriptors((q, do), BLOCK_M.value, head_dim, dtype)
    k_desc, v_desc = row_descriptors((k, v), WG_N.value, head_dim, dtype)
    grid = (triton.cdiv(n_k, NUM_WG.value * WG_N.value), batch * n_kv_heads)
    gluon_bwd_kernel[grid](q_desc, do_desc, k_desc, v_desc, lse2, delta, dq_acc, dk, dv, n_heads,
                           n_heads // n_kv_heads, n_q, n_k, scale * LOG2E, scale,
                           CAUSAL=bool(causal),
                           STAGES=stages, CONSUMER_REGS=CONSUMER_REGS,
                           PRODUCER_REGS=PRODUCER_REGS, num_warps=4)  # fmt: skip
    return dq_acc.mul_(scale).to(q.dtype), dk, dv


def compile_for_hopper(head_dim: int = 128, dtype: torch.dtype = torch.float16,
                       causal: bool = False, stages: int = DEFAULT_STAGES):  # fmt: skip
    """The backward compiled for sm_90 without a GPU (the CPU test; `gluon_offline.compile_sm90`;
    `gluon_offline.compile_offline_many` with this module's name runs it in a fresh process and
    reads ptxas's report)."""
    rows = torch.empty((1, head_dim), dtype=dtype)
    q_type, k_type = (descriptor_type(row_descriptors((rows,), block, head_dim,
                                                      GL_DTYPES[dtype])[0])
                      for block in (BLOCK_M.value, WG_N.value))  # fmt: skip
    element = {torch.float16: "*fp16", torch.bfloat16: "*bf16"}[dtype]
    signature = {"q_desc": q_type, "do_desc": q_type, "k_desc": k_type,
                 "v_desc": k_type, "lse2_ptr": "*fp32", "delta_ptr": "*fp32",
                 "dq_ptr": "*fp32", "dk_ptr": element, "dv_ptr": element, "n_heads": "i32",
                 "group": "i32", "n_q": "i32", "n_k": "i32", "qk_scale": "fp32", "scale": "fp32",
                 "CAUSAL": "constexpr", "STAGES": "constexpr", "CONSUMER_REGS": "constexpr",
                 "PRODUCER_REGS": "constexpr"}  # fmt: skip
    constants = {"CAUSAL": causal, "STAGES": stages, "CONSUMER_REGS": CONSUMER_REGS,
                 "PRODUCER_REGS": PRODUCER_REGS}  # fmt: skip
    return compile_sm90(gluon_bwd_kernel, signature, constants)
