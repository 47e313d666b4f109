"""The spec of the fused linear + cross-entropy, in plain PyTorch.

`x` (tokens, hidden) are the last hidden states, `w` (vocab, hidden) the unembedding (lm head)
weight, `targets` (tokens,) int64 class indices, where `ignore_index` marks tokens that carry no
loss (padding, the prompt). The loss is the mean over the tokens that are not ignored, as
`F.cross_entropy` does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.testing import TINY, ULP

IGNORE_INDEX = -100
# The rtol of the fused kernels' dx and dw against `loss_and_grads_fp64`, relative to
# `grad_scales_fp64`. float32: products and sums in float32; bfloat16/float16: logits and gradients
# rounded to the dtype, dw summed over chunks in the dtype -- a few ulp of the terms' magnitude.
GRAD_RTOL = {
    torch.float32: 2.0**-16,
    torch.float16: 8 * ULP[torch.float16],
    torch.bfloat16: 8 * ULP[torch.bfloat16],
}


def token_losses_tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(atol, rtol) of a kernel's per-token losses against `token_losses_fp64`: one rounding of
    each loss to the dtype (the Triton interpreter truncates instead: within one ulp) plus
    float32's error in the sums."""
    return TINY[dtype], ULP[dtype] + 2.0**-18


def linear_cross_entropy(
    x: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """What everyone writes: the full logits, then `F.cross_entropy` (mean over kept tokens)."""
    return F.cross_entropy(x @ w.t(), targets, ignore_index=ignore_index)


def token_losses(
    x: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """Per-token losses (0 where ignored), as PyTorch computes them: full logits in x's dtype."""
    return F.cross_entropy(x @ w.t(), targets, ignore_index=ignore_index, reduction="none")


def token_losses_fp64(
    x: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """Per-token losses in float64 from the same (low-precision) inputs: the checks' spec."""
    logits = x.double() @ w.double().t()
    return F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction="none")


def loss_and_grads_fp64(
    x: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, ignore_index: int = IGNORE_INDEX
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mean loss, d loss / d x, d loss / d w) in float64, by autograd on float64 copies."""
    x64 = x.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    loss = F.cross_entropy(x64 @ w64.t(), targets, ignore_index=ignore_index)
    gx, gw = torch.autograd.grad(loss, (x64, w64))
    return loss.detach(), gx, gw


def grad_scales_fp64(
    x: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, ignore_index: int = IGNORE_INDEX
) -> tuple[torch.Tensor, torch.Tensor]:
    """Magnitudes of the terms summed into each gradient element: cancellation-proof tolerances.

    dx = P @ w / n and dw = P^T @ x / n with |P| <= |softmax| + onehot: bound each sum by the sum of
    |terms|.
    """
    logits = x.double() @ w.double().t()
    p = torch.softmax(logits, dim=-1)
    valid = targets != ignore_index
    onehot = torch.zeros_like(p)
    onehot[valid, targets[valid]] = 1.0
    mag = (p + onehot) * valid[:, None] / valid.sum().clamp_min(1)
    return mag @ w.double().abs(), mag.t() @ x.double().abs()
