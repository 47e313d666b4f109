"""The decode step as one persistent Triton kernel: no kernel boundaries between the layers' GEMVs.

The CUDA graph (model.DecodeGraph) replays 117 to 166 kernels a step. Each one ramps up,
runs its last wave on a few SMs and ends before the next may start: while it does, the weights do
not stream. Here one launch of P programs (one per SM) runs the whole step. The programs walk the
schedule of persistent_schedule.py, phase by phase, and the only thing between two phases is a
counter in global memory:

* a program that has finished its units of a phase makes its writes visible to the whole GPU and
  adds 1 to the phase's counter (`tl.debug_barrier()`, then an atomic add with release semantics);
* a program that starts the next phase first asks the L2 to prefetch the weight rows of its first
  unit (weights do not depend on the activations: the memory system has work while the program
  waits), then spins on the counter until it holds P, and reads it once more with acquire
  semantics; inside a phase, each unit prefetches the next unit's rows, and each layer's qkv phase
  prefetches the keys and values the program's attention units will read (earlier steps wrote
  them);
* the spin gives up after `spin_limit` reads: the program writes the watchdog flag and the counter
  into a status word and goes on without waiting (a wrong count costs seconds, never a hang), and
  `PersistentStep.check()` raises with the counter's layer and phase. Every program still arrives on
  every counter, so the counts of the next step are right.

The last program to finish sets the counters back to zero, so the next launch (or a CUDA graph's
replay) starts clean. Activations written inside the step are read with `.cg` loads (L2, not the
SM's L1, which may hold a line from before another SM wrote it).

The GEMVs are those of triton_gemv.py turned around: a unit is a few rows of W and all of K, the x
operand (B rows) is loaded per tile of K, the product is a broadcast multiply on the CUDA cores for
up to four rows of x, tl.dot for more. The units that need an RMSNorm recompute it per program from
the residual stream (2048 values a row: cheaper than another phase). qkv's units pair rows j and j +
D/2 of a head, so RoPE and the cache append are the GEMV's epilogue; gate_up's pair a gate row with
its up row, so SwiGLU is.

Co-residency: every program must be running at once, or one spins on a counter that a program
not yet started would raise. The default is one program of 8 warps an SM; compiled for sm_90 it
takes 247 registers a thread (63,232 of the SM's 65,536) and 4 KB of shared memory, so one fits
and all are resident on an otherwise idle GPU (persistent_offline.py checks every configuration
the benchmark launches). The interpreter runs programs one after another: on the CPU the step
runs with P = 1 (tests), and P > 1 there times out at the first counter, which is what the
watchdog is for.

`pipelined_k` (off by default) runs the o, gate_up, down and lm_head phases as one loop a program
over its (unit, K tile) steps, the form of Triton's persistent matmul, with short K tiles that the
software pipeliner loads into shared memory (cp.async) a few steps ahead (_pipelined_units).
With `defer_reduce` as well (batch <= 4), a step only multiplies and adds into a register tile,
and the sum over K across the warps is made once a unit, not once a step. `pipelined_qkv` puts
the qkv phase in that loop too, with its RoPE and cache append as the unit's epilogue.
`attention_dot` computes the attention phase's q k^T and p v with tl.dot instead of broadcast
products summed across the warps (PERFORMANCE.md, section 6.5: built, not yet timed).

Measured on an H200 (PERFORMANCE.md, section 6): correct, and slower than the CUDA graph it set out
to beat (38.5% of the weight + KV floor at batch 1, context 512, against the graph's 61.0%). Its
clock trace says why: the counters cost 9% of the step, while the GEMV phases stream at 47% of the
copy rate, below the same GEMVs launched alone: one program an SM waits for each unit's loads
before it issues the next unit's. With `pipelined_k=1024, pipeline_stages=3, defer_reduce=True`
the step reaches 48.3% (1.211 ms against the graph's 0.944 in the same run; section 6.3), and
with `pipelined_qkv=True` too 50.7% (1.146 ms against the graph's 0.987; section 6.4): still
slower than the graph, held back by attention and the waits at the counters.
"""

from __future__ import annotations

from collections import namedtuple

import torch
import triton
import triton.language as tl

from kernels import runtime
from kernels.decoder import persistent_schedule as sched
from kernels.decoder.triton_ops import STATUS_TOKEN_OUT_OF_RANGE
from kernels.decoder.triton_rope import STATUS_POSITION_OUT_OF_RANGE

STATUS_WATCHDOG = 4  # the bit a program sets in status[0] when a counter never reached its count
# the same bits as constants the kernel can read
TOKEN_FLAG = tl.constexpr(STATUS_TOKEN_OUT_OF_RANGE)
POSITION_FLAG = tl.constexpr(STATUS_POSITION_OUT_OF_RANGE)
WATCHDOG_FLAG = tl.constexpr(STATUS_WATCHDOG)
LOG2E_C = tl.constexpr(1.4426950408889634)  # exp(x) = exp2(x log2(e))
# Compiled for a GPU (on one, or offline with KERNELS_COMPILE_ONLY=1), not interpreted: the GPU's
# choices of programs, tiles and prefetch apply
COMPILED = runtime.ON_GPU or runtime.COMPILE_ONLY
SPIN_LIMIT = 1 << 22 if COMPILED else 200  # counter reads before the watchdog gives up

# --------------------------------------------------------------------------------------------------
# The counters


@triton.jit
def _stamp(slot, ENABLE: tl.constexpr):
    """The GPU's nanosecond clock into `slot` (the trace of one step: where each program's phases
    began and ended)."""
    if ENABLE:
        tl.store(slot, tl.extra.cuda.globaltimer())


@triton.jit
def _wait(COUNTERS, STATUS, index, target, spin_limit, trace, TRACE: tl.constexpr):
    """Spin until COUNTERS[index] >= target, or spin_limit reads; a program that already gave up
    (the flag is set) does not wait again. The phase after counter `index` begins."""
    flags = tl.load(STATUS, volatile=True)
    limit = tl.where((flags & WATCHDOG_FLAG) != 0, 0, spin_limit)
    # Plain volatile reads while spinning (an atomic from every waiting program would queue at
    # the counter's L2 slice behind the arrivals), then one acquire read to order what follows.
    seen = tl.load(COUNTERS + index, volatile=True)
    spins = 0
    while (seen < target) & (spins < limit):
        seen = tl.load(COUNTERS + index, volatile=True)
        spins += 1
    seen = tl.atomic_add(COUNTERS + index, 0, sem="acquire", scope="gpu")
    if seen < target:
        tl.atomic_or(STATUS, WATCHDOG_FLAG)
        tl.atomic_cas(STATUS + 1, 0, index + 1)
    tl.debug_barrier()
    _stamp(trace + 2 * (index + 1), TRACE)


@triton.jit
def _arrive(COUNTERS, index, trace, TRACE: tl.constexpr):
    tl.debug_barrier()  # every thread's stores of this phase are issued before the release
    _stamp(trace + 2 * index + 1, TRACE)
    tl.atomic_add(COUNTERS + index, 1, sem="release", scope="gpu")


@triton.jit
def _prefetch_rows(W, rows, K, LINES: tl.constexpr, LINE: tl.constexpr, ENABLE: tl.constexpr):
    """Ask the L2 for the first LINES 128-byte lines of each row of W (no registers, no wait)."""
    if ENABLE:
        offs = tl.arange(0, LINES) * LINE
        ptrs = W + rows.to(tl.int64)[:, None] * K + tl.minimum(offs, K - 1)[None, :]
        tl.inline_asm_elementwise(
            "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;",
            "=r,l",
            [ptrs.to(tl.int64)],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )


@triton.jit
def _prefetch_keys(
    K_CACHE, V_CACHE, kv_base, start, end, D: tl.constexpr, LINE: tl.constexpr, ENABLE: tl.constexpr
):
    """Ask the L2 for keys [start, end) of one (sequence, KV head) of K and V: they were written by
    earlier steps, so they can move while the program still waits for this step's q."""
    if ENABLE:
        offs_t = tl.arange(0, 256)
        offs_l = tl.arange(0, (D + LINE - 1) // LINE) * LINE
        for t0 in range(start, end, 256):
            t = tl.minimum(t0 + offs_t, end - 1).to(tl.int64)
            offs = kv_base + t[:, None] * D + offs_l[None, :]
            for cache in tl.static_range(2):
                ptrs = (K_CACHE if cache == 0 else V_CACHE) + offs
                tl.inline_asm_elementwise(
                    "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;",
                    "=r,l",
                    [ptrs.to(tl.int64)],
                    dtype=tl.int32,
                    is_pure=False,
                    pack=1,
                )


@triton.jit
def _split(POSITIONS, u, splits, capacity, BLOCK_T: tl.constexpr, N_KV: tl.constexpr):
    """Attention unit u: (sequence, KV head, first key, end key) of its split."""
    s = u % splits
    kv = (u // splits) % N_KV
    bi = u // (splits * N_KV)
    n_keys = tl.minimum(tl.load(POSITIONS + bi) + 1, capacity)
    chunk = tl.cdiv(tl.cdiv(n_keys, splits), BLOCK_T) * BLOCK_T
    start = s * chunk
    return bi, kv, start, tl.minimum(start + chunk, n_keys)


# --------------------------------------------------------------------------------------------------
# The pieces of a phase


@triton.jit
def _inv_rms(x_rows, m_ok, K, eps, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """1 / sqrt(mean(x^2) + eps) of each row; x_rows (BLOCK_M,) pointers to the rows."""
    offs_k = tl.arange(0, BLOCK_K)
    total = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        ok = m_ok[:, None] & (k < K)[None, :]
        x = tl.load(x_rows[:, None] + k[None, :], mask=ok, other=0.0, cache_modifier=".cg")
        x = x.to(tl.float32)
        total += x * x
    return 1.0 / tl.sqrt(tl.sum(total, axis=1) / K + eps)


@triton.jit
def _tile_and_x(
    W, rows, row_ok, K, k0, x_rows, m_ok, rstd, NORM, HAS_NORM: tl.constexpr, BLOCK_K: tl.constexpr
):
    """(W[rows, k0:k0 + BLOCK_K], x[:, k0:k0 + BLOCK_K]) in W's dtype, zero past K, x the rows at
    x_rows, RMS-normalized (times rstd, rounded, times NORM, rounded: Hugging Face's order) when
    HAS_NORM."""
    k = k0 + tl.arange(0, BLOCK_K)
    k_ok = k < K
    w_ptrs = W + rows.to(tl.int64)[:, None] * K + k[None, :]
    w = tl.load(w_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
    x_ptrs = x_rows[:, None] + k[None, :]
    x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0, cache_modifier=".cg")
    if HAS_NORM:
        g = tl.load(NORM + k, mask=k_ok, other=0.0).to(tl.float32)
        x = (x.to(tl.float32) * rstd[:, None]).to(x.dtype).to(tl.float32) * g[None, :]
        x = x.to(w.dtype)
    return w, x


@triton.jit
def _products(x, w):
    """(BLOCK_M, rows, BLOCK_K) fp32: x[m, k] * w[r, k], the broadcast GEMV's terms, not summed."""
    return x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]


@triton.jit
def _mma(a, b, acc, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """acc + a @ b on the tensor cores: fp32 operands as IEEE fp32 (no TF32 rounding), and in
    fp32 in the interpreter, whose tl.dot is wrong on bf16 tiles."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    elif IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _tile_times_x(
    acc,
    W,
    rows,
    row_ok,
    K,
    k0,
    x_rows,
    m_ok,
    rstd,
    NORM,
    HAS_NORM: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):
    """acc (BLOCK_M, rows) fp32 + x[:, k0:k0 + BLOCK_K] @ W[rows, k0:k0 + BLOCK_K].T
    (_tile_and_x's tiles)."""
    w, x = _tile_and_x(W, rows, row_ok, K, k0, x_rows, m_ok, rstd, NORM, HAS_NORM, BLOCK_K)
    if USE_DOT:
        acc = _mma(x, tl.trans(w), acc, UPCAST, IEEE)
    else:
        acc += tl.sum(_products(x, w), axis=2)
    return acc


@triton.jit
def _rows_times_x(
    W,
    rows,
    row_ok,
    K,
    x_rows,
    m_ok,
    rstd,
    NORM,
    HAS_NORM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):
    """(BLOCK_M, ROWS) fp32: x @ W[rows].T over all of K (_tile_times_x, tile after tile)."""
    acc = tl.zeros((BLOCK_M, ROWS), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        acc = _tile_times_x(
            acc, W, rows, row_ok, K, k0, x_rows, m_ok, rstd, NORM, HAS_NORM, BLOCK_K, USE_DOT,
            UPCAST, IEEE,
        )  # fmt: skip
    return acc


@triton.jit
def _halves(acc, BLOCK_M: tl.constexpr, HALF: tl.constexpr):
    """The two row sets of a paired unit: acc (BLOCK_M, 2 HALF) -> two (BLOCK_M, HALF)."""
    return tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, HALF)), (0, 2, 1)))


@triton.jit
def _rotate(a, b, pos, INV_FREQ, j, rope_scale):
    """RoPE of the pairs (a, b) = (x[j], x[j + D/2]) at positions pos (BLOCK_M,), in fp32."""
    theta = pos.to(tl.float32)[:, None] * tl.load(INV_FREQ + j)[None, :]
    cos, sin = tl.cos(theta) * rope_scale, tl.sin(theta) * rope_scale
    return a * cos - b * sin, b * cos + a * sin


@triton.jit
def _qkv_rows(u, pair_j, pair_set, D: tl.constexpr, HALF: tl.constexpr):
    """qkv unit u: (its head, its first j, its rows): rows j0 .. j0 + HALF of the head's first
    half and the same rows of its second (RoPE's pairs j and j + D/2)."""
    PER_HEAD: tl.constexpr = D // 2 // HALF  # qkv units per head
    head = u // PER_HEAD
    j0 = (u % PER_HEAD) * HALF
    return head, j0, head * D + j0 + pair_j + pair_set * (D // 2)


# What qkv's epilogue needs: where a unit's rows go (q, the layer's cache slots of the sequences'
# positions), RoPE's frequencies, the sequences (BLOCK_M,) and their masks, and the heads' shape
# (constexprs)
QkvOut = namedtuple(
    "QkvOut",
    "q k_cache v_cache inv_freq offs_m positions q_ok pos_ok rope_scale layer cache_batch "
    "capacity n_heads n_kv head_dim",
)


@triton.jit
def _qkv_store(acc, head, j0, half_j, qkv_out, BLOCK_M: tl.constexpr, HALF: tl.constexpr):
    """qkv's epilogue: a unit's (BLOCK_M, 2 HALF) product rounded as F.linear rounds it, rotated
    (RoPE) for a query or key head, and stored: a query head's into Q, a key or value head's
    into the cache at each sequence's position (qkv_out, a QkvOut). The unit's pairs are
    columns j = j0 + half_j (half_j: 0 .. HALF - 1) and j + D/2 of the head."""
    Q, K_CACHE, V_CACHE, INV_FREQ, offs_m, positions, q_ok, pos_ok, rope_scale, layer, \
        cache_batch, capacity, N_HEADS, N_KV, D = qkv_out  # fmt: skip
    Q_W: tl.constexpr = N_HEADS * D
    dtype = Q.dtype.element_ty
    a, b = _halves(acc.to(dtype).to(tl.float32), BLOCK_M, HALF)
    j = j0 + half_j
    if head < N_HEADS:
        a, b = _rotate(a, b, positions, INV_FREQ, j, rope_scale)
        q_ptrs = Q + offs_m[:, None] * Q_W + head * D + j[None, :]
        tl.store(q_ptrs, a.to(dtype), mask=q_ok[:, None])
        tl.store(q_ptrs + D // 2, b.to(dtype), mask=q_ok[:, None])
    else:
        kv = (head - N_HEADS) % N_KV
        slot = (((layer * cache_batch + offs_m) * N_KV + kv) * capacity + positions) * D
        offs = slot.to(tl.int64)[:, None] + j[None, :]
        if head < N_HEADS + N_KV:
            a, b = _rotate(a, b, positions, INV_FREQ, j, rope_scale)
            tl.store(K_CACHE + offs, a.to(dtype), mask=pos_ok[:, None])
            tl.store(K_CACHE + offs + D // 2, b.to(dtype), mask=pos_ok[:, None])
        else:
            tl.store(V_CACHE + offs, a.to(dtype), mask=pos_ok[:, None])
            tl.store(V_CACHE + offs + D // 2, b.to(dtype), mask=pos_ok[:, None])


@triton.jit
def _swiglu_store(
    acc, H, cols, m_ok, INTER: tl.constexpr, BLOCK_M: tl.constexpr, HALF: tl.constexpr
):
    """gate_up's epilogue: silu(gate) * up of a paired unit's (BLOCK_M, 2 HALF) product into
    H[:, cols], each rounded as F.linear and F.silu round."""
    dtype = H.dtype.element_ty
    gate, up = _halves(acc.to(dtype).to(tl.float32), BLOCK_M, HALF)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)  # silu, rounded
    offs_m = tl.arange(0, BLOCK_M)
    h_ptrs = H + offs_m[:, None] * INTER + cols[None, :]
    tl.store(h_ptrs, (act * up).to(dtype), mask=m_ok[:, None] & (cols < INTER)[None, :])


@triton.jit
def _residual_store(acc, rows, r_ok, src_rows, src_ok, x_rows, m_ok):
    """o's and down's epilogue: x[:, rows] = src[:, rows] + acc, the product rounded to x's dtype
    first, as F.linear's output is."""
    dtype = x_rows.dtype.element_ty
    res = tl.load(
        src_rows[:, None] + rows[None, :],
        mask=src_ok[:, None] & r_ok[None, :],
        other=0.0,
        cache_modifier=".cg",
    )
    new = res.to(tl.float32) + acc.to(dtype).to(tl.float32)
    tl.store(x_rows[:, None] + rows[None, :], new.to(dtype), mask=m_ok[:, None] & r_ok[None, :])


@triton.jit
def _logits_and_best(acc, rows, r_ok, LOGITS, m_ok, vocab, best, best_idx, BLOCK_M: tl.constexpr):
    """lm_head's epilogue: a unit's logits stored, and (best, best_idx) of each sequence updated
    with them; a program's units come in increasing order, so a later equal logit keeps the
    smaller index."""
    logits = acc.to(LOGITS.dtype.element_ty)
    offs_m = tl.arange(0, BLOCK_M)
    tl.store(
        LOGITS + offs_m[:, None] * vocab + rows[None, :], logits, mask=m_ok[:, None] & r_ok[None, :]
    )
    value = tl.where(r_ok[None, :], logits.to(tl.float32), float("-inf"))
    tile_best = tl.max(value, axis=1)
    tile_idx = tl.min(tl.where(value == tile_best[:, None], rows[None, :], vocab), axis=1)
    take = tile_best > best
    return tl.where(take, tile_best, best), tl.where(take, tile_idx, best_idx)


# The epilogues of _pipelined_units
SWIGLU = tl.constexpr(0)
RESIDUAL = tl.constexpr(1)
ARGMAX = tl.constexpr(2)
ROPE = tl.constexpr(3)


@triton.jit
def _pipelined_units(
    W,
    K: tl.constexpr,
    N,
    x_rows,
    m_ok,
    rstd,
    NORM,
    HAS_NORM: tl.constexpr,
    OUT,
    src_rows,
    src_ok,
    pid,
    P,
    EPILOGUE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    DEFER_REDUCE: tl.constexpr,
    USE_DOT: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):
    """This program's units of a GEMV phase as one loop over its (unit, K tile) steps, the form of
    Triton's persistent matmul: the software pipeliner loads the next STAGES - 1 steps' tiles into
    shared memory (cp.async), across the units' boundaries, while this step's tile is reduced; the
    tiles waiting there hold no registers. The product is accumulated per unit and goes to the
    EPILOGUE after the unit's last K tile:

    * SWIGLU (gate_up): N outputs of H, a unit HALF gate rows and the same HALF up rows of W;
    * RESIDUAL (o, down): N outputs of x (OUT: x's rows), a unit 2 HALF rows, src the residual;
    * ARGMAX (lm_head): N = the vocabulary, a unit 2 HALF rows, the logits into OUT; returns
      the program's best logit of each sequence and its index (-inf and 0 for the others);
    * ROPE (qkv): N = the q, k and v rows, a unit HALF rows j of a head and its HALF rows
      j + D/2 (_qkv_rows), rotated and stored by _qkv_store; OUT is a QkvOut.

    DEFER_REDUCE (broadcast path only): a step adds its terms x * W into a (BLOCK_M, rows,
    BLOCK_K) fp32 register tile, and the sum over K, across the warps (shuffles, shared memory,
    barriers), is made once a unit before the epilogue instead of once a step.

    The copies of x's tiles are narrower than 16 bytes at small tiles, so they go through the
    SM's L1 (cp.async.ca), not around it as `.cg` loads do: what makes them see the other
    programs' writes is the acquire of the counter before the phase."""
    ROWS: tl.constexpr = 2 * HALF
    K_TILES: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
    PER_UNIT: tl.constexpr = HALF if EPILOGUE == SWIGLU else ROWS  # outputs a unit makes
    r = tl.arange(0, ROWS)
    n_units = tl.cdiv(N, PER_UNIT)
    best = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    best_idx = tl.zeros((BLOCK_M,), tl.int32)
    acc = tl.zeros((BLOCK_M, ROWS), dtype=tl.float32)
    if DEFER_REDUCE:  # this unit's terms so far, summed over K after its last tile
        terms = tl.zeros((BLOCK_M, ROWS, BLOCK_K), dtype=tl.float32)
    for step in tl.range(0, tl.cdiv(n_units - pid, P) * K_TILES, num_stages=STAGES):
        u = pid + (step // K_TILES) * P
        k_tile = step % K_TILES
        if EPILOGUE == SWIGLU:  # rows j of gate (the first N rows of W) and j of up (the next N)
            out = u * HALF + r % HALF
            rows = tl.minimum(out, N - 1) + (r // HALF) * N
        elif EPILOGUE == ROPE:  # every unit is whole: D / 2 is a multiple of HALF
            head, j0, rows = _qkv_rows(u, r % HALF, r // HALF, OUT.head_dim, HALF)
            out = rows
        else:
            out = u * ROWS + r
            rows = tl.minimum(out, N - 1)
        if DEFER_REDUCE:
            w, x = _tile_and_x(
                W, rows, out < N, K, k_tile * BLOCK_K, x_rows, m_ok, rstd, NORM, HAS_NORM, BLOCK_K
            )
            terms += _products(x, w)
        else:
            acc = _tile_times_x(
                acc, W, rows, out < N, K, k_tile * BLOCK_K, x_rows, m_ok, rstd, NORM, HAS_NORM,
                BLOCK_K, USE_DOT, UPCAST, IEEE,
            )  # fmt: skip
        if k_tile == K_TILES - 1:
            if DEFER_REDUCE:  # the unit's one sum over K
                acc = tl.sum(terms, axis=2)
                terms = tl.zeros((BLOCK_M, ROWS, BLOCK_K), dtype=tl.float32)
            if EPILOGUE == SWIGLU:
                _swiglu_store(acc, OUT, u * HALF + tl.arange(0, HALF), m_ok, N, BLOCK_M, HALF)
            elif EPILOGUE == RESIDUAL:
                _residual_store(acc, out, out < N, src_rows, src_ok, OUT, m_ok)
            elif EPILOGUE == ROPE:
                _qkv_store(acc, head, j0, tl.arange(0, HALF), OUT, BLOCK_M, HALF)
            else:
                best, best_idx = _logits_and_best(
                    acc, out, out < N, OUT, m_ok, N, best, best_idx, BLOCK_M
                )
            acc = tl.zeros((BLOCK_M, ROWS), dtype=tl.float32)
    return best, best_idx


@triton.jit
def _project_onto_residual(
    W,
    K: tl.constexpr,
    in_rows,
    src_rows,
    src_ok,
    x_rows,
    m_ok,
    pid,
    P,
    HIDDEN: tl.constexpr,
    LINES: tl.constexpr,
    LINE: tl.constexpr,
    PREFETCH: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PIPE_K: tl.constexpr,
    STAGES: tl.constexpr,
    DEFER_REDUCE: tl.constexpr,
    USE_DOT: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):
    """This program's units of a projection back onto the residual stream (the o and down phases):
    x[:, rows] = src[:, rows] + in @ W[rows].T. src is x itself, except in layer 0's o phase, whose
    residual is the embedding rows. PIPE_K > 0: _pipelined_units, K tiles of PIPE_K (summed over
    K once a unit with DEFER_REDUCE)."""
    if PIPE_K > 0:
        _pipelined_units(
            W, K, HIDDEN, in_rows, m_ok, None, None, False, x_rows, src_rows, src_ok, pid, P,
            RESIDUAL, BLOCK_M, HALF, PIPE_K, STAGES, DEFER_REDUCE, USE_DOT, UPCAST, IEEE,
        )  # fmt: skip
    else:
        ROWS: tl.constexpr = 2 * HALF
        r = tl.arange(0, ROWS)
        for u in range(pid, tl.cdiv(HIDDEN, ROWS), P):
            after = tl.minimum((u + P) * ROWS + r, HIDDEN - 1)
            _prefetch_rows(W, after, K, LINES, LINE, PREFETCH)  # the next unit's rows into the L2
            rows = u * ROWS + r
            r_ok = rows < HIDDEN
            acc = _rows_times_x(
                W,
                tl.minimum(rows, HIDDEN - 1),
                r_ok,
                K,
                in_rows,
                m_ok,
                None,  # no norm: the input is attention's output or SwiGLU's
                None,
                False,
                BLOCK_M,
                ROWS,
                BLOCK_K,
                USE_DOT,
                UPCAST,
                IEEE,
            )
            _residual_store(acc, rows, r_ok, src_rows, src_ok, x_rows, m_ok)


@triton.jit
def _target(P, index, bad_counter):
    """The count a wait expects: every program, one more on `bad_counter` (the watchdog's test)."""
    return P + (index == bad_counter).to(tl.int32)


# --------------------------------------------------------------------------------------------------
# The kernel


@triton.jit
def persistent_step_kernel(
    # weights: the layers' stacked (L, N, K), the norms (L, hidden)
    EMBED,
    W_QKV,
    W_O,
    W_GATE_UP,
    W_DOWN,
    ATTN_NORM,
    MLP_NORM,
    FINAL_NORM,
    LM_HEAD,
    INV_FREQ,
    # the step's state: tokens (B,) int64 in and out, positions (B,) int32, the cache
    TOKENS,
    POSITIONS,
    K_CACHE,
    V_CACHE,
    # activations and the counters
    X,
    Q,
    PART_O,
    PART_ML,
    ATTN,
    H,
    LOGITS,
    BEST_VAL,
    BEST_IDX,
    COUNTERS,
    STATUS,
    TRACE_BUF,
    batch,
    cache_batch,
    n_layers,
    capacity,
    vocab,
    eps,
    rope_scale,
    sm_scale,
    splits,
    spin_limit,
    bad_counter,
    HIDDEN: tl.constexpr,
    N_HEADS: tl.constexpr,
    N_KV: tl.constexpr,
    D: tl.constexpr,
    INTER: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PIPE_K: tl.constexpr,
    STAGES: tl.constexpr,
    DEFER_REDUCE: tl.constexpr,
    PIPE_QKV: tl.constexpr,
    ATTN_DOT: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_P: tl.constexpr,
    USE_DOT: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    PREFETCH: tl.constexpr,
    LINE: tl.constexpr,
    LINES_H: tl.constexpr,
    LINES_Q: tl.constexpr,
    LINES_I: tl.constexpr,
    TRACE: tl.constexpr,
):
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    ROWS: tl.constexpr = 2 * HALF
    QKV_W: tl.constexpr = (N_HEADS + 2 * N_KV) * D
    Q_W: tl.constexpr = N_HEADS * D
    G: tl.constexpr = N_HEADS // N_KV
    PER_HEAD: tl.constexpr = D // 2 // HALF  # qkv units per head
    PHASES: tl.constexpr = 6
    dtype = X.dtype.element_ty
    # this program's (begin, end) clock of each phase, if traced
    trace = TRACE_BUF + pid * 2 * (n_layers * PHASES + 2)
    _stamp(trace, TRACE)
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < batch
    r = tl.arange(0, ROWS)
    # a paired unit's rows: HALF of the first set, then the same HALF of the second
    pair_j, pair_set = r % HALF, r // HALF
    half_j = tl.arange(0, HALF)

    tokens = tl.load(TOKENS + offs_m, mask=m_ok, other=0)
    bad_token = m_ok & ((tokens < 0) | (tokens >= vocab))
    tl.atomic_or(STATUS + 0 * offs_m, TOKEN_FLAG, mask=bad_token & (offs_m * 0 + pid == 0))
    tok_ok = m_ok & ~bad_token
    positions = tl.load(POSITIONS + offs_m, mask=m_ok, other=0)
    pos_ok = m_ok & (positions >= 0) & (positions < capacity)
    tl.atomic_or(STATUS + 0 * offs_m, POSITION_FLAG, mask=m_ok & ~pos_ok & (offs_m * 0 + pid == 0))
    embed_rows = EMBED + tl.where(tok_ok, tokens, 0) * HIDDEN  # a bad id reads a row of zeros
    x_rows = X + offs_m * HIDDEN
    offs_g = tl.arange(0, BLOCK_G)
    g_ok = offs_g < G
    offs_d = tl.arange(0, D)
    offs_t = tl.arange(0, BLOCK_T)
    offs_s = tl.arange(0, BLOCK_S)
    s_ok = offs_s < splits

    for layer in range(n_layers):
        base = layer * PHASES
        if layer == 0:  # the first layer reads the embedding rows; the o phase writes X
            src_rows = embed_rows
            src_ok = tok_ok
        else:
            src_rows = x_rows
            src_ok = m_ok

        # ---- qkv: norm, the GEMV of rows j and j + D/2 of a head, RoPE, q out, k and v cached
        wq = W_QKV + layer * QKV_W * HIDDEN
        first = (pid // PER_HEAD) * D + (pid % PER_HEAD) * HALF + pair_j + pair_set * (D // 2)
        _prefetch_rows(wq, tl.minimum(first, QKV_W - 1), HIDDEN, LINES_H, LINE, PREFETCH)
        if PREFETCH:  # and the keys and values this program's attention units will read
            for u in range(pid, batch * N_KV * splits, P):
                bi, kv, start, end = _split(POSITIONS, u, splits, capacity, BLOCK_T, N_KV)
                kv_base = ((layer * cache_batch + bi) * N_KV + kv).to(tl.int64) * capacity * D
                _prefetch_keys(K_CACHE, V_CACHE, kv_base, start, end, D, LINE, PREFETCH)
        if layer > 0:
            _wait(
                COUNTERS,
                STATUS,
                base - 1,
                _target(P, base - 1, bad_counter),
                spin_limit,
                trace,
                TRACE,
            )
        rstd = _inv_rms(src_rows, src_ok, HIDDEN, eps, BLOCK_M, BLOCK_K)
        norm = ATTN_NORM + layer * HIDDEN
        qkv_out = QkvOut(Q, K_CACHE, V_CACHE, INV_FREQ, offs_m, positions, m_ok, pos_ok,
                         rope_scale, layer, cache_batch, capacity, N_HEADS, N_KV, D)  # fmt: skip
        if PIPE_QKV:
            _pipelined_units(
                wq, HIDDEN, QKV_W, src_rows, src_ok, rstd, norm, True, qkv_out, None, None, pid,
                P, ROPE, BLOCK_M, HALF, PIPE_K, STAGES, DEFER_REDUCE, USE_DOT, UPCAST, IEEE,
            )  # fmt: skip
        else:
            for u in range(pid, (N_HEADS + 2 * N_KV) * PER_HEAD, P):
                # the next unit's rows into the L2 while this one's loads are in flight
                after = ((u + P) // PER_HEAD) * D + ((u + P) % PER_HEAD) * HALF + pair_j
                after += pair_set * (D // 2)
                _prefetch_rows(wq, tl.minimum(after, QKV_W - 1), HIDDEN, LINES_H, LINE, PREFETCH)
                head, j0, rows = _qkv_rows(u, pair_j, pair_set, D, HALF)
                acc = _rows_times_x(
                    wq, rows, rows < QKV_W, HIDDEN, src_rows, src_ok, rstd, norm, True, BLOCK_M,
                    ROWS, BLOCK_K, USE_DOT, UPCAST, IEEE,
                )  # fmt: skip
                _qkv_store(acc, head, j0, half_j, qkv_out, BLOCK_M, HALF)
        _arrive(COUNTERS, base, trace, TRACE)

        # ---- attention: one split of the keys of one (sequence, KV head), its G query heads
        _wait(COUNTERS, STATUS, base, _target(P, base, bad_counter), spin_limit, trace, TRACE)
        for u in range(pid, batch * N_KV * splits, P):
            bi, kv, start, end = _split(POSITIONS, u, splits, capacity, BLOCK_T, N_KV)
            s = u % splits
            heads = kv * G + offs_g
            q = tl.load(
                Q + bi * Q_W + heads[:, None] * D + offs_d[None, :],
                mask=g_ok[:, None],
                other=0.0,
                cache_modifier=".cg",
            )
            if not ATTN_DOT:
                q = q.to(tl.float32) * (sm_scale * LOG2E_C)
            m_i = tl.full((BLOCK_G,), float("-inf"), tl.float32)
            l_i = tl.zeros((BLOCK_G,), tl.float32)
            acc = tl.zeros((BLOCK_G, D), tl.float32)
            kv_base = ((layer * cache_batch + bi) * N_KV + kv).to(tl.int64) * capacity * D
            for t0 in range(start, end, BLOCK_T):
                t = t0 + offs_t
                t_ok = t < end
                offs = kv_base + t[:, None] * D + offs_d[None, :]
                k = tl.load(K_CACHE + offs, mask=t_ok[:, None], other=0.0, cache_modifier=".cg")
                v = tl.load(V_CACHE + offs, mask=t_ok[:, None], other=0.0, cache_modifier=".cg")
                if ATTN_DOT:  # the G query heads padded to 16 rows (BLOCK_G): tensor cores
                    scores = tl.zeros((BLOCK_G, BLOCK_T), tl.float32)
                    scores = _mma(q, tl.trans(k), scores, UPCAST, IEEE) * (sm_scale * LOG2E_C)
                else:  # broadcast products summed across the warps
                    scores = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
                scores = tl.where(t_ok[None, :], scores, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(scores, axis=1))
                p = tl.exp2(scores - m_new[:, None])
                alpha = tl.exp2(m_i - m_new)
                l_i = l_i * alpha + tl.sum(p, axis=1)
                if ATTN_DOT:  # p rounded to the cache's dtype, as flash attention does
                    acc = _mma(p.to(v.dtype), v, acc * alpha[:, None], UPCAST, IEEE)
                else:
                    pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
                    acc = acc * alpha[:, None] + pv
                m_i = m_new
            part = (bi * N_HEADS + heads) * splits + s
            tl.store(PART_O + part[:, None] * D + offs_d[None, :], acc, mask=g_ok[:, None])
            tl.store(PART_ML + 2 * part, m_i, mask=g_ok)
            tl.store(PART_ML + 2 * part + 1, l_i, mask=g_ok)
        _arrive(COUNTERS, base + 1, trace, TRACE)

        # ---- combine: the splits of one (sequence, query head) into the attention output
        wo = W_O + layer * HIDDEN * Q_W
        _prefetch_rows(wo, tl.minimum(pid * ROWS + r, HIDDEN - 1), Q_W, LINES_Q, LINE, PREFETCH)
        _wait(
            COUNTERS, STATUS, base + 1, _target(P, base + 1, bad_counter), spin_limit, trace, TRACE
        )
        for u in range(pid, batch * N_HEADS, P):  # u = sequence * N_HEADS + head
            part = u * splits + offs_s
            m_s = tl.load(PART_ML + 2 * part, mask=s_ok, other=float("-inf"), cache_modifier=".cg")
            l_s = tl.load(PART_ML + 2 * part + 1, mask=s_ok, other=0.0, cache_modifier=".cg")
            o_s = tl.load(
                PART_O + part[:, None] * D + offs_d[None, :],
                mask=s_ok[:, None],
                other=0.0,
                cache_modifier=".cg",
            )
            m_max = tl.max(m_s, axis=0)
            weight = tl.where(m_s > float("-inf"), tl.exp2(m_s - m_max), 0.0)
            out = tl.sum(weight[:, None] * o_s, axis=0) / tl.sum(weight * l_s, axis=0)
            tl.store(ATTN + u * D + offs_d, out.to(dtype))
        _arrive(COUNTERS, base + 2, trace, TRACE)

        # ---- o: the output projection + the residual
        _wait(
            COUNTERS, STATUS, base + 2, _target(P, base + 2, bad_counter), spin_limit, trace, TRACE
        )
        attn_rows = ATTN + offs_m * Q_W
        _project_onto_residual(
            wo, Q_W, attn_rows, src_rows, src_ok, x_rows, m_ok, pid, P, HIDDEN, LINES_Q, LINE,
            PREFETCH, BLOCK_M, HALF, BLOCK_K, PIPE_K, STAGES, DEFER_REDUCE, USE_DOT, UPCAST,
            IEEE,
        )  # fmt: skip
        _arrive(COUNTERS, base + 3, trace, TRACE)

        # ---- gate_up: norm, rows of gate and the same rows of up, SwiGLU
        wg = W_GATE_UP + layer * (2 * INTER) * HIDDEN
        first = tl.minimum(pid * HALF + pair_j, INTER - 1) + pair_set * INTER
        _prefetch_rows(wg, first, HIDDEN, LINES_H, LINE, PREFETCH)
        _wait(
            COUNTERS, STATUS, base + 3, _target(P, base + 3, bad_counter), spin_limit, trace, TRACE
        )
        rstd = _inv_rms(x_rows, m_ok, HIDDEN, eps, BLOCK_M, BLOCK_K)
        norm = MLP_NORM + layer * HIDDEN
        if PIPE_K > 0:
            _pipelined_units(
                wg, HIDDEN, INTER, x_rows, m_ok, rstd, norm, True, H, None, None, pid, P,
                SWIGLU, BLOCK_M, HALF, PIPE_K, STAGES, DEFER_REDUCE, USE_DOT, UPCAST, IEEE,
            )  # fmt: skip
        else:
            for u in range(pid, tl.cdiv(INTER, HALF), P):
                after = tl.minimum((u + P) * HALF + pair_j, INTER - 1) + pair_set * INTER
                _prefetch_rows(wg, after, HIDDEN, LINES_H, LINE, PREFETCH)
                rows = u * HALF + pair_j
                acc = _rows_times_x(
                    wg,
                    tl.minimum(rows, INTER - 1) + pair_set * INTER,
                    rows < INTER,
                    HIDDEN,
                    x_rows,
                    m_ok,
                    rstd,
                    norm,
                    True,
                    BLOCK_M,
                    ROWS,
                    BLOCK_K,
                    USE_DOT,
                    UPCAST,
                    IEEE,
                )
                _swiglu_store(acc, H, u * HALF + half_j, m_ok, INTER, BLOCK_M, HALF)
        _arrive(COUNTERS, base + 4, trace, TRACE)

        # ---- down: the down projection + the residual
        wd = W_DOWN + layer * HIDDEN * INTER
        _prefetch_rows(wd, tl.minimum(pid * ROWS + r, HIDDEN - 1), INTER, LINES_I, LINE, PREFETCH)
        _wait(
            COUNTERS, STATUS, base + 4, _target(P, base + 4, bad_counter), spin_limit, trace, TRACE
        )
        h_rows = H + offs_m * INTER
        _project_onto_residual(
            wd, INTER, h_rows, x_rows, m_ok, x_rows, m_ok, pid, P, HIDDEN, LINES_I, LINE,
            PREFETCH, BLOCK_M, HALF, BLOCK_K, PIPE_K, STAGES, DEFER_REDUCE, USE_DOT, UPCAST,
            IEEE,
        )  # fmt: skip
        _arrive(COUNTERS, base + 5, trace, TRACE)

    # ---- lm_head: final norm, a slice of the vocabulary, each program's best logit per sequence
    last = n_layers * PHASES
    _prefetch_rows(LM_HEAD, tl.minimum(pid * ROWS + r, vocab - 1), HIDDEN, LINES_H, LINE, PREFETCH)
    _wait(COUNTERS, STATUS, last - 1, _target(P, last - 1, bad_counter), spin_limit, trace, TRACE)
    rstd = _inv_rms(x_rows, m_ok, HIDDEN, eps, BLOCK_M, BLOCK_K)
    if PIPE_K > 0:
        best, best_idx = _pipelined_units(
            LM_HEAD, HIDDEN, vocab, x_rows, m_ok, rstd, FINAL_NORM, True, LOGITS, None, None, pid,
            P, ARGMAX, BLOCK_M, HALF, PIPE_K, STAGES, DEFER_REDUCE, USE_DOT, UPCAST, IEEE,
        )  # fmt: skip
    else:
        best = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        best_idx = tl.zeros((BLOCK_M,), tl.int32)
        for u in range(pid, tl.cdiv(vocab, ROWS), P):
            after = tl.minimum((u + P) * ROWS + r, vocab - 1)
            _prefetch_rows(LM_HEAD, after, HIDDEN, LINES_H, LINE, PREFETCH)
            rows = u * ROWS + r
            r_ok = rows < vocab
            acc = _rows_times_x(
                LM_HEAD,
                tl.minimum(rows, vocab - 1),
                r_ok,
                HIDDEN,
                x_rows,
                m_ok,
                rstd,
                FINAL_NORM,
                True,
                BLOCK_M,
                ROWS,
                BLOCK_K,
                USE_DOT,
                UPCAST,
                IEEE,
            )
            best, best_idx = _logits_and_best(
                acc, rows, r_ok, LOGITS, m_ok, vocab, best, best_idx, BLOCK_M
            )
    tl.store(BEST_VAL + pid * BLOCK_M + offs_m, best)
    tl.store(BEST_IDX + pid * BLOCK_M + offs_m, best_idx)
    _arrive(COUNTERS, last, trace, TRACE)

    # ---- argmax: the programs' best logits of one sequence; the next token and position
    _wait(COUNTERS, STATUS, last, _target(P, last, bad_counter), spin_limit, trace, TRACE)
    offs_p = tl.arange(0, BLOCK_P)
    p_ok = offs_p < P
    for bi in range(pid, batch, P):
        values = tl.load(
            BEST_VAL + offs_p * BLOCK_M + bi, mask=p_ok, other=float("-inf"), cache_modifier=".cg"
        )
        index = tl.load(BEST_IDX + offs_p * BLOCK_M + bi, mask=p_ok, other=0, cache_modifier=".cg")
        top = tl.max(values, axis=0)
        token = tl.min(tl.where((values == top) & p_ok, index, vocab), axis=0)
        tl.store(TOKENS + bi, tl.where(token == vocab, 0, token).to(tl.int64))  # all NaN: 0
        tl.store(POSITIONS + bi, tl.load(POSITIONS + bi) + 1)
    _arrive(COUNTERS, last + 1, trace, TRACE)

    # ---- the last program here sets the counters back to zero for the next step
    arrived = tl.atomic_add(COUNTERS + last + 2, 1, sem="acq_rel", scope="gpu")
    if arrived == P - 1:
        for i in range(0, last + 3):
            tl.atomic_xchg(COUNTERS + i, 0, sem="relaxed", scope="gpu")


# --------------------------------------------------------------------------------------------------
# The wrapper


def stacked_weights(weights) -> dict[str, torch.Tensor]:
    """The layers' weights stacked (L, ...), one pointer each, copied once per DecoderWeights and
    kept on it: the model then holds the layers' weights twice (2 GB more for Llama-3.2-1B in
    bf16), and the CUDA graph's kernels keep reading the layers' own tensors."""
    if weights.stacks is None:
        names = ("qkv", "o", "gate_up", "down", "attn_norm", "mlp_norm")
        weights.stacks = {
            n: torch.stack([getattr(layer, n) for layer in weights.layers]) for n in names
        }
    return weights.stacks


class WatchdogTimeout(RuntimeError):
    pass


class PersistentStep:
    """The decode step of `model` for `batch` sequences as one persistent launch, with DecodeGraph's
    interface: start(tokens, length), then replay() writes the next tokens into `tokens`, advances
    `positions` and returns `tokens`; `logits` holds the step's logits.

    `programs` (default: one per SM on a GPU, one in the interpreter), `block_k`, `num_warps` and
    `num_stages` (software pipelining of the tl.dot loops) set the launch; `pipelined_k` > 0 runs
    the o, gate_up, down and lm_head phases as one loop a program over its (unit, K tile) steps,
    K tiles of `pipelined_k` loaded `pipeline_stages` - 1 steps ahead into shared memory
    (_pipelined_units; 0, the default: one tile of `block_k` a unit, nothing in flight across
    units); `defer_reduce` (batch <= 4, with `pipelined_k`) sums those phases' products over K
    once a unit instead of once a K tile; `pipelined_qkv` (with `pipelined_k`) runs the qkv
    phase in the same loop, RoPE and the cache append as its epilogue; `attention_dot` computes
    the attention phase's q k^T and p v with tl.dot (the query heads of a KV head padded to 16
    rows) instead of broadcast products summed across the warps; `prefetch` asks for the L2
    prefetch of the next phase's first rows (NVIDIA GPUs; never in the interpreter);
    `trace` records each program's begin and end of each phase in `trace` (nanoseconds of the
    GPU's clock; GPU only)."""

    def __init__(
        self,
        model,
        batch: int,
        *,
        programs: int | None = None,
        block_k: int | None = None,
        num_warps: int = 8,
        num_stages: int = 1,
        pipelined_k: int = 0,
        pipeline_stages: int = 4,
        defer_reduce: bool = False,
        pipelined_qkv: bool = False,
        attention_dot: bool = False,
        prefetch: bool = True,
        trace: bool = False,
        spin_limit: int = SPIN_LIMIT,
    ):
        c, dtype, device = model.c, model.dtype, model.device
        if not 1 <= batch <= min(model.max_batch, 32):
            raise ValueError(
                f"PersistentStep: batch must be in [1, {min(model.max_batch, 32)}], got {batch}"
            )
        if c.head_dim & (c.head_dim - 1) or c.n_heads % c.n_kv_heads:
            raise ValueError(
                "PersistentStep: head_dim must be a power of two and the query heads a multiple "
                f"of the KV heads, got head_dim {c.head_dim}, {c.n_heads}:{c.n_kv_heads}"
            )
        self.model, self.batch = model, batch
        if programs is None:
            programs = runtime.features().sm_count if COMPILED else 1
        self.programs = programs
        self.tile = sched.tiling(c, batch, programs)
        self.use_dot = batch > 4
        self.block_m = max(16 if self.use_dot else 1, triton.next_power_of_2(batch))
        self.block_k = block_k or (self.default_block_k() if COMPILED else 32)
        self.num_warps, self.num_stages = num_warps, num_stages
        if pipelined_k < 0 or pipelined_k & (pipelined_k - 1):
            raise ValueError(
                f"PersistentStep: pipelined_k must be 0 or a power of two, got {pipelined_k}"
            )
        self.pipelined_k, self.pipeline_stages = pipelined_k, pipeline_stages
        if defer_reduce and not pipelined_k:
            raise ValueError("PersistentStep: defer_reduce needs pipelined_k > 0")
        if defer_reduce and self.use_dot:
            raise ValueError(
                f"PersistentStep: defer_reduce is for the broadcast product (batch <= 4), got "
                f"batch {batch}: tl.dot already sums over K inside the product"
            )
        self.defer_reduce = defer_reduce
        if pipelined_qkv and not pipelined_k:
            raise ValueError("PersistentStep: pipelined_qkv needs pipelined_k > 0")
        self.pipelined_qkv = pipelined_qkv
        self.attention_dot = attention_dot
        self.prefetch = prefetch and COMPILED
        self.spin_limit = spin_limit
        self.weights = stacked_weights(model.w)
        q_width = c.n_heads * c.head_dim
        splits = self.tile.splits

        def empty(*shape, dt=dtype):
            return torch.full(shape, float("nan"), dtype=dt, device=device)

        self.tokens = torch.zeros(batch, dtype=torch.int64, device=device)
        self.positions = torch.zeros(batch, dtype=torch.int32, device=device)
        self.x = empty(batch, c.hidden_size)
        self.q = empty(batch, q_width)
        self.part_o = empty(batch * c.n_heads * splits, c.head_dim, dt=torch.float32)
        self.part_ml = empty(batch * c.n_heads * splits, 2, dt=torch.float32)
        self.attn = empty(batch, q_width)
        self.h = empty(batch, c.intermediate_size)
        self.logits = empty(batch, c.vocab_size)
        self.best_val = empty(programs * self.block_m, dt=torch.float32)
        self.best_idx = torch.zeros(programs * self.block_m, dtype=torch.int32, device=device)
        self.counters = torch.zeros(sched.n_counters(c.n_layers), dtype=torch.int32, device=device)
        self.status = torch.zeros(2, dtype=torch.int32, device=device)
        # (programs, phases, 2) clock of each phase's begin and end, when `trace` is set
        self.traced = trace and COMPILED
        n_phases = len(sched.schedule(c, batch, programs))
        self.trace = torch.zeros(
            (programs, n_phases, 2) if self.traced else 1, dtype=torch.int64, device=device
        )

    def default_block_k(self) -> int:
        """One program an SM must keep ~30 KB of weight in flight to stream at the copy rate, and
        a tile's loads are all issued before its product: the K tile is as long as registers
        allow. The broadcast product holds BLOCK_M x rows x BLOCK_K fp32 values (at most 64 a
        thread of 256); tl.dot holds only the operands."""
        if self.use_dot:  # 512 spills at 32 rows of x (offline compile for sm_90)
            return 512 if self.block_m <= 16 else 256
        c = self.model.c
        longest = triton.next_power_of_2(max(c.hidden_size, c.intermediate_size))
        return max(128, min(2048, longest, 64 * 256 // (self.block_m * self.tile.rows)))

    def start(self, tokens: torch.Tensor, length: int) -> None:
        """Set the step's input: the last tokens (B,) and the cache length they go to."""
        self.tokens.copy_(tokens)
        self.positions.fill_(length)

    def launch(self, bad_counter: int = -1) -> None:
        """One step. `bad_counter` makes the kernel wait for one arrival more than there are on
        that counter (the watchdog's test)."""
        try:
            self._launch(bad_counter)
        except Exception as error:  # noqa: BLE001 (the prefetch is a hint: run without it)
            if not self.prefetch:
                raise
            print(
                f"PersistentStep: compiled without the L2 prefetch ({type(error).__name__}: "
                f"{str(error).splitlines()[0] if str(error) else ''})"
            )
            self.prefetch = False
            self._launch(bad_counter)

    def _launch(self, bad_counter: int) -> None:
        args, constants = self.kernel_arguments(bad_counter)
        persistent_step_kernel[(self.programs,)](
            *args, **constants, num_warps=self.num_warps, num_stages=self.num_stages
        )

    def kernel_arguments(self, bad_counter: int = -1) -> tuple[list, dict]:
        """The kernel's arguments: (the tensors and scalars in order, the constexprs by name)."""
        m, c, w = self.model, self.model.c, self.model.w
        s, cache = self.weights, m.cache
        line = 128 // w.embed.element_size()  # elements of a 128-byte line

        def lines(k: int) -> int:  # the lines of a row of k elements prefetched, up to 16 KB
            return min(128, triton.next_power_of_2(triton.cdiv(k, line)))

        args = [
            w.embed, s["qkv"], s["o"], s["gate_up"], s["down"], s["attn_norm"], s["mlp_norm"],
            w.norm, w.lm_head, w.inv_freq,
            self.tokens, self.positions, cache.k, cache.v,
            self.x, self.q, self.part_o, self.part_ml, self.attn, self.h, self.logits,
            self.best_val, self.best_idx, self.counters, self.status, self.trace,
            self.batch, cache.batch, c.n_layers, cache.capacity, c.vocab_size, c.rms_eps,
            w.rope_scale, m.scale, self.tile.splits, self.spin_limit, bad_counter,
        ]  # fmt: skip
        # the query heads of a KV head; tl.dot's tiles are at least 16 on a side
        block_g = triton.next_power_of_2(c.n_heads // c.n_kv_heads)
        if self.attention_dot:
            block_g = max(16, block_g)
        constants = dict(
            HIDDEN=c.hidden_size, N_HEADS=c.n_heads, N_KV=c.n_kv_heads, D=c.head_dim,
            INTER=c.intermediate_size, HALF=self.tile.half_rows, BLOCK_M=self.block_m,
            BLOCK_K=self.block_k, PIPE_K=self.pipelined_k, STAGES=self.pipeline_stages,
            DEFER_REDUCE=self.defer_reduce, PIPE_QKV=self.pipelined_qkv,
            ATTN_DOT=self.attention_dot, BLOCK_G=block_g,
            BLOCK_T=32 if COMPILED else 16, BLOCK_S=triton.next_power_of_2(self.tile.splits),
            BLOCK_P=triton.next_power_of_2(self.programs), USE_DOT=self.use_dot,
            UPCAST=not COMPILED, IEEE=m.dtype == torch.float32, PREFETCH=self.prefetch,
            LINE=line, LINES_H=lines(c.hidden_size), LINES_Q=lines(c.n_heads * c.head_dim),
            LINES_I=lines(c.intermediate_size), TRACE=self.traced,
        )  # fmt: skip
        return args, constants

    def replay(self) -> torch.Tensor:
        """One decode step; returns the `tokens` buffer (the next tokens)."""
        self.launch()
        return self.tokens

    def check(self) -> None:
        """Raise if a counter timed out (then the step's outputs are wrong), a position was
        outside the cache or a token id outside the vocabulary. Synchronizes."""
        flags, counter = (int(v) for v in self.status.tolist())
        if flags & STATUS_WATCHDOG:
            self.status.zero_()
            self.counters.zero_()
            c = self.model.c
            index = counter - 1
            n_layer_counters = c.n_layers * len(sched.LAYER_PHASES)
            if index < n_layer_counters:
                where = (
                    f"layer {index // len(sched.LAYER_PHASES)}, phase "
                    f"{sched.LAYER_PHASES[index % len(sched.LAYER_PHASES)]}"
                )
            else:
                where = f"phase {sched.FINAL_PHASES[index - n_layer_counters]}"
            raise WatchdogTimeout(
                f"PersistentStep: the watchdog gave up on counter {index} ({where}) after "
                f"{self.spin_limit} reads: fewer than the {self.programs} programs arrived, "
                "so this step's tokens are wrong. Either the counts of the schedule are wrong or "
                "not every program was resident (another kernel on the GPU, or more programs "
                "than SMs); the counters are reset"
            )
        if flags & STATUS_POSITION_OUT_OF_RANGE:
            raise RuntimeError(
                "PersistentStep: a position outside the KV cache was refused (nothing was written "
                "there); reset() the decoder or make it with a larger max_seq"
            )
        if flags & STATUS_TOKEN_OUT_OF_RANGE:
            raise RuntimeError(
                f"PersistentStep: a token id outside [0, {self.model.c.vocab_size}) was read as a "
                "row of zeros"
            )
