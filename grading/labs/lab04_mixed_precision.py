"""Lab 04: Kahan summation in Triton and in CUDA C, and a per-block fp8 (e4m3) fake quantizer.

The graded sums take rows x of shape (rows, n) and write one float32 sum per row into out (rows,). A
case's shape is the output's; its layout names the row length: "contiguous" rows are N_DEFAULT long,
"n=K" rows K long, "drift n=K" rows hold 0.01 plus random multiples of 2**-7 (every value has the
same low-order bits, so a naive sum loses the same bits at every step and drifts, while Kahan does
not). The check: |sum - exact| <= 4u * sum |x_i|, u = 2**-24 (a bound with room: a correct Kahan sum
stays near 2u, the final rounding adds u/2).

The quantizer: each block of 128 consecutive elements of the flattened tensor gets the OCP MX scale
2**(floor(log2 amax) - 8); x / scale is clamped to +-448, rounded to e4m3 and multiplied back. The
power-of-two scale makes the division and the multiplication exact, so the result is exact: it must
equal the reference bit for bit. The block's largest values land in [256, 512): clamping matters.
"""

from __future__ import annotations

import torch

from grading.spec import Case, GradedFunction, LabSpec, PerfConfig
from kernels import runtime
from kernels.mixed_precision import cupy_reduce, reference, triton_fp8, triton_reduce
from kernels.testing import generator, random_tensor

U = reference.UNIT_ROUNDOFF[torch.float32]
N_DEFAULT = runtime.pick(gpu=65536, cpu=4097)  # 4097: not a multiple of any block
SUM_CASES = (
    Case((3,), torch.float32),
    Case((1,), torch.float32, "n=1"),
    Case((2,), torch.float32, "n=1000003"),
    Case(
        (3,), torch.float32, "strided"
    ),  # every other element of a wider buffer: reject it or sum it
    Case((1,), torch.float32, "drift n=10000000"),  # 10**7 terms: where a naive fp32 sum drifts
)
SUM_PERF = (PerfConfig("sum/fp32/4096x65536", (4096,), torch.float32),)  # 256M elements, 1 GiB
PAD = 40  # "padded n=K": each row K long inside a buffer row of K + PAD elements


def draw_sum_cases(rng) -> tuple[Case, ...]:
    """Rows drawn per run from the secret seed, one per class a wrong sum can hide in: n a multiple
    of 16384 (so of every block the course's kernels and the lab's use: 1024, 4096, 16384), an
    even n above 2**17, and rows inside a wider buffer ("padded": the row stride is not n; the
    lab's check_rows accepts any row stride with contiguous rows)."""
    return (
        Case((rng.randrange(1, 4),), torch.float32, f"n={16384 * rng.randrange(1, 4)}"),
        Case((2,), torch.float32, f"n={2 * rng.randrange(2**16 + 1, 2**18)}"),
        Case((rng.randrange(2, 6),), torch.float32, f"padded n={rng.randrange(100, 20000)}"),
    )


def _sum_inputs(shape, dtype, device, gen):
    return (random_tensor((*shape, N_DEFAULT), dtype, device, gen),)


def _seeded(x: torch.Tensor) -> torch.Generator:
    """A generator seeded by the grader's random input: each trial's fresh values give fresh
    rows."""
    seed = int(x.reshape(-1)[0].double().abs().item() * 2**40) % 2**62
    return generator(seed, x.device)


def _sum_layout(layout, inputs):
    (x,) = inputs
    if not layout.startswith(("n=", "drift n=", "padded n=")):
        return inputs
    n = int(layout.rsplit("=", 1)[1])
    g = _seeded(x)
    if layout.startswith("drift"):
        steps = torch.randint(0, 8, (x.shape[0], n), generator=g, device=x.device)
        return (0.01 + steps.to(x.dtype) * 2.0**-7,)
    if layout.startswith("padded"):
        wide = random_tensor((x.shape[0], n + PAD), x.dtype, x.device, g)
        return (wide[:, :n],)
    return (random_tensor((x.shape[0], n), x.dtype, x.device, g),)


def _sum_tolerance(dtype):
    return 0.0, 4 * U  # times sum |x_i| of the row (the `scale` below)


def _sum_scale(x):
    return reference.abs_sum_fp64(x)


def _course_sum(x, out=None):
    result = triton_reduce.sum(x, torch.float32, "kahan")
    return result if out is None else out.copy_(result)


def _course_sum_cuda(x, out=None):
    result = cupy_reduce.sum(x, torch.float32, "kahan")
    return result if out is None else out.copy_(result)


def _torch_sum(x, out=None):
    return torch.sum(x, dim=-1)


def _sum_bytes(x):
    return x.numel() * x.element_size()


def _kahan_function(name, backend, course_kernel, points, description, hint):
    return GradedFunction(
        name=name,
        points=points,
        backend=backend,
        description=description,
        make_inputs=_sum_inputs,
        prepare=_sum_layout,
        reference_fp64=reference.sum_fp64,
        tolerance=_sum_tolerance,
        scale=_sum_scale,
        course_kernel=course_kernel,
        torch_native=_torch_sum,
        bytes_moved=_sum_bytes,
        cases=SUM_CASES,
        draw_cases=draw_sum_cases,
        perf=SUM_PERF,
        hint=hint,
        input_names=("x",),
    )


# ------------------------------------------------------------------------------------------------
# fp8

FP8_SHAPES = ((1,), (1000,), (3, 5000), (4097, 128))
FP8_CASES = tuple(Case(s, d) for s in FP8_SHAPES for d in (torch.float32, torch.bfloat16)) + (
    Case((1000,), torch.float16),
    Case(
        (3, 5000), torch.float32, "magnitudes"
    ),  # blocks from 2**-12 to 2**12, an outlier, a zero block
    Case((3, 1000), torch.float32, "strided"),
)
FP8_PERF = (PerfConfig("fp8_block_fake_quant/fp32/16384x16384", (16384, 16384), torch.float32),)
FP8_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def draw_fp8_cases(rng) -> tuple[Case, ...]:
    """Shapes drawn per run from the secret seed, one per class a wrong quantizer can hide in: a
    number of elements that is a multiple of 32768 (256 blocks of 128: whole programs of every
    GROUPS up to 256), three dimensions and none (blocks run over the flattened tensor, whatever
    its rank), and more than 2**17 elements, an even number but not a multiple of 128 (a short
    last block)."""
    return (
        Case((64 * rng.randrange(1, 5), 512), rng.choice(FP8_DTYPES)),
        Case((rng.randrange(2, 4), rng.randrange(3, 9), 2 * rng.randrange(64, 160) + 1),
             rng.choice(FP8_DTYPES)),
        # rows odd, each 128 * m + 2 * j long (0 < j < 64): never a multiple of 128
        Case((2 * rng.randrange(1, 5) + 1,
              128 * rng.randrange(352, 512) + 2 * rng.randrange(1, 64)),
             rng.choice(FP8_DTYPES)),
        Case((), rng.choice(FP8_DTYPES)),
    )


def _fp8_inputs(shape, dtype, device, gen):
    return (random_tensor(shape, dtype, device, gen),)


def _fp8_layout(layout, inputs):
    (x,) = inputs
    if layout != "magnitudes":
        return inputs
    g = _seeded(x)
    flat = x.reshape(-1).float()
    blocks = -(-flat.numel() // 128)
    exps = torch.randint(-12, 13, (blocks,), generator=g, device=x.device).float()
    flat = flat * torch.exp2(exps).repeat_interleave(128)[: flat.numel()]
    flat[7] = 3.0e4
    flat[256:384] = 0.0
    return (flat.to(x.dtype).view(x.shape),)


def _fp8_reference(x):
    return reference.fake_quantize(x, torch.float8_e4m3fn, 128, pow2=True).double()


def _fp8_tolerance(dtype):
    return 0.0, 0.0  # exact: power-of-two scales leave only the fp8 rounding, which is specified


def _course_fp8(x, out=None):
    return triton_fp8.fake_quantize(x, torch.float8_e4m3fn, 128, pow2=True, out=out)


def _torch_fp8(x, out=None):
    return reference.fake_quantize(x, torch.float8_e4m3fn, 128, pow2=True)


def _fp8_bytes(x):
    return 2 * x.numel() * x.element_size()


LAB = LabSpec(
    id="04_mixed_precision",
    title="Mixed precision: Kahan summation in Triton and CUDA C, and a per-block fp8 quantizer",
    functions=(
        _kahan_function(
            "kahan_sum",
            "triton",
            _course_sum,
            4,
            "Triton: Kahan-compensated float32 sum of each row",
            "keep a compensation per lane: y = x - c; t = s + y; c = (t - s) - y; s = t -- in that "
            "order, as separate statements -- and combine the lanes without losing it",
        ),
        _kahan_function(
            "kahan_sum_cuda",
            "cupy",
            _course_sum_cuda,
            3,
            "CUDA C through CuPy: Kahan-compensated float32 sum of each row",
            "each thread carries (s, c); combine the threads' s - c in double, or with a two-sum",
        ),
        GradedFunction(
            name="fp8_block_fake_quant",
            points=3,
            backend="triton",
            description="Triton: e4m3 quantize-dequantize with a power-of-two (MX) scale per "
                        "block of 128",
            make_inputs=_fp8_inputs,
            prepare=_fp8_layout,
            reference_fp64=_fp8_reference,
            tolerance=_fp8_tolerance,
            course_kernel=_course_fp8,
            torch_native=_torch_fp8,
            bytes_moved=_fp8_bytes,
            cases=FP8_CASES,
            draw_cases=draw_fp8_cases,
            perf=FP8_PERF,
            input_names=("x",),
            hint="scale = 2**(floor(log2 amax) - 8) from the block's largest |x|; clamp x / scale "
                 "to +-448 "
            "before rounding; multiply back by the scale",
        ),
    ),
)
