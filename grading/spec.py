"""What a lab asks for, as data: the graded functions, their correctness cases and performance
configs.

One `LabSpec` per lab lives in `grading/labs/`; the notebook check cells and `python -m grading`
both run it through `grading.harness`, so a student sees in the notebook exactly what the grader
will say.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass(frozen=True)
class Case:
    """One correctness case: a shape and dtype, and how to lay the inputs out."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    # "contiguous" | "strided" (a non-contiguous view: must raise ValueError/TypeError or be right)
    # | any other name, which the function's `prepare` turns into inputs (and which must be handled)
    layout: str = "contiguous"
    params: tuple[
        tuple[str, object], ...
    ] = ()  # keyword arguments of this case, e.g. (("eps", 0.5),)

    @property
    def kwargs(self) -> dict:
        return dict(self.params)

    def as_json(self) -> dict:
        return {
            "shape": list(self.shape),
            "dtype": str(self.dtype).removeprefix("torch."),
            "layout": self.layout,
            "params": [list(p) for p in self.params],
        }

    @staticmethod
    def from_json(d: dict) -> "Case":
        return Case(
            tuple(int(s) for s in d["shape"]),
            getattr(torch, d["dtype"]),
            d["layout"],
            tuple((str(k), v) for k, v in d["params"]),
        )

    @property
    def label(self) -> str:
        size = "x".join(map(str, self.shape)) or "scalar"
        return (
            f"{size} {str(self.dtype).removeprefix('torch.')}"
            + ("" if self.layout == "contiguous" else f" {self.layout}")
            + "".join(f" {k}={v}" for k, v in self.params)
        )


@dataclass(frozen=True)
class PerfConfig:
    """A performance configuration: timed against the course's reference kernel and PyTorch."""

    id: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    params: tuple[
        tuple[str, object], ...
    ] = ()  # keyword arguments, as a Case's (e.g. (("top_k", 2),))


@dataclass(frozen=True)
class GradedFunction:
    """A function the student writes, and how to check it.

    * `make_inputs(case_shape, dtype, device, generator)` -> tuple of input tensors.
    * `reference_fp64(*inputs)` -> float64 result (the spec).
    * `tolerance(dtype)` -> (atol, rtol) against the fp64 reference; `scale(*inputs)` optional
      per-element magnitude the rtol multiplies (defaults to |reference|).
    * `bit_exact(*inputs)` optional: the result must equal this tensor bit for bit (for
    `exact_dtypes`).
    * `course_kernel` / `torch_native`: what performance is measured against (same process, same
    inputs).
    * `bytes_moved(*inputs)`: for GB/s and the hardware floor; `flops(*inputs)` optional, for the
      floor of compute-bound kernels (the floor is the larger of bytes / copy GB/s and flops /
      matmul rate).
    * `trials`: calls per correctness case; every call after the first gets new random values in the
      same input buffers, so a function that caches its previous output fails.
    * `input_names`: names of the inputs in reports and `--explain` (default: the course kernel's
      parameter names).
    * `prepare(layout, inputs)` optional: turns freshly made inputs into a case's layout (views with
      row strides, scaled values, ...) for layouts other than "contiguous" and "strided".
    * `n_outputs`: with more than one, `out=` is a tuple of that many tensors (each of the
    case's shape
      and dtype), the function returns them as a tuple, `reference_fp64` (and `scale`,
      `bit_exact`, whose
      entries may be None) return one per output; `output_names` names them in messages.
    * `output_shapes(case_shape, dtype)` optional: ((shape, dtype), ...) of each output, for
    outputs that
      are not of the case's shape and dtype (attention's float32 lse beside its output; gradients of
      inputs of different shapes).
    * `memory_budget(*inputs, **params)` optional: bytes of device memory one call may allocate
    beyond
      its inputs and outputs (its peak, from PyTorch's caching allocator; GPU only). A kernel that
      materializes what it should stream (attention's N x N scores, cross-entropy's logits)
      fails it.
    * `own_kernels_only`: launching a kernel of the course's package fails the call: a Triton
      kernel defined in a file of `kernels/` (under whatever module name it was loaded), or a
      CuPy kernel compiled from the course's CUDA C (`grading.watch.course_kernel_name`). Set it
      where the course has a kernel that does the graded job whole (lab 00's transpose, 02b's matrix
      product, 06's permutation and grouped GEMM). The other labs leave it off: their self-tests
      grade the course's kernels as known-good submissions.
    * `diagnose(output_name, result, want, bad, *inputs, **params)` optional: what a wrong output's
      pattern of bad elements (`bad`, a bool tensor of `want`'s shape) says in the lab's own terms
      ("wrong for tokens not a multiple of the block (tokens=37, first bad token 32)"), or ""
      to let the
      generic diagnosis speak.
    * `graph_capture`: on a GPU, the call must be capturable in a CUDA graph (no host
    synchronization
      inside it: `.item()`, `.cpu()`, a size read from a tensor), and the graph, replayed on new
      input values, must compute them right. Not exercised without a GPU (the report says so).
    * `allowed_ops`: PyTorch ops (e.g. `"aten.mm.default"`) this function may call on top of the
      allocations and views every function may use: a lab whose lesson is elsewhere (chunked
      cross-entropy around cuBLAS GEMMs) names the library calls it permits.
    * `extra_credit`: its points come on top of the lab's maximum, and its speed does not enter the
      lab's letter grade: a student who leaves it alone loses nothing.
    * `draw_cases(rng)` optional: more cases, drawn per run from the secret seed (`rng`, a
      `random.Random`) within size classes (an even size, a multiple of the block size, a size
      above 2**17, every rank the function accepts, the widest rows it promises), so that no fixed
      list of sizes can be learned; `cases_for(seed)` is the fixed cases and these.
    * A case's (or performance configuration's) `params` are passed as keyword arguments to the
    function,
      `reference_fp64`, `scale` and `bit_exact` (and, in timing, to the course kernel,
      PyTorch's version,
      `bytes_moved` and `flops`).
    * `grade_group` / `run_group` optional: a function graded in a process group of several
      processes (lab 08), not through the cases above. `run_group(fn, rank, world, job, inputs)`
      runs in each rank (grading/ranks.py), on that rank's inputs only, and returns what it
      produced (plain data and tensors), no verdict. `grade_group(spec, kind, call, seed, step)`
      runs in the grader: it makes the inputs, has the ranks run through `call(groups)`, each
      group `(job, per_rank, gates)` (the relay's log comes back with their answers), judges and
      returns a `FunctionResult`.
    """

    name: str
    points: int
    backend: str  # "triton" (runs in CPU mode too), "cupy" (GPU only) or "gloo" (CPU ranks)
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
    prepare: Callable | None = None
    n_outputs: int = 1
    output_names: tuple[str, ...] = ()
    output_shapes: Callable | None = None
    memory_budget: Callable | None = None
    allowed_ops: tuple[str, ...] = ()
    extra_credit: bool = False
    own_kernels_only: bool = False
    diagnose: Callable | None = None
    graph_capture: bool = False
    draw_cases: Callable | None = None
    grade_group: Callable | None = None
    run_group: Callable | None = None
    # make_inputs also takes the case's params as keywords (lab 05's ignore_index marks targets)
    inputs_take_params: bool = False

    def cases_for(self, seed: int) -> tuple[Case, ...]:
        """The fixed cases, then those drawn for this seed."""
        if self.draw_cases is None:
            return self.cases
        return self.cases + tuple(self.draw_cases(random.Random(f"cases {seed}")))


@dataclass(frozen=True)
class LabSpec:
    id: str  # e.g. "01_elementwise_add": also the notebook's stem without "_lab"
    title: str
    functions: tuple[GradedFunction, ...] = field(default_factory=tuple)

    def function(self, name: str) -> GradedFunction:
        for f in self.functions:
            if f.name == name:
                return f
        raise KeyError(
            f"lab {self.id} grades no function named {name!r}; it grades "
            f"{', '.join(f.name for f in self.functions)}"
        )
