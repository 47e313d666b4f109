"""Precision module: the sums (Triton; CuPy on a GPU) against float64 and against their own error
bounds, bit for bit against the order the kernels promise (reference.blocked_sum), the sum of 0.01
a thousand times, and the fp8 quantizers against PyTorch's conversion.

CuPy kernels run on a GPU; without one these tests assert the clear "needs a GPU" error instead."""

import math

import pytest
import torch

from kernels import runtime
from kernels.mixed_precision import cupy_reduce, reference, triton_fp8, triton_reduce
from kernels.testing import ULP, compare, generator, random_tensor

DEVICE = runtime.DEVICE
ALGORITHMS = ("naive", "pairwise", "kahan")
ACCS = reference.ACC_DTYPES
SUMS = {"triton": triton_reduce.sum, "cupy": cupy_reduce.sum}
# 1 element, odd sizes, one that is not a multiple of any block, and one that needs a second launch
SIZES = [(1, 1), (3, 1000), (2, 4097), (1, 131073 + 4096 * 32)]


def needs_gpu(name):
    return name == "cupy" and not runtime.cupy_status()[0]


def relative_error(result, x):
    """|sum - exact| / sum |x_i| in float64, per row (exact: of x as the kernel reads it)."""
    return (result.double() - reference.sum_fp64(x)).abs() / reference.abs_sum_fp64(x).clamp_min(
        1e-300
    )


@pytest.mark.parametrize("name", SUMS)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("acc", ACCS, ids=str)
@pytest.mark.parametrize("shape", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_sum_within_its_error_bound(name, algorithm, acc, shape):
    x = random_tensor(shape, torch.float32, DEVICE, generator(shape[1], DEVICE))
    # inputs the accumulator holds exactly: only the summation's error is left
    x = reference.round_to(x, acc)
    if needs_gpu(name):
        pytest.raises(RuntimeError, SUMS[name], x, acc, algorithm)
        return
    result = SUMS[name](x, acc, algorithm)
    assert result.dtype == acc and result.shape == shape[:1]
    assert torch.isfinite(result).all()
    err = relative_error(result, x)
    assert (err <= reference.sum_tolerance(algorithm, shape[1], acc)).all(), (
        err / reference.UNIT_ROUNDOFF[acc]
    ).tolist()


@pytest.mark.parametrize("name", SUMS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_inputs_vector_and_strided_rows(name, dtype):
    g = generator(5, DEVICE)
    buf = random_tensor((5, 3000), dtype, DEVICE, g)
    x = buf[:, :2999]  # rows 2999 long inside a 3000-wide buffer: the row stride is not the length
    if needs_gpu(name):
        pytest.raises(RuntimeError, SUMS[name], x)
        return
    assert (
        relative_error(SUMS[name](x), x) <= reference.sum_tolerance("naive", 2999, torch.float32)
    ).all()
    v = buf[1]
    assert (
        relative_error(SUMS[name](v, torch.float32, "kahan"), v)
        <= 4 * reference.UNIT_ROUNDOFF[torch.float32]
    )


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("acc", ACCS, ids=str)
@pytest.mark.parametrize("n, block, trips", [(1000, 64, 4), (20001, 256, 8), (5, 4096, 32)])
def test_triton_adds_in_the_promised_order(algorithm, acc, n, block, trips):
    """Bit for bit what reference.blocked_sum computes: the order is the kernel's, not the
    interpreter's or the GPU's, so both modes return these bits."""
    x = random_tensor((3, n), torch.float32, DEVICE, generator(n, DEVICE))
    trips = 1 if algorithm == "pairwise" else trips
    got = triton_reduce.sum(x, acc, algorithm, block=block, trips=trips)
    want = reference.blocked_sum(x.cpu(), acc, algorithm, block, trips)
    assert torch.equal(got.cpu(), want), (got.tolist(), want.tolist())


@pytest.mark.parametrize("name", SUMS)
def test_sum_of_1000_increments(name):
    """0.01 added 1000 times, one element after another (a single sequential lane)."""
    x32 = torch.full((1000,), 0.01, device=DEVICE)
    x16 = x32.half()
    if needs_gpu(name):
        pytest.raises(RuntimeError, SUMS[name], x32)
        return
    # the CUDA kernels' lanes are fixed; their answers are within the bounds above
    if name == "cupy":
        return
    seq = dict(algorithm="naive", block=1, trips=1024)
    assert f"{triton_reduce.sum(x32, torch.float32, **seq).item():.4f}" == "10.0001"
    assert f"{triton_reduce.sum(x16, torch.float16, **seq).item():.4f}" == "9.9531"
    assert f"{triton_reduce.sum(x16, torch.float32, **seq).item():.4f}" == "10.0021"
    # stalls: 4 + 0.01 rounds back to 4
    assert triton_reduce.sum(x32, torch.bfloat16, **seq).item() == 4.0
    assert triton_reduce.sum(x32, torch.bfloat16, "kahan", block=1, trips=1024).item() == 10.0
    want = reference.sequential_sum(x16, torch.float16).half()
    assert torch.equal(triton_reduce.sum(x16, torch.float16, **seq).cpu(), want)


def test_kahan_beats_naive_where_naive_drifts():
    """Values with the same low-order bits (0.01 plus multiples of 2**-7): a lane's naive sum loses
    the same bits at every step, so its error grows with the lane's length; Kahan's stays near u."""
    g = generator(11, DEVICE)
    n = 1 << 20
    x = 0.01 + torch.randint(0, 8, (n,), generator=g, device=DEVICE).float() * 2.0**-7
    u = reference.UNIT_ROUNDOFF[torch.float32]
    lanes = dict(block=1024, trips=n // 1024)  # one program, lanes of 1024 elements
    naive = relative_error(triton_reduce.sum(x, torch.float32, "naive", **lanes), x)
    kahan = relative_error(triton_reduce.sum(x, torch.float32, "kahan", **lanes), x)
    assert kahan <= 4 * u < 20 * u < naive, (kahan / u, naive / u)


BAD_SUMS = [
    (
        "int input",
        lambda: triton_reduce.sum(torch.ones(4, dtype=torch.int32, device=DEVICE)),
        TypeError,
        "dtype int32",
    ),
    (
        "fp64 accumulator",
        lambda: triton_reduce.sum(torch.ones(4, device=DEVICE), torch.float64),
        TypeError,
        "acc",
    ),
    (
        "unknown algorithm",
        lambda: triton_reduce.sum(torch.ones(4, device=DEVICE), algorithm="fast"),
        ValueError,
        "algorithm must be",
    ),
    (
        "3-d input",
        lambda: triton_reduce.sum(torch.ones(2, 2, 2, device=DEVICE)),
        ValueError,
        "must be a vector",
    ),
    (
        "column view",
        lambda: triton_reduce.sum(torch.ones(4, 4, device=DEVICE).t()),
        ValueError,
        "contiguous",
    ),
    ("not a tensor", lambda: triton_reduce.sum([1.0, 2.0]), TypeError, "torch.Tensor"),
    (
        "block not a power of two",
        lambda: triton_reduce.sum(torch.ones(4, device=DEVICE), block=3),
        ValueError,
        "power of two",
    ),
    # 2 elements per chunk would pass (sum, compensation) = 2 values on: the launches would never
    # end
    (
        "kahan with 2 per chunk",
        lambda: triton_reduce.sum(
            torch.ones(8, device=DEVICE), algorithm="kahan", block=2, trips=1
        ),
        ValueError,
        "at least 4 for kahan",
    ),
]


@pytest.mark.parametrize("what, call, exc, message", BAD_SUMS, ids=[b[0] for b in BAD_SUMS])
def test_bad_sum_arguments_are_rejected_clearly(what, call, exc, message):
    with pytest.raises(exc, match=message):
        call()


def test_empty_rows_sum_to_zero():
    assert torch.equal(triton_reduce.sum(torch.empty(3, 0, device=DEVICE)).cpu(), torch.zeros(3))


# --------------------------------------------------------------------------------------------------
# fp8

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def fp8_input(numel, dtype, seed):
    """Normal values of spread magnitudes (blocks tiny and large), an outlier, a block of zeros."""
    g = generator(seed, DEVICE)
    x = random_tensor((numel,), torch.float32, DEVICE, g)
    exponents = torch.randint(-12, 12, (numel // 128 + 1,), generator=g, device=DEVICE)
    x = x * torch.exp2(exponents.float()).repeat_interleave(128)[:numel]
    if numel > 300:
        x[7] = 3.0e4
        x[256:384] = 0.0
    return x.to(dtype)


@pytest.mark.parametrize("fp8", FP8, ids=str)
@pytest.mark.parametrize("block", [128, None], ids=["block128", "tensor"])
@pytest.mark.parametrize("pow2", [False, True], ids=["amax", "pow2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(1,), (1000,), (3, 5000)], ids=str)
def test_quantize_matches_pytorch_bit_for_bit(fp8, block, pow2, dtype, shape):
    x = fp8_input(math.prod(shape), dtype, seed=len(shape) * 10 + shape[-1]).view(shape)
    q, scales = triton_fp8.quantize(x, fp8, block, pow2)
    q_ref, scales_ref = reference.quantize(x.cpu(), fp8, block, pow2)
    assert q.dtype == fp8 and q.shape == x.shape
    assert torch.equal(scales.cpu(), scales_ref)
    # same bits: one fp8 ulp could be allowed for the interpreter's own float32 -> fp8 rounding,
    # but the kernels round explicitly, so this is exact in both modes
    assert torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8))
    back = triton_fp8.dequantize(q, scales, block, torch.float32)
    assert torch.equal(back.cpu(), reference.dequantize(q_ref, scales_ref, block, torch.float32))
    # the round trip is within one fp8 ulp (times the scale) of x, or within the clamp for pow2
    # scales
    err = (back.cpu().double() - x.cpu().double()).abs()
    tol = reference.roundtrip_tolerance(x.cpu(), fp8, block, pow2)
    if pow2:
        tol = tol + (
            x.cpu().double().abs()
            - reference.FP8_MAX[fp8]
            * reference.expand_scales(scales_ref, x.numel(), block).double().view(shape)
        ).clamp_min(0)
    assert (err <= tol).all()


def test_per_block_scales_beat_one_scale_when_magnitudes_vary():
    x = fp8_input(128 * 64, torch.float32, seed=3)
    errors = {}
    for block in (None, 128):
        back = triton_fp8.dequantize(
            *triton_fp8.quantize(x, torch.float8_e4m3fn, block), block, torch.float32
        )
        errors[block] = ((back - x).abs() / x.abs().clamp_min(1e-30))[x != 0].median().item()
    # one scale: small blocks in subnormals
    assert errors[128] < 0.04 and errors[None] > 2 * errors[128], errors


def test_clamp_matters_for_pow2_scales():
    """An amax of 1.9 * 2**k puts the block's largest at 1.9 * 256 = 486 > 448 in e4m3: clamped."""
    x = torch.tensor([1.9, 0.5, -1.9] + [0.1] * 125, device=DEVICE)
    q, scales = triton_fp8.quantize(x, torch.float8_e4m3fn, 128, pow2=True)
    assert scales.item() == 2.0**-8
    assert q[0].float().item() == 448.0 and q[2].float().item() == -448.0


BAD_FP8 = [
    (
        "int input",
        lambda: triton_fp8.quantize(torch.ones(4, dtype=torch.int32, device=DEVICE)),
        TypeError,
        "dtype int32",
    ),
    (
        "not fp8",
        lambda: triton_fp8.quantize(torch.ones(4, device=DEVICE), torch.float16),
        TypeError,
        "float8_e4m3fn",
    ),
    (
        "block 100",
        lambda: triton_fp8.quantize(torch.ones(4, device=DEVICE), block=100),
        ValueError,
        "power of two",
    ),
    (
        "strided",
        lambda: triton_fp8.quantize(torch.ones(4, 4, device=DEVICE).t()),
        ValueError,
        "contiguous",
    ),
    (
        "wrong scales",
        lambda: triton_fp8.dequantize(
            torch.ones(300, device=DEVICE).to(torch.float8_e4m3fn), torch.ones(2, device=DEVICE)
        ),
        ValueError,
        "3 float32 values",
    ),
]


@pytest.mark.parametrize("what, call, exc, message", BAD_FP8, ids=[b[0] for b in BAD_FP8])
def test_bad_fp8_arguments_are_rejected_clearly(what, call, exc, message):
    with pytest.raises(exc, match=message):
        call()


@pytest.mark.parametrize("pow2", [False, True], ids=["amax", "pow2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_fake_quantize_is_the_round_trip(dtype, pow2):
    x = fp8_input(3 * 1000 + 17, dtype, seed=9)
    out = torch.full_like(x, float("nan"))
    triton_fp8.fake_quantize(x, torch.float8_e4m3fn, 128, pow2, out=out)
    want = reference.fake_quantize(x.cpu(), torch.float8_e4m3fn, 128, pow2)
    if dtype == torch.bfloat16 and not pow2 and not runtime.ON_GPU:
        # q * scale is not exact in bfloat16, and the interpreter truncates float32 -> bfloat16
        assert compare(out.cpu(), want, atol=0.0, rtol=ULP[torch.bfloat16]).ok
    else:  # exact: with power-of-two scales q * scale needs no rounding
        assert torch.equal(out.cpu(), want)
