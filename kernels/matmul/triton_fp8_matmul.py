"""fp8 matrix products: per-tensor and block-scaled (DeepGEMM's 1 x 128 and 128 x 128 blocks).

    C[m, n] = sum_k (sa * A8[m, k]) (sb * W8[n, k])          (per tensor: two scalars)
    C[m, n] = sum_kb sa[m, kb] sw[n // 128, kb] sum_{k in kb} A8[m, k] W8[n, k]   (block-scaled)

A8 and W8 are float8 e4m3 (3 mantissa bits, largest finite 448); C is bf16. Hopper's tensor cores
multiply fp8 at twice the bf16 rate, so the same GEMM can run twice as fast if the values survive.

Quantizing. `quantize_per_tensor` divides a whole tensor by amax / 448: one outlier shrinks every
other value toward fp8's subnormals (e4m3 spans 448 / 2^-6 = 28,672 from its largest value to its
smallest normal one). `quantize_blocks` gives each 1 x 128 run of an activation row (or each
128 x 128 block of a weight) its own scale, as DeepSeek-V3 trains (arXiv 2412.19437, sec. 3.3): an
outlier costs only its own block. The weight is (N, K), K contiguous (nn.Linear's layout and
DeepGEMM's); the activation scales are stored K-block-major, (K / 128, M) viewed as (M, K / 128),
so a tile's BLOCK_M scales of one K block are contiguous.

Accumulating: the trap of lecture 04. Hopper's fp8 wgmma does not keep a full fp32 sum: DeepSeek
measured about 14 bits kept, so a long K sum loses low bits of every addend (a relative error near
2% at K = 4096 in their test). The cure is **promotion**: let the tensor cores sum only a few K
steps, then add that partial sum into an fp32 accumulator in registers with an ordinary FMA.
* The block-scaled kernel promotes every K block by construction: each 128-deep product starts from
  zero (`tl.dot(a, w)`, no accumulator), is multiplied by its two scales and added in fp32.
* The per-tensor kernel promotes every `promote_k` elements of K (a parameter: 0 never, the
  notebook's comparison): Triton implements it when told how many fp8 products may accumulate
  imprecisely (`tl.dot(..., max_num_imprecise_acc=promote_k)`: the wgmma sum is added into an fp32
  register accumulator every promote_k, exactly DeepGEMM's scheme). On sm_90 Triton's default is
  never; elsewhere (sm_89's mma.sync) the accumulator is fp32 and the option does nothing.

The error is measured, next to the speed, against two fp64 products (`fp8_errors`): of the
dequantized fp8 inputs (what the kernel computes exactly; the accumulation's and C's rounding
error) and of the original bf16 inputs (what a model sees; adds the quantization error). The
figure of merit is DeepGEMM's `calc_diff`, 1 - 2 sum(x y) / sum(x^2 + y^2), which its tests accept
below 1e-3.

Odd shapes: TMA needs rows on 16-byte boundaries, K a multiple of 16 for e4m3 and N of 8 for C;
other operands are copied into buffers with padded rows (and C out of one): one extra pass over
them (`tma_operands`, `output`), where the ragged K block is zero-filled by TMA.

Gated on fp8 (sm_89+: `runtime.require("fp8")`): the descriptors compile to TMA copies on sm_90 and
to ordinary loads on sm_89 (Triton rewrites them). The interpreter emulates e4m3 on the CPU; its
tl.dot multiplies the tiles after they are converted to fp32 (UPCAST), which is exact for e4m3
products.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels import runtime
from kernels.matmul.triton_matmul import GROUP_M, sm_programs, tile_coordinates
from kernels.matmul.triton_matmul_tma import deliver, descriptor, launch, tma_output, tma_view
from kernels.runtime import UPCAST

# The feature this kernel needs (runtime.FEATURE_GPUS): fp8 tensor cores, sm_89 and newer.
REQUIRES = "fp8"
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3 value
SCALE_BLOCK = 128  # DeepGEMM's granularity: 1 x 128 activation runs, 128 x 128 weight blocks
# DeepGEMM's acceptance bound on calc_diff against the bf16 product (its tests/test_core.py).
DEEPGEMM_DIFF_BOUND = 1e-3
# DeepSeek-V3 (sec. 3.3.2) found the fp8 wgmma's sum keeps "around 14 bits". Taking 13: each of
# the promote_k / 32 wgmma (k = 32 each) that add into the accumulator between promotions may lose
# 2^-13 of that interval's sum of |a w|, so a promoted product is within (promote_k / 32) 2^-13 of
# |A| |W|^T of the exact one (the GPU tests' bound; `promoted_error_bound`).
TENSOR_CORE_SUM_BITS = 13
PER_TENSOR, BLOCK_SCALED = 0, 1
# (BLOCK_M, BLOCK_N, num_warps, num_stages, k_blocks), BLOCK_K = 128 (one scale block, 128
# bytes: one swizzled row of shared memory). A stage of fp8 A and W is k_blocks x (BLOCK_M +
# BLOCK_N) x 128 bytes: 48 KiB at 128 x 256; the bf16 epilogue buffer, halved, 32 KiB. A promoted
# product holds two accumulators (the K block's partial sum and the fp32 total), which at 128 x 256
# do not fit (`fits`): ptxas spilled 624 bytes at 8 warps, and at 16 warps (128 registers a
# thread) 840 (sm_90, offline). k_blocks = 2 (block-scaled only: two K blocks' products queued
# before their promotions) at 3 stages is 213 KiB, 254 registers, no spills. On the H200 the
# block-scaled product ran best at 128 x 128 with 3 or 4 stages, or 3 with k_blocks = 2
# (PERFORMANCE.md); the last tile is for sm_89's 99 KiB of shared memory (no spills there).
GPU_TILES = [
    (128, 256, 8, 4, 1),
    (128, 256, 8, 3, 1),
    (128, 128, 8, 4, 1),
    (128, 128, 8, 3, 1),
    (128, 128, 8, 3, 2),
    (128, 128, 8, 2, 1),
]
# fp32 accumulator registers a thread may hold (of 255) without spilling, measured offline on
# sm_90: 128 (one 128 x 256 accumulator at 8 warps, or two 128 x 128 ones) fits, 256 does not.
ACC_REGS = 128


# --------------------------------------------------------------------------------------------------
# Quantizers


def quantize_per_tensor(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x8, scale): x8 = x / scale in e4m3 with scale = amax(|x|) / 448 (a float32 scalar tensor),
    so x ~ x8 * scale and the largest |x| lands on 448."""
    amax = x.abs().amax().float().clamp(min=1e-12)
    scale = amax / FP8_MAX
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_blocks(x: torch.Tensor, block_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x8, scales) for x (R, K): each block of `block_rows` x 128 (1 for activations, 128 for
    weights; the last blocks may be partial) divided by its amax / 448. scales is (ceil(R /
    block_rows), ceil(K / 128)) float32; for block_rows = 1 it is stored K-block-major (the kernel
    reads a tile's scales of one K block as one contiguous run)."""
    rows, k = x.shape
    pad_r, pad_k = -rows % block_rows, -k % SCALE_BLOCK
    padded = torch.nn.functional.pad(x.float(), (0, pad_k, 0, pad_r))
    blocks = padded.view(padded.shape[0] // block_rows, block_rows, -1, SCALE_BLOCK)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)  # (row blocks, K blocks)
    scales = amax / FP8_MAX
    q = (blocks / scales[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    q = q.view(padded.shape)[:rows, :k].contiguous()
    if block_rows == 1:
        scales = scales.T.contiguous().T  # (M, K blocks) over a (K blocks, M) buffer
    return q, scales


def quantize_activation(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """a (M, K) -> (a8, scales (M, ceil(K / 128))): one scale per 1 x 128 run of a row."""
    return quantize_blocks(a, 1)


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (N, K) -> (w8, scales (ceil(N / 128), ceil(K / 128))): one scale per 128 x 128 block."""
    return quantize_blocks(w, SCALE_BLOCK)


def dequantize(x8: torch.Tensor, scales: torch.Tensor, block_rows: int | None) -> torch.Tensor:
    """x8 * its scales in float64 (block_rows None: one scalar scale), the kernel's exact input."""
    x = x8.double()
    if block_rows is None:
        return x * scales.double()
    rows = torch.arange(x.shape[0], device=x.device) // block_rows
    cols = torch.arange(x.shape[1], device=x.device) // SCALE_BLOCK
    return x * scales.double()[rows][:, cols]


# --------------------------------------------------------------------------------------------------
# The kernel


def set_block_shapes(nargs):
    """A descriptor's block shape is part of its type: set it from the launched configuration."""
    bm, bn, bk = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_K"]
    nargs["a_desc"].block_shape = [bm, bk]
    nargs["w_desc"].block_shape = [bn, bk]
    nargs["c_desc"].block_shape = [bm, bn // 2]


def tile_config(
    bm: int, bn: int, warps: int, stages: int, k_blocks: int = 1, one_w_scale: bool = False
) -> triton.Config:
    """`k_blocks` (block-scaled only): K blocks whose products are issued together before their
    promotions (2: the second wgmma runs while nothing waits for the first); `one_w_scale`
    (block-scaled, bn = 128): the tile's weight scale loaded once a K block, not per column."""
    return triton.Config(
        {
            "BLOCK_M": bm,
            "BLOCK_N": bn,
            "BLOCK_K": SCALE_BLOCK,
            "GROUP_M": GROUP_M,
            "K_BLOCKS": k_blocks,
            "ONE_W_SCALE": one_w_scale and bn == SCALE_BLOCK,
        },
        num_warps=warps,
        num_stages=stages,
        pre_hook=set_block_shapes,
    )


def shared_bytes(bm: int, bn: int, stages: int, k_blocks: int = 1) -> int:
    """fp8 A and W tiles of 128 bytes a row per stage, and half a bf16 C tile for the epilogue."""
    return stages * k_blocks * (bm + bn) * SCALE_BLOCK + bm * bn


def accumulator_registers(bm: int, bn: int, warps: int, promoted: bool) -> int:
    """fp32 registers a thread holds for the accumulator(s) of a BLOCK_M x BLOCK_N tile."""
    return bm * bn // (32 * warps) * (2 if promoted else 1)


def fits(c: triton.Config, *, promoted: bool) -> bool:
    """Registers (`ACC_REGS`) and this GPU's shared memory (sm_90's 227 KiB in CPU mode)."""
    bm, bn, k_blocks = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["K_BLOCKS"]
    return (
        accumulator_registers(bm, bn, c.num_warps, promoted) <= ACC_REGS
        and shared_bytes(bm, bn, c.num_stages, k_blocks) <= runtime.shared_memory_budget()
    )


def prune_configs(configs, named_args, **kwargs):
    """The autotuner's early pruner: the configurations that fit (`fits`) this kind of product
    (two K blocks a step only for the block-scaled one)."""
    args = {**named_args, **kwargs}
    block_scaled = args["SCALING"] == BLOCK_SCALED
    promoted = block_scaled or args["PROMOTE_K"] > 0
    kept = [
        c
        for c in configs
        if fits(c, promoted=promoted) and (block_scaled or c.kwargs["K_BLOCKS"] == 1)
    ]
    return kept or configs[:1]


def _configs() -> list[triton.Config]:
    if not runtime.ON_GPU:  # the interpreter: one small configuration (it cannot time several)
        return [tile_config(32, 32, 1, 1)]
    # the weight scale as one scalar where it was measured faster: sm_90 (on sm_89 it spills)
    return [tile_config(*t, one_w_scale=runtime.has("wgmma")) for t in GPU_TILES]


@triton.jit
def _block_scales(
    a_scale_ptr,
    w_scale_ptr,
    rows,
    n0,
    ki,
    M,
    N,
    k_tiles,
    BLOCK_N: tl.constexpr,
    ONE_W_SCALE: tl.constexpr,
):
    """K block ki's activation scales times the weight's, to multiply a (BLOCK_M, BLOCK_N)
    product; zero past the last K block or row. ONE_W_SCALE (BLOCK_N = 128: the tile lies in one
    weight block): one scalar load, a (BLOCK_M, 1) result; else each column's block gathered
    (on sm_89, at 128 x 128 and 2 stages, the scalar form spills 552 bytes offline)."""
    in_k = ki < k_tiles
    sa = tl.load(a_scale_ptr + ki * M + rows, mask=rows < tl.where(in_k, M, 0), other=0.0)
    if ONE_W_SCALE:
        scales = (sa * tl.load(w_scale_ptr + n0 // 128 * k_tiles + ki, mask=in_k, other=0.0))[
            :, None
        ]
    else:
        col_blocks = (n0 + tl.arange(0, BLOCK_N)) // 128
        sw = tl.load(
            w_scale_ptr + col_blocks * k_tiles + ki,
            mask=col_blocks < tl.where(in_k, tl.cdiv(N, 128), 0),
            other=0.0,
        )
        scales = sa[:, None] * sw[None, :]
    return scales


@triton.autotune(
    configs=_configs(),
    key=["M", "N", "K", "SCALING", "PROMOTE_K"],
    prune_configs_by={"early_config_prune": prune_configs},
)
@triton.jit
def fp8_matmul_kernel(
    a_desc,  # A8 (M, K) e4m3
    w_desc,  # W8 (N, K) e4m3
    c_desc,  # C (M, N) bf16, stored in two halves of BLOCK_N / 2 columns
    a_scale_ptr,  # per tensor: one float32; block-scaled: (M, K / 128) with strides (1, M)
    w_scale_ptr,  # per tensor: one float32; block-scaled: (N / 128, K / 128), row-major
    M,
    N,
    K,
    NUM_PROGRAMS: tl.constexpr,  # persistent programs: one per SM
    SCALING: tl.constexpr,  # PER_TENSOR (0) or BLOCK_SCALED (1)
    PROMOTE_K: tl.constexpr,  # per tensor: fp8 products summed on the tensor cores between
    # promotions into the fp32 accumulator (0: never)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # 128: one scale block
    GROUP_M: tl.constexpr,
    K_BLOCKS: tl.constexpr,  # block-scaled: K blocks multiplied before their promotions (1, 2)
    ONE_W_SCALE: tl.constexpr,  # block-scaled, BLOCK_N = 128: the weight scale as one scalar
    UPCAST: tl.constexpr,  # the interpreter: multiply the (exactly converted) tiles in fp32
):
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_PROGRAMS, flatten=True):
        pid_m, pid_n = tile_coordinates(tile, num_pid_m, num_pid_n, GROUP_M)
        m0 = pid_m * BLOCK_M
        n0 = pid_n * BLOCK_N
        rows = m0 + tl.arange(0, BLOCK_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(0, k_tiles, K_BLOCKS):
            if SCALING == 1 and K_BLOCKS == 2:
                # Both products queued on the tensor cores before either is promoted. Past the
                # last K block (k_tiles odd) TMA reads zeros and the scales are zero.
                a0 = a_desc.load([m0, ki * BLOCK_K])
                w0 = w_desc.load([n0, ki * BLOCK_K])
                a1 = a_desc.load([m0, (ki + 1) * BLOCK_K])
                w1 = w_desc.load([n0, (ki + 1) * BLOCK_K])
                if UPCAST:
                    a0, w0 = a0.to(tl.float32), w0.to(tl.float32)
                    a1, w1 = a1.to(tl.float32), w1.to(tl.float32)
                p0 = tl.dot(a0, w0.T)
                p1 = tl.dot(a1, w1.T)
                s0 = _block_scales(
                    a_scale_ptr, w_scale_ptr, rows, n0, ki, M, N, k_tiles, BLOCK_N, ONE_W_SCALE
                )
                s1 = _block_scales(
                    a_scale_ptr, w_scale_ptr, rows, n0, ki + 1, M, N, k_tiles, BLOCK_N, ONE_W_SCALE
                )
                acc += p0 * s0 + p1 * s1
            else:
                a = a_desc.load([m0, ki * BLOCK_K])
                w = w_desc.load([n0, ki * BLOCK_K])
                if UPCAST:
                    a = a.to(tl.float32)
                    w = w.to(tl.float32)
                if SCALING == 1:
                    # This K block's product from zero on the tensor cores, then scaled and
                    # promoted into the fp32 accumulator: promotion every 128 of K.
                    scales = _block_scales(
                        a_scale_ptr, w_scale_ptr, rows, n0, ki, M, N, k_tiles, BLOCK_N, ONE_W_SCALE
                    )
                    acc += tl.dot(a, w.T) * scales
                elif PROMOTE_K > 0:
                    acc = tl.dot(a, w.T, acc, max_num_imprecise_acc=PROMOTE_K)
                else:
                    acc = tl.dot(a, w.T, acc)
        if SCALING == 0:
            acc = acc * (tl.load(a_scale_ptr) * tl.load(w_scale_ptr))
        halves = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
        left, right = tl.split(halves)
        c_desc.store([m0, n0], left.to(c_desc.dtype))
        c_desc.store([m0, n0 + BLOCK_N // 2], right.to(c_desc.dtype))


def check_fp8_args(op: str, a8, w8, a_scale, w_scale, block_scaled: bool) -> tuple[int, int, int]:
    """(M, N, K), or a TypeError/ValueError saying what is wrong with the operands."""
    for name, t in (("a8", a8), ("w8", w8), ("a_scale", a_scale), ("w_scale", w_scale)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device.type != runtime.DEVICE:
            raise ValueError(f"{op}: {name} is on {t.device}; the kernel runs on {runtime.DEVICE}")
    for name, t in (("a8", a8), ("w8", w8)):
        if t.dtype != FP8 or t.dim() != 2:
            raise TypeError(
                f"{op}: {name} must be a 2-D float8_e4m3fn tensor, got {t.dim()}-D "
                f"{str(t.dtype).removeprefix('torch.')} (quantize it first)"
            )
        if t.stride(1) != 1:
            raise ValueError(
                f"{op}: {name} must have contiguous rows (K contiguous: w8 is (N, K), "
                f"nn.Linear's layout); got strides {t.stride()}"
            )
    (M, K), (N, K_w) = a8.shape, w8.shape
    if K != K_w:
        raise ValueError(
            f"{op}: a8 is {tuple(a8.shape)} and w8 is {tuple(w8.shape)}: both must "
            "have K columns (w8 is (N, K))"
        )
    k_blocks = triton.cdiv(K, SCALE_BLOCK)
    shapes = {
        "a_scale": ((M, k_blocks), (1, M)) if block_scaled else ((), None),
        "w_scale": ((triton.cdiv(N, SCALE_BLOCK), k_blocks), (k_blocks, 1))
        if block_scaled
        else ((), None),
    }
    for name, t in (("a_scale", a_scale), ("w_scale", w_scale)):
        shape, strides = shapes[name]
        if t.dtype != torch.float32 or tuple(t.shape) != shape:
            raise ValueError(
                f"{op}: {name} must be float32 of shape {shape}, got "
                f"{str(t.dtype).removeprefix('torch.')} {tuple(t.shape)}"
            )
        # (the stride of a dimension of length 1 is never used)
        if strides is not None and any(
            n > 1 and got != want for n, got, want in zip(t.shape, t.stride(), strides)
        ):
            raise ValueError(
                f"{op}: {name} must have strides {strides} (as the quantizer makes "
                f"it), got {t.stride()}"
            )
    return M, N, K


def tma_operands(op: str, a8, w8) -> tuple[torch.Tensor, torch.Tensor]:
    """a8 and w8 as TMA reads them: themselves, or (K not a multiple of 16: e4m3 rows off
    16-byte boundaries) copies with padded rows (`tma_view`), an extra pass over each operand."""
    return tma_view(a8, "a8", op)[0], tma_view(w8, "w8", op)[0]


def output(op: str, out, M: int, N: int, device) -> torch.Tensor:
    """The C the kernel writes: `out` checked (contiguous (M, N) bf16), or a new one; a buffer
    with padded rows when N is not a multiple of 8 (`tma_output`; `deliver` copies it out)."""
    if out is not None and (
        out.shape != (M, N) or out.dtype != torch.bfloat16 or not out.is_contiguous()
    ):
        raise ValueError(f"{op}: out must be a contiguous ({M}, {N}) bfloat16 tensor")
    return tma_output(out, M, N, torch.bfloat16, device)


def _launch(op, a8, w8, a_scale, w_scale, *, scaling: int, promote_k: int, out, config):
    runtime.require(REQUIRES, op)
    M, N, K = check_fp8_args(op, a8, w8, a_scale, w_scale, scaling == BLOCK_SCALED)
    a8, w8 = tma_operands(op, a8, w8)
    c = output(op, out, M, N, a8.device)
    args = dict(
        a_desc=descriptor(a8),
        w_desc=descriptor(w8),
        c_desc=descriptor(c),
        a_scale_ptr=a_scale,
        w_scale_ptr=w_scale,
        M=M,
        N=N,
        K=K,
        NUM_PROGRAMS=sm_programs(),
        SCALING=scaling,
        PROMOTE_K=promote_k,
        UPCAST=UPCAST,
    )
    launch(fp8_matmul_kernel, args, config)
    return deliver(c, out)


def fp8_matmul_per_tensor(
    a8,
    w8,
    a_scale,
    w_scale,
    *,
    promote_k: int = SCALE_BLOCK,
    out=None,
    config: triton.Config | None = None,
) -> torch.Tensor:
    """C (M, N) bf16 = (a_scale * a8) @ (w_scale * w8).T, a8 (M, K) and w8 (N, K) e4m3 with
    one float32 scale each (`quantize_per_tensor`). `promote_k`: fp8 products the tensor cores
    sum before each promotion into fp32 (32, 64 or 128; 0: never, Triton's default on sm_90)."""
    if promote_k not in (0, 32, 64, SCALE_BLOCK):
        raise ValueError(
            f"fp8_matmul_per_tensor: promote_k {promote_k}; supported: 0 (never), "
            f"32, 64, 128 (at most one K tile of {SCALE_BLOCK})"
        )
    return _launch(
        "fp8_matmul_per_tensor",
        a8,
        w8,
        a_scale.reshape(()),
        w_scale.reshape(()),
        scaling=PER_TENSOR,
        promote_k=promote_k,
        out=out,
        config=config,
    )


def fp8_matmul_block_scaled(
    a8, a_scales, w8, w_scales, *, out=None, config: triton.Config | None = None
) -> torch.Tensor:
    """C (M, N) bf16 = A @ W.T from a8 (M, K) with 1 x 128 scales (`quantize_activation`) and w8
    (N, K) with 128 x 128 scales (`quantize_weight`); every K block's product promoted into fp32."""
    return _launch(
        "fp8_matmul_block_scaled",
        a8,
        w8,
        a_scales,
        w_scales,
        scaling=BLOCK_SCALED,
        promote_k=0,
        out=out,
        config=config,
    )


def fp8_matmul_scaled_mm(a8, w8, a_scale, w_scale) -> torch.Tensor:
    """The anchor: cuBLAS's per-tensor fp8 GEMM through torch._scaled_mm (w8.T column-major, as
    cuBLAS wants it)."""
    return torch._scaled_mm(
        a8, w8.T, scale_a=a_scale.reshape(()), scale_b=w_scale.reshape(()), out_dtype=torch.bfloat16
    )


# --------------------------------------------------------------------------------------------------
# Accuracy


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepGEMM's figure of merit, in float64: 1 - 2 sum(x y) / sum(x^2 + y^2); 0 when x = y,
    about the squared relative error when they are close. NaN anywhere gives NaN."""
    x, y = x.double(), y.double()
    denominator = (x * x + y * y).sum()
    return float(1 - 2 * (x * y).sum() / denominator)


def promoted_error_bound(a: torch.Tensor, w: torch.Tensor, promote_k: int = SCALE_BLOCK):
    """Per element of C = A W^T, how far a product promoted every `promote_k` may be from the
    exact one on Hopper's tensor cores (TENSOR_CORE_SUM_BITS), before C's rounding."""
    magnitude = a.double().abs() @ w.double().abs().T
    return promote_k / 32 * 2.0**-TENSOR_CORE_SUM_BITS * magnitude


def fp8_errors(c: torch.Tensor, dequantized: tuple, original: tuple) -> dict:
    """c against two float64 products: of the dequantized inputs (A, W as the kernel saw them:
    its accumulation and rounding error) and of the original inputs (adds the quantization
    error). Each as calc_diff and as the largest error over the largest |C|."""
    found = {}
    for name, (a, w) in (("dequantized", dequantized), ("original", original)):
        exact = a.double() @ w.double().T
        error = (c.double() - exact).abs()
        found[name] = {
            "calc_diff": calc_diff(c, exact),
            "max_error_over_max": float(error.max() / exact.abs().max()),
        }
    return found


def compile_for(
    arch: str = "sm_90",
    scaling: int = BLOCK_SCALED,
    promote_k: int = 0,
    tile: int | None = None,
    one_w_scale: bool | None = None,
):
    """The kernel compiled for `arch` (sm_89 and newer) without a GPU (`offline.compile_offline`
    runs this in a process of its own), in the tile GPU_TILES[tile]; with no tile named, the
    first that suits the product (`prune_configs`) and whose compiled shared memory fits the
    arch's (`runtime.shared_memory_budget`). `one_w_scale` None: as the autotuner offers it
    there. FeatureMissing on an arch without fp8, before compiling."""
    runtime.require(REQUIRES, "fp8_matmul")
    if one_w_scale is None:
        one_w_scale = runtime.has("wgmma")
    if tile is not None:
        return _compile_tile(arch, scaling, promote_k, GPU_TILES[tile], one_w_scale)
    args = {"SCALING": scaling, "PROMOTE_K": promote_k}
    configs = [tile_config(*t) for t in GPU_TILES]
    kept = {id(c) for c in prune_configs(configs, args)}
    for t, config in zip(GPU_TILES, configs):
        if id(config) in kept:
            kernel = _compile_tile(arch, scaling, promote_k, t, one_w_scale)
            if kernel.metadata.shared <= runtime.shared_memory_budget():
                return kernel
    raise ValueError(f"fp8_matmul: no tile of GPU_TILES fits {arch}'s shared memory")


def _compile_tile(arch, scaling, promote_k, tile, one_w_scale):
    from kernels.matmul.offline import compile_triton, descriptor_type

    bm, bn, warps, stages, k_blocks = tile
    fp8 = torch.empty((64, 64), dtype=FP8)
    bf16 = torch.empty((64, 64), dtype=torch.bfloat16)

    def desc(t, shape):
        return descriptor_type(TensorDescriptor.from_tensor(t, shape))

    constants = {
        "NUM_PROGRAMS": 132,
        "SCALING": scaling,
        "PROMOTE_K": promote_k,
        "BLOCK_M": bm,
        "BLOCK_N": bn,
        "BLOCK_K": SCALE_BLOCK,
        "GROUP_M": GROUP_M,
        "K_BLOCKS": k_blocks,
        "ONE_W_SCALE": one_w_scale and bn == SCALE_BLOCK,
        "UPCAST": False,
    }
    signature = {
        "a_desc": desc(fp8, [bm, SCALE_BLOCK]),
        "w_desc": desc(fp8, [bn, SCALE_BLOCK]),
        "c_desc": desc(bf16, [bm, bn // 2]),
        "a_scale_ptr": "*fp32",
        "w_scale_ptr": "*fp32",
        "M": "i32",
        "N": "i32",
        "K": "i32",
        **dict.fromkeys(constants, "constexpr"),
    }
    return compile_triton(fp8_matmul_kernel.fn, signature, constants, arch, warps, stages)
