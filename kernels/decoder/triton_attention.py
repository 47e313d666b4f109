"""Attention against the KV cache with each query's position read from device memory.

Module 03's `flash_decode` takes the number of keys from the cache tensor's shape: a host integer. A
CUDA graph freezes host integers at capture, so a graph of the decode step built on it would attend
to the same number of keys at every replay. Here each query row carries its position (the tensor
RoPE reads), and query (b, i) attends to keys 0 ... positions[b, i] of its sequence: the causal mask
*is* the position. One graph then serves every step, and prefill (positions 0 ... T-1) runs the same
kernel.

The work is split as in flash-decoding: the cache's capacity is cut into fixed chunks of SPLIT_KEYS
keys, program (split, row block) folds one chunk into a partial output and log-sum-exp for all the
query heads of one KV head (grouped-query attention: each K and V tile is read once per group), and
the partials are combined by their log-sum-exp, in a second kernel (`fuse_combine=False`) or in the
same launch. Chunks past a row's position exit at once: the grid is sized for the capacity, the
reads for the context.

The combine can also run in the same launch (`fuse_combine=True`). At decode sizes every launch
looked latency-bound: batch 1 at context 512 reads about 1 MB of K and V a layer (0.35 us at copy
bandwidth), yet the profiler gave the split kernel ~4.2 us and the combining launch ~2.3 us more
(H100, CUDA graph). So in the fused form each program, once its partial is stored, counts itself in
on its output tile's arrival counter, and the program that arrives last combines the tile's partials
(split-K's "last block reduces"). Measured on an H200 in a graph of 16 back-to-back layers, it saves
1-2% at batch 1 (7.16 -> 7.07 us a layer at context 512) and costs up to 9% at batch 32 with 4096
keys: the second launch was never the cost inside a graph, the split kernel's own latency is. So the
default stays two launches (`FUSE_COMBINE`), and the fused form is kept as the measured alternative:

* Which programs count: those of splits that hold a key of the tile, `split <= max position //
  SPLIT_KEYS`. Every program of a tile reads the same positions, so they agree on that number
  without talking to each other, and the programs past the context still exit without an atomic.
* Why acquire-release: the partials are plain stores, the counter an atomic. With a relaxed add the
  last program could see the count complete while another program's partial is still in flight to
  L2 (or read stale data). The release half of `sem="acq_rel"` orders this program's stores (all
  its threads', after the barrier) before its increment; the acquire half orders the last program's
  loads after the increment that saw every other release. The loads also bypass L1 (`.cg`).
* Determinism: the last program combines the splits in split order, 0, 1, 2, ..., whichever program
  arrived last, so the output does not depend on the schedule.
* The last program sets the counter back to 0: the next call (the next layer, the next graph
  replay) starts clean, with nothing to zero on the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import runtime
from kernels.decoder.pdl import launch_options, wait_then_release
from kernels.flash_attention.triton_flash import LOG2E, UPCAST

BLOCK_N = runtime.pick(gpu=64, cpu=32)  # keys per tile
SPLIT_KEYS = runtime.pick(gpu=128, cpu=64)  # keys per split: a whole number of tiles
MAX_ROWS = 64  # query rows per program (query heads of a group x queries)
NUM_WARPS = runtime.pick(gpu=4, cpu=1)
# The fused combine's round: up to this many (row, split) partials loaded at once, a (rows, splits,
# head_dim) float32 tile: 64 x 64 floats are 32 registers a thread at 4 warps. Every load of a round
# is issued together, so a round costs one trip to L2; the Llama-1B tile (4 rows) takes 16 splits a
# round, 2048 keys. The interpreter pays per loop trip, so larger rounds there.
COMBINE_PARTIALS = runtime.pick(gpu=64, cpu=512)
# Two launches (split, then combine) unless the caller asks for one: the fused combine measured
# within 2% of them at batch 1 and up to 9% slower at batch 32 (H200, 07_decoder_attention.json).
FUSE_COMBINE = False


@triton.jit
def _combine_tile(
    O_PART,
    LSE_PART,
    POS,
    OUT,
    first_row,
    n_rows,
    n_heads,
    n_q,
    n_splits,
    used_splits,
    capacity,
    stride_ob,
    stride_oh,
    stride_om,
    HEAD_DIM: tl.constexpr,
    SPLIT_KEYS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """out = sum_s 2^(lse_s - max lse) out_s / sum_s 2^(lse_s - max lse) for the (batch, head,
    query) rows first_row ... first_row + n_rows - 1 (flattened), over the splits that hold keys of
    each row (the others were not written by this call), BLOCK_R rows x BLOCK_S splits a round, the
    splits in order 0, 1, 2, ... with the maximum carried online. The partials are read past L1
    (.cg): other SMs wrote them during this launch."""
    r0 = tl.arange(0, BLOCK_R)
    s0 = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, HEAD_DIM)
    for r_start in range(0, n_rows, BLOCK_R):
        row_ok = r_start + r0 < n_rows
        row = (first_row + r_start + r0).to(tl.int64)
        b = row // (n_heads * n_q)
        h = (row // n_q) % n_heads
        i = row % n_q
        pos = tl.minimum(tl.load(POS + b * n_q + i, mask=row_ok, other=-1), capacity - 1)
        row_splits = tl.where(pos >= 0, tl.maximum(pos, 0) // SPLIT_KEYS + 1, 0)
        m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
        total = tl.zeros([BLOCK_R], dtype=tl.float32)
        acc = tl.zeros([BLOCK_R, HEAD_DIM], dtype=tl.float32)
        for start in range(0, used_splits, BLOCK_S):
            s = start + s0
            ok = row_ok[:, None] & (s[None, :] < row_splits[:, None])
            part = row[:, None] * n_splits + s[None, :]
            lse = tl.load(LSE_PART + part, mask=ok, other=float("-inf"), cache_modifier=".cg")
            o = tl.load(
                O_PART + part[:, :, None] * HEAD_DIM + dims[None, None, :],
                mask=ok[:, :, None],
                other=0.0,
                cache_modifier=".cg",
            )
            m_new = tl.maximum(m, tl.max(lse, 1))
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            w = tl.math.exp2(lse - m_shift[:, None])  # 0 where the row saw no key of the split
            alpha = tl.math.exp2(m - m_shift)
            total = total * alpha + tl.sum(w, 1)
            acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * o, 1)
            m = m_new
        out = acc / tl.where(total > 0.0, total, 1.0)[:, None]
        dst = OUT + b[:, None] * stride_ob + h[:, None] * stride_oh + i[:, None] * stride_om
        tl.store(dst + dims[None, :], out.to(OUT.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def cache_attention_split_kernel(
    Q,
    K,
    V,
    POS,
    O_PART,
    LSE_PART,
    OUT,
    ARRIVALS,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_ob,
    stride_oh,
    stride_om,
    n_kv_heads,
    group,
    n_q,
    capacity,
    n_splits,
    row_blocks,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_KEYS: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    FUSE_COMBINE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_S: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_then_release(PDL)  # launched with PDL: nothing is read before the previous kernel ends
    split = tl.program_id(0)
    tile = tl.program_id(1)  # (batch, KV head, row block): one output tile, one arrival counter
    b = tile // (n_kv_heads * row_blocks)
    kv_h = (tile // row_blocks) % n_kv_heads
    r = (tile % row_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
    row_ok = r < group * n_q
    h = kv_h * group + r // n_q  # row r: query r % n_q of query head kv_h * group + r // n_q
    i = r % n_q
    pos = tl.load(POS + b * n_q + i, mask=row_ok, other=-1)
    pos = tl.minimum(pos, capacity - 1)  # a position past the cache reads no key past it
    last_key = tl.max(pos, 0)
    lo = split * SPLIT_KEYS
    hi = tl.minimum(lo + SPLIT_KEYS, tl.maximum(last_key, 0) + 1)  # <= lo: nothing to do here

    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(
        Q
        + b.to(tl.int64) * stride_qb
        + h[:, None].to(tl.int64) * stride_qh
        + i[:, None] * stride_qm
        + dims[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    k_base = K + b.to(tl.int64) * stride_kb + kv_h.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_kb + kv_h.to(tl.int64) * stride_kh
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)
    cols0 = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        cols = start + cols0
        in_range = cols < hi
        k = tl.load(
            k_base + cols[:, None].to(tl.int64) * stride_kn + dims[None, :],
            mask=in_range[:, None],
            other=0.0,
        )
        v = tl.load(
            v_base + cols[:, None].to(tl.int64) * stride_kn + dims[None, :],
            mask=in_range[:, None],
            other=0.0,
        )
        dtype = v.dtype
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        s = tl.where(
            cols[None, :] <= pos[:, None], s, float("-inf")
        )  # the causal mask is the position
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s * qk_scale - m_shift[:, None])
        alpha = tl.math.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        p = p.to(dtype)
        if UPCAST:
            p = p.to(tl.float32)
        acc = tl.dot(p, v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    if lo < hi:
        seen = l_i > 0.0
        l_safe = tl.where(seen, l_i, 1.0)
        row = ((b * n_kv_heads * group + h) * n_q + i).to(tl.int64) * n_splits + split
        tl.store(
            O_PART + row[:, None] * HEAD_DIM + dims[None, :],
            acc / l_safe[:, None],
            mask=row_ok[:, None],
        )
        tl.store(
            LSE_PART + row, tl.where(seen, m_i + tl.math.log2(l_safe), float("-inf")), mask=row_ok
        )
        if FUSE_COMBINE:
            # The splits holding a key of this tile: every program of the tile computes the same
            # number from the same positions.
            used_splits = tl.maximum(last_key, 0) // SPLIT_KEYS + 1
            # The barrier puts every thread's partial stores before the increment (issued by one
            # thread); acq_rel: release those stores with it, acquire the others' for the combine.
            tl.debug_barrier()
            arrived = tl.atomic_add(ARRIVALS + tile, 1, sem="acq_rel", scope="gpu")
            if arrived == used_splits - 1:  # the last to arrive: every partial is visible
                first_row = (b * n_kv_heads + kv_h) * group * n_q + (tile % row_blocks) * BLOCK_H
                _combine_tile(
                    O_PART,
                    LSE_PART,
                    POS,
                    OUT,
                    first_row,
                    tl.minimum(group * n_q - (tile % row_blocks) * BLOCK_H, BLOCK_H),
                    n_kv_heads * group,
                    n_q,
                    n_splits,
                    used_splits,
                    capacity,
                    stride_ob,
                    stride_oh,
                    stride_om,
                    HEAD_DIM,
                    SPLIT_KEYS,
                    BLOCK_R,
                    BLOCK_S,
                )
                tl.store(ARRIVALS + tile, 0)  # ready for the next call, which runs after this one


@triton.jit
def cache_attention_combine_kernel(
    O_PART,
    LSE_PART,
    POS,
    OUT,
    n_heads,
    n_q,
    n_splits,
    capacity,
    stride_ob,
    stride_oh,
    stride_om,
    HEAD_DIM: tl.constexpr,
    SPLIT_KEYS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """One program per (batch, head, query) row: out = sum_s 2^(lse_s - lse) out_s over the splits
    that hold keys of this row (the others were not written by this call)."""
    wait_then_release(PDL)  # launched with PDL: nothing is read before the previous kernel ends
    row = tl.program_id(0).to(tl.int64)
    b = row // (n_heads * n_q)
    h = (row // n_q) % n_heads
    i = row % n_q
    pos = tl.minimum(tl.load(POS + b * n_q + i), capacity - 1)
    used_splits = tl.where(pos >= 0, pos // SPLIT_KEYS + 1, 0)
    dims = tl.arange(0, HEAD_DIM)
    m = float("-inf")
    total = 0.0
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    for start in range(0, used_splits, BLOCK_S):
        s = start + tl.arange(0, BLOCK_S)
        used = s < used_splits
        lse = tl.load(LSE_PART + row * n_splits + s, mask=used, other=float("-inf"))
        o = tl.load(
            O_PART + (row * n_splits + s[:, None]) * HEAD_DIM + dims[None, :],
            mask=used[:, None],
            other=0.0,
        )
        m_new = tl.maximum(m, tl.max(lse, 0))
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        w = tl.math.exp2(lse - m_shift)
        alpha = tl.math.exp2(m - m_shift)
        total = total * alpha + tl.sum(w, 0)
        acc = acc * alpha + tl.sum(w[:, None] * o, 0)
        m = m_new
    out = acc / tl.where(total > 0.0, total, 1.0)
    dst = OUT + b * stride_ob + h * stride_oh + i * stride_om + dims
    tl.store(dst, out.to(OUT.dtype.element_ty))


class AttentionWorkspace:
    """The float32 partials of `cache_attention` and the arrival counters of its fused combine,
    allocated once for a (batch, heads, queries, capacity) so that an eager step allocates nothing
    and a graph captures fixed addresses.

    The counters (int32, one per output tile) start at 0 and every call leaves them at 0 (the last
    program of each tile resets its own), so one workspace serves every layer and every replay, one
    call after another on a stream. Make it outside a graph capture: made during one, its zeroing
    is captured too, and the buffers belong to that graph's pool. `split_keys` (a multiple of
    BLOCK_N) overrides SPLIT_KEYS, for sweeps."""

    def __init__(
        self,
        batch: int,
        n_heads: int,
        n_q: int,
        capacity: int,
        head_dim: int,
        device,
        split_keys: int = SPLIT_KEYS,
    ):
        self.split_keys = split_keys
        self.n_splits = triton.cdiv(capacity, split_keys)
        rows = batch * n_heads * n_q
        self.o_part = torch.empty(
            (rows, self.n_splits, head_dim), dtype=torch.float32, device=device
        )
        self.lse_part = torch.empty((rows, self.n_splits), dtype=torch.float32, device=device)
        # batch x KV heads x row blocks tiles, never more than the rows
        self.arrivals = torch.zeros(max(rows, 1), dtype=torch.int32, device=device)
        self.shape = (batch, n_heads, n_q, capacity, head_dim)


def cache_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    positions: torch.Tensor,
    out: torch.Tensor,
    workspace: AttentionWorkspace,
    scale: float,
    fuse_combine: bool | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """softmax(scale q k^T) v where query (b, h, i) sees cache keys 0 ... positions[b * n_q + i].

    q: (B, Hq, n_q, D) any strides with a contiguous last dimension; k_cache, v_cache: (B, Hkv,
    capacity, D) with the same strides (contiguous last two dimensions); positions: (B * n_q,)
    int32/int64 on the device; out: (B, Hq, n_q, D), contiguous last dimension; workspace made for
    these sizes. The caller (the decoder) checks shapes once; this wrapper only launches, to keep
    the eager step's host time low. `fuse_combine` (default FUSE_COMBINE): combine the splits in
    the same launch (True) or in a second kernel (False). Calls sharing a workspace must run one
    after another (one stream), as a decoder's layers do. `pdl`: both kernels launched with
    programmatic dependent launch where the GPU has it (pdl.py).
    """
    batch, n_heads, n_q, head_dim = q.shape
    n_kv_heads, capacity = k_cache.shape[1], k_cache.shape[2]
    group = n_heads // n_kv_heads
    block_h = max(16, triton.next_power_of_2(min(group * n_q, MAX_ROWS)))
    row_blocks = triton.cdiv(group * n_q, block_h)
    n_splits, split_keys = workspace.n_splits, workspace.split_keys
    fuse = FUSE_COMBINE if fuse_combine is None else fuse_combine
    # the fused combine's round: the tile's real rows (up to BLOCK_H), then as many splits as fit
    block_r = triton.next_power_of_2(min(group * n_q, block_h))
    block_s = max(1, min(triton.next_power_of_2(n_splits), COMBINE_PARTIALS // block_r))
    precision = "ieee" if q.dtype == torch.float32 else None  # fp32: no TF32 rounding
    cache_attention_split_kernel[(n_splits, batch * n_kv_heads * row_blocks)](
        q,
        k_cache,
        v_cache,
        positions,
        workspace.o_part,
        workspace.lse_part,
        out,
        workspace.arrivals,
        *q.stride()[:3],
        *k_cache.stride()[:3],
        *out.stride()[:3],
        n_kv_heads,
        group,
        n_q,
        capacity,
        n_splits,
        row_blocks,
        scale * LOG2E,
        HEAD_DIM=head_dim,
        BLOCK_H=block_h,
        BLOCK_N=BLOCK_N,
        SPLIT_KEYS=split_keys,
        UPCAST=UPCAST,
        PRECISION=precision,
        FUSE_COMBINE=fuse,
        BLOCK_R=block_r,
        BLOCK_S=block_s,
        num_warps=NUM_WARPS,
        **launch_options(pdl),
    )
    if not fuse:
        cache_attention_combine_kernel[(batch * n_heads * n_q,)](
            workspace.o_part,
            workspace.lse_part,
            positions,
            out,
            n_heads,
            n_q,
            n_splits,
            capacity,
            *out.stride()[:3],
            HEAD_DIM=head_dim,
            SPLIT_KEYS=split_keys,
            BLOCK_S=min(32, triton.next_power_of_2(n_splits)),
            num_warps=runtime.pick(gpu=2, cpu=1),
            **launch_options(pdl),
        )
    return out


# --------------------------------------------------------------------------------------------------
# Two launches against one: python -m kernels.decoder.triton_attention

BENCH_BATCHES = (1, 8, 32)
BENCH_CONTEXTS = (512, 4096)
BENCH_LAYERS = 16
BENCH_CAPACITY = 4144  # the decoder benchmark's cache (max_seq): the grid is sized for it


def benchmark_fusion(
    batches=BENCH_BATCHES,
    contexts=BENCH_CONTEXTS,
    layers: int = BENCH_LAYERS,
    capacity: int = BENCH_CAPACITY,
    save: bool = True,
) -> dict:
    """Time the two-launch path against the one-launch path (and one launch with longer splits) at
    the Llama-3.2-1B attention shape (32 query heads, 8 KV heads, head_dim 64, bf16, one query per
    sequence at position context - 1, each layer its own cache): one call (device events, L2
    flushed, interleaved), and `layers` calls back to back in one CUDA graph, as in the decode
    step, where the second launch's ramp-up shows. Saved as 07_decoder_attention with the
    environment. In CPU mode: a small smoke run of the same code, without graphs, not saved."""
    from kernels import bench
    from kernels.testing import generator

    if not runtime.ON_GPU:
        batches, contexts, layers, capacity, save = batches[:1], (40,), 2, 100, False
    hq, hkv, d, dtype = 32, 8, 64, torch.bfloat16
    variants = {  # name: (split size, fused)
        "two launches": (SPLIT_KEYS, False),
        "one launch": (SPLIT_KEYS, True),
        f"one launch, {2 * SPLIT_KEYS}-key splits": (2 * SPLIT_KEYS, True),
        f"one launch, {4 * SPLIT_KEYS}-key splits": (4 * SPLIT_KEYS, True),
    }
    ceil = bench.ceilings()
    rows = []
    for batch in batches:
        g = generator(batch, runtime.DEVICE)
        shape = (layers, batch, hkv, capacity, d)
        k = torch.randn(shape, device=runtime.DEVICE, generator=g).to(dtype)
        v = torch.randn(shape, device=runtime.DEVICE, generator=g).to(dtype)
        q = torch.randn((layers, batch, 1, hq, d), device=runtime.DEVICE, generator=g)
        q = q.to(dtype).transpose(2, 3)
        out = torch.empty((layers, batch, hq, 1, d), dtype=dtype, device=runtime.DEVICE)
        spaces = {
            n: AttentionWorkspace(batch, hq, 1, capacity, d, runtime.DEVICE, split_keys=s)
            for n, (s, _) in variants.items()
        }
        for context in contexts:
            positions = torch.full((batch,), context - 1, dtype=torch.int32, device=runtime.DEVICE)

            def call(name, layer):
                def fn():
                    cache_attention(
                        q[layer], k[layer], v[layer], positions, out[layer], spaces[name],
                        d**-0.5, fuse_combine=variants[name][1],
                    )  # fmt: skip

                return fn

            def step(name):
                calls = [call(name, layer) for layer in range(layers)]

                def fn():
                    for c in calls:
                        c()

                return fn

            one = bench.benchmark({n: call(n, 0) for n in variants})
            if runtime.ON_GPU:
                graphs = {n: bench.capture_graph(step(n)) for n in variants}
                many = bench.benchmark({n: graphs[n].replay for n in variants})
            else:
                many = bench.benchmark({n: step(n) for n in variants})
            kv_bytes = batch * context * hkv * d * 2 * dtype.itemsize  # K and V of one layer
            floor = bench.floor_us(kv_bytes, ceil=ceil) if ceil else None
            base_one, base_many = one["two launches"], many["two launches"]
            for name in variants:
                rows.append(
                    {
                        "batch": batch,
                        "context": context,
                        "variant": name,
                        "call_us": one[name].median_us,
                        "call_speedup": bench.ratio(base_one, one[name]),
                        f"graph_{layers}_layers_us": many[name].median_us,
                        "graph_per_layer_us": many[name].median_us / layers,
                        "graph_speedup": bench.ratio(base_many, many[name]),
                        "kv_bytes_per_layer": kv_bytes,
                        "floor_per_layer_us": floor,
                        "clock": many[name].clock,
                        "call": one[name].summary(),
                        "graph": many[name].summary(),
                    }
                )
    columns = ["batch", "context", "variant", "call_us", "call_speedup", "graph_per_layer_us",
               "graph_speedup", "floor_per_layer_us"]  # fmt: skip
    print(bench.table(rows, columns, floatfmt=".2f"))
    fused = [r for r in rows if r["variant"] == "one launch"]
    wins = sum(r["graph_speedup"] >= 1.0 for r in fused)
    verdict = (
        f"one launch (SPLIT_KEYS {SPLIT_KEYS}) at least as fast as two in the {layers}-layer "
        f"graph at {wins} of {len(fused)} points; FUSE_COMBINE = {FUSE_COMBINE}"
    )
    print(verdict)
    results = {
        "what": "decoder cache attention: two launches (split + combine) vs one (last program "
        "combines), Llama-3.2-1B attention shape, bf16, one query per sequence",
        "shape": {
            "q_heads": hq,
            "kv_heads": hkv,
            "head_dim": d,
            "capacity": capacity,
            "layers": layers,
            "block_n": BLOCK_N,
            "split_keys": SPLIT_KEYS,
        },  # fmt: skip
        "rows": rows,
        "verdict": verdict,
        "ceilings": ceil,
        "fingerprint": runtime.fingerprint(),
    }
    if save:
        print("saved", bench.save_results("07_decoder_attention", results))
    return results


if __name__ == "__main__":
    benchmark_fusion()
