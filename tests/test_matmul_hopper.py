"""The Hopper matrix products against the float64 reference: the persistent TMA kernel
(kernels/matmul/triton_matmul_tma.py, in the interpreter on the CPU) and the warp-specialized
Gluon kernel (kernels/matmul/gluon_matmul.py, on an H100/H200), and both compiled for sm_90
without a GPU.

The offline compiles run in a subprocess (`offline.compile_offline`): this process runs the
Triton interpreter (CPU mode), which cannot compile.
"""

import pytest
import torch

from kernels import runtime
from kernels.matmul.reference import LAYOUTS, check_matmul, make_inputs
from kernels.testing import poison_

# (M, N, K): none a multiple of the tiles (interpreter 32; GPU 128 x 256 x 64), a single row, a
# K shorter than one K tile. TMA needs 16-byte row strides, so the dimensions that are a
# contiguous row's length (K for "n" a, N for "n" b and C, M for "t" a) are multiples of 8.
CPU_SHAPES = [(72, 136, 200), (8, 40, 16), (1, 8, 24)]

GPU_SHAPES = [
    (200, 264, 328),
    (8, 8, 8),
    (1000, 1000, 1000),  # 8 x 4 = 32 tiles of 128 x 256: fewer tiles than SMs
    # 24 x 9 = 216 tiles of 128 x 256 on 132 CTAs: a CTA takes one or two, the ring's position
    # and phases run on across them; K = 4096 (64 steps of 64) wraps the 3-slot ring many times.
    (3000, 2056, 4096),
    (67, 100, 300),  # rows off 16-byte boundaries: operands and C through padded buffers
]


def needs(feature: str):
    """On a GPU without `feature` the kernels refuse with FeatureMissing (asserted by the
    `refuses` tests): their other tests are skipped there, naming the feature. CPU mode runs
    them in the interpreter."""
    return pytest.mark.skipif(
        runtime.ON_GPU and not runtime.has(feature),
        reason=f"this GPU has no {feature}: the kernels refuse it (tested by the refusal test)",
    )


def _run_and_check(fn, M, N, K, dtype, layout, seed=0):
    a, b = make_inputs(M, N, K, dtype, layout, seed=seed)
    out = poison_(torch.empty((M, N), dtype=dtype, device=a.device))
    c = fn(a, b, out=out)
    assert c is out
    result = check_matmul(c, a, b)
    assert result.ok, (M, N, K, dtype, layout, result)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", runtime.pick(gpu=GPU_SHAPES, cpu=CPU_SHAPES), ids=str)
@needs("tma")
def test_tma_kernel_matches_fp64(shape, layout, dtype):
    from kernels.matmul.triton_matmul_tma import matmul_tma

    _run_and_check(matmul_tma, *shape, dtype, layout)


@needs("tma")
def test_tma_kernel_reads_rows_of_a_wider_buffer():
    """A row stride longer than the row (a column slice of a wider matrix) is still TMA's: the
    descriptor takes the stride, not the shape."""
    from kernels.matmul.triton_matmul_tma import matmul_tma

    a_wide, b = make_inputs(40, 48, 96, torch.bfloat16, "nn", seed=3)
    a = a_wide[:, :64]
    b = b[:64]
    assert not a.is_contiguous()
    result = check_matmul(matmul_tma(a, b), a, b)
    assert result.ok, result


@needs("tma")
def test_tma_kernel_odd_m():
    """M is no row length in the "nn" layout: any M works, 67 included."""
    from kernels.matmul.triton_matmul_tma import matmul_tma

    _run_and_check(matmul_tma, 67, 40, 48, torch.bfloat16, "nn")


@pytest.mark.parametrize("layout", ["nn", "tt"])
@needs("tma")
def test_tma_kernel_pads_rows_off_16_byte_boundaries(layout):
    """K = 36 and N = 20: rows of 72 and 40 bytes, off TMA's 16-byte boundaries in either
    orientation; the operands and C go through buffers with padded rows."""
    from kernels.matmul.triton_matmul_tma import matmul_tma

    _run_and_check(matmul_tma, 12, 20, 36, torch.bfloat16, layout)


@needs("tma")
def test_tma_kernel_says_what_it_cannot_read():
    from kernels.matmul.triton_matmul_tma import matmul_tma

    a, b = make_inputs(16, 24, 32, torch.bfloat16, "nn")
    with pytest.raises(ValueError, match="TMA needs one of its dimensions contiguous"):
        matmul_tma(a[::2, ::2], b[::2])
    with pytest.raises(TypeError, match="float32"):
        matmul_tma(a.float(), b.float())
    with pytest.raises(ValueError, match="a's columns"):
        matmul_tma(a, b[:8])


@pytest.mark.cpu
def test_gluon_kernel_refuses_before_anything_else_off_sm_90():
    """In CPU mode (and on any GPU but sm_90) the call fails with one sentence naming wgmma,
    before its arguments are looked at or anything is compiled: even a float32 operand gets the
    refusal, not the dtype error."""
    from kernels.matmul.gluon_matmul import gluon_matmul

    a, b = make_inputs(64, 64, 64, torch.bfloat16, "nn")
    with pytest.raises(runtime.FeatureMissing, match="gluon_matmul needs wgmma.*sm_90"):
        gluon_matmul(a, b)
    with pytest.raises(runtime.FeatureMissing, match="gluon_matmul needs wgmma"):
        gluon_matmul(a.float(), b.float())


def test_gluon_argument_checks():
    from kernels.matmul.gluon_matmul import check_gluon_args

    a, b = make_inputs(72, 136, 200, torch.bfloat16, "nt")
    M, N, K, _, b_view, b_t, c = check_gluon_args(a, b)
    assert (M, N, K, b_t) == (72, 136, 200, True)
    assert b_view.is_contiguous() and b_view.shape == (136, 200)  # the weight's (N, K) buffer
    assert c.shape == (72, 136) and c.dtype == torch.bfloat16
    a_t, b = make_inputs(72, 136, 200, torch.bfloat16, "tn")
    with pytest.raises(ValueError, match="a must have contiguous rows"):
        check_gluon_args(a_t, b)
    with pytest.raises(ValueError, match="stages 4; supported: 2, 3"):
        check_gluon_args(a, b, stages=4)
    with pytest.raises(ValueError, match="out must be"):
        check_gluon_args(a, b, out=torch.empty(72, 135, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="float16 or bfloat16|supported"):
        check_gluon_args(a.float(), b.float())


# Compiled for sm_90 without a GPU: (module, options).
COMPILED = [
    ("triton_matmul_tma", {}),
    ("triton_matmul_tma", {"b_t": True, "dtype": "float16"}),
    ("triton_matmul_tma", {"a_t": True, "tile": 4}),
    ("gluon_matmul", {}),
    ("gluon_matmul", {"b_t": True, "dtype": "float16"}),
    ("gluon_matmul", {"stages": 2}),
    ("gluon_matmul", {"block_scaled": True}),  # fp8 e4m3, 128 x 128 tiles, 4 stages
    ("gluon_matmul", {"block_scaled": True, "stages": 5}),
]


@pytest.fixture(scope="module")
def compiled_offline():
    """Every COMPILED variant, one process per module."""
    from kernels.matmul.offline import compile_offline

    found = {}
    for module in dict.fromkeys(m for m, _ in COMPILED):
        variants = [options for m, options in COMPILED if m == module]
        for options, made in zip(variants, compile_offline(f"kernels.matmul.{module}", variants)):
            found[module, str(options)] = made
    return found


@pytest.mark.cpu
@pytest.mark.parametrize("module, options", COMPILED, ids=lambda x: str(x).replace(" ", ""))
def test_compiles_for_hopper_without_a_gpu(compiled_offline, module, options):
    """Down to a cubin for sm_90a: wgmma for the products, TMA copies (cp.async.bulk.tensor) for
    the tiles, shared memory within the 227 KiB a CTA may have, nothing spilled. The Gluon kernel:
    12 warps (two consumer warpgroups and the producer's warp, padded to a warpgroup), register
    budgets within the SM's 65,536."""
    from kernels.matmul import gluon_matmul

    made = compiled_offline[module, str(options)]
    assert made["target"] == "sm_90a"
    assert made["wgmma"] > 0 and made["mma_sync"] == 0
    assert made["tma_copies"] > 0
    assert made["spill_bytes"] == 0, made
    assert made["shared_bytes"] <= 227 * 1024
    if module == "gluon_matmul":
        assert made["warps"] == 12
        consumer, producer = gluon_matmul.CONSUMER_REGS, gluon_matmul.PRODUCER_REGS
        assert {consumer, producer} <= set(made["register_budgets"])
        assert 128 * (2 * consumer + producer) <= 65536
        if options.get("block_scaled"):  # every product fp8, the ring of 128-byte rows
            assert made["wgmma_fp8"] == made["wgmma"]
            stages = options.get("stages", gluon_matmul.FP8_STAGES)
            assert made["shared_bytes"] >= stages * 2 * 128 * 128 + 2 * 64 * 128 * 2
        else:
            assert made["wgmma_fp8"] == 0
            stages = options.get("stages", gluon_matmul.STAGES)
            assert made["shared_bytes"] >= gluon_matmul.shared_bytes(stages=stages)
    else:
        assert made["warps"] == 8


@pytest.mark.cpu
@pytest.mark.parametrize("module", ["gluon_matmul", "triton_matmul_tma"])
def test_other_architectures_are_not_even_compiled(module):
    """sm_80 has neither TMA nor wgmma: the compile is refused by the feature table, with the
    sentence naming what is missing, before Triton is asked."""
    from kernels.matmul.offline import compile_offline

    with pytest.raises(RuntimeError, match="FeatureMissing: .* needs (wgmma|tma)"):
        compile_offline(f"kernels.matmul.{module}", [{}], arch="sm_80")


@pytest.mark.gpu
@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("layout", ["nn", "nt"])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
@needs("wgmma")
def test_gluon_kernel_matches_fp64(shape, layout, dtype, stages):
    from kernels.matmul.gluon_matmul import gluon_matmul

    _run_and_check(lambda a, b, out: gluon_matmul(a, b, out, stages=stages), *shape, dtype, layout)


@pytest.mark.gpu
@pytest.mark.skipif(
    runtime.has("tma") and runtime.has("wgmma"), reason="this GPU has TMA and wgmma"
)
def test_a_gpu_without_tma_or_wgmma_refuses():
    """What the `needs` marks stand for: on a GPU without the feature each kernel refuses with
    one sentence naming it, before any compilation."""
    from kernels.matmul.gluon_matmul import gluon_matmul
    from kernels.matmul.triton_matmul_tma import matmul_tma

    a, b = make_inputs(64, 64, 64, torch.float16, "nn")
    for fn, feature in ((matmul_tma, "tma"), (gluon_matmul, "wgmma")):
        if not runtime.has(feature):
            with pytest.raises(runtime.FeatureMissing, match=f"needs {feature}"):
                fn(a, b)


@pytest.mark.gpu
@needs("tma")
def test_each_tma_configuration_matches_fp64():
    """Every configuration the autotuner may pick, not only the one it picked."""
    from kernels.matmul import triton_matmul_tma as tma

    a, b = make_inputs(1000, 1016, 520, torch.bfloat16, "nn", seed=5)
    for config in tma.candidate_configs():
        out = poison_(torch.empty((1000, 1016), dtype=torch.bfloat16, device=a.device))
        result = check_matmul(tma.matmul_tma(a, b, out, config=config), a, b)
        assert result.ok, (tma.config_name(config), result)


@pytest.mark.cpu
def test_benchmark_targets_state_the_ratio_and_its_threshold():
    """The targets read the rows the sections write: a Gluon kernel at 1.04x cuBLAS misses its
    1.05x, a TMA kernel at 1.0x meets its 1.0x; the fp8 targets take the faster block-scaled
    kernel, and its error fails past DeepGEMM's bound."""
    from kernels.matmul import benchmark_hopper

    def row(shape, dtype, impls):
        return {"shape": list(shape), "dtype": dtype, "impls": impls}

    shape = benchmark_hopper.TARGET_SHAPES[0]
    hopper = {"triton TMA": {"vs_cublas": 1.0}, "gluon warp-specialized": {"vs_cublas": 1.04}}
    block = {"vs_cublas_fp8": 1.1, "errors": {"original": {"calc_diff": 2e-3}}}
    slower = {"vs_cublas_fp8": 0.9, "errors": {"original": {"calc_diff": 1e-4}}}
    fp8_rows = {"fp8 block-scaled": block, "gluon fp8 block-scaled": slower}
    results = {
        "hopper": [row(shape, "bfloat16", hopper)],
        "fp8": [row(shape, "float8_e4m3fn", fp8_rows)],
    }
    checks = {c["target"]: c for c in benchmark_hopper.performance_targets(results)}
    name = "x".join(map(str, shape))
    assert checks[f"triton TMA, {name} bfloat16: >= 1.0x cuBLAS"]["pass"]
    assert not checks[f"gluon warp-specialized, {name} bfloat16: >= 1.05x cuBLAS"]["pass"]
    assert checks[f"fp8 block-scaled, {name}: >= 1.0x cuBLAS fp8 per-tensor"]["pass"]
    error = [c for t, c in checks.items() if "calc_diff" in t]
    assert len(error) == 1 and not error[0]["pass"] and error[0]["value"] == pytest.approx(0.5)
    assert len(checks) == 4  # float16 and the second shape have no rows: no targets


def test_each_kernel_names_the_feature_it_needs():
    """REQUIRES is what the wrappers pass to runtime.require and what a compile check across
    architectures reads: TMA (sm_90+), wgmma (sm_90 only), fp8 (sm_89+)."""
    from kernels.matmul import gluon_matmul, triton_fp8_matmul, triton_matmul_tma

    required = {
        m.__name__: m.REQUIRES for m in (triton_matmul_tma, gluon_matmul, triton_fp8_matmul)
    }
    assert set(required.values()) <= set(runtime.FEATURE_GPUS)
    only = {
        name: [p.arch for p in runtime.GPU_PROFILES.values() if p.has(feature)]
        for name, feature in required.items()
    }
    assert set(only["kernels.matmul.gluon_matmul"]) == {"sm_90"}
    assert "sm_89" in only["kernels.matmul.triton_fp8_matmul"]
    assert "sm_89" not in only["kernels.matmul.triton_matmul_tma"]
