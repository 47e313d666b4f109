"""On a GPU, the paths `runtime.features()` chose really run, and run correctly.

Run in each mode on an H200 (`KERNELS_GPU_PROFILE=a100`, `=rtx4090`, and unset): every gated
kernel must take its mode's path (PDL off before sm_90, fp8 through float32 before sm_89, no TMA
before sm_90, tiles within the profile's shared memory) and match float64 or the other path bit
for bit; the Gluon kernels must refuse with a sentence instead of compiling.
"""

from __future__ import annotations

import os

import pytest
import torch

from kernels import runtime
from kernels.flash_attention import gluon_flash, reference, triton_flash
from kernels.mixed_precision import reference as mp_reference
from kernels.mixed_precision import triton_fp8
from kernels.moe import moe_layer, triton_grouped_gemm
from kernels.rmsnorm import triton_pdl, triton_rmsnorm
from kernels.testing import compare, generator, random_tensor

pytestmark = pytest.mark.gpu


def test_the_mode_is_the_one_asked_for_and_says_so():
    profile = os.environ.get("KERNELS_GPU_PROFILE", "").strip().lower()
    found = runtime.features()
    if profile:
        assert found.capability == runtime.GPU_PROFILES[profile].capability
        assert found.emulated_on is not None
        assert "emulating the" in runtime.describe()
        assert runtime.fingerprint()["gpu_profile"] == profile
    else:
        assert found.emulated_on is None and "emulating" not in runtime.describe()


@pytest.mark.parametrize("tokens", [16, 1000])
def test_the_gemm_norm_pair_matches_float64_with_and_without_pdl(tokens):
    assert triton_pdl.launch_dependents() == runtime.has("pdl")
    layers = triton_pdl.GemmNormLayers.random(tokens, hidden=1024, layers=2)
    layers.run(pdl=False)
    assert all(c.ok for c in layers.check().values())
    plain = [t.clone() for t in layers.outputs()]
    layers.run(pdl=True)
    assert all(torch.equal(a, b) for a, b in zip(layers.outputs(), plain))


def test_fp8_quantizer_gives_pytorchs_bits():
    g = generator(5, "cuda")
    x = random_tensor((513, 300), torch.float32, "cuda", g) * 30
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        for block in (128, None):
            q, scales = triton_fp8.quantize(x, dtype, block)
            want_q, want_scales = mp_reference.quantize(x, dtype, block)
            assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)), (dtype, block)
            assert torch.equal(scales, want_scales)
            back = triton_fp8.dequantize(q, scales, block, torch.float32)
            assert torch.equal(back, mp_reference.dequantize(q, scales, block, torch.float32))
    x8 = (x / 30).to(torch.float8_e4m3fn)
    w = random_tensor((300,), torch.float32, "cuda", g)
    assert torch.equal(
        triton_rmsnorm.rms_norm_fp8(x8, 2.0, w, out_dtype=torch.float32),
        triton_rmsnorm.rms_norm(x8.float() * 2.0, w),
    )


@pytest.mark.parametrize("head_dim", [64, 128])
def test_attention_runs_the_tiles_that_fit_this_mode(head_dim):
    q, k, v = (
        random_tensor((1, 4, 333, head_dim), torch.float16, "cuda", generator(s, "cuda"))
        for s in (1, 2, 3)
    )
    out, _ = triton_flash.flash_attention_forward(q, k, v, True)
    want = reference.attention_fp64(q.double(), k.double(), v.double(), causal=True)[0]
    assert compare(out, want, atol=2e-3, rtol=2e-3).ok
    budget = runtime.shared_memory_budget()
    for bm, bn, _, stages in triton_flash.fitting_tiles("forward", head_dim):
        assert triton_flash.tile_shared_bytes("forward", bm, bn, stages, head_dim) <= budget


def test_moe_layer_takes_the_grouped_gemm_this_mode_has():
    chosen = moe_layer.grouped_gemm_for(32768, 64, 2)
    assert (chosen != "pointer") == runtime.has("tma")
    for block_m in (64, 128):
        assert triton_grouped_gemm.fitting_configs(block_m, swiglu=True)


def test_gluon_runs_only_where_wgmma_exists():
    q = torch.randn(1, 2, 128, 64, dtype=torch.float16, device="cuda")
    if runtime.has("wgmma"):
        out, _ = gluon_flash.gluon_attention_forward(q, q, q)
        assert torch.isfinite(out).all()
    else:
        with pytest.raises(runtime.FeatureMissing, match="wgmma.*H100, H200"):
            gluon_flash.gluon_attention_forward(q, q, q)


def test_an_offline_compile_answers_for_its_target_not_this_gpu():
    """Notebook 02b reads sm_90's code on any GPU: the compile's process must ask sm_90's features
    (TMA), not this GPU's or the profile's (an A100 refused the TMA kernel before it compiled)."""
    from kernels.matmul.offline import compile_offline

    [made] = compile_offline("kernels.matmul.triton_matmul_tma", [{}], arch="sm_90")
    assert made["target"] == "sm_90a" and made["tma_copies"] > 0
