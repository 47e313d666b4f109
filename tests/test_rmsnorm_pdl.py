"""The GEMM -> RMSNorm pair of triton_pdl.py.

The GEMM against float64 on odd sizes, the pair against float64, bad arguments, and (on a GPU)
programmatic dependent launch giving the same bits as the plain launch, eagerly and in a CUDA
graph. In CPU mode `pdl=True` runs the plain kernels (no PDL there)."""

import pytest
import torch

from kernels import bench, runtime
from kernels.rmsnorm import triton_pdl, triton_rmsnorm
from kernels.testing import generator, poison_, random_tensor

DEVICE = runtime.DEVICE


def operands(tokens, k, n, dtype=torch.bfloat16, seed=0):
    g = generator(seed, DEVICE)
    a = random_tensor((tokens, k), dtype, DEVICE, g)
    b = (random_tensor((k, n), torch.float32, DEVICE, g) / k**0.5).to(dtype)
    return a, b, random_tensor((n,), dtype, DEVICE, g)


# K and N not multiples of any block size (the CPU tile is 32 x 64 x 64, the GPU's 16..128 x 32..256
# x 64..128)
SIZES = [(1, 200, 136), (3, 72, 40), (17, 130, 300), (17, 64, 4096)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens,k,n", SIZES, ids=lambda v: str(v))
def test_matmul_matches_fp64(tokens, k, n, dtype):
    a, b, w = operands(tokens, k, n, dtype, seed=tokens + k)
    out = poison_(torch.empty(tokens, n, dtype=dtype, device=DEVICE))
    triton_pdl.matmul(a, b, out)
    h = triton_pdl.check_pair(a, b, w, 1e-6, out, out)["h = a @ b"]
    assert h.ok, h.reason
    # The tolerance can fail: a product missing its last K row of b is rejected.
    short = (a[:, :-1].double() @ b[:-1].double()).to(dtype)
    assert not triton_pdl.check_pair(a, b, w, 1e-6, short, short)["h = a @ b"].ok


@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("tokens,k,n", SIZES[:3], ids=lambda v: str(v))
def test_pair_matches_fp64(tokens, k, n, pdl):
    a, b, w = operands(tokens, k, n, seed=7)
    h, y = (poison_(torch.empty(tokens, n, dtype=a.dtype, device=DEVICE)) for _ in range(2))
    assert triton_pdl.gemm_rms_norm(a, b, w, 1e-6, pdl=pdl, out=(h, y)) == (h, y)
    for name, cmp in triton_pdl.check_pair(a, b, w, 1e-6, h, y).items():
        assert cmp.ok, f"{name}: {cmp.reason}"


def test_layers_chain_and_check():
    layers = triton_pdl.GemmNormLayers.random(tokens=3, hidden=96, layers=3)
    for t in layers.outputs():
        poison_(t)
    layers.run(pdl=True)
    results = layers.check()
    assert len(results) == 6 and all(c.ok for c in results.values()), results
    layers.h[1].zero_()  # a layer that did not run is caught
    assert not layers.check()["layer 1: h = a @ b"].ok


def test_rms_norm_pdl_same_result():
    a, b, w = operands(5, 64, 1000, seed=3)
    x = a @ b
    assert torch.equal(triton_pdl.rms_norm_pdl(x, w), triton_rmsnorm.rms_norm(x, w))


BAD = [
    (
        "float32 a and b",
        lambda a, b, w: (a.float(), b.float(), w),
        TypeError,
        "supported: bfloat16, float16",
    ),
    ("dtypes differ", lambda a, b, w: (a, b.half(), w), TypeError, "cast one to match"),
    (
        "inner sizes differ",
        lambda a, b, w: (a, b[:-1], w),
        ValueError,
        "a's columns must equal b's rows",
    ),
    ("a is 3-D", lambda a, b, w: (a[None], b, w), ValueError, "a must be 2-D"),
    (
        "b not contiguous",
        lambda a, b, w: (a, b.t().contiguous().t(), w),
        ValueError,
        r"pass b\.contiguous\(\)",
    ),
    ("w the wrong length", lambda a, b, w: (a, b, w[:-1]), ValueError, "w must have shape"),
    ("w float32", lambda a, b, w: (a, b, w.float()), TypeError, "reads both as x's dtype"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input_is_rejected_clearly(case):
    _, make, error, message = case
    a, b, w = operands(4, 48, 48)
    with pytest.raises(error, match=message):
        triton_pdl.gemm_rms_norm(*make(a, b, w))


def test_bad_out_and_device():
    a, b, w = operands(4, 48, 32)
    with pytest.raises(ValueError, match=r"out must have shape \(4, 32\), got \(4, 31\)"):
        triton_pdl.matmul(a, b, torch.empty(4, 31, dtype=a.dtype, device=DEVICE))
    if runtime.ON_GPU:  # a CPU tensor handed to the GPU kernels
        with pytest.raises(ValueError, match="this kernel runs on cuda"):
            triton_pdl.matmul(a.cpu(), b.cpu())


@pytest.mark.gpu  # programmatic dependent launch needs a GPU (sm_90)
@pytest.mark.parametrize("tokens", [16, 512, 1000])
def test_pdl_is_bit_identical_eager_and_in_a_graph(tokens):
    layers = triton_pdl.GemmNormLayers.random(tokens, hidden=4096, layers=2)
    layers.run(pdl=False)
    assert all(c.ok for c in layers.check().values())
    plain = [t.clone() for t in layers.outputs()]
    for t in layers.outputs():
        poison_(t)
    layers.run(pdl=True)
    assert all(torch.equal(got, want) for got, want in zip(layers.outputs(), plain)), (
        "eager PDL differs"
    )
    graph = bench.capture_graph(lambda: layers.run(pdl=True))
    for t in layers.outputs():
        poison_(t)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(got, want) for got, want in zip(layers.outputs(), plain)), (
        "PDL in a CUDA graph differs"
    )
