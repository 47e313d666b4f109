"""fp8 quantization in Triton: q = fp8(clamp(x / scale)), with the scale from amax, one per tensor
or one per block of 128 consecutive elements; and the way back, x ~ q * scale.

fp8 has 3 (e4m3) or 2 (e5m2) mantissa bits and a range of +-448 or +-57344: a tensor must be scaled
into that range first. One scale per tensor lets a single outlier push every small value into fp8's
subnormals (or to zero); a scale per 128 elements adapts to each block's own amax.

Two scale rules (`pow2`):
* amax / FP8_MAX (float32): the block's largest value lands exactly on the largest fp8 number;
* OCP MX: 2**(floor(log2 amax) - emax), a power of two, so dividing and multiplying by it are exact;
  the block's largest values then land in [2**emax, 2**(emax + 1)), above FP8_MAX for e4m3 when
  amax's mantissa exceeds 1.75: they must be clamped to FP8_MAX. (On the GPU the float32 -> fp8
  conversion saturates by itself; the interpreter's does not, so the clamp is written out.)

**Rounding made explicit.** The Triton interpreter's float32 -> fp8 conversion loses the carry when
rounding up crosses a power of two (1.999 -> 1.0 instead of 2.0, 500 -> 256 in e4m3), so the kernels
round to the fp8 grid themselves (`round_to_fp8`, nearest-even, on the bits) and then convert a
value the format holds exactly: the same bits on the CPU and the GPU, and the same as PyTorch's
conversion.

**GPUs without fp8 (before sm_89: A100, A10, RTX 30xx, T4).** Triton has no e4m3 type there. Since
the kernels already round to the fp8 grid, they store those values as float32 instead, and PyTorch
converts them to fp8 exactly (`runtime.has("fp8")` decides); the way back reads fp8 converted to
float32 by PyTorch. The same bits, for 3 or 4 more bytes per element moved.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import runtime
from kernels.mixed_precision.reference import (
    FP8_BLOCK,
    FP8_EMAX,
    FP8_MANTISSA_BITS,
    FP8_MAX,
    FP8_MIN_EXPONENT,
)
from kernels.mixed_precision.validate import check_fp8_args

# Blocks of 128 per program: 32 (16 KB of float32 in, 4 KB of fp8 out) on the GPU; on the CPU few,
# large programs, because the interpreter pays per program.
GROUPS = runtime.pick(gpu=32, cpu=256)
NUM_WARPS = runtime.pick(gpu=4, cpu=1)
TENSOR_TILE = runtime.pick(gpu=4096, cpu=65536)  # elements per program of the per-tensor kernels


def fp8_constants(dtype: torch.dtype, pow2: bool) -> dict:
    """The constexpr arguments describing an fp8 format (and the scale rule) to the kernels."""
    mant, emin = FP8_MANTISSA_BITS[dtype], FP8_MIN_EXPONENT[dtype]
    # MAGIC: a power of two whose float32 ulp is the format's subnormal spacing 2**(emin - mant)
    return dict(
        FP8_MAX=FP8_MAX[dtype],
        EMAX=FP8_EMAX[dtype],
        MANT=mant,
        MIN_NORMAL=2.0**emin,
        MAGIC=2.0 ** (emin - mant + 23),
        POW2=pow2,
    )


@triton.jit
def round_to_fp8(v, MANT: tl.constexpr, MIN_NORMAL: tl.constexpr, MAGIC: tl.constexpr):
    """v (float32, in the format's range) rounded to nearest even on the fp8 grid, as float32."""
    a = tl.abs(v)
    # normal numbers: keep MANT mantissa bits, rounding the dropped ones to nearest even
    bits = a.to(tl.uint32, bitcast=True)
    drop = 23 - MANT
    bits = (bits + ((1 << (drop - 1)) - 1) + ((bits >> drop) & 1)) >> drop << drop
    normal = bits.to(tl.float32, bitcast=True)
    # subnormals: a float32 add at MAGIC's scale rounds to a multiple of the subnormal spacing
    subnormal = (a + MAGIC) - MAGIC
    r = tl.where(a < MIN_NORMAL, subnormal, normal)
    # v's sign bit put back on the bits: on the H100 `tl.where(v < 0, -r, r)` gave +0.0 where a
    # negative v rounds to zero (the interpreter, like PyTorch, gave -0.0)
    sign = v.to(tl.uint32, bitcast=True) & 0x80000000
    return (r.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _scale_from_amax(amax, FP8_MAX: tl.constexpr, EMAX: tl.constexpr, POW2: tl.constexpr):
    if POW2:
        # 2**(floor(log2 amax) - EMAX) on the bits: keep amax's exponent, zero its mantissa,
        # subtract EMAX
        exponent = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
        scale = ((exponent - EMAX) << 23).to(tl.float32, bitcast=True)
    else:
        scale = tl.math.div_rn(amax, FP8_MAX)  # IEEE division, as PyTorch's (see _to_fp8)
    return tl.where(amax > 0, scale, 1.0)


@triton.jit
def _to_fp8(
    v,
    scale,
    q_ptr,
    FP8_MAX: tl.constexpr,
    MANT: tl.constexpr,
    MIN_NORMAL: tl.constexpr,
    MAGIC: tl.constexpr,
):
    # div_rn: IEEE division, as PyTorch's; Triton's `/` on the GPU is an approximate (2-ulp)
    # division
    v = tl.minimum(tl.maximum(tl.math.div_rn(v, scale), -FP8_MAX), FP8_MAX)
    # an exact conversion
    return round_to_fp8(v, MANT, MIN_NORMAL, MAGIC).to(q_ptr.dtype.element_ty)


@triton.jit
def quantize_blocks_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    n,
    n_blocks,
    BLOCK: tl.constexpr,
    GROUPS: tl.constexpr,
    FP8_MAX: tl.constexpr,
    EMAX: tl.constexpr,
    MANT: tl.constexpr,
    MIN_NORMAL: tl.constexpr,
    MAGIC: tl.constexpr,
    POW2: tl.constexpr,
):
    """GROUPS blocks of BLOCK elements per program: amax per block, scale, quantize, store."""
    blk = tl.program_id(0).to(tl.int64) * GROUPS + tl.arange(0, GROUPS)
    offsets = blk[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    scale = _scale_from_amax(tl.max(tl.abs(x), axis=1), FP8_MAX, EMAX, POW2)
    tl.store(
        q_ptr + offsets,
        _to_fp8(x, scale[:, None], q_ptr, FP8_MAX, MANT, MIN_NORMAL, MAGIC),
        mask=mask,
    )
    tl.store(scale_ptr + blk, scale, mask=blk < n_blocks)


@triton.jit
def fake_quantize_kernel(
    x_ptr,
    out_ptr,
    n,
    BLOCK: tl.constexpr,
    GROUPS: tl.constexpr,
    FP8_MAX: tl.constexpr,
    EMAX: tl.constexpr,
    MANT: tl.constexpr,
    MIN_NORMAL: tl.constexpr,
    MAGIC: tl.constexpr,
    POW2: tl.constexpr,
):
    """quantize then dequantize in one pass: the values the fp8 tensor represents, in x's dtype
    (quantization-aware training's fake quantization; lab 04's reference)."""
    blk = tl.program_id(0).to(tl.int64) * GROUPS + tl.arange(0, GROUPS)
    offsets = blk[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    scale = _scale_from_amax(tl.max(tl.abs(x), axis=1), FP8_MAX, EMAX, POW2)[:, None]
    q = round_to_fp8(
        tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_MAX), FP8_MAX), MANT, MIN_NORMAL, MAGIC
    )
    tl.store(out_ptr + offsets, (q * scale).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def amax_kernel(x_ptr, out_ptr, n, TILE: tl.constexpr):
    """The largest |x| of each TILE elements; relaunched on its output until one value is left."""
    offsets = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
    x = tl.load(x_ptr + offsets, mask=offsets < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.max(tl.abs(x), axis=0))


@triton.jit
def quantize_tensor_kernel(
    x_ptr,
    q_ptr,
    amax_ptr,
    scale_ptr,
    n,
    TILE: tl.constexpr,
    FP8_MAX: tl.constexpr,
    EMAX: tl.constexpr,
    MANT: tl.constexpr,
    MIN_NORMAL: tl.constexpr,
    MAGIC: tl.constexpr,
    POW2: tl.constexpr,
):
    """One scale for the tensor, computed by every program from the amax in memory (no sync)."""
    offsets = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
    mask = offsets < n
    scale = _scale_from_amax(tl.load(amax_ptr), FP8_MAX, EMAX, POW2)
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(q_ptr + offsets, _to_fp8(x, scale, q_ptr, FP8_MAX, MANT, MIN_NORMAL, MAGIC), mask=mask)
    if tl.program_id(0) == 0:
        tl.store(scale_ptr, scale)


@triton.jit
def dequantize_kernel(
    q_ptr, scale_ptr, out_ptr, n, BLOCK: tl.constexpr, TILE: tl.constexpr, PER_TENSOR: tl.constexpr
):
    offsets = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
    mask = offsets < n
    if PER_TENSOR:
        scale = tl.load(scale_ptr)
    else:
        scale = tl.load(scale_ptr + offsets // BLOCK, mask=mask, other=1.0)
    q = tl.load(q_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offsets, (q * scale).to(out_ptr.dtype.element_ty), mask=mask)


def _amax(x: torch.Tensor) -> torch.Tensor:
    level = x.flatten()
    while True:
        programs = triton.cdiv(level.numel(), TENSOR_TILE)
        out = torch.empty(programs, dtype=torch.float32, device=x.device)
        amax_kernel[(programs,)](level, out, level.numel(), TILE=TENSOR_TILE, num_warps=NUM_WARPS)
        if programs == 1:
            return out
        level = out


def quantize(
    x: torch.Tensor,
    dtype: torch.dtype = torch.float8_e4m3fn,
    block: int | None = FP8_BLOCK,
    pow2: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scales): q of x's shape in `dtype`; scales float32, one per `block` elements of the
    flattened x (the last block may be partial), or one (shape (1,)) with block=None."""
    check_fp8_args("quantize", x, dtype, block)
    n = x.numel()
    # without fp8 in Triton, the kernel stores the values it rounded to the grid as float32
    stored = dtype if runtime.has("fp8") else torch.float32
    q = torch.empty(x.shape, dtype=stored, device=x.device)
    fp8 = fp8_constants(dtype, pow2)
    if block is None:
        scales = torch.ones(1, dtype=torch.float32, device=x.device)
        if n:
            quantize_tensor_kernel[(triton.cdiv(n, TENSOR_TILE),)](
                x, q, _amax(x), scales, n, TILE=TENSOR_TILE, num_warps=NUM_WARPS, **fp8
            )
        return q.to(dtype), scales
    n_blocks = triton.cdiv(n, block)
    scales = torch.empty(n_blocks, dtype=torch.float32, device=x.device)
    if n:
        groups = max(1, min(GROUPS, triton.next_power_of_2(n_blocks)))
        quantize_blocks_kernel[(triton.cdiv(n_blocks, groups),)](
            x, q, scales, n, n_blocks, BLOCK=block, GROUPS=groups, num_warps=NUM_WARPS, **fp8
        )
    return q.to(dtype), scales


def fake_quantize(
    x: torch.Tensor,
    dtype: torch.dtype = torch.float8_e4m3fn,
    block: int = FP8_BLOCK,
    pow2: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """dequantize(quantize(x)) per block, in one pass, in x's dtype (into `out` if given)."""
    check_fp8_args("fake_quantize", x, dtype, block)
    out = torch.empty_like(x) if out is None else out
    if x.numel():
        n_blocks = triton.cdiv(x.numel(), block)
        groups = max(1, min(GROUPS, triton.next_power_of_2(n_blocks)))
        fake_quantize_kernel[(triton.cdiv(n_blocks, groups),)](
            x,
            out,
            x.numel(),
            BLOCK=block,
            GROUPS=groups,
            num_warps=NUM_WARPS,
            **fp8_constants(dtype, pow2),
        )
    return out


def dequantize(
    q: torch.Tensor,
    scales: torch.Tensor,
    block: int | None = FP8_BLOCK,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """x ~ q * scale, in `out_dtype`."""
    if not isinstance(q, torch.Tensor) or q.dtype not in FP8_MAX:
        raise TypeError(
            "dequantize: q must be a float8_e4m3fn or float8_e5m2 tensor, got "
            f"{getattr(q, 'dtype', q)!r}"
        )
    if not q.is_contiguous():
        raise ValueError("dequantize: q must be contiguous")
    want = 1 if block is None else triton.cdiv(q.numel(), block)
    if scales.dtype != torch.float32 or scales.numel() != want:
        raise ValueError(
            f"dequantize: scales must be {want} float32 values for {q.numel()} elements in blocks "
            f"of {block}, got {scales.numel()} {scales.dtype}"
        )
    out = torch.empty(q.shape, dtype=out_dtype, device=q.device)
    if not runtime.has("fp8"):
        q = q.float()  # exact; Triton cannot read e4m3 before sm_89
    if q.numel():
        dequantize_kernel[(triton.cdiv(q.numel(), TENSOR_TILE),)](
            q,
            scales,
            out,
            q.numel(),
            BLOCK=block or 1,
            TILE=TENSOR_TILE,
            PER_TENSOR=block is None,
            num_warps=NUM_WARPS,
        )
    return out
