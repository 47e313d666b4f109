"""Argument checks of the fused linear + cross-entropy kernels."""

from __future__ import annotations

import torch

from kernels.validate import FLOAT_DTYPES


def check_linear_ce_args(op: str, x, w, targets, *, device_type: str) -> None:
    """x (tokens, hidden) float, w (vocab, hidden) alike, targets (tokens,) int64, one device."""
    for name, t in (("x", x), ("w", w), ("targets", targets)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{op}: x has dtype {str(x.dtype).removeprefix('torch.')}; supported: float32, "
            "float16, "
            "bfloat16"
        )
    if w.dtype != x.dtype:
        raise TypeError(
            f"{op}: w is {str(w.dtype).removeprefix('torch.')} but x is "
            f"{str(x.dtype).removeprefix('torch.')}; cast one so they match"
        )
    if targets.dtype != torch.int64:
        raise TypeError(
            f"{op}: targets must be int64 class indices, got "
            f"{str(targets.dtype).removeprefix('torch.')}"
        )
    if x.dim() != 2 or w.dim() != 2 or targets.dim() != 1:
        raise ValueError(
            f"{op}: expected x (tokens, hidden), w (vocab, hidden), targets (tokens,); got shapes "
            f"{tuple(x.shape)}, {tuple(w.shape)}, {tuple(targets.shape)} (flatten batch and "
            "sequence)"
        )
    if w.shape[1] != x.shape[1]:
        raise ValueError(f"{op}: w has hidden size {w.shape[1]} but x has {x.shape[1]}")
    if targets.shape[0] != x.shape[0]:
        raise ValueError(
            f"{op}: targets has {targets.shape[0]} entries but x has {x.shape[0]} tokens"
        )
    for name, t in (("x", x), ("w", w), ("targets", targets)):
        if t.device.type != device_type:
            raise ValueError(f"{op}: {name} is on {t.device}, expected a {device_type} tensor")
        if not t.is_contiguous():
            raise ValueError(
                f"{op}: {name} is not contiguous (strides {t.stride()}): pass {name}.contiguous()"
            )
