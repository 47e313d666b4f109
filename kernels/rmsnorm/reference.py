"""The specification: RMSNorm in plain PyTorch.

    y = x / sqrt(mean(x^2) + eps) * w        (mean over the last dimension, accumulated in float32)

`*_fp64` versions give the exact answer from the same low-precision inputs, to compare kernels with.
`naive` is the unfused version a first implementation writes: several kernels, several passes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import runtime
from kernels.testing import TINY, ULP


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(atol, rtol) of a kernel's y against `rms_norm_fp64` of the same x: one rounding of the
    output, plus float32's error summing the squares of a row."""
    return TINY[dtype], ULP[dtype] + 2.0**-16


def fused_tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(atol, rtol) of the fused add's y against `fused_add_rms_norm_fp64`, which normalizes h
    rounded to the dtype (as the model stores it): y is one rounding from it, half an ulp, plus
    float32's error summing the squares. A kernel that normalizes h before rounding it is up to a
    second half ulp off, and fails. In CPU mode Triton's interpreter truncates float32 -> bfloat16
    instead of rounding it, both h and y: up to an ulp each, so two are allowed there."""
    truncated = dtype == torch.bfloat16 and not runtime.ON_GPU
    return TINY[dtype], (2 * ULP[dtype] if truncated else ULP[dtype] / 2) + 2.0**-16


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """PyTorch's own fused kernel (the anchor the course's kernels are timed against)."""
    return F.rms_norm(x, (x.shape[-1],), w, eps)


def naive(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """One op at a time, as the formula reads: square, mean, add, rsqrt, multiply twice, cast."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


def rms_norm_fp64(
    x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6, x_scale: float = 1.0
) -> torch.Tensor:
    x64 = x.double() * x_scale
    return x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w.double()


def fused_add_rms_norm_fp64(
    x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's fused_add_rms_norm: h = x + residual, then y = rmsnorm(h).

    h is rounded to the dtype first, as the model stores it."""
    h = (x.double() + residual.double()).to(x.dtype)
    return rms_norm_fp64(h, w, eps), h.double()


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    h = x + residual
    return rms_norm(h, w, eps), h
