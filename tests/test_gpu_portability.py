"""The paths each GPU takes, chosen by `runtime.features()` alone.

On the CPU, `features()` is made to answer for an A100 (sm_80), an RTX 4090 (sm_89), a T4 (sm_75)
and others from `runtime.GPU_PROFILES`; each test checks the path that GPU would take (PDL off,
fp8 through float32, the Gluon kernels refused by a sentence, tiles that fit its shared memory,
bf16 products refused on a T4), and, where the interpreter runs both paths, that they give the same
bits. An H100 profile must choose exactly what the course measured on sm_90.
"""

from __future__ import annotations

import pytest
import torch

from kernels import feature_table, runtime
from kernels.flash_attention import gluon_flash, gluon_flash_backward, triton_flash
from kernels.mixed_precision import triton_fp8
from kernels.moe import moe_layer, triton_grouped_gemm
from kernels.rmsnorm import triton_pdl, triton_rmsnorm
from kernels.testing import generator, random_tensor
from kernels.validate import check_matmul_args

pytestmark = pytest.mark.cpu
BEFORE_HOPPER = ["t4", "a100", "a10", "rtx4090"]


@pytest.fixture
def gpu(monkeypatch):
    """gpu("a100"): features() answers for that profile until the test ends."""

    def take(name: str):
        profile = runtime.GPU_PROFILES[name]
        monkeypatch.setattr(runtime, "features", lambda: profile)
        return profile

    return take


@pytest.mark.parametrize("name", BEFORE_HOPPER)
def test_pdl_is_off_before_hopper_and_the_gemm_carries_no_trigger(gpu, name):
    gpu(name)
    assert not triton_pdl.launch_dependents()
    g = generator(3, "cpu")
    x, w = (
        random_tensor((5, 300), torch.float32, "cpu", g),
        random_tensor((300,), torch.float32, "cpu", g),
    )
    # rms_norm_pdl falls back to the plain kernel: the same bits, no griddepcontrol anywhere
    assert torch.equal(triton_pdl.rms_norm_pdl(x, w), triton_rmsnorm.rms_norm(x, w))


@pytest.mark.parametrize("name", ["h100", "h200", "b200", "rtx5090"])
def test_pdl_is_on_from_hopper(gpu, name):
    gpu(name)
    assert triton_pdl.launch_dependents()


def test_sm90_takes_exactly_the_measured_tiles(gpu):
    """No regression on Hopper: every table entry kept, in order, and nothing added."""
    gpu("h200")
    for kind, table in triton_flash.TUNING_TABLES.items():
        for head_pad, tiles in table.items():
            assert triton_flash.fitting_tiles(kind, head_pad) == tiles, (kind, head_pad)
    for rows in (16, 64, 1024, 4096):
        most_tile = next(t for most, *t in triton_pdl.GPU_TILES if most is None or rows <= most)
        assert list(triton_pdl.gpu_tile(rows)) == most_tile
    for block_m in (64, 128):
        for swiglu in (False, True):
            chosen = triton_grouped_gemm.fitting_configs(block_m, swiglu)
            assert all(
                (c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_warps, c.num_stages)
                in triton_grouped_gemm.GPU_TUNING
                for c in chosen
            )


@pytest.mark.parametrize("name, budget", [("t4", 64), ("rtx4090", 99), ("a100", 163)])
def test_tiles_fit_the_gpus_shared_memory(gpu, name, budget):
    """A T4 has 64 KiB a block, an RTX 4090 99 KiB: lab 03's head dim 128 must get a tile."""
    assert gpu(name).shared_memory_per_block == budget * 1024
    for kind in triton_flash.TUNING_TABLES:
        for head_pad in (16, 32, 64, 128, 256):
            tiles = triton_flash.fitting_tiles(kind, head_pad)
            assert tiles
            for bm, bn, _, stages in tiles:
                used = triton_flash.tile_shared_bytes(kind, bm, bn, stages, head_pad)
                assert used <= budget * 1024, (kind, head_pad, bm, bn, stages)
    for rows in (16, 64, 1024, 4096):
        bm, bn, bk, _, stages = triton_pdl.gpu_tile(rows)
        assert stages * (bm + bn) * bk * 2 <= budget * 1024
    for block_m in (64, 128):
        for swiglu in (False, True):
            for c in triton_grouped_gemm.fitting_configs(block_m, swiglu):
                used = triton_grouped_gemm.pipeline_bytes(
                    block_m, c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_stages, swiglu
                )
                assert used <= budget * 1024, (block_m, swiglu, c)


def test_the_t4_gets_a_smaller_tile_than_the_table_at_head_dim_128(gpu):
    gpu("t4")
    tiles = triton_flash.fitting_tiles("forward", 128)
    assert tiles == [triton_flash.SMALL_TILES[0]]


@pytest.mark.parametrize("name", ["t4", "a100", "a10"])
def test_fp8_before_sm89_gives_the_same_bits_through_float32(gpu, monkeypatch, name):
    """The quantizer stores the values it rounded as float32 and PyTorch converts them: the bits of
    the fp8 path, which the interpreter also runs."""
    g = generator(8, "cpu")
    x = random_tensor((3, 700), torch.float32, "cpu", g) * 40
    native = {
        (dtype, block): triton_fp8.quantize(x, dtype, block, pow2=block is None)
        for dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
        for block in (128, None)
    }
    x8 = (x / 40).to(torch.float8_e4m3fn)
    w = random_tensor((700,), torch.float32, "cpu", g)
    norm = triton_rmsnorm.rms_norm_fp8(x8, 0.5, w)
    dq = triton_fp8.dequantize(*native[(torch.float8_e4m3fn, 128)], 128)
    gpu(name)
    assert not runtime.has("fp8")
    for (dtype, block), (q, scales) in native.items():
        soft_q, soft_scales = triton_fp8.quantize(x, dtype, block, pow2=block is None)
        assert soft_q.dtype == dtype
        assert torch.equal(soft_q.view(torch.uint8), q.view(torch.uint8)), (dtype, block)
        assert torch.equal(soft_scales, scales)
    assert torch.equal(triton_rmsnorm.rms_norm_fp8(x8, 0.5, w), norm)
    assert torch.equal(triton_fp8.dequantize(*native[(torch.float8_e4m3fn, 128)], 128), dq)


@pytest.mark.parametrize("name", ["t4", "a100", "rtx4090", "b200", "rtx5090"])
def test_gluon_refuses_by_a_sentence_before_compiling(gpu, monkeypatch, name):
    """Off sm_90 LLVM aborts the process compiling these kernels: they must never be compiled."""
    profile = gpu(name)

    class NeverLaunched:
        def __getitem__(self, grid):
            raise AssertionError("the Gluon kernel was launched (and so compiled)")

    monkeypatch.setattr(gluon_flash, "gluon_fwd_kernel", NeverLaunched())
    monkeypatch.setattr(gluon_flash_backward, "gluon_bwd_kernel", NeverLaunched())
    q = torch.randn(1, 2, 128, 64, dtype=torch.float16)
    with pytest.raises(runtime.FeatureMissing) as refused:
        gluon_flash.gluon_attention_forward(q, q, q)
    sentence = str(refused.value)
    assert "wgmma" in sentence and "H100, H200" in sentence and profile.arch in sentence
    lse = torch.zeros(1, 2, 128)
    with pytest.raises(runtime.FeatureMissing, match="wgmma.*H100, H200"):
        gluon_flash_backward.gluon_attention_backward(q, q, q, q, q, lse)


@pytest.mark.parametrize("name", BEFORE_HOPPER)
def test_no_tma_means_the_pointer_grouped_gemm(gpu, name):
    gpu(name)
    assert moe_layer.grouped_gemm_for(32768, 64, 2) == "pointer"
    with pytest.raises(runtime.FeatureMissing, match="tma"):
        moe_layer.grouped_gemm_functions(moe_layer.LARGE_BATCH_VARIANT)
    q = torch.randn(1, 2, 40, 64, dtype=torch.float16)
    with pytest.raises(runtime.FeatureMissing, match=r"tma=True.*tma"):
        triton_flash.flash_attention_forward(q, q, q, tma=True)


def test_hopper_keeps_the_tma_grouped_gemm_for_large_batches(gpu):
    gpu("h100")
    assert moe_layer.grouped_gemm_for(32768, 64, 2) == moe_layer.LARGE_BATCH_VARIANT


def test_a_t4_refuses_bf16_products_and_says_to_pass_float16(gpu):
    gpu("t4")
    a = torch.randn(32, 16, dtype=torch.bfloat16)
    with pytest.raises(
        runtime.FeatureMissing,
        match=r"bfloat16 tensors needs bf16.*Tesla T4 \(sm_75\).*Pass float16",
    ):
        check_matmul_args("matmul", a, a.T.contiguous(), None, device_type="cpu")
    check_matmul_args("matmul", a.half(), a.T.contiguous().half(), None, device_type="cpu")
    q = torch.randn(1, 2, 40, 64, dtype=torch.bfloat16)
    with pytest.raises(runtime.FeatureMissing, match="bf16"):
        triton_flash.check_inputs("flash_attention", q, q, q)


def test_emulation_says_what_runs_and_what_compiles(monkeypatch):
    emulated = runtime.Features(
        "A100 80GB", (8, 0), 163 * 1024, 132, emulated_on="NVIDIA H200 (sm_90)"
    )
    monkeypatch.setattr(runtime, "features", lambda: emulated)
    assert runtime.emulation() == (
        "emulating the A100 80GB on the NVIDIA H200: paths and shared-memory budget of sm_80, "
        "kernels compiled for sm_90"
    )
    monkeypatch.setattr(runtime, "features", lambda: runtime.GPU_PROFILES["h200"])
    assert runtime.emulation() is None


def test_the_feature_table_says_where_the_hopper_kernels_cannot_exist():
    feature_table.check_table()
    gluon = "flash_attention.gluon_flash:gluon_fwd_kernel"
    assert feature_table.cannot_exist(gluon) == ("sm_75", "sm_80", "sm_86", "sm_89", "sm_100",
                                                 "sm_120")  # fmt: skip
    assert feature_table.cannot_exist("rmsnorm.triton_pdl:rmsnorm_pdl_kernel") == (
        "sm_75",
        "sm_80",
        "sm_86",
        "sm_89",
    )
    # a portable path: compiled everywhere
    assert feature_table.cannot_exist("rmsnorm.triton_pdl:matmul_kernel") == ()
    assert feature_table.missing("mixed_precision.triton_fp8:quantize_blocks_kernel", "sm_86") == (
        "fp8",
    )
