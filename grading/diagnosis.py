"""Explaining a failure: what an exception means, what pattern the wrong elements show, and the
inputs and worst elements behind a failing check (the report's `detail`, `--explain`)."""
from __future__ import annotations

import inspect
import traceback
from dataclasses import dataclass

import torch

from grading.results import ContextLost
from grading.spec import Case, GradedFunction
from kernels import interpreter_poison, runtime
from kernels.testing import ULP, unravel_index


@dataclass
class Limits:
    """The caps the worker set on its process, for messages; None where none is set."""

    host_memory_gib: float | None = None
    gpu_memory_gib: float | None = None


def short_exception(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    # Where in the student's code (the graded module is student_<lab>.py), else the innermost frame.
    mine = [f for f in frames if f.filename.rsplit("/", 1)[-1].startswith("student_")]
    frames = mine or frames
    where = f" (at {frames[-1].name}, line {frames[-1].lineno})" if frames else ""
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    if type(exc).__name__ == "CompilationError" and len(text) > 1:
        # Triton's: "at 5:8:", the offending source line, a caret, then the reason
        first = f"{first} {text[-1].strip()}"
    return f"{type(exc).__name__}: {first}{where}".strip()


def _gib(value: float | None) -> str:
    return "" if value is None else f" (a lab may use {value:.1f} GiB)"


def is_host_oom(exc: BaseException) -> bool:
    text = str(exc)
    return (isinstance(exc, MemoryError) or "can't allocate memory" in text
            or "DefaultCPUAllocator" in text)


def is_gpu_oom(exc: BaseException) -> bool:
    # torch.OutOfMemoryError ("CUDA out of memory"), cupy.cuda.memory.OutOfMemoryError
    return "OutOfMemoryError" in type(exc).__name__ or "out of memory" in str(exc).lower()


def describe_exception(exc: BaseException, limits: Limits | None = None) -> str:
    limits = limits or Limits()
    if is_host_oom(exc):
        return f"ran out of host memory{_gib(limits.host_memory_gib)}: {short_exception(exc)}"
    if is_gpu_oom(exc):
        return f"ran out of GPU memory{_gib(limits.gpu_memory_gib)}: {short_exception(exc)}"
    return short_exception(exc)


def check_context(label: str, exc: BaseException) -> None:
    """On a GPU, after an exception: raise ContextLost if the CUDA context no longer works.

    Running out of memory does not corrupt the context (and the failed call's tensors may still be
    alive, held by the traceback, so a probe could run out of memory itself): it is never a loss."""
    if not runtime.ON_GPU or is_gpu_oom(exc) or is_host_oom(exc):
        return
    try:
        torch.cuda.synchronize()
        torch.ones(1, device="cuda").add_(1).item()
    except Exception as probe:  # noqa: BLE001 - any failure but memory means the context is gone
        if is_gpu_oom(probe):
            return
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        oob = "illegal" in text or "address" in text
        hint = " (an out-of-bounds read or write?)" if oob else ""
        raise ContextLost(f"{label}: {text}{hint}; the CUDA context is lost") from exc


def size_context(case: Case) -> str:
    if len(case.shape) > 2:  # a problem shape (attention's B x Hq x Hkv x Nq x Nk x D)
        return "shape " + "x".join(map(str, case.shape))
    n = 1
    for s in case.shape:
        n *= s
    return f"n={n}"


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                       b.contiguous().reshape(-1).view(torch.uint8))


def bad_mask(result: torch.Tensor, want: torch.Tensor, atol: float, rtol: float,
             scale) -> torch.Tensor:
    want = want.detach().to(torch.float64).flatten()
    got = result.detach().to(want.device, torch.float64).flatten()
    s = want.abs() if scale is None else scale.detach().to(want.device, torch.float64).flatten()
    return ~((got - want).abs() <= atol + rtol * s)


def diagnose(case: Case, result: torch.Tensor, want: torch.Tensor, cmp, atol: float, rtol: float,
             scale=None) -> str:
    """A pattern in the wrong elements that says what to fix, or "" (the counts say the rest)."""
    numel = cmp.numel
    if not numel or not cmp.n_bad or tuple(result.shape) != tuple(want.shape):
        return ""
    bad = bad_mask(result, want, atol, rtol, scale)
    got = result.detach().flatten()
    bad_idx = torch.nonzero(bad).flatten()
    if not bad_idx.numel():
        return ""
    k = int(bad_idx[0])
    nan_bad = int(torch.isnan(got[bad]).sum())
    if interpreter_poison.hint() and interpreter_poison.computed_nans(got[bad]):
        return interpreter_poison.hint()  # CPU mode: NaN computed from lanes a mask turned off
    if cmp.n_bad == numel and nan_bad == numel:
        return "no element was written (every one is still the NaN the grader put in out)"
    if k > 0 and bad_idx.numel() == numel - k:  # everything from index k on, nothing before
        never = " (never written)" if nan_bad == numel - k else ""
        if k % 16 == 0:  # k is where a block (of 16, 32, ... elements) begins
            return (f"wrong for n not a multiple of the block size (n={numel}, first bad index "
                    f"{k}): the last {numel - k} elements are wrong{never}; mask the loads and "
                    f"stores of the last block")
        return (f"wrong from index {k} to the end (n={numel}): the last {numel - k} elements are "
                f"wrong{never}")
    if nan_bad == cmp.n_bad:
        return (f"{nan_bad} elements were never written (still NaN); does every element get a "
                f"thread?")
    dtype = result.dtype if result.dtype in ULP else case.dtype  # attention's float32 lse
    if cmp.n_nan == 0 and cmp.n_inf == 0 and dtype in ULP and cmp.max_rel_err < 0.05:
        ulps = cmp.max_rel_err / ULP[dtype]
        allowed = rtol / ULP[dtype]
        return (f"rounding error up to {ulps:.0f} ulp of {str(dtype).removeprefix('torch.')} "
                f"where {allowed:g} is allowed: is it computed in a lower precision? (compute in "
                f"float32, round once)")
    return ""


def lab_diagnosis(spec: GradedFunction, case: Case, inputs, oname: str, result, want, atol: float,
                  rtol: float, scale) -> str:
    """The lab's own reading of the wrong elements (`GradedFunction.diagnose`), or ""."""
    if spec.diagnose is None or tuple(result.shape) != tuple(want.shape):
        return ""
    bad = bad_mask(result, want, atol, rtol, scale).view(want.shape)
    return spec.diagnose(oname, result, want, bad, *inputs, **case.kwargs)


def input_names(spec: GradedFunction, count: int) -> list[str]:
    names = list(spec.input_names)
    if not names:
        try:
            names = [p.name for p in inspect.signature(spec.course_kernel).parameters.values()
                     if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        except (TypeError, ValueError):
            names = []
    names = names[:count]
    return names + [f"input {i + 1}" for i in range(len(names), count)]


def _value(t: torch.Tensor, i: int) -> float:
    return float(t.reshape(-1)[i].item())


def detail(spec: GradedFunction, case: Case, inputs, seed: int, trial: int, result=None, want=None,
           atol: float = 0.0, rtol: float = 0.0, scale=None, worst: int = 5) -> dict:
    """The failing check's inputs and its worst elements, for the report and `--explain`."""
    names = input_names(spec, len(inputs))
    found = {"case": case.label, "seed": seed, "trial": trial + 1,
             "inputs": [{"name": n, "shape": list(t.shape),
                         "dtype": str(t.dtype).removeprefix("torch."), "stride": list(t.stride())}
                        for n, t in zip(names, inputs)],
             "worst": [], "first_bad": []}
    if (result is None or want is None or tuple(result.shape) != tuple(want.shape)
            or not want.numel()):
        return found
    w = want.detach().to(torch.float64).flatten()
    g = result.detach().to(w.device, torch.float64).flatten()
    err = (g - w).abs()
    err = torch.where(torch.isnan(err), torch.full_like(err, float("inf")), err)
    same_shape = [(n, t) for n, t in zip(names, inputs) if tuple(t.shape) == tuple(result.shape)]

    def row(i: int) -> dict:
        return {"index": unravel_index(i, want.shape), "expected": float(w[i]),
                "actual": float(g[i]), "inputs": {n: _value(t, i) for n, t in same_shape}}

    top = torch.topk(err, min(worst, err.numel())).indices.tolist()
    found["worst"] = [row(i) for i in top]
    bad = torch.nonzero(bad_mask(result, want, atol, rtol, scale)).flatten()[:3].tolist()
    found["first_bad"] = [row(i) for i in bad]
    return found
