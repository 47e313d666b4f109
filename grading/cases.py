"""A case, made: its inputs from a seed, its output buffers, and its float64 references.

Correctness (grading/correctness.py), graph capture (grading/graph.py) and timing
(grading/performance.py) make a case's tensors the same way, from the spec (grading/spec.py).
"""
from __future__ import annotations

import torch

from grading.spec import Case, GradedFunction
from kernels import runtime
from kernels.testing import strided_view


def make_inputs(spec: GradedFunction, case: Case, gen, device=None) -> tuple:
    params = case.kwargs if spec.inputs_take_params else {}
    inputs = spec.make_inputs(case.shape, case.dtype, device or runtime.DEVICE, gen, **params)
    if case.layout == "strided":
        inputs = tuple(strided_view(t) for t in inputs)
    if spec.prepare is not None:
        inputs = tuple(spec.prepare(case.layout, inputs))
    return inputs


def output_names(spec: GradedFunction) -> list[str]:
    if spec.n_outputs == 1:
        return ["out"]
    names = list(spec.output_names)[:spec.n_outputs]
    return names + [f"out[{i}]" for i in range(len(names), spec.n_outputs)]


def as_tuple(value, n: int) -> tuple | None:
    """A function's (or reference's) outputs as an n-tuple; None if it did not return n of them."""
    if n == 1:
        return (value,)
    if isinstance(value, (tuple, list)) and len(value) == n:
        return tuple(value)
    return None


def output_shapes(spec: GradedFunction, case: Case) -> tuple:
    if spec.output_shapes is not None:
        return tuple(spec.output_shapes(case.shape, case.dtype))
    return ((case.shape, case.dtype),) * spec.n_outputs


def new_outputs(spec: GradedFunction, case: Case, device=None) -> tuple:
    return tuple(torch.empty(shape, dtype=dtype, device=device or runtime.DEVICE)
                 for shape, dtype in output_shapes(spec, case))


GUARD_ELEMENTS = 256  # after each output, in the same allocation: a store past the end lands here
GUARD_BYTE = 0xA5


def guarded_outputs(spec: GradedFunction, case: Case) -> tuple[tuple, tuple]:
    """(outputs, guards): each output the start of a larger buffer whose tail, the guard band,
    holds GUARD_BYTE and must still hold it after the call."""
    outs, guards = [], []
    for shape, dtype in output_shapes(spec, case):
        numel = torch.Size(shape).numel()
        base = torch.empty(numel + GUARD_ELEMENTS, dtype=dtype, device=runtime.DEVICE)
        base[numel:].view(torch.uint8).fill_(GUARD_BYTE)
        outs.append(base[:numel].view(shape))
        guards.append(base[numel:])
    return tuple(outs), tuple(guards)


def out_argument(outs: tuple):
    return outs[0] if len(outs) == 1 else outs


def references(spec: GradedFunction, inputs, kw: dict) -> tuple[tuple, tuple]:
    """The float64 reference of each output and the scale its tolerance is relative to."""
    wants = as_tuple(spec.reference_fp64(*inputs, **kw), spec.n_outputs)
    scales = (as_tuple(spec.scale(*inputs, **kw), spec.n_outputs) if spec.scale
              else (None,) * spec.n_outputs)
    return wants, scales
