"""What a lab asks for, as data: the graded functions, their correctness cases and performance configs.

One `LabSpec` per lab lives in `grading/labs/`; the notebook check cells and `python -m grading` both
run it through `grading.harness`, so a student sees in the notebook exactly what the grader will say.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass(frozen=True)
class Case:
    """One correctness case: a shape and dtype, and how to lay the inputs out."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    layout: str = "contiguous"  # "contiguous" | "strided" (a non-contiguous view: must raise or be right)

    @property
    def label(self) -> str:
        size = "x".join(map(str, self.shape)) or "scalar"
        return f"{size} {str(self.dtype).removeprefix('torch.')}" + ("" if self.layout == "contiguous" else
                                                                     f" {self.layout}")


@dataclass(frozen=True)
class PerfConfig:
    """A performance configuration: timed against the course's reference kernel and PyTorch."""

    id: str
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class GradedFunction:
    """A function the student writes, and how to check it.

    * `make_inputs(case_shape, dtype, device, generator)` -> tuple of input tensors.
    * `reference_fp64(*inputs)` -> float64 result (the spec).
    * `tolerance(dtype)` -> (atol, rtol) against the fp64 reference; `scale(*inputs)` optional
      per-element magnitude the rtol multiplies (defaults to |reference|).
    * `bit_exact(*inputs)` optional: the result must equal this tensor bit for bit (for `exact_dtypes`).
    * `course_kernel` / `torch_native`: what performance is measured against (same process, same inputs).
    * `bytes_moved(*inputs)`: for GB/s and the hardware floor; `flops(*inputs)` optional, for the
      floor of compute-bound kernels (the floor is the larger of bytes / copy GB/s and flops / matmul rate).
    * `trials`: calls per correctness case; every call after the first gets new random values in the
      same input buffers, so a function that caches its previous output fails.
    * `input_names`: names of the inputs in reports and `--explain` (default: the course kernel's
      parameter names).
    """

    name: str
    points: int
    backend: str  # "triton" (runs in CPU mode too) or "cupy" (GPU only)
    description: str
    make_inputs: Callable
    reference_fp64: Callable
    tolerance: Callable
    course_kernel: Callable
    torch_native: Callable
    bytes_moved: Callable
    cases: tuple[Case, ...]
    perf: tuple[PerfConfig, ...] = ()
    scale: Callable | None = None
    bit_exact: Callable | None = None
    exact_dtypes: tuple[torch.dtype, ...] = ()
    hint: str = ""
    flops: Callable | None = None
    trials: int = 2
    input_names: tuple[str, ...] = ()


@dataclass(frozen=True)
class LabSpec:
    id: str  # e.g. "01_elementwise_add": also the notebook's stem without "_lab"
    title: str
    functions: tuple[GradedFunction, ...] = field(default_factory=tuple)

    def function(self, name: str) -> GradedFunction:
        for f in self.functions:
            if f.name == name:
                return f
        raise KeyError(f"lab {self.id} grades no function named {name!r}; it grades "
                       f"{', '.join(f.name for f in self.functions)}")
