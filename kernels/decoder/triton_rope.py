"""Rotary position embedding (RoPE) in Triton, with the KV-cache append fused in.

RoPE rotates each pair of a head's dimensions by an angle that grows with the token's position: with
theta_j = position * inv_freq[j] (j < D/2),

    y[j]       = x[j] cos(theta_j) - x[j + D/2] sin(theta_j)
    y[j + D/2] = x[j + D/2] cos(theta_j) + x[j] sin(theta_j)

The pairs are (j, j + D/2): the *half-split* layout of Hugging Face's Llama (`rotate_half`), not the
interleaved (2j, 2j + 1) of the RoPE paper. A checkpoint's q and k projections are permuted for the
pairing it was trained with: rotating the other pairs gives a model that runs and talks nonsense.

Positions are read per token from device memory: prefill (positions 0 ... T-1) and decode (one
position per sequence) share the kernel, and a CUDA graph replays it with new positions without a
new capture. The angle is computed in float32 in the kernel (position * inv_freq, one rounding, as
Hugging Face does), so no cos/sin table is read.

`rope_append` is what the decoder runs: one launch rotates q in place, rotates k and stores it into
the KV cache at the token's position, and stores v there too. A position outside the cache is not
written: the kernel raises a flag in `status` instead, which the host reads when it may synchronize.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import runtime
from kernels.decoder.pdl import launch_options, wait_then_release
from kernels.validate import FLOAT_DTYPES

POSITION_DTYPES = (torch.int32, torch.int64)
# Heads per program: a (heads, D/2) tile. 8 heads x 32 pairs x 2 halves is 512 elements, a warp's
# worth of 16-byte loads on each half; the interpreter pays per program, so it gets every head at
# once.
HEADS_PER_PROGRAM = runtime.pick(gpu=8, cpu=64)
STATUS_POSITION_OUT_OF_RANGE = 1  # the bit rope_append sets in `status`


@triton.jit
def _angles(POS, INV_FREQ, token, half, scale, BLOCK_D: tl.constexpr):
    """cos and sin of position * inv_freq[j] for j < half (times the model's attention scaling)."""
    j = tl.arange(0, BLOCK_D)
    pos = tl.load(
        POS + token + 0 * j
    )  # the token's position, once per pair (a vector, not a scalar)
    theta = pos.to(tl.float32) * tl.load(INV_FREQ + j, mask=j < half, other=0.0)
    return pos, j, tl.cos(theta) * scale, tl.sin(theta) * scale


@triton.jit
def _rotate(src, dst, j, mask, cos, sin, half):
    """Load the two halves at `src`, rotate them in float32, store them at `dst` (may be `src`)."""
    x1 = tl.load(src + j, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + half + j, mask=mask, other=0.0).to(tl.float32)
    y1 = x1 * cos - x2 * sin
    y2 = x2 * cos + x1 * sin
    tl.store(dst + j, y1.to(dst.dtype.element_ty), mask=mask)
    tl.store(dst + half + j, y2.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def rope_kernel(
    X,
    Y,
    POS,
    INV_FREQ,
    stride_xt,
    stride_xh,
    stride_yt,
    stride_yh,
    n_heads,
    half,
    scale,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    _, j, cos, sin = _angles(POS, INV_FREQ, token, half, scale, BLOCK_D)
    mask = (h[:, None] < n_heads) & (j[None, :] < half)
    src = X + token.to(tl.int64) * stride_xt + h[:, None].to(tl.int64) * stride_xh
    dst = Y + token.to(tl.int64) * stride_yt + h[:, None].to(tl.int64) * stride_yh
    _rotate(src, dst, j[None, :], mask, cos[None, :], sin[None, :], half)


def check_rope_args(
    op: str,
    x: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    *,
    device_type: str | None = None,
) -> None:
    """x (tokens, heads, even head_dim) float with a contiguous last dimension; positions (tokens,)
    int32/int64, contiguous; inv_freq float32 (head_dim / 2,); all on `device_type` (by default the
    mode's device, where Triton kernels run)."""
    device_type = device_type or runtime.DEVICE
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        raise ValueError(
            f"{op}: x must be a (tokens, heads, head_dim) tensor, got "
            f"{getattr(x, 'shape', type(x).__name__)}"
        )
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: x must be float32, float16 or bfloat16, not {x.dtype}")
    if x.shape[-1] % 2 or x.stride(-1) != 1:
        raise ValueError(
            f"{op}: head_dim must be even with a contiguous last dimension, got shape "
            f"{tuple(x.shape)} strides {x.stride()}"
        )
    if not isinstance(positions, torch.Tensor) or positions.dtype not in POSITION_DTYPES:
        raise TypeError(
            f"{op}: positions must be an int32 or int64 tensor, got "
            f"{getattr(positions, 'dtype', type(positions).__name__)}"
        )
    if positions.shape != x.shape[:1] or not positions.is_contiguous():
        raise ValueError(
            f"{op}: positions must be contiguous, one per token: shape {tuple(x.shape[:1])}, "
            f"got {tuple(positions.shape)}"
        )
    if inv_freq.dtype != torch.float32 or inv_freq.shape != (x.shape[-1] // 2,):
        raise ValueError(
            f"{op}: inv_freq must be float32 of shape ({x.shape[-1] // 2},), got "
            f"{inv_freq.dtype} {tuple(inv_freq.shape)}"
        )
    for name, t in (("x", x), ("positions", positions), ("inv_freq", inv_freq)):
        if t.device.type != device_type:
            raise ValueError(f"{op}: {name} is on {t.device}; this kernel runs on {device_type}")


def rope(
    x: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    scale: float = 1.0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x (tokens, heads, head_dim) rotated by RoPE at each token's position (half-split pairs).

    x may be strided over tokens and heads (a slice of a fused qkv buffer); `out=x` rotates in
    place. `scale` multiplies cos and sin (Hugging Face's `attention_scaling`, 1.0 for Llama)."""
    check_rope_args("rope", x, positions, inv_freq)
    if out is None:
        out = torch.empty_like(x)
    elif out.shape != x.shape or out.dtype != x.dtype or out.stride(-1) != 1:
        raise ValueError(
            f"rope: out must match x ({tuple(x.shape)} {x.dtype}), with a contiguous last "
            f"dimension; got {tuple(out.shape)} {out.dtype}"
        )
    tokens, heads, head_dim = x.shape
    if x.numel():
        block_h = min(HEADS_PER_PROGRAM, triton.next_power_of_2(heads))
        rope_kernel[(tokens, triton.cdiv(heads, block_h))](
            x,
            out,
            positions,
            inv_freq,
            x.stride(0),
            x.stride(1),
            out.stride(0),
            out.stride(1),
            heads,
            head_dim // 2,
            float(scale),
            BLOCK_H=block_h,
            BLOCK_D=triton.next_power_of_2(head_dim // 2),
            num_warps=runtime.pick(gpu=4, cpu=1),
        )
    return out


@triton.jit
def rope_append_kernel(
    QKV,
    POS,
    INV_FREQ,
    K_CACHE,
    V_CACHE,
    STATUS,
    stride_t,
    seq_len,
    n_q_heads,
    n_kv_heads,
    half,
    capacity,
    scale,
    stride_cb,
    stride_ch,
    stride_cs,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Program (token, head block): heads [0, n_q_heads) are q (rotated in place), then the KV
    heads."""
    wait_then_release(PDL)  # launched with PDL: nothing is read before the previous kernel ends
    token = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    pos, j, cos, sin = _angles(POS, INV_FREQ, token, half, scale, BLOCK_D)
    in_dims = j[None, :] < half
    row = QKV + token.to(tl.int64) * stride_t
    head_dim = 2 * half
    # q: rotated where it lies
    q_src = row + h[:, None].to(tl.int64) * head_dim
    _rotate(
        q_src,
        q_src,
        j[None, :],
        (h[:, None] < n_q_heads) & in_dims,
        cos[None, :],
        sin[None, :],
        half,
    )
    # k and v of KV head g, stored at the token's position: a position outside the cache is refused
    # (no store) and flagged, so a bad position corrupts nothing
    ok = (pos >= 0) & (pos < capacity)
    first = j + tl.program_id(1) == 0  # one lane of one program per token raises the flag
    tl.atomic_or(STATUS + 0 * j, 1, mask=((pos < 0) | (pos >= capacity)) & first)
    g = h - n_q_heads
    is_kv = (g >= 0) & (g < n_kv_heads)
    g = tl.where(is_kv, g, 0)
    b = token // seq_len
    slot = (
        b.to(tl.int64) * stride_cb
        + g[:, None].to(tl.int64) * stride_ch
        + tl.where(ok, pos, 0)[None, :].to(tl.int64) * stride_cs
    )
    kv_mask = is_kv[:, None] & in_dims & ok[None, :]
    k_src = row + (n_q_heads + g[:, None]).to(tl.int64) * head_dim
    _rotate(k_src, K_CACHE + slot, j[None, :], kv_mask, cos[None, :], sin[None, :], half)
    v_src = k_src + n_kv_heads * head_dim
    tl.store(V_CACHE + slot + j[None, :], tl.load(v_src + j[None, :], mask=kv_mask), mask=kv_mask)
    tl.store(
        V_CACHE + slot + half + j[None, :],
        tl.load(v_src + half + j[None, :], mask=kv_mask),
        mask=kv_mask,
    )


def rope_append(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    status: torch.Tensor,
    *,
    n_q_heads: int,
    n_kv_heads: int,
    batch: int,
    scale: float = 1.0,
    pdl: bool = False,
) -> None:
    """RoPE on q in place and the append of rotated k and of v to the cache, in one launch.

    qkv: (batch * seq, (n_q_heads + 2 n_kv_heads) * head_dim), the fused projection's output, tokens
    of sequence b at rows b * seq ... b * seq + seq - 1; positions (batch * seq,) int32/int64 on the
    device; k_cache, v_cache: (batch, n_kv_heads, capacity, head_dim) views of one layer's cache
    (contiguous last two dimensions); status: an int32 flag word, OR-ed with 1 where a position is
    outside [0, capacity). Shapes are the caller's (the decoder's) responsibility: checked once
    there, not per layer. `pdl`: launched with programmatic dependent launch where the GPU has it
    (pdl.py)."""
    tokens, width = qkv.shape
    head_dim = k_cache.shape[-1]
    heads = n_q_heads + n_kv_heads  # v needs no program of its own: the k program copies it
    block_h = min(HEADS_PER_PROGRAM, triton.next_power_of_2(heads))
    rope_append_kernel[(tokens, triton.cdiv(heads, block_h))](
        qkv,
        positions,
        inv_freq,
        k_cache,
        v_cache,
        status,
        qkv.stride(0),
        tokens // batch,
        n_q_heads,
        n_kv_heads,
        head_dim // 2,
        k_cache.shape[2],
        float(scale),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        BLOCK_H=block_h,
        BLOCK_D=triton.next_power_of_2(head_dim // 2),
        num_warps=runtime.pick(gpu=4, cpu=1),
        **launch_options(pdl),
    )
