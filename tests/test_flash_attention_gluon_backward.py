"""The Gluon backward (kernels/flash_attention/gluon_flash_backward.py) against float64 autograd,
on the edge cases of the Triton backward's tests, and compiled for sm_90 without a GPU."""

import pytest
import torch

from kernels import runtime
from kernels.flash_attention import reference
from kernels.testing import TINY, ULP, compare, generator, poison_, random_tensor
from tests.test_flash_attention import grad_magnitudes, make

# Gluon kernels refuse off sm_90 (and under KERNELS_GPU_PROFILE=a100, say): what the refusal says
# is checked in tests/test_gpu_portability.py
needs_wgmma = pytest.mark.skipif(not runtime.has("wgmma"), reason="Gluon kernels need sm_90")

DEVICE = runtime.DEVICE

# (B, Hq, Hkv, Nq, Nk, D), causal, dtype, stages: key and query counts off every block size (64
# queries a step, 64 keys a warpgroup, 128 a CTA); more queries than keys under the causal mask
# (rows that see no key); one query; grouped heads (4 query heads a KV head); exact multiples of
# the blocks; many steps and CTAs a head; a ring of 3.
CASES = [
    ((1, 2, 2, 100, 100, 64), False, torch.float16, 2),
    ((1, 2, 2, 197, 197, 64), True, torch.bfloat16, 2),
    ((1, 4, 2, 70, 150, 128), False, torch.bfloat16, 2),
    ((2, 4, 2, 100, 100, 128), True, torch.float16, 2),
    ((1, 2, 1, 130, 70, 64), True, torch.float16, 2),
    ((1, 2, 2, 3, 200, 128), True, torch.bfloat16, 2),
    ((1, 1, 1, 1, 1, 64), False, torch.float16, 2),
    ((1, 8, 2, 300, 300, 64), True, torch.bfloat16, 2),
    ((2, 2, 2, 256, 256, 64), False, torch.float16, 2),
    ((1, 2, 2, 256, 384, 128), True, torch.bfloat16, 2),
    ((1, 2, 1, 1000, 1000, 128), True, torch.float16, 2),
    ((1, 2, 2, 333, 333, 128), False, torch.float16, 3),
    ((1, 2, 2, 333, 333, 64), True, torch.bfloat16, 3),
]


def _case_id(case):
    (b, hq, hkv, nq, nk, d), causal, dtype, stages = case
    causal_id = "_causal" if causal else ""
    return f"B{b}_H{hq}:{hkv}_Nq{nq}_Nk{nk}_D{d}{causal_id}_{str(dtype)[6:]}_s{stages}"


@pytest.mark.gpu
@needs_wgmma
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_gluon_backward_matches_fp64_autograd(case):
    from kernels.flash_attention import gluon_flash_backward, triton_flash

    (b, hq, hkv, nq, nk, d), causal, dtype, stages = case
    q, k, v = make((b, hq, nq, d), (b, hkv, nk, d), dtype, seed=nq + 5 * nk + d)
    do = random_tensor((b, hq, nq, d), dtype, DEVICE, generator(nq + 1, DEVICE))
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    reference.attention_fp64(q64, k64, v64, causal=causal)[0].backward(do.double())
    out, lse = triton_flash.flash_attention_forward(q, k, v, causal)
    dk, dv = poison_(torch.empty_like(k)), poison_(torch.empty_like(v))
    dq, dk_got, dv_got = gluon_flash_backward.gluon_attention_backward(
        do, q, k, v, out, lse, causal, dk=dk, dv=dv, stages=stages
    )
    assert dk_got is dk and dv_got is dv
    magnitudes = grad_magnitudes(q, k, v, do, causal)
    for name, got, want, magnitude in zip(
        "qkv", (dq, dk, dv), (q64.grad, k64.grad, v64.grad), magnitudes
    ):
        assert got.dtype == dtype and got.shape == want.shape
        cmp = compare(got, want, atol=TINY[dtype], rtol=4 * ULP[dtype], scale=magnitude)
        assert cmp.ok, f"d{name}: {cmp.reason}"


@pytest.mark.gpu
@needs_wgmma
def test_gluon_backward_agrees_with_pytorch_sdpa():
    """The same gradients as PyTorch's own attention backward (SDPA), within rounding."""
    import torch.nn.functional as F

    from kernels.flash_attention import gluon_flash_backward, triton_flash

    q, k, v = make((2, 4, 512, 128), (2, 4, 512, 128), torch.bfloat16, seed=21)
    do = random_tensor(q.shape, q.dtype, DEVICE, generator(22, DEVICE))
    qt, kt, vt = (t.clone().requires_grad_() for t in (q, k, v))
    F.scaled_dot_product_attention(qt, kt, vt, is_causal=True).backward(do)
    out, lse = triton_flash.flash_attention_forward(q, k, v, True)
    grads = gluon_flash_backward.gluon_attention_backward(do, q, k, v, out, lse, True)
    for name, got, want in zip("qkv", grads, (qt.grad, kt.grad, vt.grad)):
        err = (got.float() - want.float()).abs().max().item()
        assert err <= 0.02 * want.float().abs().max().item(), f"d{name}: {err}"


@pytest.mark.cpu
def test_gluon_backward_refuses_what_it_does_not_cover(monkeypatch):
    """Checked before anything runs, so on any device: head sizes, dtypes, layouts, shapes. The
    device's wgmma is checked first (test_gpu_portability.py); here it is taken as present."""
    from kernels.flash_attention.gluon_flash_backward import gluon_attention_backward

    monkeypatch.setattr(runtime, "has", lambda feature: True)

    def inputs(d=64, dtype=torch.float16, n=64):
        q, k, v = make((1, 2, n, d), (1, 2, n, d), dtype, seed=d + n)
        lse = torch.zeros(q.shape[:3], dtype=torch.float32, device=q.device)
        return q.clone(), q, k, v, q.clone(), lse

    do, q, k, v, out, lse = inputs(d=96)
    with pytest.raises(ValueError, match="head_dim 96; supported: 64, 128"):
        gluon_attention_backward(do, q, k, v, out, lse)
    do, q, k, v, out, lse = inputs()
    with pytest.raises(ValueError, match="dout must be a torch.float16 tensor"):
        gluon_attention_backward(do.float(), q, k, v, out, lse)
    _, k_strided, _ = make((1, 2, 64, 64), (1, 2, 64, 64), torch.float16, seed=3, layout="bnhd")
    with pytest.raises(ValueError, match="k must be contiguous"):
        gluon_attention_backward(do, q, k_strided, v, out, lse)
    # contiguous, but one element past a 16-byte boundary: the error names this function
    shifted = torch.empty(q.numel() + 1, dtype=q.dtype, device=q.device)[1:].view(q.shape)
    with pytest.raises(ValueError, match="gluon_attention_backward: dout must start on a 16-byte"):
        gluon_attention_backward(shifted.copy_(do), q, k, v, out, lse)
    with pytest.raises(ValueError, match="must have q's shape"):
        gluon_attention_backward(do[:, :, :32].contiguous(), q, k, v, out, lse)
    with pytest.raises(ValueError, match="lse must be the forward's contiguous float32"):
        gluon_attention_backward(do, q, k, v, out, lse.half())
    with pytest.raises(ValueError, match="dk must be contiguous"):
        gluon_attention_backward(do, q, k, v, out, lse, dk=torch.empty_like(q[:, :1]))
    # K and V 64 KiB, dS^T 32 KiB and 5 x 32 KiB of Q and dO: past the 227 KiB of a CTA
    do, q, k, v, out, lse = inputs(d=128)
    with pytest.raises(ValueError, match="5 stages need 262144 bytes of shared memory"):
        gluon_attention_backward(do, q, k, v, out, lse, stages=5)


# (head_dim, dtype, causal, schedule): both head sizes, both dtypes, with and without the mask,
# and a ring of 3
COMPILED = [(128, "float16", True, {}), (128, "bfloat16", False, {}), (64, "float16", True, {}),
            (64, "bfloat16", False, {}), (128, "float16", False, {"stages": 3})]  # fmt: skip


@pytest.fixture(scope="module")
def compiled_offline():
    from kernels.flash_attention import gluon_offline

    return gluon_offline.compile_offline_many(
        COMPILED, "kernels.flash_attention.gluon_flash_backward"
    )


@pytest.mark.cpu
@pytest.mark.parametrize("variant", range(len(COMPILED)),
                         ids=lambda i: str(COMPILED[i]).replace(" ", ""))  # fmt: skip
def test_gluon_backward_compiles_for_hopper_without_a_gpu(compiled_offline, variant):
    """The warp-specialized kernel as ptxas builds it for sm_90: 12 warps (two consumer
    warpgroups, the producer's warp padded to a warpgroup), the register budgets set, the
    five products as wgmma, TMA copies, the shared memory `shared_bytes` counts."""
    from kernels.flash_attention import gluon_flash_backward

    head_dim, _, _, schedule = COMPILED[variant]
    made = compiled_offline[variant]
    assert made["warps"] == 12
    assert {24, 240} <= set(made["register_budgets"]), made
    assert made["wgmma"] > 0 and made["tma_copies"] > 0
    stages = schedule.get("stages", gluon_flash_backward.DEFAULT_STAGES)
    assert gluon_flash_backward.shared_bytes(head_dim, stages) <= made["shared_bytes"]
    assert made["shared_bytes"] <= gluon_flash_backward.shared_bytes(head_dim, stages) + 1024
    # D = 64 nearly fits its 240 registers (ptxas spills 32 bytes with the mask); at D = 128, dK
    # and dV (128 registers) beside S^T, dP^T and the dQ share do not, and ptxas spills about
    # 4 KB (the performance log has the counts)
    assert made["spill_bytes"] <= (64 if head_dim == 64 else 5120), made


@pytest.mark.cpu
def test_backward_target_is_checked_at_the_large_shape_only():
    """The benchmark's checks: Gluon >= 0.8 x cuDNN for the backward at (32, 32, 4096, 128), the
    ratio stated as measured; the (16, 16, 2048, 64) rows are informational."""
    from kernels.flash_attention import benchmark_gluon_backward

    def row(shape, ratio, causal):
        impls = {"ours (Gluon)": {"bwd_vs_cudnn": ratio}}
        return {"shape": shape, "dtype": "float16", "causal": causal, "impls": impls}

    rows = [row([32, 32, 4096, 128], 0.64, False), row([32, 32, 4096, 128], 0.81, True),
            row([16, 16, 2048, 64], 0.7, False)]  # fmt: skip
    checks = benchmark_gluon_backward.targets(rows)
    got = [(c["target"], c["value"], c["threshold"], c["pass"]) for c in checks]
    assert got == [
        ("bwd (32, 32, 4096, 128) float16: Gluon >= 0.8 x cuDNN", 0.64, 0.8, False),
        ("bwd (32, 32, 4096, 128) float16 causal: Gluon >= 0.8 x cuDNN", 0.81, 0.8, True),
    ]


def test_rates_name_the_direction_and_divide_by_cudnn():
    """`benchmark.rates`, shared by the forward and backward benchmarks: milliseconds, TFLOP/s and
    the ratio to cuDNN (the median of per-repetition ratios: 0.75, 1.5 and 0.5 here)."""
    from kernels import bench
    from kernels.flash_attention import benchmark

    timings = {"ours": bench.Timing("ours", [2000.0, 1000.0, 3000.0], "cuda-events"),
               "sdpa cudnn": bench.Timing("sdpa cudnn", [1500.0] * 3, "cuda-events")}  # fmt: skip
    got = benchmark.rates(timings, 4e12, "bwd")
    assert got["ours"] == {"bwd_ms": 2.0, "bwd_tflops": 2000.0, "bwd_vs_cudnn": 0.75}
    assert got["sdpa cudnn"]["bwd_vs_cudnn"] == 1.0
    assert set(benchmark.rates({"ours": timings["ours"]}, 4e12, "fwd")["ours"]) == {
        "fwd_ms", "fwd_tflops"}  # fmt: skip
