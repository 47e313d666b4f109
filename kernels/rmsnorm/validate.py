"""Argument checks shared by the RMSNorm kernels."""

from __future__ import annotations

import torch

from kernels.validate import FLOAT_DTYPES, check_elementwise


def check_rmsnorm_args(
    op: str,
    x: torch.Tensor,
    w: torch.Tensor,
    eps: float,
    out: torch.Tensor | None,
    *,
    device_type: str,
    dtypes=FLOAT_DTYPES,
) -> None:
    """x: (..., width) with a contiguous last dimension; w: (width,) of x's dtype; eps > 0."""
    if not isinstance(x, torch.Tensor) or not isinstance(w, torch.Tensor):
        raise TypeError(f"{op}: x and w must be torch.Tensors")
    if x.dim() == 0:
        raise ValueError(f"{op}: x must have at least one dimension (the normalized one)")
    if not isinstance(eps, (int, float)) or not eps > 0:
        raise ValueError(
            f"{op}: eps must be a positive number, got {eps!r} (eps > 0 keeps 1/sqrt finite on a "
            "zero row)"
        )
    if w.dim() != 1 or w.shape[0] != x.shape[-1]:
        raise ValueError(
            f"{op}: w must have shape ({x.shape[-1]},) to match x's last dimension, got "
            f"{tuple(w.shape)}"
        )
    check_elementwise(op, {"w": w}, dtypes=dtypes, device_type=device_type)
    if x.dtype not in dtypes:
        raise TypeError(
            f"{op}: x has dtype {str(x.dtype).removeprefix('torch.')}; supported: "
            + ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        )
    if w.dtype != x.dtype and x.dtype in FLOAT_DTYPES:  # an fp8 x comes with a higher-precision w
        raise TypeError(
            f"{op}: w is {str(w.dtype).removeprefix('torch.')} but x is "
            f"{str(x.dtype).removeprefix('torch.')}; the kernel reads both as x's dtype"
        )
    if x.device != w.device:
        raise ValueError(f"{op}: x is on {x.device} but w is on {w.device}")
    if x.stride(-1) != 1 and x.shape[-1] > 1:
        raise ValueError(
            f"{op}: x's last dimension must be contiguous (stride 1), got strides {x.stride()}"
        )
    rows_view(x)  # raises if the leading dimensions cannot be flattened without a copy
    if out is not None:
        if out.shape != x.shape or out.dtype != x.dtype or out.device != x.device:
            raise ValueError(f"{op}: out must match x's shape, dtype and device")
        if not out.is_contiguous():
            raise ValueError(f"{op}: out must be contiguous")


def rows_view(t: torch.Tensor) -> torch.Tensor:
    """t as (rows, width) without copying; rows may be strided. Raises if that needs a copy."""
    if t.dim() == 1:
        return t.unsqueeze(0)
    if t.dim() == 2:
        return t
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError as exc:
        raise ValueError(
            f"the leading dimensions of a tensor with shape {tuple(t.shape)} and strides "
            f"{t.stride()} cannot be flattened without a copy: pass t.contiguous()"
        ) from exc
