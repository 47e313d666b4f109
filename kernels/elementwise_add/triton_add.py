"""Element-wise add in Triton, and the fused three-way residual add.

A Triton program handles one BLOCK of elements: it computes their offsets, masks the ones past the
end (n is rarely a multiple of BLOCK), loads, adds and stores. Triton turns the contiguous,
16-byte-aligned block into 16-byte vector loads by itself -- the thing the CUDA C version spells
out.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import runtime
from kernels.validate import check_elementwise

# On an H200 every BLOCK from 1024 to 8192 with 4 or 8 warps landed within 2% of torch.add at 64M
# elements (data/results/h200/01_elementwise_add/vectorized-add-variants.md; notebook 01 repeats
# the sweep). In CPU mode the interpreter's cost grows with the number of programs, so it gets few,
# large blocks.
BLOCK_SIZE = runtime.pick(gpu=4096, cpu=8192)
NUM_WARPS = runtime.pick(gpu=8, cpu=1)


@triton.jit
def add_kernel(a_ptr, b_ptr, out_ptr, n, BLOCK: tl.constexpr):
    # int64 offsets: pid * BLOCK overflows int32 for tensors of more than 2^31 elements.
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    a = tl.load(a_ptr + offsets, mask=mask)
    b = tl.load(b_ptr + offsets, mask=mask)
    # Add in float32 and round once, as PyTorch does: bit-identical results for fp16 and bf16.
    total = a.to(tl.float32) + b.to(tl.float32)
    tl.store(out_ptr + offsets, total.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def residual_add_kernel(
    x_ptr, attn_ptr, mlp_ptr, out_ptr, n, BLOCK: tl.constexpr, EXACT_ORDER: tl.constexpr
):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
    attn = tl.load(attn_ptr + offsets, mask=mask).to(tl.float32)
    mlp = tl.load(mlp_ptr + offsets, mask=mask).to(tl.float32)
    partial = mlp + attn
    if EXACT_ORDER:
        # PyTorch's `mlp + attn + x` rounds the intermediate to the tensor dtype: do the same.
        partial = partial.to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + offsets, (partial + x).to(out_ptr.dtype.element_ty), mask=mask)


def _prepare(op: str, inputs: dict[str, torch.Tensor], out: torch.Tensor | None) -> torch.Tensor:
    check_elementwise(op, inputs, out, device_type=runtime.DEVICE)
    return torch.empty_like(next(iter(inputs.values()))) if out is None else out


def add(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    block_size: int = BLOCK_SIZE,
    num_warps: int = NUM_WARPS,
) -> torch.Tensor:
    """out = a + b."""
    out = _prepare("add", {"a": a, "b": b}, out)
    n = out.numel()
    if n:
        add_kernel[(triton.cdiv(n, block_size),)](
            a, b, out, n, BLOCK=block_size, num_warps=num_warps
        )
    return out


def residual_add(
    x: torch.Tensor,
    attn: torch.Tensor,
    mlp: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    accumulate: str = "exact_order",
    block_size: int = BLOCK_SIZE,
    num_warps: int = NUM_WARPS,
) -> torch.Tensor:
    """out = (mlp + attn) + x in one pass; `accumulate` as in cupy_add.residual_add."""
    if accumulate not in ("exact_order", "fp32"):
        raise ValueError(f"accumulate must be 'exact_order' or 'fp32', not {accumulate!r}")
    out = _prepare("residual_add", {"x": x, "attn": attn, "mlp": mlp}, out)
    n = out.numel()
    if n:
        residual_add_kernel[(triton.cdiv(n, block_size),)](
            x,
            attn,
            mlp,
            out,
            n,
            BLOCK=block_size,
            EXACT_ORDER=accumulate == "exact_order",
            num_warps=num_warps,
        )
    return out
