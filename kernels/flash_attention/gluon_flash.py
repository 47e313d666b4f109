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

Budget of a two-warpgroup CTA (a 64 x N fp32 tile spread over a warpgroup's 128 threads costs N / 2
registers a thread): 12 warps (two consumer warpgroups, the producer's warp padded to a warpgroup)
share the 65,536 registers of an SM; `setmaxnreg` gives each consumer thread 240 (S 64, O D/2,
P 32 as fp16 pairs, the row statistics and indices) and the producer 24: 2 x 128 x 240 + 128 x 24
= 64,512. Shared memory: Q 2 x 64 x D x 2 bytes plus STAGES x (K + V) of 128 x D x 2 bytes =
224 KiB at D = 128 (of 227), 112 KiB at D = 64.

Seven variants, selected by keyword (`gluon_attention_forward`) like the turns (`pingpong`) and
the ring's depth (`stages`); DEFAULT_SCHEDULE names, per head_dim and causal, the combination that
measured fastest (PERFORMANCE.md, "The schedules measured" and the sections after it). Every
combination passed every fp64 test on an H100 and an H200.

* `warpgroups=3` (D = 64 only), FlashAttention-3's choice at D = 64: three consumer warpgroups,
  192 query rows a CTA. Each K/V tile brought into shared memory serves 192 rows instead of 128,
  and the turns go round-robin (0, 1, 2, 0, ...): a warpgroup's softmax hides behind the other two
  warpgroups' products instead of one. At D = 64 the exponentials of a block take about as long as
  the block's two products, which is why one warpgroup's products cannot cover them. Budget: 16
  warps, `setmaxnreg` 160 for the consumers (S 64 + O 32 + P 32) and 24 for the producer: 3 x 128
  x 160 + 128 x 24 = 64,512 registers (the kernel's own warpgroup, consumer 0, keeps what is
  left: 168); shared memory Q 24 KiB + 3 x 32 KiB = 120 KiB. At D = 128
  it does not fit: S + O + P alone are 160 registers, and Q 48 KiB + 3 x 64 KiB > 227 KiB.
* `overlap=True`, FlashAttention-3's intra-warpgroup overlap: iteration j queues S_j = Q K_j^T
  and O += P_{j-1} V_{j-1}, waits for S_j only (wgmma groups retire in issue order, so
  `warpgroup_mma_wait(1)` returns once S_j is done), runs the softmax of S_j while P_{j-1} V_{j-1}
  is still on the tensor cores, then waits for that product and rescales O. The softmax now also
  hides behind its own warpgroup's product. Cost: P_{j-1} stays in registers until its product
  retires, beside S_j and P_j: O 64 + S 64 + P 32 + P 32 = 192 of the 240 registers at D = 128;
  shared memory unchanged.
* `persistent=True` (2 warpgroups): one CTA per SM instead of one per tile; each CTA takes one
  tile of every round of 132, in a snake order that evens out causal work (`_snake_position`). The
  producer loads the next tile's Q (once both consumers' last S = Q K^T of the tile that used the
  buffer before has retired: `q_free`) and K/V blocks while the consumers finish the last tile;
  the ring's position and the turns run on across tiles. Every role loops over its tiles either
  way; without it the loop has a trip count of one, which the compiler removes. Against one CTA a
  tile (2 warpgroups, the overlap): +9 points of cuDNN at D = 64 non-causal, +13 causal with the
  snake, +2 to +5 at D = 128 causal (PERFORMANCE.md).
* `q_buffers=2` (persistent grid; not at D = 128 with 3 stages: no room): Q in two shared-memory
  buffers, so the producer loads the next tile's Q, and so its K and V, while the consumers still
  read this tile's, instead of after the tile's last S = Q K^T. +1.6 points of cuDNN at D = 64
  causal, +5 to +7 at D = 128 (H200).
* `tma_store=True` (with the overlap; on the persistent grid with two Q buffers): the epilogue
  writes O into the tile's own Q buffer and one TMA copy stores it (`_store_rows`), instead of
  every thread storing its pieces of the accumulator from registers; the buffer goes back to the
  producer a block into the next tile (`_release_staged_q`). +1 to +5 points of cuDNN (H200).
  At 3 warpgroups ptxas spills 416 bytes with it, and it still wins.
* `tile_plan=True` (persistent grid): each CTA's tiles come from a plan made once per shape on
  the host (`plan_tiles`: longest first within windows of heads whose K and V fit in half the L2,
  each tile to the CTA with the least work so far) instead of the snake. At (16, 16, 2048, 64)
  causal the busiest CTA visits 266 key blocks against the snake's 272 (mean 264). Measured on an
  H100: +5 points of cuDNN there (with the turns; without, under 1) and +3 to +6 at D = 128
  causal.
* `poly_exp2=n` (2, 4 or 8; 0, off, in every default): one exponential in every n by a
  polynomial on the FMA units instead of the multi-function unit, in inline PTX
  (`_exp2_poly_ptx`). FlashAttention-4 (Zadouri et al. 2026, arXiv 2603.05451) does this on
  Blackwell, whose tensor cores outgrew its exponential units; at D = 64 the same balance holds on
  Hopper (a block's exponentials take about as long as its products). Measured on an H100 it
  loses at every case and rate (PERFORMANCE.md): each exponential moved costs 9 instructions
  instead of one, and this kernel is short of instruction issue, not of exponentials. Degree 3,
  FlashAttention-4's choice, failed the log-sum-exp's float32 check; degree 4 passes.

Scope: the forward, head_dim 64 and 128, fp16 and bf16, causal (bottom-right aligned, as in
`reference.py`) or not, grouped-query attention, any lengths; q, k and v contiguous (B, H, N, D)
(a 2-D TMA descriptor over all rows). Rows of a tile past the end of a head read the next head's
rows (or zeros past the tensor): their scores are masked and their outputs never stored. Needs a
Triton whose `gl.warp_specialize` takes a list of (function, args) pairs, as 3.6 and later do.
"""

from __future__ import annotations

import functools
import struct

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from kernels import runtime
from kernels.flash_attention.triton_flash import LOG2E, check_inputs, output_buffers, softmax_scale

HEAD_DIMS = (64, 128)
WG_M = gl.constexpr(64)  # query rows per consumer warpgroup (one wgmma M)
BLOCK_N = 128  # keys per K/V tile
# By (head_dim, causal), the schedule a call gets unless it asks for another: whether the consumer
# warpgroups take turns on the tensor cores (ping-pong), the K/V ring's depth (3 stages of K and V
# at D = 128 are 192 KiB, plus Q 32 KiB: 224 of the 227 KiB a CTA may use), consumer warpgroups per
# CTA (3 fit only at D = 64), the intra-warpgroup overlap, one CTA per SM looping over tiles, the
# exponentials, Q's buffers, O's TMA copy, the host's tile plan. Each is the fastest schedule
# measured (PERFORMANCE.md, "The schedules measured" and the sections after it), and the whole
# table was run again on an H100 and an H200.
DEFAULT_SCHEDULE = {
    (64, False): {"pingpong": True, "stages": 2, "warpgroups": 3, "overlap": True,
                  "persistent": False, "poly_exp2": 0, "q_buffers": 1, "tma_store": True,
                  "tile_plan": False},
    (64, True): {"pingpong": True, "stages": 2, "warpgroups": 2, "overlap": True,
                 "persistent": True, "poly_exp2": 0, "q_buffers": 2, "tma_store": True,
                 "tile_plan": True},
    (128, False): {"pingpong": False, "stages": 2, "warpgroups": 2, "overlap": True,
                   "persistent": True, "poly_exp2": 0, "q_buffers": 2, "tma_store": True,
                   "tile_plan": False},
    (128, True): {"pingpong": False, "stages": 2, "warpgroups": 2, "overlap": True,
                  "persistent": True, "poly_exp2": 0, "q_buffers": 2, "tma_store": True,
                  "tile_plan": True},
}  # fmt: skip
# setmaxnreg budgets, registers per thread: the consumers hold S, P and O, the producer a few
# scalars. 2 consumers: 2 x 128 x 240 + 128 x 24 = 64,512; 3: 3 x 128 x 160 + 128 x 24 = 64,512.
CONSUMER_REGS = {2: 240, 3: 160}
PRODUCER_REGS = 24
SHARED_BYTES = 227 * 1024  # what one CTA may have on sm_90
GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}
# TMA global-to-shared copy: `async_load` in newer releases, `async_copy_global_to_shared` before.
tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
tma_store = tma.async_store if hasattr(tma, "async_store") else tma.async_copy_shared_to_global
# Where the decorator for functions evaluated at compile time lives differs between releases.
constexpr_function = getattr(gl, "constexpr_function", None) or gluon.constexpr_function


@constexpr_function
def accumulator_layout(width):
    """The wgmma accumulator layout of a 64 x width tile: the 4 warps of a warpgroup stacked along
    M; instruction shape m16 x n(width) x k16 (16-bit inputs)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                     instr_shape=[16, int(width), 16])  # fmt: skip


# A degree-4 polynomial for 2^f on f in [-0.5, 0.5], fitted for least largest relative error
# (2.7e-6 evaluated in float32), highest power first. Degree 3 (7.5e-5) is closer than P's own
# rounding to 16 bits, but not than the log-sum-exp's float32 check (2^-16 + 2^-20 relative).
EXP2_POLY = (0.009570098482072353, 0.055917855352163315, 0.240247443318367, 0.6931217908859253,
             0.9999992847442627)  # fmt: skip


def _ptx_float(value: float) -> str:
    """A float32 constant as PTX writes it exactly: 0f and its bits in hex."""
    return "0f%08X" % struct.unpack("<I", struct.pack("<f", value))[0]


def _exp2_poly_ptx(x: str, out: str) -> str:
    """PTX for one exponential on the FMA units, from register `x` into `out`: x = j + f with
    j = round(x) (adding 1.5 * 2^23 leaves j in the low bits of t), 2^f by EXP2_POLY, and j
    added into the exponent field. x is clamped at -126 first (max.NaN keeps a NaN a NaN), so a
    masked score (-inf) gives a tiny positive number, not a wrapped exponent: `_store_rows` tells
    a row that saw no key by its maximum, not by its sum."""
    highest, *rest = map(_ptx_float, EXP2_POLY)
    magic = _ptx_float(1.5 * 2**23)
    return "\n".join([
        "{", ".reg .f32 xc, t, j, f, p;", ".reg .b32 tb, pb;",
        f"max.NaN.f32 xc, {x}, {_ptx_float(-126.0)};",
        f"add.rn.f32 t, xc, {magic};", f"sub.rn.f32 j, t, {magic};", "sub.rn.f32 f, xc, j;",
        f"mov.f32 p, {highest};", *[f"fma.rn.f32 p, p, f, {c};" for c in rest],
        "mov.b32 tb, t;", "mov.b32 pb, p;", "shl.b32 tb, tb, 23;", "add.s32 pb, pb, tb;",
        f"mov.b32 {out}, pb;", "}"])  # fmt: skip


# inline_asm_elementwise's PTX for `pack` = n exponentials: n - 1 on the multi-function unit
# (`ex2.approx`), the last by the polynomial. Outputs are $0 .. $n-1, inputs $n .. $2n-1.
EXP2_ASM = {n: "\n".join([f"ex2.approx.ftz.f32 ${i}, ${n + i};" for i in range(n - 1)]
                         + [_exp2_poly_ptx(x=f"${2 * n - 1}", out=f"${n - 1}")])
            for n in (2, 4, 8)}  # fmt: skip


@constexpr_function
def exp2_asm(every):
    """EXP2_ASM[every], looked up while the kernel compiles."""
    return EXP2_ASM[int(every)]


@constexpr_function
def exp2_constraints(every):
    """Every operand a 32-bit float register: `every` outputs, then `every` inputs."""
    return ",".join(["=f"] * int(every) + ["f"] * int(every))


@gluon.jit
def _exp2(x, POLY_EXP2: gl.constexpr):
    """2^x elementwise; with POLY_EXP2 = n > 0, one element in every n by a polynomial on the FMA
    units instead of the multi-function unit (`exp2_asm`)."""
    if POLY_EXP2 == 0:
        return gl.exp2(x)
    else:
        return gl.inline_asm_elementwise(exp2_asm(POLY_EXP2), exp2_constraints(POLY_EXP2), [x],
                                         gl.float32, is_pure=True, pack=POLY_EXP2)  # fmt: skip


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_free, k_ready, v_ready,
              slot_free, tiles, CAUSAL: gl.constexpr, PERSISTENT: gl.constexpr):  # fmt: skip
    """One warp: for each of the CTA's tiles, Q (every consumer's rows), then K and V block by
    block into the ring. The ring's position (`it`, blocks loaded so far) runs on across tiles:
    with PERSISTENT, the next tile's first blocks load while the consumers finish the last one,
    and with two Q buffers its Q too."""
    Q_BUFFERS: gl.constexpr = q_ready.shape[0]
    NUM_WG: gl.constexpr = q_smem.shape[0] // Q_BUFFERS
    STAGES: gl.constexpr = k_smem.shape[0]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    it = 0
    done_tiles = 0
    for i in range(_tile_count(tiles, PERSISTENT)):
        t = _tile_id(i, tiles, PERSISTENT)
        q_row, kv_row, _, n_blocks, _ = _tile(t, tiles, NUM_WG * WG_M, BLOCK_N, CAUSAL)
        # Q's buffer is free once every consumer's last S = Q K^T of the tile that used it before
        # (the previous one, or with two buffers the one before that) retired: q_free. A fresh
        # barrier counts as released for parity 1, so the first tile (or two) goes on.
        buf = done_tiles % Q_BUFFERS
        mbarrier.wait(q_free.index(buf), ((done_tiles // Q_BUFFERS) & 1) ^ 1)
        mbarrier.expect(q_ready.index(buf), NUM_WG * q_desc.block_type.nbytes)
        for wg in gl.static_range(NUM_WG):
            tma_load(q_desc, [q_row + wg * WG_M, 0], q_ready.index(buf),
                     q_smem.index(buf * NUM_WG + wg))  # fmt: skip
        for j in range(n_blocks):
            slot = it % STAGES
            # Wait until every consumer released this slot's K (its previous use, STAGES blocks
            # ago; slot_free[slot]) and, before V, its V (slot_free[STAGES + slot]).
            free_phase = ((it // STAGES) & 1) ^ 1
            mbarrier.wait(slot_free.index(slot), free_phase)
            mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
            tma_load(k_desc, [kv_row + j * BLOCK_N, 0], k_ready.index(slot), k_smem.index(slot))
            mbarrier.wait(slot_free.index(STAGES + slot), free_phase)
            mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
            tma_load(v_desc, [kv_row + j * BLOCK_N, 0], v_ready.index(slot), v_smem.index(slot))
            it += 1
        done_tiles += 1


@gluon.jit
def _tile_count(tiles, PERSISTENT: gl.constexpr):
    """How many tiles this CTA takes. PERSISTENT = 2: as many as the host's plan gives it
    (`plan_tiles`; the plan's first num_programs + 1 entries are where each CTA's tiles start).
    PERSISTENT = 1: one per round of num_programs tiles, plus one of the last, partial round if its
    position there (`_snake_position`) falls inside it. 0 (one CTA a tile): the one tile
    program_id (a constant trip count of one, so the compiler drops the loop around the tile)."""
    if PERSISTENT:
        if PERSISTENT == 2:
            plan = tiles[6]
            return gl.load(plan + gl.program_id(0) + 1) - gl.load(plan + gl.program_id(0))
        else:
            n_tiles = tiles[0]
            full_rounds = n_tiles // gl.num_programs(0)
            last = _snake_position(full_rounds) < n_tiles % gl.num_programs(0)
            return full_rounds + last.to(gl.int32)
    else:
        return 1


@gluon.jit
def _tile_id(i, tiles, PERSISTENT: gl.constexpr):
    """The CTA's i-th tile: the plan's (PERSISTENT = 2); round i hands out tiles i * num_programs
    onwards, this CTA the one at its `_snake_position` (1); tile program_id (0)."""
    if PERSISTENT:
        if PERSISTENT == 2:
            plan = tiles[6]
            first = gl.load(plan + gl.program_id(0))
            return gl.load(plan + gl.num_programs(0) + 1 + first + i)
        else:
            return i * gl.num_programs(0) + _snake_position(i)
    else:
        return gl.program_id(0)


@gluon.jit
def _snake_position(round):
    """Where this CTA's tile lies within a round of num_programs tiles: program_id, and every
    other round counted backwards (a snake). With causal masking a tile's work grows with its
    query block, and a CTA's tiles in consecutive rounds then pair a long one with a short one.
    Plain round robin (tile c + i * num_programs) gives a CTA the same few query blocks round
    after round: at (16, 16, 2048, 64) causal on 132 CTAs the busiest CTA visits 320 key blocks,
    21% above the mean (264); in the snake, 272 (3%)."""
    position = gl.program_id(0)
    if round % 2 == 1:
        position = gl.num_programs(0) - 1 - gl.program_id(0)
    return position


@gluon.jit
def _tile(t, tiles, CTA_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """Tile t (query block fastest, then batch x head): its first Q and K/V rows in the flattened
    (B * H * N, D) views, its first query m0, the key blocks it visits (n_blocks), and the causal
    diagonal (query i sees keys j <= i + diagonal). `tiles`: (tiles, query blocks a head, heads,
    query heads per KV head, Nq, Nk)."""
    n_m, n_heads, group, n_q, n_k = tiles[1], tiles[2], tiles[3], tiles[4], tiles[5]
    pid_m = t % n_m
    if CAUSAL:  # the last query blocks see the most keys: start them first
        pid_m = n_m - 1 - pid_m
    bh = t // n_m
    kv_bh = (bh // n_heads) * (n_heads // group) + (bh % n_heads) // group
    m0 = pid_m * CTA_M
    if CAUSAL:
        diagonal = n_k - n_q  # bottom-right aligned: query i sees keys j <= i + Nk - Nq
        hi = gl.minimum(n_k, gl.maximum(0, m0 + CTA_M + diagonal))
    else:
        diagonal = n_k
        hi = n_k
    return bh * n_q + m0, kv_bh * n_k, m0, gl.cdiv(hi, BLOCK_N), diagonal


@gluon.jit
def _row_bounds(first_row, diagonal, n_k, BLOCK_N: gl.constexpr, row_layout: gl.constexpr):
    """For one warpgroup's WG_M query rows from `first_row` (query index in the head): the last key
    each row sees, the diagonal and the end of the keys in one bound (a masked block then costs one
    comparison a score), and how many key blocks every one of these rows sees whole (counted from
    this warpgroup's first row, not the tile's: a lower warpgroup masks fewer blocks)."""
    rows = first_row + gl.arange(0, WG_M, layout=row_layout)
    last_key = gl.minimum(rows + diagonal, n_k - 1)
    unmasked_blocks = gl.maximum(0, gl.minimum(n_k, first_row + diagonal + 1)) // BLOCK_N
    return last_key, unmasked_blocks


@gluon.jit
def _store_rows(WG: gl.constexpr, acc, m_i, l_i, out_ptr, lse_ptr, q_row, m0, n_q, o_desc, staging,
                TMA_STORE: gl.constexpr):  # fmt: skip
    """The epilogue of one warpgroup: normalize O, store the rows that exist and their log-sum-exp
    (natural log); a row that saw no key gets 0 and lse -inf. With TMA_STORE, a warpgroup whose
    64 rows all exist writes O into `staging` (its Q buffer: every S of the tile has retired) and
    one TMA copy stores it, so the warpgroup goes on while the copy runs; `_release_staged_q` waits
    for the copy before the buffer takes a later tile's Q. A copy of rows past the end of a head
    would write into the next head's rows: those warpgroups store with a mask."""
    o_layout: gl.constexpr = acc.type.layout
    row_layout: gl.constexpr = m_i.type.layout
    seen = m_i > float("-inf")  # not l_i > 0: a polynomial exponential of -inf is tiny, not 0
    l_safe = gl.where(seen, l_i, 1.0)
    lse = gl.where(seen, (m_i + gl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    wg_rows = gl.arange(0, WG_M, layout=row_layout)
    gl.store(lse_ptr + (q_row + WG * WG_M) + wg_rows, lse, mask=m0 + WG * WG_M + wg_rows < n_q)
    inverse = gl.where(seen, 1.0 / l_safe, 0.0)  # a row that saw no key stores exact zeros
    out = acc * gl.expand_dims(gl.convert_layout(inverse, gl.SliceLayout(1, o_layout)), 1)
    out = out.to(out_ptr.dtype.element_ty)
    if TMA_STORE and m0 + WG * WG_M + WG_M <= n_q:
        staging.store(out)
        fence_async_shared()  # the threads' shared-memory writes, before the copy reads them
        tma_store(o_desc, [q_row + WG * WG_M, 0], staging)
    else:
        _store_rows_masked(WG, out, out_ptr, q_row, m0, n_q)


@gluon.jit
def _store_rows_masked(WG: gl.constexpr, out, out_ptr, q_row, m0, n_q):
    """O's rows of one warpgroup that exist, stored from registers."""
    o_layout: gl.constexpr = out.type.layout
    HEAD_DIM: gl.constexpr = out.shape[1]
    o_rows = gl.arange(0, WG_M, layout=gl.SliceLayout(1, o_layout))
    o_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    offsets = (gl.expand_dims((q_row + WG * WG_M + o_rows).to(gl.int64), 1) * HEAD_DIM
               + gl.expand_dims(o_cols, 0))  # fmt: skip
    row_ok = gl.expand_dims(m0 + WG * WG_M + o_rows < n_q, 1)
    gl.store(out_ptr + offsets, out, mask=row_ok & gl.expand_dims(o_cols < HEAD_DIM, 0))


@gluon.jit
def _release_staged_q(q_free, done_tiles, Q_BUFFERS: gl.constexpr):
    """With TMA_STORE, the previous tile's Q buffer holds its O until the TMA copy has read it:
    wait for that (by now long done), then let the producer load a later tile's Q there."""
    if done_tiles > 0:
        tma.store_wait(0)
        mbarrier.arrive(q_free.index((done_tiles - 1) % Q_BUFFERS), count=1)


@gluon.jit
def _consumer(WG: gl.constexpr, q_smem, k_smem, v_smem, q_ready, q_free, k_ready, v_ready,
              slot_free, out_ptr, lse_ptr, qk_scale, tiles, CAUSAL: gl.constexpr,
              PERSISTENT: gl.constexpr, POLY_EXP2: gl.constexpr):  # fmt: skip
    """One warpgroup, 64 query rows of each of the CTA's tiles: the FlashAttention-2 loop with
    wgmma, fed by the producer."""
    Q_BUFFERS: gl.constexpr = q_ready.shape[0]
    NUM_WG: gl.constexpr = q_smem.shape[0] // Q_BUFFERS
    dtype: gl.constexpr = q_smem.dtype
    STAGES: gl.constexpr = k_smem.shape[0]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    HEAD_DIM: gl.constexpr = k_smem.shape[2]
    s_layout: gl.constexpr = accumulator_layout(BLOCK_N)  # S: 64 x BLOCK_N
    o_layout: gl.constexpr = accumulator_layout(HEAD_DIM)  # O: 64 x D
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    zero_s = gl.zeros([WG_M, BLOCK_N], gl.float32, layout=s_layout)
    n_q, n_k = tiles[4], tiles[5]

    it = 0  # K/V blocks consumed so far, over all tiles: the ring's position, as the producer's
    done_tiles = 0
    for i in range(_tile_count(tiles, PERSISTENT)):
        t = _tile_id(i, tiles, PERSISTENT)
        q_row, _, m0, n_blocks, diagonal = _tile(t, tiles, NUM_WG * WG_M, BLOCK_N, CAUSAL)
        last_key, unmasked_blocks = _row_bounds(m0 + WG * WG_M, diagonal, n_k, BLOCK_N,
                                                row_layout)  # fmt: skip
        m_i = gl.full([WG_M], float("-inf"), gl.float32, layout=row_layout)
        l_i = gl.zeros([WG_M], gl.float32, layout=row_layout)
        acc = gl.zeros([WG_M, HEAD_DIM], gl.float32, layout=o_layout)
        buf = done_tiles % Q_BUFFERS
        q = q_smem.index(buf * NUM_WG + WG)
        mbarrier.wait(q_ready.index(buf), (done_tiles // Q_BUFFERS) & 1)
        for j in range(n_blocks):
            slot = (it + j) % STAGES
            phase = ((it + j) // STAGES) & 1
            mbarrier.wait(k_ready.index(slot), phase)
            s = warpgroup_mma(q, k_smem.index(slot).permute((1, 0)), zero_s, use_acc=False,
                              is_async=True)  # fmt: skip
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            mbarrier.arrive(slot_free.index(slot), count=1)  # K consumed
            p_op, m_i, l_i, alpha = _softmax_step(s, j, m_i, l_i, last_key, qk_scale,
                                                  unmasked_blocks, dtype, p_layout,
                                                  o_layout, POLY_EXP2)  # fmt: skip
            acc = acc * gl.expand_dims(alpha, 1)
            mbarrier.wait(v_ready.index(slot), phase)
            acc = warpgroup_mma(p_op, v_smem.index(slot), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(slot_free.index(STAGES + slot), count=1)  # V consumed
        mbarrier.arrive(q_free.index(buf), count=1)  # every S of this tile retired
        _store_rows(WG, acc, m_i, l_i, out_ptr, lse_ptr, q_row, m0, n_q, None, None, False)
        it += n_blocks
        done_tiles += 1


@gluon.jit
def _softmax_step(s, j, m_i, l_i, last_key, qk_scale, unmasked_blocks, dtype: gl.constexpr,
                  p_layout: gl.constexpr, o_layout: gl.constexpr,
                  POLY_EXP2: gl.constexpr):  # fmt: skip
    """The online softmax of key block j's scores s: the mask (past each row's `last_key`: the
    diagonal, the end of the keys), the new row maximum m_new, P (as the next product's register
    operand), the running sum, and alpha (in O's row layout), the factor that moves O from the old
    maximum to m_new. O itself is not touched: the caller rescales it once O's previous product has
    retired."""
    BLOCK_N: gl.constexpr = s.shape[1]
    if j >= unmasked_blocks:  # a block some row does not see whole
        # The key indices are made here, from j, not once before the loop: hoisted, they are 32
        # more registers a thread for the whole loop (they made 3 warpgroups spill at 160).
        cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s.type.layout))
        keep = gl.expand_dims(cols, 0) <= gl.expand_dims(last_key, 1)
        s = gl.where(keep, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
    m_shift = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row that saw no key yet
    p = _exp2(s * qk_scale - gl.expand_dims(m_shift, 1), POLY_EXP2)
    alpha = gl.exp2(m_i - m_shift)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    p_op = gl.convert_layout(p.to(dtype), p_layout)  # P stays in registers: wgmma's A operand
    return p_op, m_new, l_i, gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))


@gluon.jit
def _consumer_pingpong(WG: gl.constexpr, q_smem, k_smem, v_smem, q_ready, q_free, k_ready,
                       v_ready, slot_free, turn, out_ptr, o_desc, lse_ptr, qk_scale, tiles,
                       CAUSAL: gl.constexpr, PERSISTENT: gl.constexpr, PINGPONG: gl.constexpr,
                       OVERLAP: gl.constexpr, POLY_EXP2: gl.constexpr,
                       TMA_STORE: gl.constexpr):  # fmt: skip
    """The same warpgroup loop in FlashAttention-3's order: iteration j queues this warpgroup's
    two matrix products, S_j = Q K_j^T and O += P_{j-1} V_{j-1}, then runs the softmax of S_j.

    PINGPONG (on by default at D = 64): before queueing, wait for this warpgroup's turn; after, pass
    the turn to the next warpgroup (round-robin over the `turn` barriers: 0, 1, 0, ... with two
    warpgroups, 0, 1, 2, 0, ... with three). The warpgroups' products then alternate on the tensor
    cores instead of colliding, and each softmax hides behind the others' products.
    OVERLAP (on in every default schedule): wait for S_j alone and run its softmax while
    P_{j-1} V_{j-1} still runs; rescale O after that product retires. Without it, both products
    are waited for first.
    TMA_STORE: the epilogue stores O by a TMA copy from the tile's Q buffer (`_store_rows`); the
    buffer is released once the copy has read it, after the next tile's first block."""
    Q_BUFFERS: gl.constexpr = q_ready.shape[0]
    NUM_WG: gl.constexpr = q_smem.shape[0] // Q_BUFFERS
    NEXT: gl.constexpr = (WG + 1) % NUM_WG  # the warpgroup whose turn follows this one's
    # Turn parity: warpgroup 0 goes first (a fresh barrier passes parity 1): its j-th wait is for
    # the j-th pass from the last warpgroup; warpgroup w > 0 waits for the (j+1)-th pass from w-1.
    # Each warpgroup passes the turn on to NEXT.
    FIRST: gl.constexpr = 1 if WG == 0 else 0
    dtype: gl.constexpr = q_smem.dtype
    STAGES: gl.constexpr = k_smem.shape[0]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    HEAD_DIM: gl.constexpr = k_smem.shape[2]
    s_layout: gl.constexpr = accumulator_layout(BLOCK_N)
    o_layout: gl.constexpr = accumulator_layout(HEAD_DIM)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)

    zero_s = gl.zeros([WG_M, BLOCK_N], gl.float32, layout=s_layout)
    n_q, n_k = tiles[4], tiles[5]

    # Over all tiles: K/V blocks consumed (the ring's position, as the producer's) and turns taken
    # (one per block, as every warpgroup's).
    it = 0
    done_tiles = 0
    for i in range(_tile_count(tiles, PERSISTENT)):
        t = _tile_id(i, tiles, PERSISTENT)
        q_row, _, m0, n_blocks, diagonal = _tile(t, tiles, NUM_WG * WG_M, BLOCK_N, CAUSAL)
        last_key, unmasked_blocks = _row_bounds(m0 + WG * WG_M, diagonal, n_k, BLOCK_N,
                                                row_layout)  # fmt: skip
        m_i = gl.full([WG_M], float("-inf"), gl.float32, layout=row_layout)
        l_i = gl.zeros([WG_M], gl.float32, layout=row_layout)
        acc = gl.zeros([WG_M, HEAD_DIM], gl.float32, layout=o_layout)
        p_op = gl.zeros([WG_M, BLOCK_N], dtype, layout=p_layout)  # P of the previous block
        buf = done_tiles % Q_BUFFERS
        q = q_smem.index(buf * NUM_WG + WG)
        mbarrier.wait(q_ready.index(buf), (done_tiles // Q_BUFFERS) & 1)
        if n_blocks > 0:  # block 0 has only its S = Q K^T: there is no P V yet
            slot = it % STAGES
            if PINGPONG:
                mbarrier.wait(turn.index(WG), (it + FIRST) & 1)
            mbarrier.wait(k_ready.index(slot), (it // STAGES) & 1)
            s = warpgroup_mma(q, k_smem.index(slot).permute((1, 0)), zero_s, use_acc=False,
                              is_async=True)  # fmt: skip
            if PINGPONG:
                mbarrier.arrive(turn.index(NEXT), count=1)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            mbarrier.arrive(slot_free.index(slot), count=1)  # K_0 consumed
            # O is still zero: block 0's alpha has nothing to rescale.
            p_op, m_i, l_i, alpha = _softmax_step(s, 0, m_i, l_i, last_key, qk_scale,
                                                  unmasked_blocks, dtype, p_layout,
                                                  o_layout, POLY_EXP2)  # fmt: skip
        if TMA_STORE:  # block 0 took long enough for the last tile's copy to have read its O
            _release_staged_q(q_free, done_tiles, Q_BUFFERS)
        for j in range(1, n_blocks):
            slot = (it + j) % STAGES
            prev = (it + j - 1) % STAGES
            if PINGPONG:
                mbarrier.wait(turn.index(WG), (it + j + FIRST) & 1)
            mbarrier.wait(k_ready.index(slot), ((it + j) // STAGES) & 1)
            s = warpgroup_mma(q, k_smem.index(slot).permute((1, 0)), zero_s, use_acc=False,
                              is_async=True)  # fmt: skip
            mbarrier.wait(v_ready.index(prev), ((it + j - 1) // STAGES) & 1)
            acc = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
            # Both products are queued on the tensor cores: the next warpgroup may queue its own
            # (they run after these), while this one waits for its S and runs the softmax.
            if PINGPONG:
                mbarrier.arrive(turn.index(NEXT), count=1)
            if OVERLAP:
                # wgmma groups retire in issue order: one left outstanding is P_{j-1} V_{j-1}.
                s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
                mbarrier.arrive(slot_free.index(slot), count=1)  # K_j consumed
                p_new, m_i, l_i, alpha = _softmax_step(s, j, m_i, l_i, last_key, qk_scale,
                                                       unmasked_blocks, dtype,
                                                       p_layout, o_layout,
                                                       POLY_EXP2)  # fmt: skip
                # P_{j-1} is the running product's register operand: naming it in `deps` keeps
                # its registers from being reused (by P_j, say) until the product has retired.
                acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_op))
                mbarrier.arrive(slot_free.index(STAGES + prev), count=1)  # V_{j-1} consumed
                acc = acc * gl.expand_dims(alpha, 1)
                p_op = p_new
            else:
                s, acc = warpgroup_mma_wait(num_outstanding=0, deps=(s, acc))
                mbarrier.arrive(slot_free.index(slot), count=1)  # K_j consumed
                mbarrier.arrive(slot_free.index(STAGES + prev), count=1)  # V_{j-1} consumed
                p_op, m_i, l_i, alpha = _softmax_step(s, j, m_i, l_i, last_key, qk_scale,
                                                      unmasked_blocks, dtype, p_layout,
                                                      o_layout, POLY_EXP2)  # fmt: skip
                acc = acc * gl.expand_dims(alpha, 1)
        if not TMA_STORE:  # every S retired: the producer may load a later tile's Q into the buffer
            mbarrier.arrive(q_free.index(buf), count=1)
        if n_blocks > 0:  # the last block's P V
            last = (it + n_blocks - 1) % STAGES
            mbarrier.wait(v_ready.index(last), ((it + n_blocks - 1) // STAGES) & 1)
            acc = warpgroup_mma(p_op, v_smem.index(last), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(slot_free.index(STAGES + last), count=1)  # V consumed
        _store_rows(WG, acc, m_i, l_i, out_ptr, lse_ptr, q_row, m0, n_q, o_desc, q, TMA_STORE)
        it += n_blocks
        done_tiles += 1
    if TMA_STORE:  # the last copy must have read shared memory before the CTA exits
        tma.store_wait(0)


# warp_specialize runs one function per partition; these fix the warpgroup index of each.
@gluon.jit
def _pingpong_0(args, CAUSAL: gl.constexpr, PERSISTENT: gl.constexpr, PINGPONG: gl.constexpr,
                OVERLAP: gl.constexpr, POLY_EXP2: gl.constexpr,
                TMA_STORE: gl.constexpr):  # fmt: skip
    _consumer_pingpong(0, *args, CAUSAL, PERSISTENT, PINGPONG, OVERLAP, POLY_EXP2, TMA_STORE)


@gluon.jit
def _pingpong_1(args, CAUSAL: gl.constexpr, PERSISTENT: gl.constexpr, PINGPONG: gl.constexpr,
                OVERLAP: gl.constexpr, POLY_EXP2: gl.constexpr,
                TMA_STORE: gl.constexpr):  # fmt: skip
    _consumer_pingpong(1, *args, CAUSAL, PERSISTENT, PINGPONG, OVERLAP, POLY_EXP2, TMA_STORE)


@gluon.jit
def _pingpong_2(args, CAUSAL: gl.constexpr, PERSISTENT: gl.constexpr, PINGPONG: gl.constexpr,
                OVERLAP: gl.constexpr, POLY_EXP2: gl.constexpr,
                TMA_STORE: gl.constexpr):  # fmt: skip
    _consumer_pingpong(2, *args, CAUSAL, PERSISTENT, PINGPONG, OVERLAP, POLY_EXP2, TMA_STORE)


@gluon.jit
def _consumer_0(args, CAUSAL: gl.constexpr, PERSISTENT: gl.constexpr,
                POLY_EXP2: gl.constexpr):  # fmt: skip
    _consumer(0, *args, CAUSAL, PERSISTENT, POLY_EXP2)


@gluon.jit
def _consumer_1(args, CAUSAL: gl.constexpr, PERSISTENT: gl.constexpr,
                POLY_EXP2: gl.constexpr):  # fmt: skip
    _consumer(1, *args, CAUSAL, PERSISTENT, POLY_EXP2)


@gluon.jit
def _consumer_2(args, CAUSAL: gl.constexpr, PERSISTENT: gl.constexpr,
                POLY_EXP2: gl.constexpr):  # fmt: skip
    _consumer(2, *args, CAUSAL, PERSISTENT, POLY_EXP2)


# The sizes are not specialized on (Triton would compile again for every length divisible by 16
# or equal to 1): they only enter address arithmetic, TMA coordinates and masks.
@gluon.jit(do_not_specialize=["n_tiles", "n_m", "n_heads", "group", "n_q", "n_k"])
def gluon_fwd_kernel(q_desc, k_desc, v_desc, out_ptr, o_desc, lse_ptr, plan_ptr, n_tiles, n_m,
                     n_heads, group, n_q, n_k, qk_scale, CAUSAL: gl.constexpr, STAGES: gl.constexpr,
                     PINGPONG: gl.constexpr, NUM_WG: gl.constexpr, OVERLAP: gl.constexpr,
                     PERSISTENT: gl.constexpr, POLY_EXP2: gl.constexpr, Q_BUFFERS: gl.constexpr,
                     TMA_STORE: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                     PRODUCER_REGS: gl.constexpr):  # fmt: skip
    """Tiles of NUM_WG x 64 query rows of one head; the CTA takes tile program_id, or with one
    CTA per SM (persistent) one tile of every round of num_programs tiles (`_tile_id`), and then
    the producer loads the next tile's first K and V blocks while the consumers finish a tile."""
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    tiles = (n_tiles, n_m, n_heads, group, n_q, n_k, plan_ptr)

    # Q buffer b of warpgroup w is q_smem[b * NUM_WG + w], guarded by q_ready[b] and q_free[b].
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [Q_BUFFERS * NUM_WG, WG_M, HEAD_DIM],
                                       q_desc.layout)  # fmt: skip
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [Q_BUFFERS, 1], mbarrier.MBarrierLayout())
    q_free = gl.allocate_shared_memory(gl.int64, [Q_BUFFERS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    # slot_free[s]: K of slot s consumed; slot_free[STAGES + s]: V of slot s consumed.
    slot_free = gl.allocate_shared_memory(gl.int64, [2 * STAGES, 1], mbarrier.MBarrierLayout())
    for b in gl.static_range(Q_BUFFERS):
        mbarrier.init(q_ready.index(b), count=1)
        mbarrier.init(q_free.index(b), count=NUM_WG)  # every consumer is done with this Q
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(slot_free.index(i), count=NUM_WG)  # every consumer releases each K and V
        mbarrier.init(slot_free.index(STAGES + i), count=NUM_WG)

    # The kernel's own 4 warps run consumer 0; each further warpgroup a consumer; one warp loads.
    # The flags go as arguments of their own: a constexpr inside a tuple (`args`, `tiles`) would
    # reach the partition as a runtime value.
    producer_args = (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_free, k_ready,
                     v_ready, slot_free, tiles, CAUSAL, PERSISTENT)  # fmt: skip
    if PINGPONG or OVERLAP:
        turn = gl.allocate_shared_memory(gl.int64, [NUM_WG, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NUM_WG):
            mbarrier.init(turn.index(i), count=1)
        args = (q_smem, k_smem, v_smem, q_ready, q_free, k_ready, v_ready, slot_free, turn,
                out_ptr, o_desc, lse_ptr, qk_scale, tiles)  # fmt: skip
        if NUM_WG == 2:
            gl.warp_specialize(
                [(_pingpong_0, (args, CAUSAL, PERSISTENT, PINGPONG, OVERLAP, POLY_EXP2,
                               TMA_STORE)),
                 (_pingpong_1, (args, CAUSAL, PERSISTENT, PINGPONG, OVERLAP, POLY_EXP2,
                               TMA_STORE)),
                 (_producer, producer_args)], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])  # fmt: skip
        else:
            gl.warp_specialize(
                [(_pingpong_0, (args, CAUSAL, PERSISTENT, PINGPONG, OVERLAP, POLY_EXP2,
                               TMA_STORE)),
                 (_pingpong_1, (args, CAUSAL, PERSISTENT, PINGPONG, OVERLAP, POLY_EXP2,
                               TMA_STORE)),
                 (_pingpong_2, (args, CAUSAL, PERSISTENT, PINGPONG, OVERLAP, POLY_EXP2,
                               TMA_STORE)),
                 (_producer, producer_args)], [4, 4, 1],
                [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])  # fmt: skip
    else:
        args = (q_smem, k_smem, v_smem, q_ready, q_free, k_ready, v_ready, slot_free, out_ptr,
                lse_ptr, qk_scale, tiles)  # fmt: skip
        if NUM_WG == 2:
            gl.warp_specialize([(_consumer_0, (args, CAUSAL, PERSISTENT, POLY_EXP2)),
                                (_consumer_1, (args, CAUSAL, PERSISTENT, POLY_EXP2)),
                                (_producer, producer_args)], [4, 1],
                               [CONSUMER_REGS, PRODUCER_REGS])  # fmt: skip
        else:
            gl.warp_specialize([(_consumer_0, (args, CAUSAL, PERSISTENT, POLY_EXP2)),
                                (_consumer_1, (args, CAUSAL, PERSISTENT, POLY_EXP2)),
                                (_consumer_2, (args, CAUSAL, PERSISTENT, POLY_EXP2)),
                                (_producer, producer_args)], [4, 4, 1],
                               [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])  # fmt: skip


def tile_blocks(n_m: int, n_bh: int, n_q: int, n_k: int, cta_m: int, causal: bool) -> list[int]:
    """Key blocks each tile visits, in the kernel's numbering of tiles (`_tile`)."""
    blocks = []
    for t in range(n_m * n_bh):
        pid_m = n_m - 1 - t % n_m if causal else t % n_m
        hi = min(n_k, max(0, (pid_m + 1) * cta_m + n_k - n_q)) if causal else n_k
        blocks.append(-(-hi // BLOCK_N))
    return blocks


# Candidate windows of a plan, in heads: tiles go longest first within a window of this many
# heads, windows in order.
PLAN_WINDOWS = (1, 2, 4, 8, 16, 32)


def plan_tiles(n_m: int, n_bh: int, n_q: int, n_k: int, cta_m: int, causal: bool, ctas: int,
               max_window: int) -> tuple[list[list[int]], str]:  # fmt: skip
    """Which tiles each of `ctas` persistent CTAs runs, in order, and how the plan was made. A
    tile costs its key blocks plus one (its Q load, first block and epilogue, which do not scale
    with keys). Candidates: the snake (`_snake_position`'s order), and for each window in
    PLAN_WINDOWS up to `max_window` heads (as many as the L2 holds the K and V of: longest first
    over all heads lost more in L2 reuse than it won in balance, PERFORMANCE.md) the tiles
    longest first within windows of that many heads, each handed to the CTA with the least work
    so far (as a queue would, if every CTA ran at the same speed). The plan whose busiest CTA
    has the least work wins (the snake on a tie)."""
    import heapq

    cost = [b + 1 for b in tile_blocks(n_m, n_bh, n_q, n_k, cta_m, causal)]
    n_tiles = len(cost)
    snake = [[] for _ in range(ctas)]
    for t in range(n_tiles):
        round_, position = divmod(t, ctas)
        snake[ctas - 1 - position if round_ % 2 else position].append(t)
    best, best_load, how = snake, max(sum(cost[t] for t in tiles) for tiles in snake), "snake"
    for window in PLAN_WINDOWS:
        if window > min(n_bh, max_window) or (window > 1 and not causal):  # equal tiles: no gain
            break
        order = []
        for first in range(0, n_bh, window):
            heads = range(first, min(n_bh, first + window))
            order += sorted((t for h in heads for t in range(h * n_m, (h + 1) * n_m)),
                            key=lambda t: -cost[t])  # fmt: skip
        load = [(0, c) for c in range(ctas)]
        plan = [[] for _ in range(ctas)]
        for t in order:
            work, c = heapq.heappop(load)
            plan[c].append(t)
            heapq.heappush(load, (work + cost[t], c))
        busiest = max(work for work, _ in load)
        if busiest < best_load:
            best, best_load, how = plan, busiest, f"longest first in windows of {window} heads"
    return best, how


@functools.lru_cache(maxsize=32)
def _plan_on_device(n_m, n_bh, n_q, n_k, cta_m, causal, ctas, kv_head_bytes,
                    device) -> torch.Tensor:  # fmt: skip
    """`plan_tiles` as the kernel reads it: where each CTA's tiles start (ctas + 1 offsets), then
    the tiles, CTA by CTA; made once per shape. Windows hold at most half the L2 in K and V."""
    l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size
    max_window = max(1, l2_bytes // 2 // kv_head_bytes)
    plan, _ = plan_tiles(n_m, n_bh, n_q, n_k, cta_m, causal, ctas, max_window)
    starts = [0]
    for tiles in plan:
        starts.append(starts[-1] + len(tiles))
    flat = starts + [t for tiles in plan for t in tiles]
    return torch.tensor(flat, dtype=torch.int32, device=device)


@functools.cache
def _no_plan(device) -> torch.Tensor:
    return torch.zeros(1, dtype=torch.int32, device=device)


def resolve_schedule(head_dim: int, causal: bool, pingpong=None, stages=None, warpgroups=None,
                     overlap=None, persistent=None, poly_exp2=None, q_buffers=None,
                     tma_store=None, tile_plan=None) -> dict:  # fmt: skip
    """The kernel's schedule constexprs for one call, the defaults filled in (None: the
    DEFAULT_SCHEDULE of this head_dim and `causal`), checked: ValueError for a combination the
    kernel does not have."""
    default = DEFAULT_SCHEDULE[head_dim, bool(causal)]
    warpgroups = default["warpgroups"] if warpgroups is None else int(warpgroups)
    if warpgroups not in CONSUMER_REGS:
        raise ValueError(f"gluon_attention_forward: warpgroups {warpgroups}; supported: 2, 3")
    if warpgroups == 3 and head_dim != 64:
        raise ValueError("gluon_attention_forward: warpgroups=3 needs head_dim 64 (at 128, S, P and"
                         " O need 160 registers a thread, all that 3 consumers get)")  # fmt: skip
    if persistent is None:  # the default grid gives way to an explicit 3 warpgroups
        persistent = default["persistent"] and warpgroups == 2
    persistent = bool(persistent)
    if persistent and warpgroups == 3:
        raise ValueError("gluon_attention_forward: persistent=True needs 2 warpgroups (with 3, "
                         "the tile loop's state spills past 160 registers a thread)")  # fmt: skip
    stages = default["stages"] if stages is None else int(stages)
    if stages not in (2, 3):
        raise ValueError(f"gluon_attention_forward: stages {stages}; supported: 2, 3")
    poly_exp2 = default["poly_exp2"] if poly_exp2 is None else int(poly_exp2)
    if poly_exp2 not in (0, 2, 4, 8):
        raise ValueError(f"gluon_attention_forward: poly_exp2 {poly_exp2}; supported: 0 (every "
                         "exponential on the multi-function unit), 2, 4, 8")  # fmt: skip

    def shared_bytes(q_buffers):  # Q per buffer and warpgroup, K and V per stage
        return (q_buffers * warpgroups * WG_M.value + stages * 2 * BLOCK_N) * head_dim * 2

    if q_buffers is None:  # a default second buffer gives way to an explicit grid or ring
        q_buffers = default["q_buffers"]
        if not persistent or shared_bytes(q_buffers) > SHARED_BYTES:
            q_buffers = 1
    q_buffers = int(q_buffers)
    if q_buffers not in (1, 2):
        raise ValueError(f"gluon_attention_forward: q_buffers {q_buffers}; supported: 1, 2")
    if q_buffers == 2 and not persistent:
        raise ValueError("gluon_attention_forward: q_buffers=2 needs persistent=True (one CTA a "
                         "tile has no next tile's Q to load)")  # fmt: skip
    shared = shared_bytes(q_buffers)
    if shared > SHARED_BYTES:
        raise ValueError(f"gluon_attention_forward: {q_buffers} Q buffers and {stages} stages at "
                         f"head_dim {head_dim} need {shared // 1024} KiB of shared memory, more "
                         f"than the {SHARED_BYTES // 1024} KiB a CTA has")  # fmt: skip
    overlap = default["overlap"] if overlap is None else bool(overlap)
    # O's TMA copy is staged in the tile's Q buffer, released after the next tile's first block:
    # on the persistent grid that takes a second buffer (with one, the next tile's Q could never
    # load), and only the consumer with the overlap (`_consumer_pingpong`) has it.
    has_tma_store = overlap and (q_buffers == 2 or not persistent)
    if tma_store is None:  # a default TMA store gives way to an explicit schedule without it
        tma_store = default["tma_store"] and has_tma_store
    tma_store = bool(tma_store)
    if tma_store and not has_tma_store:
        raise ValueError("gluon_attention_forward: tma_store=True needs overlap=True, and on "
                         "the persistent grid q_buffers=2 (O is staged in the tile's Q "
                         "buffer)")  # fmt: skip
    if tile_plan is None:  # a default plan gives way to an explicit grid of one CTA a tile
        tile_plan = default["tile_plan"] and persistent
    if tile_plan and not persistent:
        raise ValueError("gluon_attention_forward: tile_plan=True needs persistent=True")
    # In the kernel's order of parameters: `compile_for_hopper` numbers the constexprs by it.
    return {"STAGES": stages,
            "PINGPONG": default["pingpong"] if pingpong is None else bool(pingpong),
            "NUM_WG": warpgroups,
            "OVERLAP": overlap, "PERSISTENT": 2 if tile_plan else int(persistent),
            "POLY_EXP2": poly_exp2,
            "Q_BUFFERS": q_buffers, "TMA_STORE": tma_store,
            "CONSUMER_REGS": CONSUMER_REGS[warpgroups], "PRODUCER_REGS": PRODUCER_REGS}  # fmt: skip


def row_descriptors(tensors, block_rows: int, head_dim: int, dtype) -> list:
    """TMA descriptors over all rows of each (B, H, N, D) tensor, viewed as (B * H * N, D): tiles
    of `block_rows` rows, in the default swizzled shared-memory layout for `dtype` (a Gluon
    dtype)."""
    layout = gl.NVMMASharedLayout.get_default_for([block_rows, head_dim], dtype)
    flat = (t.view(-1, head_dim) for t in tensors)
    return [TensorDescriptor(t, list(t.shape), list(t.stride()), [block_rows, head_dim], layout)
            for t in flat]  # fmt: skip


def check_tma_tensors(function: str, **tensors: torch.Tensor) -> None:
    """What the kernels' 2-D TMA descriptors over all rows need of each named tensor: contiguous
    (B, H, N, D), and its first byte on a 16-byte boundary. ValueError naming the function and the
    tensor, instead of failing inside the descriptor (a view that starts a few elements in, say)."""
    for name, t in tensors.items():
        if not t.is_contiguous():
            raise ValueError(f"{function}: {name} must be contiguous (B, H, N, D)")
        if t.data_ptr() % 16:
            raise ValueError(f"{function}: {name} must start on a 16-byte boundary for TMA "
                             f"(address {t.data_ptr():#x}); pass a fresh or .clone()d "
                             "tensor")  # fmt: skip


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def gluon_attention_forward(q, k, v, causal: bool = False, scale: float | None = None, *,
                            out=None, lse=None, pingpong: bool | None = None,
                            stages: int | None = None, warpgroups: int | None = None,
                            overlap: bool | None = None,
                            persistent: bool | None = None,
                            poly_exp2: int | None = None,
                            q_buffers: int | None = None,
                            tma_store: bool | None = None,
                            tile_plan: bool | None = None):  # fmt: skip
    """(out, lse) as `triton_flash.flash_attention_forward`, with the warp-specialized kernel.
    The schedule (None: DEFAULT_SCHEDULE for this head_dim and `causal`):
    `pingpong` orders the warpgroups' products by turns; `stages` is the depth of the K/V ring;
    `warpgroups` is 2 or 3 consumer warpgroups of 64 query rows (3 at head_dim 64 only);
    `overlap` runs each softmax beside the warpgroup's own previous P V product; `persistent`
    launches one CTA per SM, each looping over tiles, instead of one per tile (2 warpgroups only:
    a default persistent grid gives way to an explicit `warpgroups=3`); `poly_exp2` = n computes
    one exponential of every n on the FMA units by a polynomial instead of the multi-function
    unit (0: none); `q_buffers` = 2 (persistent grid only) gives Q two shared-memory buffers, so
    the producer loads the next tile's Q while the consumers still read this one's; `tma_store`
    stores O by a TMA copy from shared memory instead of from registers (needs the overlap, and
    on the persistent grid two Q buffers); `tile_plan` hands the persistent grid's tiles to CTAs
    by a plan made on the host (`plan_tiles`) instead of the snake."""
    # before anything compiles: for another architecture LLVM aborts the process
    runtime.require("wgmma", "gluon_attention_forward")
    check_inputs("gluon_attention_forward", q, k, v)
    head_dim = q.shape[-1]
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"gluon_attention_forward: head_dim {head_dim}; supported: 64, 128")
    check_tma_tensors("gluon_attention_forward", q=q, k=k, v=v)
    variant = resolve_schedule(head_dim, causal, pingpong, stages, warpgroups, overlap, persistent,
                               poly_exp2, q_buffers, tma_store, tile_plan)  # fmt: skip
    scale = softmax_scale(scale, head_dim)
    out, lse = output_buffers("gluon_attention_forward", q, out, lse)
    check_tma_tensors("gluon_attention_forward", out=out)
    batch, n_heads, n_q, _ = q.shape
    n_kv_heads, n_k = k.shape[1], k.shape[2]
    if out.numel() == 0:
        return out, lse
    dtype = GL_DTYPES[q.dtype]
    # O's rows leave as Q's came in: 64 rows a copy
    q_desc, o_desc = row_descriptors((q, out), WG_M.value, head_dim, dtype)
    k_desc, v_desc = row_descriptors((k, v), BLOCK_N, head_dim, dtype)
    n_m = triton.cdiv(n_q, variant["NUM_WG"] * WG_M.value)  # query tiles a head
    n_tiles = n_m * batch * n_heads
    ctas = min(n_tiles, _sm_count(q.device.index)) if variant["PERSISTENT"] else n_tiles
    if variant["PERSISTENT"] == 2:
        kv_head_bytes = 2 * n_k * head_dim * q.element_size()  # one head's K and V
        plan = _plan_on_device(n_m, batch * n_heads, n_q, n_k, variant["NUM_WG"] * WG_M.value,
                               bool(causal), ctas, kv_head_bytes, q.device)  # fmt: skip
    else:  # the kernel does not read it, but its type must be the plan's
        plan = _no_plan(q.device)
    gluon_fwd_kernel[(ctas,)](q_desc, k_desc, v_desc, out, o_desc, lse, plan, n_tiles, n_m, n_heads,
                              n_heads // n_kv_heads, n_q, n_k, scale * LOG2E,
                              CAUSAL=bool(causal), **variant, num_warps=4)  # fmt: skip
    return out, lse


def compile_for_hopper(head_dim: int = 128, dtype: torch.dtype = torch.float16,
                       causal: bool = False, **schedule):  # fmt: skip
    """The forward compiled for sm_90 without a GPU (the CPU test; `gluon_offline.compile_sm90`).
    `schedule`: pingpong, stages, warpgroups, overlap, persistent, poly_exp2, q_buffers,
    tma_store and tile_plan, as `gluon_attention_forward` takes them."""
    from kernels.flash_attention.gluon_offline import compile_sm90, descriptor_type

    variant = resolve_schedule(head_dim, causal, **schedule)
    rows = torch.empty((1, head_dim), dtype=dtype)
    q_desc, kv_desc = (row_descriptors((rows,), block, head_dim, GL_DTYPES[dtype])[0]
                       for block in (WG_M.value, BLOCK_N))  # fmt: skip
    element = {torch.float16: "*fp16", torch.bfloat16: "*bf16"}[dtype]
    q_type, kv_type = descriptor_type(q_desc), descriptor_type(kv_desc)
    signature = {"q_desc": q_type, "k_desc": kv_type, "v_desc": kv_type,
                 "out_ptr": element, "o_desc": q_type, "lse_ptr": "*fp32",
                 "plan_ptr": "*i32",
                 "n_tiles": "i32", "n_m": "i32", "n_heads": "i32", "group": "i32",
                 "n_q": "i32", "n_k": "i32", "qk_scale": "fp32", "CAUSAL": "constexpr",
                 **dict.fromkeys(variant, "constexpr")}  # fmt: skip
    return compile_sm90(gluon_fwd_kernel, signature, {"CAUSAL": causal, **variant})


def compile_offline(head_dim: int = 128, dtype: str = "float16", causal: bool = True,
                    **schedule) -> dict:  # fmt: skip
    """`compile_for_hopper` in a fresh process (a process running Triton's interpreter cannot
    compile Gluon): what the compiler emitted, counted in the PTX (warps, shared bytes, wgmma and
    TMA instructions, `setmaxnreg` instructions and the register counts they set,
    `register_budgets`), and from ptxas's report the registers a thread at launch and the bytes
    spilled to local memory."""
    from kernels.flash_attention.gluon_offline import compile_offline_many

    return compile_offline_many([(head_dim, dtype, causal, schedule)], __name__)[0]
