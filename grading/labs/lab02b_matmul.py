"""Lab 02b: the tiled matrix product, in CUDA C (shared-memory and register tiles) and in Triton."""

from __future__ import annotations

import torch

from grading.spec import Case, GradedFunction, LabSpec, PerfConfig
from kernels import runtime
from kernels.matmul import cupy_matmul, reference, triton_matmul
from kernels.testing import TINY, ULP, random_tensor

DTYPES = reference.DTYPES
# A case's shape is (M, N, K); its layout says which operands are transposed views ("tn": a is the
# transpose of a row-major (K, M) buffer; see reference.LAYOUTS).
ODD = (37, 45, 63)  # no side a multiple of anything
# M and N multiples of every tile size a kernel picks, K not (100 = 3 * 32 + 4, 72 = 64 + 8): a
# kernel that rounds K down to its block is wrong everywhere, not at an edge.
K_TAIL = ((64, 64, 100), (128, 128, 72))
# A long K: a float16 or bfloat16 running sum of 2048 products (8192 on a GPU) is off by many ulp
# of C, a float32 one is not. Rows and columns are few, so the interpreter pays for one program.
LONG_K = (16, 32, runtime.pick(gpu=8192, cpu=2048))
# More than one tile each way and a partial last one (CPU tiles are 32 wide in the solution).
SEVERAL_TILES = runtime.pick(gpu=(300, 520, 1000), cpu=(70, 100, 130))
CASES = (
    Case((1, 1, 1), torch.bfloat16),
    Case((1, 1, 1), torch.float16),
    Case(ODD, torch.bfloat16),
    Case(ODD, torch.float16),
    Case(ODD, torch.bfloat16, "tn"),
    Case(ODD, torch.float16, "nt"),
    Case(ODD, torch.bfloat16, "tt"),
    Case(K_TAIL[0], torch.bfloat16),
    Case(K_TAIL[1], torch.float16),
    Case(LONG_K, torch.float16),
    Case(LONG_K, torch.bfloat16),
    Case(SEVERAL_TILES, torch.bfloat16, "nt"),  # x @ W.T, as nn.Linear stores W
    Case(SEVERAL_TILES, torch.float16, "tn"),
    Case((1, 257, 300), torch.bfloat16, "nt"),  # one row: the decode step's shape
)


def draw_cases(rng) -> tuple[Case, ...]:
    """Shapes drawn per run from the secret seed, one per class a wrong kernel can hide in: every
    side odd, every side a multiple of 128 (no tail anywhere), a transposed operand, and a skinny
    M of 2 to 32 rows."""
    big = runtime.pick(gpu=1500, cpu=160)

    def odd():
        return 2 * rng.randrange(16, big // 2) + 1

    multiple = runtime.pick(gpu=(2, 9), cpu=(1, 3))
    return (
        Case((odd(), odd(), odd()), rng.choice(DTYPES)),
        Case(tuple(128 * rng.randrange(*multiple) for _ in range(3)), rng.choice(DTYPES)),
        Case((odd(), odd(), odd()), rng.choice(DTYPES), rng.choice(("tn", "nt", "tt"))),
        Case((rng.randrange(2, 33), odd(), odd()), rng.choice(DTYPES), rng.choice(("nn", "nt"))),
    )


def _inputs(shape, dtype, device, gen):
    M, N, K = shape
    return random_tensor((M, K), dtype, device, gen), random_tensor((K, N), dtype, device, gen)


def _layout(layout, inputs):
    """"t" in position i: operand i becomes a view of the transpose of a row-major buffer, with the
    same values (strides (1, rows)). "contiguous" is "nn"."""
    flags = layout if layout in reference.LAYOUTS else "nn"
    return tuple(x.T.contiguous().T if flag == "t" else x for flag, x in zip(flags, inputs))


def _output_shapes(shape, dtype):
    M, N, _ = shape
    return (((M, N), dtype),)


def _tolerance(dtype):
    """atol, rtol; the scale below carries the float32 accumulation term (reference.py)."""
    return TINY[dtype], ULP[dtype]


def _scale(a, b):
    return reference.matmul_tolerance(a, b)[2]


def _bytes(a, b):
    return reference.matmul_bytes(a.shape[0], b.shape[1], a.shape[1], a.dtype)


def _flops(a, b):
    return reference.matmul_flops(a.shape[0], b.shape[1], a.shape[1])


def _torch_matmul(a, b, out=None):
    return reference.matmul_torch(a, b)  # cuBLAS, allocating its output as PyTorch does


def _close(got: torch.Tensor, other: torch.Tensor, dtype) -> bool:
    """got equals `other` (a product computed another, wrong, way) up to rounding it to `dtype`."""
    bound = TINY[dtype] + ULP[dtype] * (got.abs() + other.abs())
    return bool(((got - other).abs() <= bound).double().mean() > 0.99)


def _diagnose(output_name, result, want, bad, a, b):
    """What the wrong C says: the K tail dropped, a transposed operand read as row-major, or a
    running sum kept in 16 bits."""
    got = result.detach().double()
    if torch.isnan(got).any():
        return ""  # unwritten elements: the generic reading names them
    K = a.shape[1]
    for block in (128, 64, 32, 16, 8):
        kept = K - K % block
        if kept < K and _close(got, a[:, :kept].double() @ b[:kept].double(), a.dtype):
            return (f"C is the product of the first {kept} of K={K} columns of a (rows of b): "
                    f"the last {K - kept} are left out; mask the K tail with zeros")
    for name, x in (("a", a), ("b", b)):
        if not x.is_contiguous():
            as_rows = torch.as_strided(x, x.shape, (x.shape[1], 1))
            read_a, read_b = (as_rows, b) if name == "a" else (a, as_rows)
            product = read_a.double() @ read_b.double()
            if _close(got, product, a.dtype):
                return (f"{name} is a transposed view (strides {x.stride()}) and was read as if "
                        f"it were row-major: index it with both of its strides")
    # what rounding C once does not explain, against what float32 accumulation may add
    magnitude = a.double().abs() @ b.double().abs()
    unexplained = (got - want.double()).abs() - ULP[a.dtype] * want.double().abs()
    excess = float((unexplained / magnitude.clamp_min(1e-30)).max())
    allowed = reference.ACCUMULATION_ULPS * K**0.5 * ULP[torch.float32]
    if allowed < excess < 0.01:
        return (f"C is off by up to {excess / allowed:.0f}x what float32 accumulation allows: is "
                f"the running sum kept in 16 bits? Accumulate in float32 and round C once at the "
                f"end")
    return ""


def _matmul_function(name, backend, course_kernel, points, description, hint):
    return GradedFunction(
        name=name,
        points=points,
        backend=backend,
        description=description,
        make_inputs=_inputs,
        prepare=_layout,
        output_shapes=_output_shapes,
        reference_fp64=reference.matmul_reference,
        tolerance=_tolerance,
        scale=_scale,
        diagnose=_diagnose,
        course_kernel=course_kernel,
        torch_native=_torch_matmul,
        bytes_moved=_bytes,
        flops=_flops,
        cases=CASES,
        perf=(
            PerfConfig(f"{name}/bf16/4096x4096x4096", (4096, 4096, 4096), torch.bfloat16),
            PerfConfig(f"{name}/fp16/4096x4096x4096", (4096, 4096, 4096), torch.float16),
        ),
        hint=hint,
        input_names=("a", "b"),
        own_kernels_only=True,  # the course's kernels compute the whole product
        draw_cases=draw_cases,
    )


def _course_cuda(a, b, out=None):
    """The course's register-tiled CUDA C step: what the lab asks for (its later steps add 16-byte
    loads and tensor cores, which the lab does not)."""
    return cupy_matmul.matmul(a, b, out=out, step="register")


LAB = LabSpec(
    id="02b_matmul",
    title="The tiled matrix product: shared-memory and register tiles in CUDA C, tl.dot in Triton",
    functions=(
        _matmul_function(
            "matmul_cuda",
            "cupy",
            _course_cuda,
            5,
            "CuPy RawKernel: a block computes a tile of C from shared-memory tiles of a and b, "
            "each thread a small block of it in registers",
            "zeros past M, N and K when loading a tile; __syncthreads() after filling the tiles "
            "and again before overwriting them; index a and b with both of their strides; a float "
            "accumulator",
        ),
        _matmul_function(
            "matmul",
            "triton",
            triton_matmul.matmul,
            5,
            "Triton: one program per tile of C, tl.dot over tiles of K, any strides",
            "mask the loads of the last K tile with other=0, keep the accumulator in float32, "
            "and pass both strides of a and b",
        ),
    ),
)
