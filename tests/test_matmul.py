"""The matrix product (kernels/matmul): the spec's tolerance catches the classic wrong products;
the Triton kernels (tiled, persistent, split-K, the skinny dispatch) and, on a GPU, every CUDA C
step match float64 at sizes that are multiples of no tile, on every layout (transposed operands are
views), both dtypes, with outputs poisoned with NaN; bad arguments get a clear message.

CPU: the interpreter on small odd sizes (well under a minute on one core). GPU: odd sizes near a
thousand, each configuration of the autotune list, against float64 and against cuBLAS."""

import pytest
import torch

from kernels import runtime
from kernels.matmul import reference, triton_matmul, triton_skinny
from kernels.matmul.cupy_matmul import MMA_FALLBACK, MMA_VARIANTS
from kernels.matmul.reference import LAYOUTS, check_matmul, make_inputs
from kernels.testing import compare, poison_

DEVICE = runtime.DEVICE
DTYPES = list(reference.DTYPES)
# (M, N, K): multiples of no block of either mode, and more tiles than the CPU's 4 persistent
# programs.
SHAPES = runtime.pick(gpu=[(1000, 1031, 997), (129, 4100, 520)], cpu=[(70, 100, 45), (5, 33, 97)])
SKINNY = runtime.pick(gpu=(4103, 2050), cpu=(75, 300))  # (N, K)


def poisoned(M, N, dtype):
    return poison_(torch.empty(M, N, dtype=dtype, device=DEVICE))


def assert_exact(c, a, b):
    result = check_matmul(c, a, b)
    assert result.ok, result.reason


# --------------------------------------------------------------------------------------------------
# The spec: its tolerance fails the wrong products a grader must reject


def fp32_then_round(a, b):
    return (a.float() @ b.float()).to(a.dtype)


def accumulated_in_dtype(a, b):
    """The fp16/bf16-accumulator bug: the running sum rounded to the input dtype at every step."""
    acc = torch.zeros(a.shape[0], b.shape[1], dtype=a.dtype)
    for k in range(a.shape[1]):
        acc = (acc.float() + a[:, k : k + 1].float() * b[k : k + 1].float()).to(a.dtype)
    return acc


WRONG = {
    "accumulates in the input dtype": accumulated_in_dtype,
    "drops the last K step": lambda a, b: fp32_then_round(a[:, :-1], b[:-1]),
    "ignores a transposed operand's strides": lambda a, b: fp32_then_round(
        a, b.contiguous().view(b.shape[1], b.shape[0]).T
    ),
    "one element unwritten": lambda a, b: fp32_then_round(a, b).index_fill_(
        1, torch.tensor([3]), float("nan")
    ),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("wrong", WRONG, ids=str)
def test_tolerance_rejects_wrong_products(wrong, dtype):
    a, b = make_inputs(24, 20, 300, dtype, "nt", seed=1, device="cpu")
    assert_exact(fp32_then_round(a, b), a, b)  # the right product passes ...
    assert not check_matmul(WRONG[wrong](a, b), a, b).ok  # ... and the wrong one does not


@pytest.mark.parametrize("layout", LAYOUTS)
def test_make_inputs_layouts(layout):
    a, b = make_inputs(6, 5, 7, torch.float16, layout, seed=2, device="cpu")
    assert a.shape == (6, 7) and b.shape == (7, 5)
    assert a.is_contiguous() == (layout[0] == "n") and b.is_contiguous() == (layout[1] == "n")
    assert (a != 0).all() and (b != 0).all()
    again = make_inputs(6, 5, 7, torch.float16, layout, seed=2, device="cpu")
    assert torch.equal(a, again[0]) and torch.equal(b, again[1])


def test_floor_helpers():
    assert reference.matmul_flops(2, 3, 4) == 48
    assert reference.matmul_bytes(2, 3, 4, torch.bfloat16) == (8 + 12 + 6) * 2
    assert reference.arithmetic_intensity(3000, 3000, 3000) == pytest.approx(1000)


# --------------------------------------------------------------------------------------------------
# The CUDA C compiles to what its comments say (no GPU needed: nvcc and cuobjdump)


def test_cuda_steps_use_wide_loads_and_tensor_cores(tmp_path):
    from kernels import cuda
    from tests.test_cuda_compile import _functions, _sass, compile_cubin

    def sass(name):
        cubin, _ = compile_cubin(cuda.source_path(f"matmul/{name}.cu"), "sm_90", tmp_path)
        return _functions(_sass(cubin))

    register = sass("matmul_register")
    assert "LDG.E.128" in register["matmul_vectorized_bf16"]
    assert "LDG.E.128" not in register["matmul_register_bf16"]
    mma = sass("matmul_mma")
    cm = cupy_matmul()
    default = cm.MMA_DEFAULT
    for dtype, instruction in (
        (torch.float16, "HMMA.16816.F32 "),
        (torch.bfloat16, "HMMA.16816.F32.BF16"),
    ):
        name = default.kernel(False, dtype)
        body = mma[name]
        assert instruction in body, f"{name} issues no {instruction}"
        assert "LDSM.16.M88.4" in body and "LDSM.16.MT88.4" in body  # ldmatrix, plain and .trans
        # cp.async.cg, 16 bytes: unchecked inside the matrices, zero-filled at the edges
        assert "LDGSTS.E.BYPASS.LTC128B.128 " in body and ".128.ZFILL" in body
        assert "STG.E " in body  # C's neighbours stored in pairs (4 bytes), not one by one
        kmajor = mma[default.kernel(True, dtype)]  # B = W.T: no transposing ldmatrix
        assert instruction in kmajor and "LDSM.16.MT88.4" not in kmajor
        general = mma[cm.MMA_FALLBACK.kernel(False, dtype)]  # any strides: through registers
        assert instruction in general and "LDGSTS" not in general


def test_every_mma_config_is_compiled_with_the_shared_memory_the_wrapper_gives():
    """Each MMA_VARIANTS entry names kernels its .cu file defines, and the default fits an H100's
    or H200's 227 KB and falls back to the 48 KB configuration where a block gets less."""
    from kernels import cuda

    cm = cupy_matmul()
    text = cuda.source_path(cm.STEPS["mma"].source).read_text()

    def dims(config):
        c = config
        return ", ".join(map(str, (c.block_m, c.block_n, c.block_k, c.warp_m, c.warp_n, c.stages)))

    for config in cm.MMA_VARIANTS.values():
        assert f"MMA_ENTRIES({dims(config)})" in text, config.name
        assert config.shared_bytes() <= 227 * 1024, config.name
    assert f"MMA_GENERAL_ENTRIES({dims(cm.MMA_FALLBACK)})" in text
    assert cm.MMA_FALLBACK.shared_bytes() <= 48 * 1024
    # 128 x 256 x 32, 4 stages: A 128 x 32 and B 32 x 256 elements a stage, two bytes each
    assert cm.MMA_DEFAULT.shared_bytes() == 2 * 4 * (128 * 32 + 32 * 256)


def test_persistent_mma_launches_what_the_sms_hold(monkeypatch):
    """The persistent launch: as many blocks as fit at once (one of 8 warps an SM), so with more
    tiles than that each block loops over tiles (MMA_SHAPES' last shape runs it on a GPU)."""
    cm = cupy_matmul()
    h200 = runtime.GPU_PROFILES["h200"]
    monkeypatch.setattr(runtime, "features", lambda: h200)
    monkeypatch.setattr(runtime, "shared_memory_budget", lambda: h200.shared_memory_per_block)
    [persistent] = [c for c in cm.MMA_VARIANTS.values() if c.persistent]
    assert persistent.threads == 256 and persistent.blocks(1000) == h200.sm_count
    assert persistent.blocks(5) == 5
    assert cm.MMA_DEFAULT.blocks(1000) == 1000


def test_mma_step_falls_back_where_shared_memory_is_short_or_rows_unpacked(monkeypatch):
    cm = cupy_matmul()
    monkeypatch.setattr(runtime, "shared_memory_budget", lambda: 227 * 1024)  # Hopper
    assert cm.mma_config_for(packed=True) is cm.MMA_DEFAULT
    assert cm.mma_config_for(packed=False) is cm.MMA_FALLBACK  # a transposed A, say
    monkeypatch.setattr(runtime, "shared_memory_budget", lambda: 99 * 1024)  # an RTX 4090
    assert cm.mma_config_for(packed=True) is cm.MMA_DEFAULT  # 96 KB
    monkeypatch.setattr(runtime, "shared_memory_budget", lambda: 80 * 1024)
    assert cm.mma_config_for(packed=True).shared_bytes() <= 80 * 1024
    assert cm.mma_config_for(packed=True) is not cm.MMA_FALLBACK
    monkeypatch.setattr(runtime, "shared_memory_budget", lambda: 40 * 1024)  # less than any
    assert cm.mma_config_for(packed=True) is cm.MMA_FALLBACK


# --------------------------------------------------------------------------------------------------
# Bad arguments


def bad_args():
    a, b = make_inputs(8, 6, 4, torch.bfloat16, seed=3)
    return {
        "float32": ((a.float(), b.float()), TypeError, "for float32, use a @ b"),
        "mixed dtypes": ((a, b.half()), TypeError, "cast one to match"),
        "K mismatch": ((a, b[:3]), ValueError, "a's columns (4) must equal b's rows (3)"),
        "1-D": ((a[0], b), ValueError, "must be 2-D"),
        "empty": ((a[:0], b), ValueError, "at least 1"),
        "not a tensor": ((a, b.tolist()), TypeError, "must be a torch.Tensor"),
        "out shape": ((a, b, torch.empty(6, 8, dtype=a.dtype, device=DEVICE)), ValueError, "out"),
        "out strided": ((a, b, torch.empty(6, 8, dtype=a.dtype, device=DEVICE).T), ValueError,
                        "contiguous"),
    }  # fmt: skip


BAD = bad_args()
WRAPPERS = [triton_matmul.matmul, triton_matmul.matmul_persistent, triton_skinny.matmul_split_k]


@pytest.mark.parametrize("wrapper", WRAPPERS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("case", BAD, ids=str)
def test_bad_arguments_are_named(case, wrapper):
    args, error, words = BAD[case]
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        wrapper(*args)


def test_split_k_refuses_tall_a_and_bad_splits():
    a, b = make_inputs(33, 8, 16, torch.float16, seed=4)
    with pytest.raises(ValueError, match="at most 32"):
        triton_skinny.matmul_split_k(a, b)
    with pytest.raises(ValueError, match="splits"):
        triton_skinny.matmul_split_k(a[:4], b, splits=0)


# --------------------------------------------------------------------------------------------------
# Triton: against float64


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize(
    "kernel", [triton_matmul.matmul, triton_matmul.matmul_persistent], ids=lambda f: f.__name__
)
def test_triton_matches_fp64(kernel, shape, layout, dtype):
    M, N, K = shape
    a, b = make_inputs(M, N, K, dtype, layout, seed=M + K)
    c = poisoned(M, N, dtype)
    assert kernel(a, b, c) is c
    assert_exact(c, a, b)


@pytest.mark.parametrize("kernel", [triton_matmul.matmul, triton_matmul.matmul_persistent])
def test_launch_order_does_not_change_the_result(kernel):
    """Row-major (group_m=1) and grouped order compute each tile the same way: the same bits."""
    a, b = make_inputs(*SHAPES[0], torch.bfloat16, "nn", seed=5)
    assert torch.equal(kernel(a, b, group_m=1), kernel(a, b, group_m=3))


def test_allocates_its_output():
    a, b = make_inputs(*SHAPES[1], torch.float16, "tn", seed=6)
    c = triton_matmul.matmul(a, b)
    assert c.dtype == a.dtype and c.is_contiguous()
    assert_exact(c, a, b)


def test_configs_fit_the_shared_memory_budget(monkeypatch):
    assert all(triton_matmul.stage_bytes(c) <= 227 * 1024 for c in triton_matmul.GPU_CONFIGS)
    monkeypatch.setattr(runtime, "shared_memory_budget", lambda: 99 * 1024)  # sm_86/89/120
    kept = triton_matmul.fitting_configs()
    assert kept and len(kept) < len(triton_matmul.GPU_CONFIGS)
    assert all(triton_matmul.stage_bytes(c) <= 99 * 1024 for c in kept)


# --------------------------------------------------------------------------------------------------
# Skinny: split-K and the GEMV


@pytest.mark.parametrize("splits", [1, 3, None])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(
    "m, dtype", [(1, torch.bfloat16), (7, torch.float16), (32, torch.bfloat16)]
)
def test_split_k_matches_fp64(m, dtype, layout, splits):
    N, K = SKINNY
    a, b = make_inputs(m, N, K, dtype, layout, seed=m)
    c = poisoned(m, N, dtype)
    triton_skinny.matmul_split_k(a, b, c, splits=splits)
    assert_exact(c, a, b)


@pytest.mark.parametrize("layout", ["nt", "nn"])
def test_skinny_matmul_takes_the_gemv_for_weights(layout):
    a, b = make_inputs(3, *SKINNY, torch.bfloat16, layout, seed=7)
    assert triton_skinny.takes_gemv(a, b) == (layout == "nt")
    c = poisoned(3, SKINNY[0], torch.bfloat16)
    triton_skinny.skinny_matmul(a, b, c)
    assert_exact(c, a, b)


# --------------------------------------------------------------------------------------------------
# GPU: every CUDA C step, every Triton configuration, and agreement with cuBLAS

GPU_SHAPES = [(1000, 1031, 997), (257, 136, 64), (1, 300, 40)]


def cupy_matmul():
    from kernels.matmul import cupy_matmul

    return cupy_matmul


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
@pytest.mark.parametrize("step", ["naive", "shared", "register", "vectorized", "mma"])
def test_cuda_steps_match_fp64_and_cublas(step, shape, layout, dtype):
    M, N, K = shape
    a, b = make_inputs(M, N, K, dtype, layout, seed=K)
    c = poisoned(M, N, dtype)
    assert cupy_matmul().matmul(a, b, c, step=step) is c
    assert_exact(c, a, b)
    assert_within_twice_the_tolerance_of_cublas(c, a, b)


def assert_within_twice_the_tolerance_of_cublas(c, a, b):
    atol, rtol, scale = reference.matmul_tolerance(a, b)
    result = compare(c, reference.matmul_torch(a, b), atol=atol, rtol=2 * rtol,
                               scale=scale)  # fmt: skip
    assert result.ok, f"against cuBLAS: {result.reason}"


# More tiles than stages; (second) fewer K tiles than the pipeline's depth; (third) rows of whole
# 16-byte packs, so the cp.async path runs, with a tail of every dimension (the first two take the
# fallback on the layouts whose rows are odd); (fourth) more tiles of C than an H200 has SMs, so
# the persistent launch's blocks loop over tiles.
MMA_SHAPES = [(1000, 1031, 997), (130, 264, 24), (1000, 1032, 1000), (2000, 2056, 136)]
MMA_CONFIGS = [*MMA_VARIANTS, MMA_FALLBACK.name]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", MMA_SHAPES, ids=str)
@pytest.mark.parametrize("config", MMA_CONFIGS)
def test_every_mma_config_matches_fp64(config, shape, layout, dtype):
    cm = cupy_matmul()
    mma = cm.MMA_VARIANTS.get(config, cm.MMA_FALLBACK)
    if mma.shared_bytes() > runtime.shared_memory_budget():
        pytest.skip("more shared memory than this GPU gives a block")
    M, N, K = shape
    a, b = make_inputs(M, N, K, dtype, layout, seed=M + K)
    c = poisoned(M, N, dtype)
    assert cm.matmul(a, b, c, mma=mma) is c
    assert_exact(c, a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["nn", "nt"])
@pytest.mark.parametrize("config", list(MMA_VARIANTS))
def test_mma_copies_only_the_matrix_from_padded_rows(config, layout, dtype):
    """Operands that are column slices of wider buffers whose extra columns hold NaN: rows of
    16-byte packs (the cp.async path), K and N odd, so the last pack of a row is partly outside the
    matrix. A copy of the whole pack would bring NaN into the product."""
    cm = cupy_matmul()
    if cm.MMA_VARIANTS[config].shared_bytes() > runtime.shared_memory_budget():
        pytest.skip("more shared memory than this GPU gives a block")
    M, N, K = 300, 1001, 997
    a, b = make_inputs(M, N, K, dtype, layout, seed=7)
    a_rows = poisoned(M, 1008, dtype)[:, :K].copy_(a)
    if layout == "nn":
        b_rows = poisoned(K, 1008, dtype)[:, :N].copy_(b)
    else:  # B = W.T, W (N, K) a slice of an (N, 1008) buffer
        b_rows = poisoned(N, 1008, dtype)[:, :K].copy_(b.T).T
    assert cm.rows_are_16_byte_packs(a_rows)
    assert cm.rows_are_16_byte_packs(b_rows if layout == "nn" else b_rows.T)
    assert cm.mma_config_for(packed=True, mma=cm.MMA_VARIANTS[config]).name == config
    c = poisoned(M, N, dtype)
    assert cm.matmul(a_rows, b_rows, c, mma=cm.MMA_VARIANTS[config]) is c
    assert_exact(c, a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_mma_step_reads_weights_k_major(dtype):
    """B = W.T with W's rows 16-byte aligned takes the _kmajor kernel: right at odd M and N."""
    a, b = make_inputs(301, 203, 264, dtype, "nt", seed=12)
    assert cupy_matmul().rows_are_16_byte_packs(b.T)
    assert_exact(cupy_matmul().matmul(a, b, step="mma"), a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("step", ["vectorized", "mma"])
def test_cuda_steps_on_misaligned_rows(step):
    """A view starting one element into its buffer: no 16-byte loads, the element path instead."""
    a, b = make_inputs(200, 160, 136, torch.float16, "nn", seed=8)
    a_buffer = torch.empty(200 * 136 + 1, dtype=a.dtype, device=DEVICE)
    a_off = a_buffer[1:].view(200, 136).copy_(a)
    assert not cupy_matmul().rows_are_16_byte_packs(a_off)
    assert_exact(cupy_matmul().matmul(a_off, b, step=step), a, b)


@pytest.mark.gpu
def test_mma_step_refuses_bf16_without_bf16_tensor_cores(monkeypatch):
    """Turing (sm_75) has fp16 mma.sync only: bf16 gets a sentence, not a launch."""
    monkeypatch.setattr(runtime, "features", lambda: runtime.GPU_PROFILES["t4"])
    a, b = make_inputs(16, 16, 16, torch.bfloat16, seed=11)
    with pytest.raises(runtime.FeatureMissing, match="bf16"):
        cupy_matmul().matmul(a, b, step="mma")


@pytest.mark.gpu
@pytest.mark.parametrize("config", triton_matmul.GPU_CONFIGS, ids=str)
@pytest.mark.parametrize("kernel", [triton_matmul.matmul, triton_matmul.matmul_persistent])
def test_every_triton_config_matches_fp64(kernel, config):
    persistent = kernel is triton_matmul.matmul_persistent
    reserve = triton_matmul.PERSISTENT_EPILOGUE_BYTES if persistent else 0
    if config not in triton_matmul.fitting_configs(reserve=reserve):
        pytest.skip("more shared memory than this GPU has per block")
    a, b = make_inputs(1000, 1031, 997, torch.bfloat16, "nt", seed=9)
    c = kernel(a, b, config=config)
    assert_exact(c, a, b)
    assert_within_twice_the_tolerance_of_cublas(c, a, b)


@pytest.mark.cpu
def test_cuda_steps_say_they_need_a_gpu():
    a, b = make_inputs(8, 8, 8, torch.float16, seed=10)
    with pytest.raises(RuntimeError, match="GPU"):
        cupy_matmul().matmul(a, b)
