"""The fp8 matrix products (kernels/matmul/triton_fp8_matmul.py): the quantizers, both kernels
against float64 products of the dequantized and of the original inputs (in the interpreter on
the CPU, on the GPU at sizes where accumulation matters), the argument checks, and the kernel
compiled for sm_90 and sm_89 without a GPU (and refused for sm_80).
"""

import pytest
import torch

from kernels import runtime
from kernels.matmul import triton_fp8_matmul as fp8
from kernels.testing import generator, poison_
from tests.test_matmul_hopper import needs

# (M, N, K): none a multiple of the tiles; K not a multiple of the 128-wide scale blocks (a
# partial last block) but of 16 (TMA's 16-byte rows of e4m3); N past one 128-row weight block.
CPU_SHAPES = [(72, 200, 272), (1, 136, 144), (40, 16, 48)]
# (130, 100, 300): K off e4m3's 16-byte rows and N off bf16's, so the operands and C go through
# buffers with padded rows.
GPU_SHAPES = [(200, 264, 400), (1000, 1000, 1040), (3000, 2056, 4096), (130, 100, 300)]
# torch._scaled_mm takes only K and N that are multiples of 16 (it raises on the others), so the
# per-tensor kernel is compared with cuBLAS at those shapes alone.
CUBLAS_SHAPES = [(3000, 2048, 4096), (200, 272, 400), (1, 1024, 2048)]
SHAPES = runtime.pick(gpu=GPU_SHAPES, cpu=CPU_SHAPES)


def make_inputs(M, N, K, seed=0, device=None):
    """bf16 activation a (M, K) and weight w (N, K), standard normal."""
    gen = generator(seed, device or runtime.DEVICE)
    a = torch.randn(M, K, generator=gen, device=gen.device).bfloat16()
    w = torch.randn(N, K, generator=gen, device=gen.device).bfloat16()
    return a, w


def check_kernel_error(c, a_deq, w_deq):
    """C against the exact product of what the kernel was given, and NaN never passes. Allowed:
    C's rounding to bf16 (an ulp, 2^-7 of |C|: the interpreter truncates) plus the accumulation's
    error: in the interpreter float32 (sqrt(K) 2^-23 of |A| |W|^T, twice for the promotions), on
    Hopper the tensor cores' shorter sum between promotions every 128 (`promoted_error_bound`)."""
    exact = a_deq @ w_deq.T
    if runtime.ON_GPU:
        accumulation = fp8.promoted_error_bound(a_deq, w_deq)
    else:
        accumulation = 2 * a_deq.shape[1] ** 0.5 * 2.0**-23 * (a_deq.abs() @ w_deq.abs().T)
    bound = 2.0**-7 * exact.abs() + accumulation
    error = (c.double() - exact).abs()
    assert not torch.isnan(c).any(), "an element of C was never written (NaN)"
    worst = int((error - bound).argmax())
    assert (error <= bound).all(), (error.flatten()[worst].item(), bound.flatten()[worst].item())


def run_block_scaled(M, N, K, seed=0, kernel=fp8.fp8_matmul_block_scaled, **options):
    a, w = make_inputs(M, N, K, seed)
    a8, sa = fp8.quantize_activation(a)
    w8, sw = fp8.quantize_weight(w)
    out = poison_(torch.empty((M, N), dtype=torch.bfloat16, device=a.device))
    c = kernel(a8, sa, w8, sw, out=out, **options)
    assert c is out
    deq = (fp8.dequantize(a8, sa, 1), fp8.dequantize(w8, sw, fp8.SCALE_BLOCK))
    return c, deq, (a, w)


def run_per_tensor(M, N, K, promote_k, seed=0):
    a, w = make_inputs(M, N, K, seed)
    (a8, sa), (w8, sw) = fp8.quantize_per_tensor(a), fp8.quantize_per_tensor(w)
    out = poison_(torch.empty((M, N), dtype=torch.bfloat16, device=a.device))
    c = fp8.fp8_matmul_per_tensor(a8, w8, sa, sw, promote_k=promote_k, out=out)
    deq = (fp8.dequantize(a8, sa, None), fp8.dequantize(w8, sw, None))
    return c, deq, (a, w), (a8, w8, sa, sw)


def test_block_quantizer_scales_each_block_to_448_and_rounds_within_half_an_e4m3_ulp():
    a, w = make_inputs(5, 200, 272, seed=1)
    for x, rows in ((a, 1), (w, fp8.SCALE_BLOCK)):
        x8, scales = fp8.quantize_blocks(x, rows)
        assert x8.dtype == fp8.FP8 and x8.shape == x.shape
        assert scales.shape == (-(-x.shape[0] // rows), 3)  # K = 272: two whole blocks and a part
        # the largest |value| of every block lands on 448 exactly
        blocks = torch.nn.functional.pad(x8.float().abs(), (0, -272 % 128, 0, -x.shape[0] % rows))
        blocks = blocks.view(scales.shape[0], rows, 3, 128).amax(dim=(1, 3))
        assert (blocks == fp8.FP8_MAX).all()
        # e4m3 keeps 3 mantissa bits: relative rounding error at most 2^-4 for normal values,
        # and the block's scale times half the smallest subnormal (2^-10) for tiny ones
        deq = fp8.dequantize(x8, scales, rows)
        cols = torch.arange(272) // 128
        step = scales.double()[torch.arange(x.shape[0]) // rows][:, cols]
        assert ((deq - x.double()).abs() <= 2.0**-4 * x.double().abs() + 2.0**-10 * step).all()
    _, a_scales = fp8.quantize_activation(a)
    assert a_scales.stride() == (1, a.shape[0])  # K-block-major, as the kernel reads them


def test_per_block_scaling_keeps_an_outlier_from_flattening_the_rest():
    """e4m3 spans 448 / 2^-6 = 28,672 from its largest value to its smallest normal one. With one
    value 10^5 times the others, the per-tensor scale pushes every other value into the
    subnormals (a few bits left); the 1 x 128 scales, only the 127 others of its block."""
    a, _ = make_inputs(64, 8, 512, seed=2)
    a[3, 5] = 1e5
    others = torch.ones_like(a, dtype=torch.bool)
    others[3, 5] = False

    def error_of_the_others(deq):
        return (deq - a.double())[others].norm() / a.double()[others].norm()

    a8, scale = fp8.quantize_per_tensor(a)
    per_tensor = error_of_the_others(fp8.dequantize(a8, scale, None))
    a8, scales = fp8.quantize_activation(a)
    blocked = error_of_the_others(fp8.dequantize(a8, scales, 1))
    assert blocked < per_tensor / 4, (blocked, per_tensor)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@needs("fp8")
def test_block_scaled_matches_fp64(shape):
    c, deq, original = run_block_scaled(*shape)
    check_kernel_error(c, *deq)
    errors = fp8.fp8_errors(c, deq, original)
    assert errors["original"]["calc_diff"] < fp8.DEEPGEMM_DIFF_BOUND, errors


# On the GPU the never-promoted sum is not held to the promoted bound: that is what it shows.
@pytest.mark.parametrize("promote_k", runtime.pick(gpu=[128, 64], cpu=[0, 128]))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@needs("fp8")
def test_per_tensor_matches_fp64(shape, promote_k):
    c, deq, original, _ = run_per_tensor(*shape, promote_k)
    check_kernel_error(c, *deq)
    assert fp8.fp8_errors(c, deq, original)["original"]["calc_diff"] < fp8.DEEPGEMM_DIFF_BOUND


@needs("fp8")
def test_wrong_scales_are_caught():
    """The check can fail: the weight's scale blocks swapped along N give a C far off the
    dequantized product."""
    a, w = make_inputs(32, 256, 256, seed=4)
    a8, sa = fp8.quantize_activation(a)
    gain = torch.tensor([1.0, 8.0], device=w.device).repeat_interleave(128)
    w8, sw = fp8.quantize_weight(w * gain[:, None])
    deq = (fp8.dequantize(a8, sa, 1), fp8.dequantize(w8, sw, 128))
    c = fp8.fp8_matmul_block_scaled(a8, sa, w8, sw.flip(0).contiguous())
    with pytest.raises(AssertionError):
        check_kernel_error(c, *deq)


@needs("fp8")
def test_arguments_are_checked():
    a, w = make_inputs(16, 32, 256)
    a8, sa = fp8.quantize_activation(a)
    w8, sw = fp8.quantize_weight(w)
    with pytest.raises(TypeError, match="a8 must be a 2-D float8_e4m3fn tensor.*quantize it"):
        fp8.fp8_matmul_block_scaled(a, sa, w8, sw)
    with pytest.raises(ValueError, match="both must have K columns"):
        fp8.fp8_matmul_block_scaled(a8, sa, w8[:, :128], sw)
    with pytest.raises(ValueError, match=r"w_scale must be float32 of shape \(1, 2\)"):
        fp8.fp8_matmul_block_scaled(a8, sa, w8, sw[:, :1])
    with pytest.raises(ValueError, match=r"a_scale must have strides \(1, 16\)"):
        fp8.fp8_matmul_block_scaled(a8, sa.contiguous(), w8, sw)  # row-major: not K-block-major
    with pytest.raises(ValueError, match="w8 must have contiguous rows"):
        fp8.fp8_matmul_block_scaled(a8, sa, w8.T.contiguous().T, sw)
    with pytest.raises(ValueError, match="promote_k 100; supported: 0"):
        fp8.fp8_matmul_per_tensor(a8, w8, sa[0, 0], sw[0, 0], promote_k=100)


# Compiled without a GPU: (arch, options).
COMPILED = [
    ("sm_90", {"tile": 2}),  # block-scaled, 128 x 128
    ("sm_90", {"tile": 3}),
    ("sm_90", {"scaling": fp8.PER_TENSOR, "promote_k": 128, "tile": 2}),
    ("sm_90", {"scaling": fp8.PER_TENSOR, "promote_k": 32, "tile": 2}),
    ("sm_90", {"scaling": fp8.PER_TENSOR, "promote_k": 0, "tile": 2}),
    ("sm_90", {"scaling": fp8.PER_TENSOR, "promote_k": 0, "tile": 0}),  # 128 x 256
    ("sm_90", {"tile": 2, "one_w_scale": True}),  # the weight scale as one scalar
    ("sm_90", {"tile": 4, "one_w_scale": True}),  # two K blocks a step: 213 KiB
    ("sm_89", {"tile": 5}),
    ("sm_89", {"scaling": fp8.PER_TENSOR, "promote_k": 0, "tile": 5}),
]


@pytest.fixture(scope="module")
def compiled_offline():
    from kernels.matmul.offline import compile_offline

    found = {}
    for arch in dict.fromkeys(a for a, _ in COMPILED):
        variants = [options for a, options in COMPILED if a == arch]
        module = "kernels.matmul.triton_fp8_matmul"
        for options, made in zip(variants, compile_offline(module, variants, arch=arch)):
            found[arch, str(options)] = made
    return found


@pytest.mark.cpu
@pytest.mark.parametrize("arch, options", COMPILED, ids=lambda x: str(x).replace(" ", ""))
def test_compiles_without_a_gpu(compiled_offline, arch, options):
    """sm_90: fp8 e4m3 wgmma and TMA copies; sm_89: mma.sync on fp8, the descriptors rewritten to
    ordinary loads. Every tile the pruner keeps for its product compiles without spilling, in
    the shared memory the architecture has."""
    made = compiled_offline[arch, str(options)]
    tile = fp8.GPU_TILES[options["tile"]]
    warps = tile[2]
    promoted = options.get("scaling", fp8.BLOCK_SCALED) == fp8.BLOCK_SCALED or options.get(
        "promote_k", 0
    )
    assert fp8.fits(fp8.tile_config(*tile), promoted=bool(promoted))
    assert made["spill_bytes"] == 0, made
    assert made["warps"] == warps
    if arch == "sm_90":
        assert made["target"] == "sm_90a"
        assert made["wgmma"] > 0 and made["wgmma_fp8"] == made["wgmma"]
        assert made["tma_copies"] > 0
        assert made["shared_bytes"] <= 227 * 1024
    else:
        assert made["target"] == "sm_89"
        assert made["mma_sync"] > 0 and made["wgmma"] == 0 and made["tma_copies"] == 0
        assert made["shared_bytes"] <= 99 * 1024


@pytest.mark.cpu
def test_promotion_is_in_the_compiled_code(compiled_offline):
    """On sm_90 a promotion is one float32 add per accumulator register: 64 a thread for a
    128 x 128 tile over 256 threads. promote_k = 128 adds once a K step of 128, 32 four times
    (after every wgmma), 0 never (the tensor cores keep the whole sum)."""
    adds = {
        p: compiled_offline["sm_90", str({"scaling": fp8.PER_TENSOR, "promote_k": p, "tile": 2})][
            "f32_adds"
        ]
        for p in (0, 32, 128)
    }
    assert adds == {0: 0, 32: 4 * 64, 128: 64}


@pytest.mark.cpu
def test_a_gpu_without_fp8_is_not_even_compiled_for():
    from kernels.matmul.offline import compile_offline

    with pytest.raises(RuntimeError, match="FeatureMissing: fp8_matmul needs fp8"):
        compile_offline("kernels.matmul.triton_fp8_matmul", [{}], arch="sm_80")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", CUBLAS_SHAPES, ids=str)
@needs("fp8")
def test_per_tensor_agrees_with_cublas(shape):
    c, _, _, (a8, w8, sa, sw) = run_per_tensor(*shape, promote_k=128)
    cublas = fp8.fp8_matmul_scaled_mm(a8, w8, sa, sw)
    assert fp8.calc_diff(c, cublas) < 2e-5  # two bf16 roundings of C apart, at most


@pytest.mark.gpu
@needs("fp8")
def test_promotion_does_not_lose_to_the_tensor_cores_own_sum():
    """At K = 16384 the per-tensor product promoted every 128 is at least as close to the exact
    product of its inputs as the one summed on the tensor cores alone (promote_k = 0)."""
    promoted, deq, _, _ = run_per_tensor(256, 256, 16384, promote_k=128)
    unpromoted, _, _, _ = run_per_tensor(256, 256, 16384, promote_k=0)
    exact = deq[0] @ deq[1].T
    assert fp8.calc_diff(promoted, exact) <= fp8.calc_diff(unpromoted, exact) * 1.05


@pytest.mark.gpu
@pytest.mark.parametrize("stages", [2, 4, 5])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
@needs("wgmma")
def test_gluon_block_scaled_matches_fp64(shape, stages):
    """The warp-specialized fp8 kernel (gluon_matmul.py), every ring depth it takes."""
    from kernels.matmul.gluon_matmul import gluon_fp8_matmul_block_scaled

    c, deq, original = run_block_scaled(*shape, kernel=gluon_fp8_matmul_block_scaled, stages=stages)
    check_kernel_error(c, *deq)
    errors = fp8.fp8_errors(c, deq, original)
    assert errors["original"]["calc_diff"] < fp8.DEEPGEMM_DIFF_BOUND, errors


@pytest.mark.cpu
def test_gluon_block_scaled_refuses_off_sm_90():
    from kernels.matmul.gluon_matmul import gluon_fp8_matmul_block_scaled

    a, w = make_inputs(16, 32, 128)
    with pytest.raises(runtime.FeatureMissing, match="gluon_fp8_matmul_block_scaled needs wgmma"):
        gluon_fp8_matmul_block_scaled(*fp8.quantize_activation(a), *fp8.quantize_weight(w))


@pytest.mark.parametrize("k_blocks, one_w_scale", [(2, False), (2, True), (1, True)])
@needs("fp8")
def test_tile_options_match_fp64(k_blocks, one_w_scale):
    """k_blocks = 2: two K blocks' products issued before their promotions (K = 300 is three
    blocks, so the last step's second block lies past K: zeros, zero scales); one_w_scale: the
    128-column tile's weight scale loaded as one scalar (N = 300: the last block is partial)."""
    bm, bn, warps, stages = runtime.pick(gpu=(128, 128, 8, 3), cpu=(32, 128, 1, 1))
    for shape in runtime.pick(gpu=[(1000, 1016, 520), (130, 300, 300)], cpu=[(40, 300, 300)]):
        config = fp8.tile_config(bm, bn, warps, stages, k_blocks, one_w_scale)
        c, deq, _ = run_block_scaled(*shape, seed=7, config=config)
        check_kernel_error(c, *deq)


@pytest.mark.gpu
@pytest.mark.skipif(runtime.has("fp8") and runtime.has("wgmma"), reason="this GPU has fp8, wgmma")
def test_a_gpu_without_fp8_or_wgmma_refuses():
    """What the `needs` marks stand for: each fp8 kernel refuses a GPU without its feature with
    one sentence naming it, before any compilation."""
    from kernels.matmul.gluon_matmul import gluon_fp8_matmul_block_scaled

    a, w = make_inputs(16, 128, 128)
    blocked = (*fp8.quantize_activation(a), *fp8.quantize_weight(w))
    kernels = (
        (fp8.fp8_matmul_block_scaled, "fp8"),
        (gluon_fp8_matmul_block_scaled, "wgmma"),
    )
    for fn, feature in kernels:
        if not runtime.has(feature):
            with pytest.raises(runtime.FeatureMissing, match=f"needs {feature}"):
                fn(*blocked)


@pytest.mark.gpu
@needs("fp8")
def test_each_configuration_matches_fp64():
    """Every configuration the pruner keeps, not only the one the autotuner picked."""
    for tile in fp8.GPU_TILES:
        config = fp8.tile_config(*tile, one_w_scale=runtime.has("wgmma"))
        if fp8.fits(config, promoted=True):
            c, deq, _ = run_block_scaled(1000, 1016, 520, seed=6, config=config)
            check_kernel_error(c, *deq)


@pytest.mark.parametrize("kind", ["block-scaled", "per-tensor"])
@needs("fp8")
def test_rows_off_16_byte_boundaries_are_padded(kind):
    """e4m3 rows of 40 bytes (K = 40) and bf16 rows of C of 36 x 2 bytes (N = 36) are not on
    16-byte boundaries: TMA reads and writes padded copies, and C is still right."""
    if kind == "block-scaled":
        c, deq, _ = run_block_scaled(17, 36, 40, seed=3)
    else:
        c, deq, _, _ = run_per_tensor(17, 36, 40, promote_k=128, seed=3)
    check_kernel_error(c, *deq)
