"""Lab 01: the vectorized CuPy add, the Triton add and the fused three-way residual add."""

from __future__ import annotations

import torch

from grading.spec import Case, GradedFunction, LabSpec, PerfConfig
from kernels.elementwise_add import cupy_add, reference, triton_add
from kernels.testing import random_tensor

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Odd sizes and sizes one either side of a power of two catch a missing mask or a wrong tail. The
# same cases run in both modes, so a check cell prints the same lines on a GPU and on a laptop; the
# 64M-element performance configs check correctness at scale on the GPU.
SIZES = ((1,), (7,), (1023,), (1025,), (98765,), (3, 1001))
CASES = tuple(Case(shape, dtype) for shape in SIZES for dtype in DTYPES) + (
    Case((1025,), torch.float16, "strided"),
    Case((0,), torch.float32),
)


def draw_cases(rng) -> tuple[Case, ...]:
    """Sizes drawn per run from the secret seed, one per class a wrong kernel can hide in: even n
    (every dtype), a multiple of every power-of-two block up to 8192 (two blocks at least: one
    block is right for a kernel that launches one program), n above 2**17, three dimensions, and
    a 0-d tensor (every rank is accepted)."""
    even = 2 * rng.randrange(1, 2048)
    blocks = 8192 * rng.randrange(2, 5)
    large = rng.randrange(2**17 + 1, 2**18)
    cube = (rng.randrange(2, 5), rng.randrange(2, 9), 2 * rng.randrange(16, 64) + 1)
    return (
        *(Case((even,), dtype) for dtype in DTYPES),
        Case((blocks,), torch.float32),
        Case((blocks,), torch.float16),
        Case((large,), rng.choice(DTYPES)),
        Case(cube, rng.choice(DTYPES)),
        Case((), rng.choice(DTYPES)),
    )


PERF_N = 64 * 2**20  # 64M elements: far larger than L2, so HBM bandwidth decides


def _inputs(count):
    def make(shape, dtype, device, gen):
        return tuple(random_tensor(shape, dtype, device, gen) for _ in range(count))

    return make


def _torch_add(a, b, out=None):
    return torch.add(a, b, out=out)


def _torch_residual_add(x, attn, mlp, out=None):
    result = reference.residual_add(x, attn, mlp)
    return result if out is None else out.copy_(result)


def _bytes(*tensors) -> int:
    # every input read once, the output written once
    return (len(tensors) + 1) * tensors[0].numel() * tensors[0].element_size()


def _add_function(name, backend, course_kernel, points, description, hint):
    return GradedFunction(
        name=name,
        points=points,
        backend=backend,
        description=description,
        make_inputs=_inputs(2),
        reference_fp64=reference.add_fp64,
        tolerance=reference.add_tolerance,
        course_kernel=course_kernel,
        torch_native=_torch_add,
        bytes_moved=_bytes,
        cases=CASES,
        perf=(
            PerfConfig(f"{name}/fp16/64M", (PERF_N,), torch.float16),
            PerfConfig(f"{name}/fp32/64M", (PERF_N,), torch.float32),
        ),
        bit_exact=lambda a, b: torch.add(a, b),
        exact_dtypes=(torch.float32, torch.float16),
        hint=hint,
        draw_cases=draw_cases,
    )


LAB = LabSpec(
    id="01_elementwise_add",
    title="Element-wise add: CUDA C with 16-byte loads, Triton, and a fused residual add",
    functions=(
        _add_function(
            "add_vectorized",
            "cupy",
            cupy_add.add_vectorized,
            3,
            "CuPy RawKernel: out = a + b with 16-byte loads, a grid-stride loop and a scalar tail",
            "each thread moves 16 bytes; the last n % (16 / element size) elements need the tail",
        ),
        _add_function(
            "add",
            "triton",
            triton_add.add,
            3,
            "Triton: out = a + b, any n",
            "mask the loads and the store with offsets < n",
        ),
        GradedFunction(
            name="residual_add",
            points=4,
            backend="triton",
            description="Triton: out = (mlp + attn) + x in one pass, bit-identical to PyTorch's "
            "mlp + attn + x",
            make_inputs=_inputs(3),
            reference_fp64=reference.residual_add_fp64,
            # two roundings (the intermediate, then the result), relative to the terms' magnitude
            tolerance=reference.residual_add_tolerance,
            scale=lambda x, attn, mlp: x.double().abs() + attn.double().abs() + mlp.double().abs(),
            bit_exact=reference.residual_add,
            exact_dtypes=(torch.float32, torch.float16),
            course_kernel=triton_add.residual_add,
            torch_native=_torch_residual_add,
            bytes_moved=_bytes,
            cases=CASES,
            perf=(PerfConfig("residual_add/fp16/64M", (PERF_N,), torch.float16),),
            hint="round mlp + attn to the tensor dtype before adding x, as PyTorch does",
            draw_cases=draw_cases,
        ),
    ),
)
