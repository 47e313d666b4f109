"""The add kernels against the float64 reference: odd sizes, every dtype, strided views, bad input.

Triton kernels run everywhere (the interpreter on CPU). CuPy kernels run on a GPU; without one,
these tests assert the clear "needs a GPU" error instead -- they are never skipped.
"""

import pytest
import torch

from kernels import runtime
from kernels.elementwise_add import cupy_add, reference, triton_add
from kernels.testing import compare, generator, poison_, random_tensor, strided_view

SIZES = [1, 7, 1023, 1025, 98_765]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DEVICE = runtime.DEVICE
ADDS = {
    "triton": triton_add.add,
    "cupy naive": cupy_add.add_naive,
    "cupy vectorized": cupy_add.add_vectorized,
}
RESIDUAL_ADDS = {"triton": triton_add.residual_add, "cupy": cupy_add.residual_add}


def needs_cupy(name: str) -> bool:
    return name.startswith("cupy") and not runtime.cupy_status()[0]


def inputs(count, n, dtype, seed):
    g = generator(seed, DEVICE)
    return [random_tensor((n,), dtype, DEVICE, g) for _ in range(count)]


@pytest.mark.parametrize("name", ADDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_add_matches_fp64(name, dtype, n):
    a, b = inputs(2, n, dtype, seed=n)
    out = poison_(torch.empty_like(a))
    if needs_cupy(name):
        with pytest.raises(RuntimeError, match="need an NVIDIA GPU"):
            ADDS[name](a, b, out)
        return
    result = ADDS[name](a, b, out)
    assert result is out
    atol, rtol = reference.add_tolerance(dtype)
    cmp = compare(out, reference.add_fp64(a, b), atol=atol, rtol=rtol)
    assert cmp.ok, cmp.reason
    if dtype != torch.bfloat16 or runtime.ON_GPU:  # the interpreter truncates fp32 -> bf16
        assert torch.equal(out, a + b)


@pytest.mark.parametrize("name", ADDS)
def test_add_allocates_when_no_out(name):
    a, b = inputs(2, 1025, torch.float16, seed=3)
    if needs_cupy(name):
        pytest.raises(RuntimeError, ADDS[name], a, b)
        return
    assert torch.equal(ADDS[name](a, b), a + b)


@pytest.mark.parametrize("name", RESIDUAL_ADDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_residual_add_reproduces_pytorch_order(name, dtype, n):
    x, attn, mlp = inputs(3, n, dtype, seed=10 * n)
    out = poison_(torch.empty_like(x))
    if needs_cupy(name):
        pytest.raises(RuntimeError, RESIDUAL_ADDS[name], x, attn, mlp, out)
        return
    RESIDUAL_ADDS[name](x, attn, mlp, out)
    atol, rtol = reference.residual_add_tolerance(dtype)
    scale = x.double().abs() + attn.double().abs() + mlp.double().abs()
    cmp = compare(out, reference.residual_add_fp64(x, attn, mlp), atol=atol, rtol=rtol, scale=scale)
    assert cmp.ok, cmp.reason
    if dtype != torch.bfloat16 or runtime.ON_GPU:
        assert torch.equal(out, reference.residual_add(x, attn, mlp)), (
            "not bit-identical to mlp + attn + x"
        )


@pytest.mark.parametrize("name", RESIDUAL_ADDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_residual_add_fp32_accumulation_rounds_once(name, dtype):
    x, attn, mlp = inputs(3, 98_765, dtype, seed=7)
    if needs_cupy(name):
        pytest.raises(RuntimeError, RESIDUAL_ADDS[name], x, attn, mlp, accumulate="fp32")
        return
    out = RESIDUAL_ADDS[name](x, attn, mlp, accumulate="fp32")
    terms = x.double().abs() + attn.double().abs() + mlp.double().abs()
    exact = reference.residual_add_fp64(x, attn, mlp)
    if dtype == torch.float32:  # the accumulator is the dtype: two float32 roundings
        atol, rtol = reference.residual_add_tolerance(dtype)
        scale = terms
    else:  # one rounding of the float32 sum, whose own error is far below a half-precision ulp
        atol, rtol = reference.add_tolerance(dtype)
        scale = exact.abs() + 2**-22 * terms
    cmp = compare(out, exact, atol=atol, rtol=rtol, scale=scale)
    assert cmp.ok, cmp.reason


def test_fp16_addition_order_changes_bits():
    """The reason exact_order exists: (mlp + attn) + x and mlp + (attn + x) differ in fp16."""
    x, attn, mlp = inputs(3, 98_765, torch.float16, seed=11)
    other_order = mlp + (attn + x)
    fused = triton_add.residual_add(x, attn, mlp)
    assert not torch.equal(fused, other_order)
    assert torch.equal(fused, reference.residual_add(x, attn, mlp))


BAD_INPUTS = [
    ("shape", lambda t: (t, t[:-1]), ValueError, "does not broadcast"),
    ("dtype mix", lambda t: (t, t.float()), TypeError, "cast one"),
    ("int dtype", lambda t: (t.int(), t.int()), TypeError, "supported: float32, float16, bfloat16"),
    ("not a tensor", lambda t: (t, [1.0]), TypeError, "must be a torch.Tensor"),
    ("non-contiguous", lambda t: (strided_view(t), t), ValueError, "not contiguous"),
]


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_triton_add_rejects_bad_input_clearly(case):
    _, make, error, message = case
    (t,) = inputs(1, 1025, torch.float16, seed=1)
    with pytest.raises(error, match=message):
        triton_add.add(*make(t))
    with pytest.raises(error, match=message):
        triton_add.residual_add(*make(t), make(t)[0])


def test_wrong_device_is_rejected_clearly():
    (t,) = inputs(1, 8, torch.float32, seed=1)
    if runtime.ON_GPU:
        with pytest.raises(ValueError, match="expected a cuda tensor"):
            triton_add.add(t.cpu(), t.cpu())
        with pytest.raises(ValueError, match=r"move it with \.cuda\(\)"):
            cupy_add.add_vectorized(t.cpu(), t.cpu())
    else:
        with pytest.raises(RuntimeError, match="need an NVIDIA GPU"):
            cupy_add.add_vectorized(t, t)


@pytest.mark.parametrize("kernel", [triton_add.add, lambda a, b: triton_add.residual_add(a, b, b)])
def test_zero_elements(kernel):
    a = torch.empty(0, 5, device=DEVICE)
    assert kernel(a, a).shape == (0, 5)


def test_invalid_accumulate_mode():
    (t,) = inputs(1, 8, torch.float16, seed=1)
    with pytest.raises(ValueError, match="accumulate"):
        triton_add.residual_add(t, t, t, accumulate="fp16")


def test_vectorized_add_falls_back_on_misaligned_views():
    a, b = inputs(2, 1025, torch.float16, seed=5)
    out = torch.empty_like(a)
    if needs_cupy("cupy"):
        pytest.raises(RuntimeError, cupy_add.add_vectorized, a[1:], b[1:], out[1:])
        return
    cupy_add.add_vectorized(a[1:], b[1:], out[1:])  # 2-byte offset: not 16-byte aligned
    assert torch.equal(out[1:], a[1:] + b[1:])
