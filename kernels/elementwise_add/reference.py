"""The specification: what the add kernels compute, in plain PyTorch.

`*_fp64` versions compute the exact answer from the same low-precision inputs, to compare kernels
with; the others are the PyTorch-native versions kernels are timed against.
"""

from __future__ import annotations

import torch


def add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a + b


def add_fp64(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.double() + b.double()


def residual_add(x: torch.Tensor, attn: torch.Tensor, mlp: torch.Tensor) -> torch.Tensor:
    """GPT-NeoX's parallel residual as Hugging Face writes it: `mlp_output + attn_output +
    hidden_states`.

    Python evaluates left to right, so this is (mlp + attn) + x, with the intermediate rounded to
    the tensor dtype: two kernels, one intermediate written to and read back from memory.
    """
    return mlp + attn + x


def residual_add_fp64(x: torch.Tensor, attn: torch.Tensor, mlp: torch.Tensor) -> torch.Tensor:
    return mlp.double() + attn.double() + x.double()
