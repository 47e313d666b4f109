"""FlashAttention-2 in Triton: forward, backward and a `torch.autograd.Function`.

Forward. One program owns BLOCK_M queries of one (batch, head) and walks the keys in blocks of
BLOCK_N, keeping the softmax *online*: per query row a running maximum m, a running sum l of exp(s -
m) and an unnormalized output acc; a new block with a larger maximum rescales l and acc by exp(m_old
- m_new). The (Nq x Nk) score matrix never exists in memory: Q is read once, K and V once per query
block, O and the log-sum-exp written once. Scores are kept in base 2: scale * log2(e) is folded into
one multiply-add per score, and exp2 is the hardware's native exponential (exp is exp2 plus a
multiply).

The key loop is split in two so the common case pays for no masks: the blocks every query of the
program sees completely (no causal mask, inside Nk) run unmasked; then the few blocks on the causal
diagonal or past the end of the keys run with masks. Blocks above the diagonal are never visited
(causal skipping).

Causal masking is bottom-right aligned, as in `reference.py`: query i sees keys j <= i + Nk - Nq.

Backward (recomputation). The forward saved only O and the log-sum-exp (lse); P = exp(S - lse) is
recomputed block by block. With D_i = rowsum(dO_i * O_i):
    dV = P^T dO        dP = dO V^T        dS = P * (dP - D)        dQ = scale dS K        dK = scale
    dS^T Q
Three kernels: a pre-pass computing D (and lse in base 2), one program per KV block accumulating dK
and dV over all query blocks (and, with grouped-query attention, over every query head of the group:
no atomics), and one program per query block accumulating dQ over the key blocks (or, with
`atomic_dq`, dQ added by float32 atomics from the dK/dV program, as FlashAttention-2 does).

Tiles reach shared memory through pointer arithmetic (cp.async) or, with `tma`, through tensor
descriptors (the Hopper TMA engine); which is faster is measured by `benchmark.py` (PERFORMANCE.md).

Head sizes. `tl.arange` and `tl.dot` want power-of-two tile sides (at least 16), while models use
head_dim 80 (Phi-2), 96 (Phi-3-mini) or 192 (DeepSeek-V2's q/k). Every kernel therefore works on a
tile of HEAD_PAD = next_power_of_2(head_dim) columns: the columns past head_dim are loaded as zeros
(they add nothing to q.k, and give zero columns of P V) and never stored. Any multiple of 8 up to
256 works; the power-of-two sizes pay for no masks at all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import runtime
from kernels.flash_attention.fast_launch import LaunchCache
from kernels.flash_attention.validate import check_attention_inputs
from kernels.runtime import UPCAST
from kernels.validate import check_bf16_products

# 1 / ln(2): exp(x) = exp2(x * LOG2E); inside kernels ln(2) = 0.693... is a literal
LOG2E = 1.4426950408889634
MAX_HEAD_DIM = 256
# The forward's default way of loading tiles: pointers (cp.async) or tensor descriptors (TMA); see
# PERFORMANCE.md for which measured faster, and `flash_attention_forward(tma=...)` to choose per
# call.
USE_TMA = False
# The backward's default for dQ: a separate kernel (False) or float32 atomics from the dK/dV kernel
# (True); `flash_attention_backward(atomic_dq=...)` chooses per call.
ATOMIC_DQ = False


# ------------------------------------------------------------------------------------------------
# Autotuning. A handful of configurations (BLOCK_M, BLOCK_N, num_warps, num_stages) that suit sm_90
# for each head dim; the autotuner picks one per (Nq bucket, Nk bucket, head dim, causal, dtype).
# Few, because each is compiled for every (head dim, causal, dtype) the first time it is seen.
# Shared memory bounds them: Q stays resident (BLOCK_M x D) and each pipeline stage holds a K and a
# V tile (2 x BLOCK_N x D), so D = 256 gets small tiles and two stages. CPU mode gets one
# configuration with few, large blocks (the interpreter's cost grows with the number of programs and
# loop trips); its BLOCK_M != BLOCK_N so the tests exercise a diagonal that crosses block boundaries
# unevenly.


def _configs(
    table: dict[int, list[tuple[int, int, int, int]]], cpu: tuple[int, int]
) -> list[triton.Config]:
    if not runtime.ON_GPU:
        return [triton.Config({"BLOCK_M": cpu[0], "BLOCK_N": cpu[1]}, num_warps=1, num_stages=1)]
    unique = sorted({c for rows in table.values() for c in rows})
    return [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
        for m, n, w, s in unique
    ]


# None: autotune over the table's entries for the head dim. An integer i: use entry i alone (the
# last one if the table is shorter), so the tests compile one kernel per case on a GPU, or step
# through every entry. After changing it, call `reset_autotuning()`: the autotuner remembers its
# choice per key.
TUNING_OVERRIDE: int | None = None


def _pruner(table):
    """Keep only the configurations listed for this tile width (the autotuner's
    early_config_prune)."""

    def prune(configs, named_args, **kwargs):
        if len(configs) == 1:
            return configs
        kind = next(name for name, known in TUNING_TABLES.items() if known is table)
        wanted = fitting_tiles(kind, {**named_args, **kwargs}["HEAD_PAD"])
        if TUNING_OVERRIDE is not None:
            wanted = [wanted[min(TUNING_OVERRIDE, len(wanted) - 1)]]
        kept = [
            c
            for c in configs
            if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) in wanted
        ]
        listed = {
            (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in kept
        }
        # a GPU with less shared memory than sm_90 gets SMALL_TILES, which the table does not list
        return kept + [
            triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
            for m, n, w, s in wanted
            if (m, n, w, s) not in listed
        ]

    return prune


def reset_autotuning() -> None:
    for kernel in (flash_fwd_kernel, flash_bwd_dkdv_kernel, flash_bwd_dq_kernel):
        kernel.cache.clear()
    FWD_LAUNCHES.clear()  # its entries hold the configurations the autotuner picked
    _FWD_CALLS.clear()


# Every entry below compiles for sm_90 with Triton 3.6 without register spills (ptxas, checked
# offline with triton.compile for GPUTarget("cuda", 90, 32); PERFORMANCE.md lists what was dropped
# and why).
FWD_TUNING = {
    16: [(128, 64, 4, 3), (128, 128, 8, 3), (64, 64, 4, 3)],
    32: [(128, 64, 4, 3), (128, 128, 8, 3), (64, 64, 4, 3)],
    64: [(128, 64, 4, 3), (128, 128, 8, 3), (128, 64, 8, 3), (128, 128, 8, 2)],
    128: [(128, 64, 8, 3), (128, 128, 8, 2), (128, 64, 8, 2), (128, 128, 8, 3)],
    256: [(64, 64, 8, 2), (128, 64, 8, 2), (64, 32, 4, 2), (128, 32, 8, 2)],
}
# Backward kernels: (BLOCK_M queries, BLOCK_N keys). dK/dV keeps K and V tiles and two float32
# accumulators (2 x BLOCK_N x D) resident for the whole loop, so few tiles fit: 8 warps, small query
# blocks.
DKDV_TUNING = {
    16: [(64, 128, 8, 2), (32, 128, 8, 3)],
    32: [(64, 128, 8, 2), (32, 128, 8, 3)],
    64: [(64, 128, 8, 2), (32, 128, 8, 3), (32, 128, 8, 2)],
    128: [(32, 128, 8, 2), (16, 128, 8, 2)],
    256: [(16, 64, 8, 2)],
}
DQ_TUNING = {
    16: [(128, 64, 8, 3), (128, 32, 4, 3), (64, 64, 4, 3)],
    32: [(128, 64, 8, 3), (128, 32, 4, 3), (64, 64, 4, 3)],
    64: [(128, 64, 8, 3), (128, 32, 4, 3), (128, 128, 8, 2)],
    128: [(128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 8, 3)],
    256: [(64, 32, 8, 2), (32, 32, 4, 2)],
}
TUNING_TABLES = {"forward": FWD_TUNING, "dkdv": DKDV_TUNING, "dq": DQ_TUNING}
# Where no entry of a table fits the GPU's shared memory (a T4's 64 KiB, an RTX 4090's 99 KiB at
# head dim 256): the first of these that fits, largest first.
SMALL_TILES = [(64, 32, 4, 2), (32, 32, 4, 2), (32, 16, 4, 1), (16, 16, 4, 1)]


def tile_shared_bytes(kind: str, block_m: int, block_n: int, stages: int, head_pad: int) -> int:
    """Shared memory a tile needs, in 16-bit elements: the forward keeps Q (BLOCK_M x D) and a K
    and a V tile per pipeline stage; dK/dV keeps K and V, a Q and a dO tile per stage; dQ keeps Q
    and dO, a K and a V tile per stage."""
    resident, streamed = {"forward": (block_m, 2 * block_n), "dkdv": (2 * block_n, 2 * block_m),
                          "dq": (2 * block_m, 2 * block_n)}[kind]  # fmt: skip
    return (resident + stages * streamed) * head_pad * 2


def fitting_tiles(kind: str, head_pad: int) -> list[tuple[int, int, int, int]]:
    """The table's tiles for this head tile width that fit `runtime.shared_memory_budget()` (all
    of them on sm_90 and in CPU mode), else the first of SMALL_TILES that does."""
    budget = runtime.shared_memory_budget()
    found = runtime.features()
    if kind != "forward" and found is not None and found.capability < (8, 0):
        # Turing (no cp.async) stages the backward's operands through shared memory again: dK/dV
        # at d = 64, 32 x 128, 2 stages took 80 KiB for sm_75 and 44 KiB for sm_80 (compile_all)
        budget //= 2

    def fitting(tiles):
        return [t for t in tiles if tile_shared_bytes(kind, t[0], t[1], t[3], head_pad) <= budget]

    return fitting(TUNING_TABLES[kind][head_pad]) or fitting(SMALL_TILES)[:1] or SMALL_TILES[-1:]


FWD_CONFIGS = _configs(FWD_TUNING, cpu=(64, 32))
DKDV_CONFIGS = _configs(DKDV_TUNING, cpu=(32, 64))
DQ_CONFIGS = _configs(DQ_TUNING, cpu=(64, 32))
# The autotuner keys on length *buckets* (next power of two), not exact lengths: a run over many
# lengths (a KV cache growing token by token) tunes once per bucket instead of once per length.
TUNE_KEY = ["N_Q_BUCKET", "N_K_BUCKET", "HEAD_DIM", "CAUSAL"]


def _bucket(n: int) -> int:
    return triton.next_power_of_2(max(n, 1))


def head_tile(head_dim: int) -> int:
    """The tile width for a head size: the next power of two, at least 16 (the smallest tl.dot)."""
    return max(16, triton.next_power_of_2(head_dim))


@triton.jit
def load_tile(
    ptrs, row_ok, dims, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, MASK_ROWS: tl.constexpr
):
    """A (rows, HEAD_PAD) tile at `ptrs`: rows where `row_ok` is False (with MASK_ROWS) and the
    padding columns past HEAD_DIM read as 0. With neither, a plain load (no predicates at all)."""
    if HEAD_PAD == HEAD_DIM:
        if MASK_ROWS:
            tile = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
        else:
            tile = tl.load(ptrs)
    else:
        if MASK_ROWS:
            tile = tl.load(ptrs, mask=row_ok[:, None] & (dims[None, :] < HEAD_DIM), other=0.0)
        else:
            tile = tl.load(ptrs, mask=dims[None, :] < HEAD_DIM, other=0.0)
    return tile


@triton.jit
def tile_mask(row_ok, dims, HEAD_DIM: tl.constexpr):
    """Where a (rows, HEAD_PAD) tile may be stored: real rows, real columns."""
    return row_ok[:, None] & (dims[None, :] < HEAD_DIM)


# ------------------------------------------------------------------------------------------------
# Forward


@triton.jit
def _key_range(
    m0, n_k, causal_offset, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):
    """(unmasked_end, hi) for the query rows [m0, m0 + BLOCK_M): keys [0, unmasked_end) are whole
    blocks every row sees (no mask needed), keys [unmasked_end, hi) need masks, keys from hi on are
    never visited. Causal: every row sees keys j <= m0 + offset; the last row sees j < m0 + BLOCK_M
    + offset."""
    if CAUSAL:
        hi = tl.minimum(n_k, tl.maximum(0, m0 + BLOCK_M + causal_offset))
        unmasked_end = tl.maximum(0, tl.minimum(n_k, m0 + causal_offset + 1)) // BLOCK_N * BLOCK_N
    else:
        hi = n_k
        unmasked_end = n_k // BLOCK_N * BLOCK_N
    return unmasked_end, hi


@triton.jit
def _fwd_kv_loop(
    acc,
    l_i,
    m_i,
    q,
    k_base,
    v_base,
    stride_kn,
    stride_vn,
    rows,
    lo,
    hi,
    n_k,
    causal_offset,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr,
    TMA: tl.constexpr,
):
    """Fold keys [lo, hi) into the running (acc, l, m) of the query rows `rows`.

    MASKED=False is the steady state: whole blocks every row sees, no masks at all. MASKED=True
    handles the diagonal (causal) and the last, partial block (j >= Nk)."""
    cols0 = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_PAD)
    for start in range(lo, hi, BLOCK_N):
        cols = start + cols0
        if TMA:  # tensor descriptors: the copy engine zero-fills rows past Nk and columns past D
            k = k_base.load([start, 0])
            v = v_base.load([start, 0])
        else:
            k_ptrs = k_base + cols[:, None] * stride_kn + dims[None, :]
            v_ptrs = v_base + cols[:, None] * stride_vn + dims[None, :]
            k = load_tile(k_ptrs, cols < n_k, dims, HEAD_DIM, HEAD_PAD, MASKED)
            v = load_tile(v_ptrs, cols < n_k, dims, HEAD_DIM, HEAD_PAD, MASKED)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k))  # raw scores q.k in float32; the scale is applied below, fused
        if MASKED:
            keep = cols[None, :] < n_k
            if CAUSAL:
                keep = keep & (cols[None, :] <= rows[:, None] + causal_offset)
            s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)  # base-2 units: log2(e) * scale * max(q.k)
        if MASKED:
            # A row that has seen no key yet has m = -inf; shift it by 0 instead (-inf - -inf is
            # NaN).
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_shift = m_new
        p = tl.math.exp2(s * qk_scale - m_shift[:, None])  # one FMA and one exp2 per score
        alpha = tl.math.exp2(m_i - m_shift)  # rescales what was accumulated under the old maximum
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        p = p.to(
            v.dtype
        )  # P goes through the tensor cores in the input precision, as in FlashAttention
        if UPCAST:
            p = p.to(tl.float32)
            v = v.to(tl.float32)
        acc = tl.dot(p, v, acc)
        m_i = m_new
    return acc, l_i, m_i


@triton.autotune(
    configs=FWD_CONFIGS,
    key=TUNE_KEY + ["TMA"],
    prune_configs_by={"early_config_prune": _pruner(FWD_TUNING)},
)
@triton.jit
def flash_fwd_kernel(
    Q,
    K,
    V,
    OUT,
    LSE,
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
    n_q_heads,
    group,
    n_q,
    n_k,
    qk_scale,
    N_Q_BUCKET,
    N_K_BUCKET,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr,
    TMA: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    if (
        CAUSAL
    ):  # the last query blocks see the most keys: start them first so the tail of the grid is short
        pid_m = tl.num_programs(0) - 1 - pid_m
    bh = tl.program_id(1)
    b = bh // n_q_heads
    h = bh % n_q_heads
    kv_h = h // group  # grouped-query attention: index arithmetic, K and V are never repeated
    q_base = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    k_base = K + b.to(tl.int64) * stride_kb + kv_h.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + kv_h.to(tl.int64) * stride_vh

    m0 = pid_m * BLOCK_M
    rows = m0 + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_PAD)
    o_base = OUT + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
    if TMA:
        # Tensor descriptors of this (batch, head)'s 2-D slices: the TMA engine copies whole tiles
        # into shared memory without address arithmetic in the threads, and clips at the slice's
        # edges.
        q_desc = tl.make_tensor_descriptor(
            q_base, [n_q, HEAD_DIM], [stride_qm, 1], [BLOCK_M, HEAD_PAD]
        )
        k_src = tl.make_tensor_descriptor(
            k_base, [n_k, HEAD_DIM], [stride_kn, 1], [BLOCK_N, HEAD_PAD]
        )
        v_src = tl.make_tensor_descriptor(
            v_base, [n_k, HEAD_DIM], [stride_vn, 1], [BLOCK_N, HEAD_PAD]
        )
        q = q_desc.load([m0, 0])
    else:
        k_src = k_base
        v_src = v_base
        q = load_tile(
            q_base + rows[:, None] * stride_qm + dims[None, :],
            rows < n_q,
            dims,
            HEAD_DIM,
            HEAD_PAD,
            True,
        )
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)

    causal_offset = n_k - n_q
    unmasked_end, hi = _key_range(m0, n_k, causal_offset, CAUSAL, BLOCK_M, BLOCK_N)
    acc, l_i, m_i = _fwd_kv_loop(
        acc,
        l_i,
        m_i,
        q,
        k_src,
        v_src,
        stride_kn,
        stride_vn,
        rows,
        0,
        unmasked_end,
        n_k,
        causal_offset,
        qk_scale,
        HEAD_DIM,
        HEAD_PAD,
        BLOCK_N,
        False,
        CAUSAL,
        UPCAST,
        TMA,
    )
    acc, l_i, m_i = _fwd_kv_loop(
        acc,
        l_i,
        m_i,
        q,
        k_src,
        v_src,
        stride_kn,
        stride_vn,
        rows,
        unmasked_end,
        hi,
        n_k,
        causal_offset,
        qk_scale,
        HEAD_DIM,
        HEAD_PAD,
        BLOCK_N,
        True,
        CAUSAL,
        UPCAST,
        TMA,
    )

    # A row that saw no key (causal with Nq > Nk) has l = 0: its output is 0 and its lse -inf.
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(
        seen, (m_i + tl.math.log2(l_safe)) * 0.6931471805599453, float("-inf")
    )  # natural log
    if TMA:
        o_desc = tl.make_tensor_descriptor(
            o_base, [n_q, HEAD_DIM], [stride_om, 1], [BLOCK_M, HEAD_PAD]
        )
        o_desc.store([m0, 0], out.to(OUT.dtype.element_ty))
    else:
        tl.store(
            o_base + rows[:, None] * stride_om + dims[None, :],
            out.to(OUT.dtype.element_ty),
            mask=tile_mask(rows < n_q, dims, HEAD_DIM),
        )
    tl.store(LSE + bh.to(tl.int64) * n_q + rows, lse, mask=rows < n_q)


# The forward's compiled kernels per call signature, launched without Triton's per-call binding.
FWD_LAUNCHES = LaunchCache(flash_fwd_kernel)


def softmax_scale(scale, head_dim: int) -> float:
    """The scale of q.k: 1/sqrt(head_dim) by default, else a checked positive finite number."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"flash_attention: scale must be a positive finite number, got {scale!r}")
    return float(scale)


def input_signature(q, k, v) -> tuple | None:
    """Every fact `check_inputs` judges (shapes, strides, dtypes, devices); None if q, k or v is not
    a tensor. Inputs with a signature that passed once pass again: the checks run once per
    signature, not once per call (they cost microseconds a decode step does not have)."""
    try:
        return (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(),
                q.dtype, k.dtype, v.dtype, q.device, k.device, v.device)  # fmt: skip
    except (AttributeError, TypeError):
        return None


_CHECKED: set = set()
_MAX_CHECKED = 4096  # signatures remembered; a KV cache growing token by token adds one per step


def check_inputs(op: str, q, k, v) -> tuple | None:
    """The checks of `check_attention_inputs`, and a head size these kernels can tile. Returns the
    inputs' signature (see `input_signature`)."""
    signature = input_signature(q, k, v)
    if signature is not None and signature in _CHECKED:
        return signature
    check_attention_inputs(q, k, v, op=op)
    if q.dtype == torch.bfloat16:
        check_bf16_products(op)
    head_dim = q.shape[-1]
    if head_dim % 8 or not 8 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(
            f"{op}: head_dim {head_dim} is not supported; supported: multiples of 8 "
            f"up to {MAX_HEAD_DIM}"
        )
    if len(_CHECKED) >= _MAX_CHECKED:
        _CHECKED.clear()
    _CHECKED.add(signature)
    return signature


def output_buffers(op: str, q: torch.Tensor, out: torch.Tensor | None, lse: torch.Tensor | None):
    """(out, lse) to write into: the caller's (checked), or new ones. out may have any strides with
    a contiguous last dimension; lse must be a contiguous float32 (B, Hq, Nq)."""
    batch, n_heads, n_q, head_dim = q.shape
    if out is None:
        out = torch.empty((batch, n_heads, n_q, head_dim), dtype=q.dtype, device=q.device)
    elif (
        out.shape != q.shape
        or out.dtype != q.dtype
        or out.device != q.device
        or out.stride(-1) != 1
    ):
        raise ValueError(
            f"{op}: out must have q's shape {tuple(q.shape)}, dtype and device, with a contiguous "
            f"last dimension; got {tuple(out.shape)} {out.dtype} on {out.device}"
        )
    if lse is None:
        lse = torch.empty((batch, n_heads, n_q), dtype=torch.float32, device=q.device)
    elif (
        lse.shape != q.shape[:3]
        or lse.dtype != torch.float32
        or lse.device != q.device
        or not lse.is_contiguous()
    ):
        raise ValueError(
            f"{op}: lse must be a contiguous float32 tensor of shape {tuple(q.shape[:3])} on "
            f"{q.device}; got {tuple(lse.shape)} {lse.dtype}"
        )
    return out, lse


def tma_compatible(*tensors: torch.Tensor) -> bool:
    """A TMA descriptor needs a 16-byte aligned base and 16-byte multiples as strides (last
    one 1)."""
    return all(
        t.data_ptr() % 16 == 0 and all(s * t.element_size() % 16 == 0 for s in t.stride()[:3])
        for t in tensors
    )


def _set_tma_allocator() -> None:
    """Descriptors made inside a kernel live in a global scratch buffer that Triton asks the host
    for."""
    global _TMA_ALLOCATOR_SET
    if not _TMA_ALLOCATOR_SET and runtime.ON_GPU:
        triton.set_allocator(
            lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda")
        )
        _TMA_ALLOCATOR_SET = True


_TMA_ALLOCATOR_SET = False


def flash_attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
    *,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    tma: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse): out (B, Hq, Nq, D) in q's dtype, lse (B, Hq, Nq) float32 (natural log), written
    into `out` and `lse` when given (not differentiable: `flash_attention` is).

    `tma` picks how tiles reach shared memory: tensor descriptors (the Hopper TMA engine) or pointer
    arithmetic (cp.async); None follows USE_TMA, falling back to pointers for unaligned strides."""
    return _forward(q, k, v, causal, scale, out, lse, tma, keep_lse=True)


@dataclass(frozen=True)
class ForwardPlan:
    """What a forward call needs beyond its tensors, worked out once per input signature."""

    empty: bool  # nothing to compute (a zero-sized dimension)
    strides: tuple  # q's, k's and v's (batch, head, seq) strides
    out_strides: tuple  # (batch, head, seq) strides of a new contiguous output
    sizes: tuple  # n_heads, group, n_q, n_k
    buckets: tuple  # the autotuner's length buckets of n_q and n_k
    qk_scale: float  # the default scale 1/sqrt(D), times log2(e)
    head_dim: int
    head_pad: int  # head_tile(head_dim)
    programs_bh: int  # batch x query heads: the grid's second axis
    lse_scratch: torch.Tensor  # where the log-sum-exp goes when the caller does not keep it

    def grid(self, meta) -> tuple:
        return triton.cdiv(self.sizes[2], meta["BLOCK_M"]), self.programs_bh, 1


_FWD_PLANS: dict = {}
_MAX_PLANS = 64  # plans remembered (each holds an lse row of scratch)


def _forward_plan(signature, q, k, v) -> ForwardPlan:
    batch, n_heads, n_q, head_dim = q.shape
    n_kv_heads, n_k = k.shape[1], k.shape[2]
    plan = ForwardPlan(
        empty=q.numel() == 0,
        strides=(*q.stride()[:3], *k.stride()[:3], *v.stride()[:3]),
        out_strides=(n_heads * n_q * head_dim, n_q * head_dim, head_dim),
        sizes=(n_heads, n_heads // n_kv_heads, n_q, n_k),
        buckets=(_bucket(n_q), _bucket(n_k)),
        qk_scale=softmax_scale(None, head_dim) * LOG2E,
        head_dim=head_dim,
        head_pad=head_tile(head_dim),
        programs_bh=batch * n_heads,
        lse_scratch=torch.empty((batch, n_heads, n_q), dtype=torch.float32, device=q.device),
    )
    if not (runtime.ON_GPU and torch.cuda.is_current_stream_capturing()):
        if len(_FWD_PLANS) >= _MAX_PLANS:
            _FWD_PLANS.clear()
        _FWD_PLANS[signature] = plan
    return plan


def call_key(q, k, v, causal) -> tuple:
    """What a call with new outputs depends on: every fact `check_inputs` judges (the inputs'
    signature), `causal`, USE_TMA, and whether all three data pointers are 16-byte aligned (0 if so:
    Triton specializes each pointer on it). AttributeError if q, k or v is not a tensor."""
    return (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(),
            q.dtype, k.dtype, v.dtype, q.device, k.device, v.device,
            causal, USE_TMA, (q.data_ptr() | k.data_ptr() | v.data_ptr()) % 16)  # fmt: skip


class ForwardCall:
    """A forward call with new outputs, worked out once per `call_key`: what to allocate and every
    launch argument that is not a tensor. It is also the call's key in FWD_LAUNCHES (hashed by
    identity: no tuple to build and hash a second time)."""

    __slots__ = ("lse_scratch", "qk_scale", "head_dim", "before_scale", "after_scale", "grid",
                 "constants")  # fmt: skip

    def __init__(self, plan: ForwardPlan, constants: dict):
        self.lse_scratch = plan.lse_scratch
        self.qk_scale, self.head_dim = plan.qk_scale, plan.head_dim
        self.before_scale = (*plan.strides, *plan.out_strides, *plan.sizes)
        self.after_scale = plan.buckets
        self.grid, self.constants = plan.grid, constants


# call_key -> ForwardCall, for the calls of the hot path (new outputs, aligned inputs)
_FWD_CALLS: dict = {}


def _remember_call(q, k, v, causal, plan: ForwardPlan, constants: dict) -> ForwardCall:
    if len(_FWD_CALLS) >= _MAX_PLANS:
        for old in _FWD_CALLS.values():
            FWD_LAUNCHES.entries.pop(old, None)
        _FWD_CALLS.clear()
    call = _FWD_CALLS[call_key(q, k, v, causal)] = ForwardCall(plan, constants)
    return call


def _forward(q, k, v, causal, scale, out, lse, tma, keep_lse: bool):
    """The forward's launch. With keep_lse=False (and no lse given) the log-sum-exp goes to the
    plan's scratch row (the next call with the same signature overwrites it)."""
    if out is None and lse is None and tma is None:
        # The hot path (every eager prefill call): inputs with a key seen before passed every check
        # of `check_inputs` then (the key holds each fact they judge: shapes, strides, dtypes,
        # devices), so one dict lookup stands for the checks, the plan and the launch key. Only the
        # scale, which the key leaves out, is checked here. A new key, a non-tensor, an unaligned
        # pointer or caller-given outputs take the full path below.
        try:
            call = _FWD_CALLS.get(call_key(q, k, v, causal))
        except (AttributeError, TypeError):  # not a tensor, or an unhashable `causal`
            call = None
        if call is not None:
            # empty_like reads shape, dtype and device from one tensor (out has q's shape, a new
            # lse the scratch row's): on the H100 the two cost 5.6 us of host time, against 9.3
            # us for torch.empty with keyword arguments
            out = torch.empty_like(q, memory_format=torch.contiguous_format)
            lse = torch.empty_like(call.lse_scratch) if keep_lse else call.lse_scratch
            qk_scale = call.qk_scale if scale is None else (
                softmax_scale(scale, call.head_dim) * LOG2E)  # fmt: skip
            FWD_LAUNCHES.launch(call, call.grid, (q, k, v, out, lse, *call.before_scale, qk_scale,
                                                  *call.after_scale), call.constants)  # fmt: skip
            return out, lse
    signature = check_inputs("flash_attention", q, k, v)
    plan = _FWD_PLANS.get(signature) or _forward_plan(signature, q, k, v)
    qk_scale = plan.qk_scale if scale is None else softmax_scale(scale, plan.head_dim) * LOG2E
    # Outputs: new ones (contiguous, aligned: nothing to key on), or the caller's, checked.
    if out is None and lse is None:
        out_key = None
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        lse = torch.empty_like(plan.lse_scratch) if keep_lse else plan.lse_scratch
    else:
        out, lse = output_buffers("flash_attention", q, out, lse)
        out_key = (out.stride(), out.data_ptr() % 16, lse.data_ptr() % 16)
    if plan.empty:
        return out, lse
    use_tma = USE_TMA if tma is None else bool(tma)
    if use_tma and not runtime.has("tma"):
        if tma:
            runtime.require("tma", "flash_attention(tma=True)")
        use_tma = False
    if use_tma:
        if not tma_compatible(q, k, v, out):
            if tma:
                raise ValueError(
                    "flash_attention: tma=True needs 16-byte aligned data and strides (in bytes) "
                    "for q, k, v and out"
                )
            use_tma = False
        else:
            _set_tma_allocator()
    # Everything Triton specializes on, or the autotuner keys on, follows from these (fast_launch).
    constants = {"HEAD_DIM": plan.head_dim, "HEAD_PAD": plan.head_pad, "CAUSAL": bool(causal),
                 "UPCAST": UPCAST, "TMA": use_tma}  # fmt: skip
    aligned = (q.data_ptr() | k.data_ptr() | v.data_ptr()) % 16 == 0
    remembered = _FWD_PLANS.get(signature) is plan  # not during a CUDA-graph capture
    if out_key is None and tma is None and aligned and remembered and isinstance(causal, bool):
        # the next call like this one takes the hot path above
        key = _remember_call(q, k, v, causal, plan, constants)
    else:
        key = (signature, out_key, bool(causal), use_tma, q.data_ptr() % 16, k.data_ptr() % 16,
               v.data_ptr() % 16)  # fmt: skip
    out_strides = plan.out_strides if out_key is None else out.stride()[:3]
    args = (q, k, v, out, lse, *plan.strides, *out_strides, *plan.sizes, qk_scale, *plan.buckets)
    FWD_LAUNCHES.launch(key, plan.grid, args, constants)
    return out, lse


# ------------------------------------------------------------------------------------------------
# Backward


@triton.jit
def flash_bwd_preprocess_kernel(
    OUT,
    DO,
    LSE,
    DELTA,
    LSE2,
    stride_ob,
    stride_oh,
    stride_om,
    stride_dob,
    stride_doh,
    stride_dom,
    n_q_heads,
    n_q,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """D = rowsum(dO * O), and lse in base 2 with -inf (a row that saw no key) turned into +inf, so
    the recomputed P = exp2(s * scale * log2e - lse2) is 0 there instead of NaN."""
    bh = tl.program_id(1)
    b = bh // n_q_heads
    h = bh % n_q_heads
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_PAD)
    o_ptrs = (
        OUT
        + b.to(tl.int64) * stride_ob
        + h.to(tl.int64) * stride_oh
        + rows[:, None] * stride_om
        + dims[None, :]
    )
    do_ptrs = (
        DO
        + b.to(tl.int64) * stride_dob
        + h.to(tl.int64) * stride_doh
        + rows[:, None] * stride_dom
        + dims[None, :]
    )
    o = load_tile(o_ptrs, rows < n_q, dims, HEAD_DIM, HEAD_PAD, True).to(tl.float32)
    do = load_tile(do_ptrs, rows < n_q, dims, HEAD_DIM, HEAD_PAD, True).to(tl.float32)
    offs = bh.to(tl.int64) * n_q + rows
    tl.store(DELTA + offs, tl.sum(o * do, 1), mask=rows < n_q)
    lse = tl.load(LSE + offs, mask=rows < n_q, other=0.0)
    tl.store(
        LSE2 + offs,
        tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634),
        mask=rows < n_q,
    )


@triton.jit
def _dkdv_q_loop(
    dk,
    dv,
    k,
    v,
    q_base,
    do_base,
    lse2_base,
    delta_base,
    dq_acc_base,
    stride_qm,
    stride_dom,
    cols,
    lo,
    hi,
    n_q,
    causal_offset,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CAUSAL_MASK: tl.constexpr,
    UPCAST: tl.constexpr,
    ATOMIC_DQ: tl.constexpr,
):
    """Add the contributions of query rows [lo, hi) of one head to dK and dV of the key block `cols`
    (and with ATOMIC_DQ, this key block's share of dQ to a float32 buffer, by atomic adds).

    Rows past Nq are loaded as zeros with lse2 = +inf, so their P is exactly 0 without a mask on P
    (the row masks on the loads are predicates on the copies, nearly free). CAUSAL_MASK applies the
    causal mask, for the query blocks on the diagonal."""
    rows0 = tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_PAD)
    for start in range(lo, hi, BLOCK_M):
        rows = start + rows0
        row_ok = rows < n_q
        q = load_tile(
            q_base + rows[:, None] * stride_qm + dims[None, :],
            row_ok,
            dims,
            HEAD_DIM,
            HEAD_PAD,
            True,
        )
        do = load_tile(
            do_base + rows[:, None] * stride_dom + dims[None, :],
            row_ok,
            dims,
            HEAD_DIM,
            HEAD_PAD,
            True,
        )
        lse2 = tl.load(lse2_base + rows, mask=row_ok, other=float("inf"))
        delta = tl.load(delta_base + rows, mask=row_ok, other=0.0)
        dtype = q.dtype  # the input precision, also in CPU mode where tiles are float32
        if UPCAST:
            q = q.to(tl.float32)
            do = do.to(tl.float32)
        s_t = tl.dot(k, tl.trans(q))  # S^T: (keys, queries)
        p_t = tl.math.exp2(s_t * qk_scale - lse2[None, :])
        if CAUSAL_MASK:
            p_t = tl.where(cols[:, None] <= rows[None, :] + causal_offset, p_t, 0.0)
        p_lo = p_t.to(dtype)
        if UPCAST:
            p_lo = p_lo.to(tl.float32)
        dv = tl.dot(p_lo, do, dv)
        dp_t = tl.dot(v, tl.trans(do))
        ds_t = p_t * (dp_t - delta[None, :])
        ds_lo = ds_t.to(dtype)
        if UPCAST:
            ds_lo = ds_lo.to(tl.float32)
        dk = tl.dot(ds_lo, q, dk)
        if ATOMIC_DQ:
            dq = tl.dot(tl.trans(ds_lo), k)  # (queries, D), unscaled
            tl.atomic_add(
                dq_acc_base + rows[:, None] * HEAD_DIM + dims[None, :],
                dq,
                mask=tile_mask(row_ok, dims, HEAD_DIM),
                sem="relaxed",
            )
    return dk, dv


@triton.autotune(
    configs=DKDV_CONFIGS,
    key=TUNE_KEY + ["ATOMIC_DQ"],
    reset_to_zero=["DQ_ACC"],
    prune_configs_by={"early_config_prune": _pruner(DKDV_TUNING)},
)
@triton.jit
def flash_bwd_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    LSE2,
    DELTA,
    DK,
    DV,
    DQ_ACC,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_dob,
    stride_doh,
    stride_dom,
    stride_dkb,
    stride_dkh,
    stride_dkn,
    stride_dvb,
    stride_dvh,
    stride_dvn,
    n_q_heads,
    group,
    n_q,
    n_k,
    scale,
    qk_scale,
    N_Q_BUCKET,
    N_K_BUCKET,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr,
    ATOMIC_DQ: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One program per (key block, batch, KV head): dK and dV of BLOCK_N keys, summed over every
    query block and over the `group` query heads that share this KV head, in registers (no atomics).

    ATOMIC_DQ (FlashAttention-2's own scheme): also add dS^T K of this key block to a float32 dQ
    buffer (B, Hq, Nq, D) by atomics, instead of recomputing S and dP in a separate dQ kernel: 5
    matrix products instead of 7, for B * Hq * Nq * D atomic adds per key block (and a summation
    order that varies from run to run)."""
    n0 = tl.program_id(0) * BLOCK_N
    n_kv_heads = n_q_heads // group
    b = tl.program_id(1) // n_kv_heads
    kv_h = tl.program_id(1) % n_kv_heads
    cols = n0 + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_PAD)
    k_ptrs = (
        K
        + b.to(tl.int64) * stride_kb
        + kv_h.to(tl.int64) * stride_kh
        + cols[:, None] * stride_kn
        + dims[None, :]
    )
    v_ptrs = (
        V
        + b.to(tl.int64) * stride_vb
        + kv_h.to(tl.int64) * stride_vh
        + cols[:, None] * stride_vn
        + dims[None, :]
    )
    k = load_tile(k_ptrs, cols < n_k, dims, HEAD_DIM, HEAD_PAD, True)
    v = load_tile(v_ptrs, cols < n_k, dims, HEAD_DIM, HEAD_PAD, True)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros([BLOCK_N, HEAD_PAD], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_PAD], dtype=tl.float32)

    causal_offset = n_k - n_q
    if CAUSAL:
        # Query i sees key j iff i >= j - offset: start at the first query that sees this block's
        # first key; the causal mask is needed up to the first query block whose every row sees all
        # the keys.
        lo = tl.minimum(tl.maximum(0, n0 - causal_offset) // BLOCK_M * BLOCK_M, n_q)
        diag_end = tl.minimum(
            tl.cdiv(tl.maximum(0, n0 + BLOCK_N - 1 - causal_offset), BLOCK_M) * BLOCK_M, n_q
        )
        diag_end = tl.maximum(diag_end, lo)
    else:
        lo = 0
        diag_end = 0
    for g in range(group):
        h = kv_h * group + g
        bh = b * n_q_heads + h
        q_base = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
        do_base = DO + b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh
        lse2_base = LSE2 + bh.to(tl.int64) * n_q
        delta_base = DELTA + bh.to(tl.int64) * n_q
        dq_acc_base = DQ_ACC + bh.to(tl.int64) * n_q * HEAD_DIM
        # Two loops, not three (diagonal, interior, last partial block): a third pipelined loop made
        # ptxas spill at every tile size on sm_90, which costs more than the row predicates.
        dk, dv = _dkdv_q_loop(
            dk,
            dv,
            k,
            v,
            q_base,
            do_base,
            lse2_base,
            delta_base,
            dq_acc_base,
            stride_qm,
            stride_dom,
            cols,
            lo,
            diag_end,
            n_q,
            causal_offset,
            qk_scale,
            HEAD_DIM,
            HEAD_PAD,
            BLOCK_M,
            CAUSAL,
            UPCAST,
            ATOMIC_DQ,
        )
        dk, dv = _dkdv_q_loop(
            dk,
            dv,
            k,
            v,
            q_base,
            do_base,
            lse2_base,
            delta_base,
            dq_acc_base,
            stride_qm,
            stride_dom,
            cols,
            diag_end,
            n_q,
            n_q,
            causal_offset,
            qk_scale,
            HEAD_DIM,
            HEAD_PAD,
            BLOCK_M,
            False,
            UPCAST,
            ATOMIC_DQ,
        )
    dk = dk * scale
    kv_mask = tile_mask(cols < n_k, dims, HEAD_DIM)
    tl.store(
        DK
        + b.to(tl.int64) * stride_dkb
        + kv_h.to(tl.int64) * stride_dkh
        + cols[:, None] * stride_dkn
        + dims[None, :],
        dk.to(DK.dtype.element_ty),
        mask=kv_mask,
    )
    tl.store(
        DV
        + b.to(tl.int64) * stride_dvb
        + kv_h.to(tl.int64) * stride_dvh
        + cols[:, None] * stride_dvn
        + dims[None, :],
        dv.to(DV.dtype.element_ty),
        mask=kv_mask,
    )


@triton.jit
def _dq_kv_loop(
    dq,
    q,
    do,
    lse2,
    delta,
    k_base,
    v_base,
    stride_kn,
    stride_vn,
    rows,
    lo,
    hi,
    n_k,
    causal_offset,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Add the contributions of keys [lo, hi) to dQ of the query rows `rows`."""
    cols0 = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_PAD)
    for start in range(lo, hi, BLOCK_N):
        cols = start + cols0
        k_ptrs = k_base + cols[:, None] * stride_kn + dims[None, :]
        v_ptrs = v_base + cols[:, None] * stride_vn + dims[None, :]
        k = load_tile(k_ptrs, cols < n_k, dims, HEAD_DIM, HEAD_PAD, MASKED)
        v = load_tile(v_ptrs, cols < n_k, dims, HEAD_DIM, HEAD_PAD, MASKED)
        dtype = k.dtype
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k))
        p = tl.math.exp2(s * qk_scale - lse2[:, None])
        if MASKED:
            keep = cols[None, :] < n_k
            if CAUSAL:
                keep = keep & (cols[None, :] <= rows[:, None] + causal_offset)
            p = tl.where(keep, p, 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = (p * (dp - delta[:, None])).to(dtype)
        if UPCAST:
            ds = ds.to(tl.float32)
        dq = tl.dot(ds, k, dq)
    return dq


@triton.autotune(
    configs=DQ_CONFIGS, key=TUNE_KEY, prune_configs_by={"early_config_prune": _pruner(DQ_TUNING)}
)
@triton.jit
def flash_bwd_dq_kernel(
    Q,
    K,
    V,
    DO,
    LSE2,
    DELTA,
    DQ,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_dob,
    stride_doh,
    stride_dom,
    stride_dqb,
    stride_dqh,
    stride_dqm,
    n_q_heads,
    group,
    n_q,
    n_k,
    scale,
    qk_scale,
    N_Q_BUCKET,
    N_K_BUCKET,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One program per (query block, batch, head): dQ over the key blocks the queries see."""
    pid_m = tl.program_id(0)
    if CAUSAL:
        pid_m = tl.num_programs(0) - 1 - pid_m
    bh = tl.program_id(1)
    b = bh // n_q_heads
    h = bh % n_q_heads
    kv_h = h // group
    m0 = pid_m * BLOCK_M
    rows = m0 + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_PAD)
    row_mask = rows < n_q
    q_ptrs = (
        Q
        + b.to(tl.int64) * stride_qb
        + h.to(tl.int64) * stride_qh
        + rows[:, None] * stride_qm
        + dims[None, :]
    )
    do_ptrs = (
        DO
        + b.to(tl.int64) * stride_dob
        + h.to(tl.int64) * stride_doh
        + rows[:, None] * stride_dom
        + dims[None, :]
    )
    q = load_tile(q_ptrs, row_mask, dims, HEAD_DIM, HEAD_PAD, True)
    do = load_tile(do_ptrs, row_mask, dims, HEAD_DIM, HEAD_PAD, True)
    lse2 = tl.load(LSE2 + bh.to(tl.int64) * n_q + rows, mask=row_mask, other=float("inf"))
    delta = tl.load(DELTA + bh.to(tl.int64) * n_q + rows, mask=row_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    k_base = K + b.to(tl.int64) * stride_kb + kv_h.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + kv_h.to(tl.int64) * stride_vh
    dq = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    causal_offset = n_k - n_q
    unmasked_end, hi = _key_range(m0, n_k, causal_offset, CAUSAL, BLOCK_M, BLOCK_N)
    dq = _dq_kv_loop(
        dq,
        q,
        do,
        lse2,
        delta,
        k_base,
        v_base,
        stride_kn,
        stride_vn,
        rows,
        0,
        unmasked_end,
        n_k,
        causal_offset,
        qk_scale,
        HEAD_DIM,
        HEAD_PAD,
        BLOCK_N,
        False,
        CAUSAL,
        UPCAST,
    )
    dq = _dq_kv_loop(
        dq,
        q,
        do,
        lse2,
        delta,
        k_base,
        v_base,
        stride_kn,
        stride_vn,
        rows,
        unmasked_end,
        hi,
        n_k,
        causal_offset,
        qk_scale,
        HEAD_DIM,
        HEAD_PAD,
        BLOCK_N,
        True,
        CAUSAL,
        UPCAST,
    )
    dq = dq * scale
    tl.store(
        DQ
        + b.to(tl.int64) * stride_dqb
        + h.to(tl.int64) * stride_dqh
        + rows[:, None] * stride_dqm
        + dims[None, :],
        dq.to(DQ.dtype.element_ty),
        mask=tile_mask(row_mask, dims, HEAD_DIM),
    )


def backward_row_terms(do, out, lse) -> tuple[torch.Tensor, torch.Tensor]:
    """What every backward needs per query row: delta = rowsum(dO * O) and the log-sum-exp in
    log2 units, both float32 (B, H, Nq). `do` and `out` need a contiguous last dimension."""
    batch, n_heads, n_q, head_dim = out.shape
    delta = torch.empty_like(lse)
    lse2 = torch.empty_like(lse)
    pre_block = runtime.pick(gpu=64, cpu=128)
    flash_bwd_preprocess_kernel[(triton.cdiv(n_q, pre_block), batch * n_heads)](
        out,
        do,
        lse,
        delta,
        lse2,
        *out.stride()[:3],
        *do.stride()[:3],
        n_heads,
        n_q,
        HEAD_DIM=head_dim,
        HEAD_PAD=head_tile(head_dim),
        BLOCK_M=pre_block,
    )
    return delta, lse2


def flash_attention_backward(
    do, q, k, v, out, lse, causal: bool, scale: float, atomic_dq: bool | None = None
):
    """(dq, dk, dv) from the forward's out and lse; every gradient in its input's dtype.

    `atomic_dq` (None: ATOMIC_DQ) accumulates dQ inside the dK/dV kernel by float32 atomics instead
    of running the dQ kernel: less work, run-to-run variation in dQ's last bits."""
    atomic_dq = ATOMIC_DQ if atomic_dq is None else bool(atomic_dq)
    batch, n_heads, n_q, head_dim = q.shape
    n_kv_heads, n_k = k.shape[1], k.shape[2]
    group = n_heads // n_kv_heads
    if do.stride(-1) != 1:
        do = do.contiguous()
    dq, dk, dv = (
        torch.empty_like(q, memory_format=torch.contiguous_format),
        torch.empty_like(k, memory_format=torch.contiguous_format),
        torch.empty_like(v, memory_format=torch.contiguous_format),
    )
    if q.numel() == 0 or k.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    delta, lse2 = backward_row_terms(do, out, lse)
    common = {
        "HEAD_DIM": head_dim,
        "HEAD_PAD": head_tile(head_dim),
        "CAUSAL": bool(causal),
        "UPCAST": UPCAST,
    }
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3])
    sizes = (n_heads, group, n_q, n_k, scale, scale * LOG2E, _bucket(n_q), _bucket(n_k))
    dq_acc = (
        torch.zeros(q.shape, dtype=torch.float32, device=q.device) if atomic_dq else dk
    )  # dk: unused
    flash_bwd_dkdv_kernel[lambda meta: (triton.cdiv(n_k, meta["BLOCK_N"]), batch * n_kv_heads)](
        q,
        k,
        v,
        do,
        lse2,
        delta,
        dk,
        dv,
        dq_acc,
        *strides,
        *dk.stride()[:3],
        *dv.stride()[:3],
        *sizes,
        ATOMIC_DQ=atomic_dq,
        **common,
    )
    if atomic_dq:
        return dq.copy_(dq_acc.mul_(scale)), dk, dv
    flash_bwd_dq_kernel[lambda meta: (triton.cdiv(n_q, meta["BLOCK_M"]), batch * n_heads)](
        q, k, v, do, lse2, delta, dq, *strides, *dq.stride()[:3], *sizes, **common
    )
    return dq, dk, dv


class FlashAttentionFunction(torch.autograd.Function):
    """Attention with the Triton forward and backward: out = softmax(scale Q K^T [causal]) V, and
    lse."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale):
        # As little as a forward can do: the launch (which checks the inputs and the scale), and
        # what backward needs; backward works out the scale itself.
        out, lse = _forward(q, k, v, causal, scale, None, None, None, keep_lse=True)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale = causal, scale
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        # lse is marked non-differentiable: dlse is ignored (a loss built on it gets no gradient
        # through it)
        q, k, v, out, lse = ctx.saved_tensors
        scale = softmax_scale(ctx.scale, q.shape[-1])
        dq, dk, dv = flash_attention_backward(dout, q, k, v, out, lse, ctx.causal, scale)
        return dq, dk, dv, None, None


def _direct_apply():
    """(apply, transforms_active, unwrap_if_dead): the pieces of `Function.apply` for a Function
    without setup_context, or None if this torch release lacks one of them.

    `FlashAttentionFunction.apply` is a Python layer over the C++ apply that, for such a Function
    outside functorch transforms (torch.func), only checks that no transform is active and unwraps
    leftover ("dead") functorch wrappers among the arguments, in a generic loop that costs a few
    microseconds per call. `flash_attention` does those two steps itself and calls the C++ apply;
    inside a transform it takes `FlashAttentionFunction.apply` (which refuses, as before)."""
    try:
        apply = super(torch.autograd.Function, FlashAttentionFunction).apply
        return apply, torch._C._are_functorch_transforms_active, torch._C._functorch.unwrap_if_dead
    except AttributeError:
        return None


_DIRECT_APPLY = _direct_apply()


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
    return_lse: bool = False,
):
    """softmax(scale * q k^T) v with FlashAttention-2, differentiable.

    q: (B, Hq, Nq, D), k and v: (B, Hkv, Nk, D), Hq % Hkv == 0 (grouped-query attention), fp16 or
    bf16, D any multiple of 8 up to 256; any strides with a contiguous last dimension. `causal` is
    bottom-right aligned (query i sees keys j <= i + Nk - Nq). Returns out (B, Hq, Nq, D), and with
    `return_lse` also the natural-log log-sum-exp of the scaled scores, float32 (B, Hq, Nq).
    """
    # Without gradients to record, skip the autograd.Function (its bookkeeping costs microseconds).
    try:
        track = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    except AttributeError:  # not a tensor: the checks in _forward say which
        track = False
    if track:
        if _DIRECT_APPLY is not None and not _DIRECT_APPLY[1]():
            apply, _, unwrap = _DIRECT_APPLY
            out, lse = apply(unwrap(q), unwrap(k), unwrap(v), bool(causal), scale)
        else:
            out, lse = FlashAttentionFunction.apply(q, k, v, bool(causal), scale)
    else:
        out, lse = _forward(q, k, v, causal, scale, None, None, None, keep_lse=return_lse)
    return (out, lse) if return_lse else out
