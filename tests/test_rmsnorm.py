"""RMSNorm kernels against the float64 reference: odd widths, several row counts, strided rows,
every dtype, the fused residual add, fp8 input, and the backward pass (gradcheck in float64).

CuPy kernels run on a GPU; without one these tests assert the clear "needs a GPU" error instead."""

import functools

import pytest
import torch

from kernels import runtime
from kernels.rmsnorm import cupy_rmsnorm, reference, triton_rmsnorm
from kernels.testing import ULP, compare, generator, poison_, random_tensor

DEVICE = runtime.DEVICE
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(1, 1), (3, 1000), (4097, 64), (5, 5120), (2, 4096), (7, 8192), (2, 16384), (1, 4096)]
FORWARDS = {
    "triton": triton_rmsnorm.rms_norm,
    "cupy": cupy_rmsnorm.rms_norm,
    "cupy staged": functools.partial(cupy_rmsnorm.rms_norm, staged=True),
    "cupy staged x8": functools.partial(cupy_rmsnorm.rms_norm, staged=True, unroll=8),
}


def close(actual, expected, dtype):
    """The comparison every forward test makes: reference.tolerance for `dtype`."""
    atol, rtol = reference.tolerance(dtype)
    return compare(actual, expected, atol=atol, rtol=rtol)


def data(rows, width, dtype, seed, scale=1.0):
    g = generator(seed, DEVICE)
    return random_tensor((rows, width), dtype, DEVICE, g) * scale, random_tensor(
        (width,), dtype, DEVICE, g
    )


def needs_gpu(name):
    return name.startswith("cupy") and not runtime.cupy_status()[0]


@pytest.mark.parametrize("name", FORWARDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_forward_matches_fp64(name, dtype, shape):
    x, w = data(*shape, dtype, seed=shape[1])
    out = poison_(torch.empty_like(x))
    if needs_gpu(name):
        pytest.raises(RuntimeError, FORWARDS[name], x, w, 1e-6, out)
        return
    if "staged" in name and shape[1] * x.element_size() > cupy_rmsnorm.STAGED_MAX_BYTES:
        with pytest.raises(
            ValueError, match="staged=True holds a row in at most 47 KB of shared memory"
        ):
            FORWARDS[name](x, w, 1e-6, out)
        return
    FORWARDS[name](x, w, 1e-6, out)
    cmp = close(out, reference.rms_norm_fp64(x, w, 1e-6), dtype)
    assert cmp.ok, cmp.reason


@pytest.mark.parametrize("name", FORWARDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_rows_and_eps_that_matters(name, dtype):
    # rows of 1000 inside a buffer 1024 wide (stride > width), tiny values so eps changes the answer
    g = generator(3, DEVICE)
    buf = random_tensor((33, 1024), dtype, DEVICE, g) * 1e-3
    x = buf[:, :1000]
    w = random_tensor((1000,), dtype, DEVICE, g)
    if needs_gpu(name):
        pytest.raises(RuntimeError, FORWARDS[name], x, w, 1e-6)
        return
    y = FORWARDS[name](x, w, 1e-6)
    cmp = close(y, reference.rms_norm_fp64(x, w, 1e-6), dtype)
    assert cmp.ok, cmp.reason
    without_eps = reference.rms_norm_fp64(x, w, 1e-30)
    assert not close(y, without_eps, dtype).ok, "eps had no effect"


@pytest.mark.parametrize("name", FORWARDS)
def test_3d_input_and_zero_rows(name):
    x, w = data(2 * 3, 512, torch.bfloat16, seed=1)
    x = x.view(2, 3, 512)
    if needs_gpu(name):
        pytest.raises(RuntimeError, FORWARDS[name], x, w)
        return
    y = FORWARDS[name](x, w)
    assert y.shape == x.shape
    assert close(y, reference.rms_norm_fp64(x, w), torch.bfloat16).ok
    assert FORWARDS[name](x[:0], w).shape == (0, 3, 512)


BAD = [
    ("wrong weight length", lambda x, w: (x, w[:-1], 1e-6), ValueError, "w must have shape"),
    ("eps zero", lambda x, w: (x, w, 0.0), ValueError, "eps must be a positive"),
    ("eps negative", lambda x, w: (x, w, -1e-6), ValueError, "eps must be a positive"),
    ("int dtype", lambda x, w: (x.int(), w.int(), 1e-6), TypeError, "supported"),
    ("dtype mismatch", lambda x, w: (x, w.double(), 1e-6), TypeError, "dtype"),
    (
        "weight dtype differs",
        lambda x, w: (x, w.bfloat16(), 1e-6),
        TypeError,
        "reads both as x's dtype",
    ),
    (
        "column-strided",
        lambda x, w: (x.t().contiguous().t(), w, 1e-6),
        ValueError,
        "last dimension must be contiguous",
    ),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input_is_rejected_clearly(case):
    _, make, error, message = case
    x, w = data(8, 8, torch.float32, seed=2)
    with pytest.raises(error, match=message):
        triton_rmsnorm.rms_norm(*make(x, w))


def test_cpu_tensor_to_gpu_kernel():
    x, w = data(4, 64, torch.float32, seed=2)
    if runtime.ON_GPU:
        with pytest.raises(ValueError, match=r"move it with \.cuda\(\)"):
            cupy_rmsnorm.rms_norm(x.cpu(), w.cpu())
    else:
        with pytest.raises(RuntimeError, match="need an NVIDIA GPU"):
            cupy_rmsnorm.rms_norm(x, w)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape", [(1, 1000), (65, 4096), (3, 5120)], ids=lambda s: f"{s[0]}x{s[1]}"
)
def test_fused_add_rmsnorm(dtype, shape):
    g = generator(9, DEVICE)
    x, res = (random_tensor(shape, dtype, DEVICE, g) for _ in range(2))
    w = random_tensor((shape[1],), dtype, DEVICE, g)
    y, h = triton_rmsnorm.fused_add_rms_norm(x, res, w)
    assert torch.equal(h, x + res) or (
        dtype == torch.bfloat16
        and not runtime.ON_GPU
        and compare(h, x.double() + res.double(), atol=0, rtol=ULP[dtype]).ok
    )
    y_ref, _ = reference.fused_add_rms_norm_fp64(x, res, w)
    cmp = close(y, reference.rms_norm_fp64(h, w), dtype)
    assert cmp.ok, cmp.reason


def test_fp8_input_with_scale():
    g = generator(4, DEVICE)
    x8 = (random_tensor((16, 64, 512), torch.float32, DEVICE, g) * 8).to(torch.float8_e4m3fn)
    w = random_tensor((512,), torch.bfloat16, DEVICE, g)
    y = triton_rmsnorm.rms_norm_fp8(x8, 0.25, w)
    assert y.dtype == torch.bfloat16
    cmp = close(y, reference.rms_norm_fp64(x8, w, x_scale=0.25), torch.bfloat16)
    assert cmp.ok, cmp.reason
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        triton_rmsnorm.rms_norm_fp8(x8.float(), 0.25, w)


def test_gradcheck_float64():
    g = generator(5, DEVICE)
    x = random_tensor((6, 37), torch.float64, DEVICE, g).requires_grad_()
    w = random_tensor((37,), torch.float64, DEVICE, g).requires_grad_()
    assert torch.autograd.gradcheck(
        lambda x, w: triton_rmsnorm.rms_norm_autograd(x, w, 1e-6), (x, w)
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape", [(1, 1000), (257, 512), (9, 5120)], ids=lambda s: f"{s[0]}x{s[1]}"
)
def test_backward_matches_fp64_autograd(dtype, shape):
    x, w = data(*shape, dtype, seed=11)
    dy = random_tensor(shape, dtype, DEVICE, generator(12, DEVICE))
    xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
    reference.rms_norm_fp64(xr, wr).backward(dy.double())
    xt, wt = x.clone().requires_grad_(), w.clone().requires_grad_()
    triton_rmsnorm.rms_norm_autograd(xt, wt).backward(dy)
    # dx: a few roundings per element; dw: a float32 sum over rows, rounded once to the dtype
    for got, want, scale in ((xt.grad, xr.grad, 8), (wt.grad, wr.grad, 4)):
        cmp = compare(
            got, want, atol=1e-6 * want.abs().max().item(), rtol=scale * ULP[dtype] + 2.0**-14
        )
        assert cmp.ok, cmp.reason


def test_every_launch_configuration_fits_the_register_file(tmp_path):
    """threads x registers <= 64K for every kernel the wrapper can pick (ptxas's sm_90 report)."""
    import re
    import subprocess

    from kernels import cuda

    src = cuda.source_path("rmsnorm/rmsnorm.cu")
    report = subprocess.run(
        [
            cuda.nvcc_path(),
            "-cubin",
            "-arch=sm_90",
            "-std=c++17",
            "-Xptxas",
            "-v",
            *(f"-I{d}" for d in cuda.cuda_include_dirs()),
            "-o",
            str(tmp_path / "r.cubin"),
            str(src),
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stderr
    regs = dict(
        re.findall(r"Compiling entry function '(\w+)'.*?Used (\d+) registers", report, re.S)
    )
    checked = 0
    for dtype, suffix in cupy_rmsnorm.SUFFIX.items():
        for vec, pack in (("v", 16 // dtype.itemsize), ("s", 1)):
            for width in list(range(1, 300)) + [
                1000,
                2048,
                4096,
                5120,
                8192,
                12288,
                16384,
                32768,
                65536,
            ]:
                kind, threads, items = cupy_rmsnorm.launch_config(width, pack, dtype.itemsize)
                name = f"rmsnorm_{kind}_{suffix}_{vec}{items}"
                assert name in regs, (
                    f"wrapper would launch {name}, which rmsnorm.cu does not define"
                )
                assert threads * int(regs[name]) <= 65536, (name, threads, regs[name])
                assert threads % 32 == 0 and (
                    kind != "block" or items == 0 or threads * items * pack >= width
                )
                # the row fits the dynamic shared memory a block gets without an opt-in
                if kind == "staged":
                    assert width * dtype.itemsize <= cupy_rmsnorm.STAGED_MAX_BYTES <= 48 * 1024
                checked += 1
    assert checked > 1000
