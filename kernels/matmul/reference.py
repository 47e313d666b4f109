"""The specification: the matrix product in plain PyTorch.

    C[m, n] = sum_k A[m, k] * B[k, n]        A: (M, K), B: (K, N), C: (M, N)

A and B are float16 or bfloat16 (one dtype for both), with any strides: a transposed operand is a
view, not a copy. Products and sums are float32 (the tensor cores' accumulator); C is rounded once
to the input dtype at the end.

`matmul_reference` is the exact answer from the same low-precision inputs, to compare kernels with;
`matmul_torch` is the anchor every kernel is timed against (cuBLAS on a GPU). The tolerance is
written once, here, and the tests, the lab and the grader read it from here.
"""

from __future__ import annotations

import torch

from kernels import runtime
from kernels.testing import TINY, ULP, Comparison, compare, generator, random_tensor
from kernels.validate import MATMUL_DTYPES, check_operands

# a and b in, C out: the dtypes every matmul kernel of the course accepts.
DTYPES = MATMUL_DTYPES
# How each operand is stored: "n" as given (row-major), "t" as the transpose of a row-major buffer,
# i.e. a (K, M) buffer viewed as (M, K). "tn" is a transposed, b as given; "nt" is x @ W.T, as
# nn.Linear stores its weight.
LAYOUTS = ("nn", "tn", "nt", "tt")
# Offsets are computed in int32 by the kernels: no operand may span 2**31 elements.
MAX_OFFSET = 2**31 - 1


def matmul_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b in float64 from the same fp16/bf16 inputs: every product exact, sums rounded at
    float64's 2**-53, which is the exact answer as far as an fp32-accumulating kernel can tell."""
    return a.double() @ b.double()


def matmul_torch(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """PyTorch's matmul, the anchor: cuBLAS on a GPU (it picks its own kernel per shape)."""
    return a @ b


def check_matmul_args(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    op: str = "matmul",
    device_type: str | None = None,
) -> tuple[int, int, int]:
    """(M, N, K) of a (M, K) @ b (K, N), or a TypeError/ValueError saying what is wrong.

    a and b: fp16 or bf16, one dtype, one device (`device_type`, default the course's device:
    "cuda" for CuPy kernels), 2-D, any strides. out (M, N): a's dtype and device, contiguous.
    """
    device_type = runtime.DEVICE if device_type is None else device_type
    check_operands(op, {"a": a, "b": b}, device_type=device_type, float32_instead="a @ b")
    (M, K), (K_b, N) = a.shape, b.shape
    if K != K_b:
        raise ValueError(
            f"{op}: a is {tuple(a.shape)} and b is {tuple(b.shape)}: a's columns ({K}) must "
            f"equal b's rows ({K_b})"
        )
    if min(M, N, K) == 0:
        raise ValueError(f"{op}: M, N and K must be at least 1, got M={M}, N={N}, K={K}")
    for name, t in (("a", a), ("b", b)):
        if sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) > MAX_OFFSET:
            raise ValueError(
                f"{op}: {name} spans more than 2**31 elements (shape {tuple(t.shape)}, strides "
                f"{t.stride()}); the kernels index in int32: split the product"
            )
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"{op}: out must be a torch.Tensor, got {type(out).__name__}")
        if tuple(out.shape) != (M, N) or out.dtype != a.dtype or out.device != a.device:
            raise ValueError(
                f"{op}: out must be ({M}, {N}) {str(a.dtype).removeprefix('torch.')} on "
                f"{a.device}, got {tuple(out.shape)} {str(out.dtype).removeprefix('torch.')} on "
                f"{out.device}"
            )
        if not out.is_contiguous():
            raise ValueError(f"{op}: out must be contiguous (strides {out.stride()})")
        if M * N > MAX_OFFSET:
            raise ValueError(f"{op}: out has {M * N} elements; the kernels index in int32")
    return M, N, K


# --------------------------------------------------------------------------------------------------
# The tolerance: how far from matmul_reference a correct C may be

# Error of float32 accumulation, in units of sqrt(K) * 2**-23 * (|A| @ |B|). Rounding errors of a
# K-term sum are random in sign, so they grow as sqrt(K), not K; each is at most one float32 ulp of
# the partial sum (tensor cores may truncate rather than round), and |partial sum| <= (|A| @ |B|).
# The factor 2 covers split-K's extra float32 additions. A kernel that accumulates in fp16 or bf16
# is off by sqrt(K) * 2**-10 or 2**-7 of its partial sums instead, which this bound catches.
ACCUMULATION_ULPS = 2.0


def matmul_tolerance(
    a: torch.Tensor, b: torch.Tensor, exact: torch.Tensor | None = None
) -> tuple[float, float, torch.Tensor]:
    """(atol, rtol, scale) for `kernels.testing.compare(c, matmul_reference(a, b), ...)`.

    A correct C is within ulp(dtype) * |C| (one rounding to the dtype: half an ulp rounded to
    nearest, one when the interpreter truncates) plus ACCUMULATION_ULPS * sqrt(K) * 2**-23 *
    (|A| @ |B|) (float32 accumulation) of the exact product. As compare's bound is
    atol + rtol * scale, the scale is |C| + that accumulation term over ulp(dtype). `exact` saves
    recomputing matmul_reference(a, b)."""
    ulp = ULP[a.dtype]
    exact = matmul_reference(a, b) if exact is None else exact
    magnitude = a.double().abs() @ b.double().abs()
    accumulation = ACCUMULATION_ULPS * a.shape[1] ** 0.5 * ULP[torch.float32] / ulp
    return TINY[a.dtype], ulp, exact.abs() + accumulation * magnitude


def check_matmul(
    c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, exact: torch.Tensor | None = None
) -> Comparison:
    """c against the exact a @ b within `matmul_tolerance`. NaN (an unwritten element of a
    poisoned output) never passes. `exact` saves recomputing matmul_reference(a, b)."""
    exact = matmul_reference(a, b) if exact is None else exact
    atol, rtol, scale = matmul_tolerance(a, b, exact)
    return compare(c, exact, atol=atol, rtol=rtol, scale=scale)


# --------------------------------------------------------------------------------------------------
# Inputs


def make_inputs(
    M: int,
    N: int,
    K: int,
    dtype: torch.dtype = torch.bfloat16,
    layout: str = "nn",
    seed: int = 0,
    device: str | torch.device | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh standard-normal a (M, K) and b (K, N) (never zeros). A "t" in `layout` (see LAYOUTS)
    makes that operand a non-contiguous view of its transpose: a kernel that ignores strides is
    wrong on it."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if dtype not in DTYPES:
        raise TypeError(f"dtype must be one of {DTYPES}, got {dtype}")
    device = runtime.DEVICE if device is None else device
    gen = generator(seed, device)
    a_t, b_t = layout[0] == "t", layout[1] == "t"
    a = random_tensor((K, M) if a_t else (M, K), dtype, device, gen)
    b = random_tensor((N, K) if b_t else (K, N), dtype, device, gen)
    return (a.T if a_t else a), (b.T if b_t else b)


# --------------------------------------------------------------------------------------------------
# The floor: what must happen and what must move


def matmul_flops(M: int, N: int, K: int) -> int:
    """A multiply and an add for each of the M * N * K products."""
    return 2 * M * N * K


def matmul_bytes(M: int, N: int, K: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """The least traffic: A and B read once, C written once (a kernel that re-reads tiles from
    memory rather than L2 moves more)."""
    return (M * K + K * N + M * N) * torch.empty((), dtype=dtype).element_size()


def arithmetic_intensity(M: int, N: int, K: int, dtype: torch.dtype = torch.bfloat16) -> float:
    """Flops per byte at the floor. Square n: 2n^3 / (3 n^2 * 2 bytes) = n / 3 for 16-bit inputs,
    past any GPU's ridge point (peak flop/s over bandwidth) from n of a few hundred; M = 1 is
    2K N / (2 K N bytes) ~ 1 flop per byte, far below it: a weight stream."""
    return matmul_flops(M, N, K) / matmul_bytes(M, N, K, dtype)
