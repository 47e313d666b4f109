"""The specification: what the add kernels compute, in plain PyTorch.

`*_fp64` versions compute the exact answer from the same low-precision inputs, to compare kernels
with; the others are the PyTorch-native versions kernels are timed against.
"""

from __future__ import annotations

import torch

from kernels.testing import tolerance


def add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a + b


def add_fp64(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.double() + b.double()


def residual_add(x: torch.Tensor, attn: torch.Tensor, mlp: torch.Tensor) -> torch.Tensor:
    """GPT-NeoX's parallel residual as Hugging Face writes it.

    `mlp_output + attn_output + hidden_states`.

    Python evaluates left to right, so this is (mlp + attn) + x, with the intermediate rounded to
    the tensor dtype: two kernels, one intermediate written to and read back from memory.
    """
    return mlp + attn + x


def residual_add_fp64(x: torch.Tensor, attn: torch.Tensor, mlp: torch.Tensor) -> torch.Tensor:
    return mlp.double() + attn.double() + x.double()


def add_tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(atol, rtol) of a kernel's a + b against `add_fp64`: one rounding to the dtype."""
    return tolerance(dtype, roundings=1)


def residual_add_tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(atol, rtol) of a kernel's mlp + attn + x against `residual_add_fp64`, relative to
    |x| + |attn| + |mlp|: two roundings, the intermediate sum's and the result's."""
    return tolerance(dtype, roundings=2)
