"""Argument checks of the precision kernels: clear errors instead of garbage reads."""

from __future__ import annotations

import torch

from kernels.validate import FLOAT_DTYPES

ALGORITHMS = ("naive", "pairwise", "kahan")


def _name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_float_tensor(op: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{op}: x has dtype {_name(x.dtype)}; supported: float32, float16, bfloat16"
        )


def check_sum_args(op: str, x, acc, algorithm: str, *, device_type: str) -> None:
    """x: a float32/float16/bfloat16 tensor of 1 or 2 dimensions (rows are summed) whose last
    dimension is contiguous; acc: float32, float16 or bfloat16; algorithm: naive, pairwise or
    kahan."""
    _check_float_tensor(op, x)
    if acc not in FLOAT_DTYPES:
        raise TypeError(
            f"{op}: acc (the accumulator dtype) must be torch.float32, float16 or bfloat16, not "
            f"{acc!r}"
        )
    if algorithm not in ALGORITHMS:
        raise ValueError(
            f"{op}: algorithm must be one of {', '.join(ALGORITHMS)}, not {algorithm!r}"
        )
    if x.dim() not in (1, 2):
        raise ValueError(
            f"{op}: x must be a vector (n,) or rows (rows, n), got shape {tuple(x.shape)}"
        )
    if x.device.type != device_type:
        raise ValueError(f"{op}: x is on {x.device}, expected a {device_type} tensor")
    if x.shape[-1] > 1 and x.stride(-1) != 1:
        raise ValueError(
            f"{op}: x's last dimension must be contiguous (stride 1), got strides {x.stride()}; "
            "pass x.contiguous()"
        )


def check_fp8_args(op: str, x, dtype, block) -> None:
    from kernels.mixed_precision.reference import FP8_DTYPES

    _check_float_tensor(op, x)
    if dtype not in FP8_DTYPES:
        raise TypeError(
            f"{op}: dtype must be torch.float8_e4m3fn or torch.float8_e5m2, not {dtype!r}"
        )
    if block is not None and (not isinstance(block, int) or block <= 0 or block & (block - 1)):
        raise ValueError(
            f"{op}: block must be None (one scale per tensor) or a power of two, got {block!r}"
        )
    if not x.is_contiguous():
        raise ValueError(
            f"{op}: x must be contiguous (blocks are runs of the flattened tensor); pass "
            "x.contiguous()"
        )
