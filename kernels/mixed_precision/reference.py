"""The specification of the precision module in plain PyTorch.

* `round_to(v, acc)`: a float32 tensor rounded to the accumulator dtype and held in float32 again.
  Every low-precision kernel in this module computes in float32 and rounds after each step like
  this: an fp16/bf16 operation computed in float32 and rounded once is the correctly rounded
  fp16/bf16 result (float32 has more than 2p + 2 bits for p = 11 or 8), so CPU and GPU agree bit for
  bit.
* `sequential_sum`: s = s + x[i], one element at a time, rounded to `acc` after each step (the
  accumulation experiment of the CS336 assignment 2 handout, "mixed_precision_accumulation").
* `sum_fp64`, `abs_sum_fp64`: the exact answer and the condition scale sum |x_i| of a row.
* fp8: ranges, per-tensor and per-block scales from amax, and the fp64 quantize -> dequantize round
  trip.
"""

from __future__ import annotations

import torch

ACC_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Unit roundoff u = 2**-p (half an ulp at 1.0): the bound of one correctly rounded operation.
UNIT_ROUNDOFF = {
    torch.float64: 2.0**-53,
    torch.float32: 2.0**-24,
    torch.float16: 2.0**-11,
    torch.bfloat16: 2.0**-8,
}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
# Largest power-of-two exponent of a normal number (OCP MX: the block exponent is floor(log2 amax) -
# EMAX).
FP8_EMAX = {torch.float8_e4m3fn: 8, torch.float8_e5m2: 15}
FP8_MANTISSA_BITS = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}
FP8_MIN_EXPONENT = {torch.float8_e4m3fn: -6, torch.float8_e5m2: -14}  # of the smallest normal
FP8_BLOCK = 128


def round_to(v: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """v (float32) rounded to nearest-even in `acc`, returned as float32."""
    return v if acc == torch.float32 else v.to(acc).to(torch.float32)


def sequential_sum(x: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """The textbook loop: each element rounded to `acc`, added, the sum rounded to `acc` (a Python
    loop: for small n, such as the notebook's sum of increments)."""
    s = torch.zeros((), dtype=torch.float32)
    for v in round_to(x.detach().flatten().cpu().float(), acc):
        s = round_to(s + v, acc)
    return s


def _tree(v: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """Adjacent pairs, level by level, along the last dimension (a power of two), each rounded."""
    while v.shape[-1] > 1:
        v = round_to(v[..., 0::2] + v[..., 1::2], acc)
    return v[..., 0]


def _two_sum_tree(
    s: torch.Tensor, c: torch.Tensor, acc: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    while s.shape[-1] > 1:
        sa, sb, ca, cb = s[..., 0::2], s[..., 1::2], c[..., 0::2], c[..., 1::2]
        t = round_to(sa + sb, acc)
        b_virtual = round_to(t - sa, acc)
        e = round_to(
            round_to(sa - round_to(t - b_virtual, acc), acc) + round_to(sb - b_virtual, acc), acc
        )
        s, c = t, round_to(round_to(ca + cb, acc) - e, acc)
    return s[..., 0], c[..., 0]


def blocked_sum(
    x: torch.Tensor, acc: torch.dtype, algorithm: str, block: int, trips: int
) -> torch.Tensor:
    """The Triton kernels' sum, addition for addition (`triton_reduce.sum` with the same block and
    trips returns these bits in both modes): rows cut into chunks of block * trips elements; within
    a chunk lane j adds elements j, j + block, ... in order (naive, or Kahan with a compensation per
    lane), or, for pairwise (trips = 1), the chunk is one tree; lanes then meet in a tree of
    adjacent pairs; the chunks' partial sums (and minus their compensations) are summed the same way
    until one is left."""
    v = round_to(x.detach().float().reshape(-1, x.shape[-1]), acc)
    while True:
        rows, n = v.shape
        per_chunk = block * trips
        chunks = max(1, -(-n // per_chunk))
        v = torch.nn.functional.pad(v, (0, chunks * per_chunk - n)).view(rows, chunks, trips, block)
        comp = torch.zeros(rows, chunks, dtype=torch.float32, device=v.device)
        if algorithm == "pairwise":
            total = _tree(v.reshape(rows, chunks, per_chunk), acc)
        else:
            s = torch.zeros(rows, chunks, block, dtype=torch.float32, device=v.device)
            c = torch.zeros_like(s)
            for t in range(trips):
                if algorithm == "kahan":
                    y = round_to(v[:, :, t] - c, acc)
                    new = round_to(s + y, acc)
                    c = round_to(round_to(new - s, acc) - y, acc)
                    s = new
                else:
                    s = round_to(s + v[:, :, t], acc)
            total, comp = (
                _two_sum_tree(s, c, acc) if algorithm == "kahan" else (_tree(s, acc), comp)
            )
        if chunks == 1:
            return round_to(total[:, 0] - comp[:, 0], acc).reshape(x.shape[:-1]).to(acc)
        v = torch.cat([total, -comp], 1) if algorithm == "kahan" else total


def sum_fp64(x: torch.Tensor) -> torch.Tensor:
    """Exact (to float64) sum over the last dimension."""
    return x.double().sum(-1)


def abs_sum_fp64(x: torch.Tensor) -> torch.Tensor:
    """sum |x_i| over the last dimension: error bounds of a sum scale with it, not with |sum|."""
    return x.double().abs().sum(-1)


def error_bound(algorithm: str, n: int, acc: torch.dtype) -> float:
    """Worst-case |error| / sum|x_i| of summing n terms: (n-1)u naive, ceil(log2 n)u pairwise, 2u
    Kahan (plus the O(n u^2) term, negligible while n u << 1)."""
    import math

    u = UNIT_ROUNDOFF[acc]
    if algorithm == "naive":
        return (n - 1) * u
    if algorithm == "pairwise":
        return max(1, math.ceil(math.log2(max(n, 2)))) * u
    if algorithm == "kahan":
        return 2 * u + n * u * u
    raise ValueError(f"algorithm must be 'naive', 'pairwise' or 'kahan', not {algorithm!r}")


def sum_tolerance(algorithm: str, n: int, acc: torch.dtype) -> float:
    """The rtol a kernel's row sum is held to against `sum_fp64`, relative to sum|x_i|
    (`abs_sum_fp64`): the worst-case bound plus one rounding of the result (the accumulator dtype
    is also the output's)."""
    return error_bound(algorithm, n, acc) + 2 * UNIT_ROUNDOFF[acc]


# --------------------------------------------------------------------------------------------------
# fp8


def fp8_ulp(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of `dtype` (an fp8 format) at |v| (float64): 2**(exponent - mantissa bits), and
    the subnormal spacing below the smallest normal."""
    e = torch.floor(torch.log2(v.double().abs().clamp_min(2.0 ** FP8_MIN_EXPONENT[dtype])))
    return torch.pow(2.0, e - FP8_MANTISSA_BITS[dtype])


def amax_scales(
    x: torch.Tensor, dtype: torch.dtype, block: int | None, pow2: bool = False
) -> torch.Tensor:
    """float32 scales (x ~ q * scale): one per tensor (block=None) or per `block` consecutive
    elements of the flattened tensor. amax / FP8_MAX, or with pow2 the OCP MX scale 2**(floor(log2
    amax) - emax), whose multiply is exact but whose block maximum may land above FP8_MAX (so it
    must be clamped). An all-zero block gets scale 1."""
    flat = x.detach().float().flatten()
    if block is None:
        amax = flat.abs().max().reshape(1) if flat.numel() else torch.zeros(1, device=x.device)
    else:
        pad = (-flat.numel()) % block
        amax = torch.nn.functional.pad(flat.abs(), (0, pad)).view(-1, block).amax(1)
    if pow2:
        scale = torch.pow(2.0, torch.floor(torch.log2(amax)) - FP8_EMAX[dtype])
    else:
        # in float64, then rounded: IEEE float32 division on every device (CUDA's `tensor / number`
        # multiplies by the reciprocal, one ulp off the kernels' div_rn for some amax)
        scale = (amax.double() / FP8_MAX[dtype]).float()
    return torch.where(amax > 0, scale, torch.ones_like(scale)).float()


def expand_scales(scales: torch.Tensor, numel: int, block: int | None) -> torch.Tensor:
    """One scale per element of a flattened tensor of `numel`: the per-tensor scale broadcast, or
    each block's scale repeated `block` times."""
    return scales.expand(numel) if block is None else scales.repeat_interleave(block)[:numel]


def quantize(
    x: torch.Tensor,
    dtype: torch.dtype = torch.float8_e4m3fn,
    block: int | None = FP8_BLOCK,
    pow2: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scales): q = fp8(clamp(x / scale, -max, max)), rounded to nearest even by PyTorch."""
    scales = amax_scales(x, dtype, block, pow2)
    flat = x.detach().float().flatten()
    s = expand_scales(scales, flat.numel(), block)
    q = (flat / s).clamp(-FP8_MAX[dtype], FP8_MAX[dtype]).to(dtype)
    return q.view(x.shape), scales


def dequantize(
    q: torch.Tensor,
    scales: torch.Tensor,
    block: int | None = FP8_BLOCK,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    s = expand_scales(scales, q.numel(), block)
    return (q.flatten().float() * s).to(out_dtype).view(q.shape)


def roundtrip_fp64(
    x: torch.Tensor,
    dtype: torch.dtype = torch.float8_e4m3fn,
    block: int | None = FP8_BLOCK,
    pow2: bool = False,
) -> torch.Tensor:
    """dequantize(quantize(x)) in float64: what a correct quantizer's round trip gives."""
    q, scales = quantize(x, dtype, block, pow2)
    return (q.flatten().double() * expand_scales(scales, q.numel(), block).double()).view(x.shape)


def fake_quantize(
    x: torch.Tensor,
    dtype: torch.dtype = torch.float8_e4m3fn,
    block: int | None = FP8_BLOCK,
    pow2: bool = False,
) -> torch.Tensor:
    """The round trip in x's dtype: q * scale computed in float32, rounded once to x's dtype."""
    q, scales = quantize(x, dtype, block, pow2)
    return dequantize(q, scales, block, torch.float32).to(x.dtype)


def roundtrip_tolerance(
    x: torch.Tensor,
    dtype: torch.dtype = torch.float8_e4m3fn,
    block: int | None = FP8_BLOCK,
    pow2: bool = False,
) -> torch.Tensor:
    """One fp8 ulp at each element, times its scale: the interpreter rounds float32 -> fp8
    differently from PyTorch for a few values (subnormals among them), so tests allow one ulp
    there."""
    q, scales = quantize(x, dtype, block, pow2)
    return (
        fp8_ulp(q.flatten().double(), dtype) * expand_scales(scales, q.numel(), block).double()
    ).view(x.shape)
