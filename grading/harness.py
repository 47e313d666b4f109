"""Checks one student function against its lab spec: correctness, then (on a GPU) performance.

Both the notebook check cells (`grading.check`) and `python -m grading` call `check_function`, so the
notebook shows exactly what the grader will report.

Correctness, per case: fresh random inputs from the run's seed; the output buffer poisoned with NaN;
the call watched for PyTorch compute ops (a submission must launch its own kernel, not `torch.add`)
and for kernel launches; the result compared with the float64 reference (per-dtype tolerance, NaN never
passes) and, where the spec demands it, with PyTorch bit for bit; the inputs compared with copies taken
before the call. A non-contiguous input must be rejected with ValueError/TypeError or handled correctly.
"""
from __future__ import annotations

import secrets
import traceback
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from grading.spec import Case, GradedFunction
from kernels import bench, runtime
from kernels.testing import compare, generator, poison_, strided_view

TIERS = ((0.8, "A"), (0.7, "B"), (0.6, "C"), (0.4, "D"))  # seed 003's boundaries, as a fraction of reference speed


def tier(ratio_to_reference: float) -> str:
    for threshold, letter in TIERS:
        if ratio_to_reference > threshold:
            return letter
    return "F"


# --------------------------------------------------------------------------------------------------
# Watching a call: which PyTorch ops it ran, and how many Triton kernels it launched.

_aten = torch.ops.aten
# Ops that allocate, describe or move memory without computing: a wrapper may use these freely.
ALLOWED_OPS = {
    _aten.empty.memory_format, _aten.empty_like.default, _aten.empty_strided.default, _aten.new_empty.default,
    _aten.zeros.default, _aten.zeros_like.default, _aten.fill_.Scalar, _aten.zero_.default,
    _aten.view.default, _aten._unsafe_view.default, _aten.reshape.default, _aten._reshape_alias.default,
    _aten.as_strided.default, _aten.alias.default, _aten.detach.default, _aten.t.default,
    _aten.transpose.int, _aten.permute.default, _aten.unsqueeze.default, _aten.squeeze.dim, _aten.squeeze.default,
    _aten.expand.default, _aten.slice.Tensor, _aten.select.int, _aten.flatten.using_ints,
    _aten.clone.default, _aten.copy_.default, _aten._to_copy.default, _aten.lift_fresh.default,
    _aten.is_same_size.default, _aten.sym_size.int, _aten.sym_stride.int, _aten.sym_numel.default,
    _aten.sym_storage_offset.default,
}


class _LaunchState:
    depth = 0
    launches = 0


def _install_launch_hooks() -> None:
    """Count Triton launches (compiled and interpreted) and let the op watcher ignore their internals."""
    from triton.runtime import jit

    classes = [jit.JITFunction]
    if runtime.MODE == "cpu":
        from triton.runtime import interpreter
        classes.append(interpreter.InterpretedFunction)
    for cls in classes:
        if getattr(cls.run, "_grading_hook", False):
            continue
        original = cls.run

        def run(self, *args, _original=original, **kwargs):
            if not kwargs.get("warmup", False):
                _LaunchState.launches += 1
            _LaunchState.depth += 1
            try:
                return _original(self, *args, **kwargs)
            finally:
                _LaunchState.depth -= 1

        run._grading_hook = True
        cls.run = run


class _OpWatcher(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.forbidden: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _LaunchState.depth == 0 and func not in ALLOWED_OPS and str(func) not in self.forbidden:
            self.forbidden.append(str(func))
        return func(*args, **(kwargs or {}))


@dataclass
class Watched:
    forbidden_ops: list[str]
    triton_launches: int
    cuda_kernels: list[str] = field(default_factory=list)


@contextmanager
def watch(profile_cuda: bool = False):
    """Record the PyTorch ops and kernel launches of the code inside the block."""
    _install_launch_hooks()
    before = _LaunchState.launches
    watcher = _OpWatcher()
    record = Watched([], 0)
    prof = None
    if profile_cuda:
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
        prof.__enter__()
    try:
        with watcher:
            yield record
    finally:
        if runtime.ON_GPU:
            torch.cuda.synchronize()
        if prof is not None:
            prof.__exit__(None, None, None)
            record.cuda_kernels = sorted({e.name for e in prof.events()
                                          if e.device_type == torch.autograd.DeviceType.CUDA})
        record.forbidden_ops = watcher.forbidden
        record.triton_launches = _LaunchState.launches - before


def _is_torch_kernel(name: str) -> bool:
    return "at::native" in name or name.startswith(("void at::", "at::", "Memset", "Memcpy"))


# --------------------------------------------------------------------------------------------------
# Results


@dataclass
class CaseResult:
    case: str
    ok: bool
    reason: str = ""
    comparison: dict | None = None


@dataclass
class PerfResult:
    config: str
    student_us: float | None = None
    reference_us: float | None = None
    torch_us: float | None = None
    spread_us: list[float] | None = None
    ratio_to_reference: float | None = None
    ratio_to_torch: float | None = None
    gbps: float | None = None
    nbytes: int | None = None
    percent_of_floor: float | None = None
    tier: str | None = None
    correct: bool | None = None
    note: str = ""
    expected: dict | None = None


@dataclass
class FunctionResult:
    name: str
    backend: str
    description: str
    status: str  # "pass" | "fail" | "not implemented" | "needs a GPU" | "missing"
    points: int
    max_points: int
    message: str = ""
    cases: list[CaseResult] = field(default_factory=list)
    perf: list[PerfResult] = field(default_factory=list)
    seed: int | None = None

    @property
    def tier(self) -> str | None:
        tiers = [p.tier for p in self.perf if p.tier]
        return max(tiers) if tiers else None  # the worst letter: "F" > "D" > ... > "A"

    def as_dict(self) -> dict:
        d = asdict(self)
        d["tier"] = self.tier
        return d


# --------------------------------------------------------------------------------------------------
# Correctness


def _short_exception(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {frames[-1].name}, line {frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}".strip()


def _size_context(case: Case) -> str:
    n = 1
    for s in case.shape:
        n *= s
    return f"n={n}" if len(case.shape) != 1 else f"n={case.shape[0]}"


def _run_case(fn, spec: GradedFunction, case: Case, seed: int, profile: bool = False) -> CaseResult:
    device = runtime.DEVICE
    gen = generator(seed, device)
    inputs = spec.make_inputs(case.shape, case.dtype, device, gen)
    if case.layout == "strided":
        inputs = tuple(strided_view(t) for t in inputs)
    originals = tuple(t.clone() for t in inputs)
    out = poison_(torch.empty(case.shape, dtype=case.dtype, device=device))
    try:
        with watch(profile_cuda=profile) as seen:
            result = fn(*inputs, out=out)
    except NotImplementedError:
        raise
    except (ValueError, TypeError) as exc:
        if case.layout != "contiguous":
            return CaseResult(case.label, True, f"rejected clearly: {exc}")
        return CaseResult(case.label, False, _short_exception(exc))
    except Exception as exc:  # noqa: BLE001 - a student's code may raise anything; report it
        return CaseResult(case.label, False, _short_exception(exc))
    if seen.forbidden_ops:
        return CaseResult(case.label, False, "computes with PyTorch ops instead of its own kernel: "
                          + ", ".join(seen.forbidden_ops[:4]))
    if not isinstance(result, torch.Tensor):
        return CaseResult(case.label, False, f"returned {type(result).__name__}, expected the output tensor")
    if result.data_ptr() != out.data_ptr() and out.numel():
        return CaseResult(case.label, False, "given out=, it must write into out and return it "
                          "(it returned another tensor)")
    for i, (now, before) in enumerate(zip(inputs, originals)):
        if not torch.equal(now, before):
            return CaseResult(case.label, False, f"modified its input #{i + 1}")
    atol, rtol = spec.tolerance(case.dtype)
    cmp = compare(result, spec.reference_fp64(*inputs), atol=atol, rtol=rtol,
                  scale=spec.scale(*inputs) if spec.scale else None)
    if not cmp.ok:
        return CaseResult(case.label, False, f"{_size_context(case)}: {cmp.reason}", cmp.as_dict())
    if spec.bit_exact is not None and case.dtype in spec.exact_dtypes:
        want = spec.bit_exact(*inputs)
        differ = (result.view(-1) != want.view(-1)).nonzero()
        if differ.numel():
            i = int(differ[0])
            return CaseResult(case.label, False,
                              f"{_size_context(case)}: not bit-identical to PyTorch: {differ.numel()} elements differ, "
                              f"first at {i} (PyTorch {want.view(-1)[i].item():.6g}, "
                              f"yours {result.view(-1)[i].item():.6g})", cmp.as_dict())
    # Right answer, but from where? A graded function must compute with its own kernel.
    if spec.backend == "triton" and case.shape and min(case.shape) > 0 and seen.triton_launches == 0:
        return CaseResult(case.label, False, "launched no Triton kernel")
    if seen.cuda_kernels and all(_is_torch_kernel(k) for k in seen.cuda_kernels):
        return CaseResult(case.label, False, "launched only PyTorch kernels: " + ", ".join(seen.cuda_kernels[:3]))
    return CaseResult(case.label, True, "", cmp.as_dict())


def _allocating_call_ok(fn, spec: GradedFunction, seed: int) -> str:
    """Called without out=, the function must allocate and return a correct result."""
    case = next(c for c in spec.cases if c.layout == "contiguous" and min(c.shape) > 1)
    inputs = spec.make_inputs(case.shape, case.dtype, runtime.DEVICE, generator(seed, runtime.DEVICE))
    try:
        result = fn(*inputs)
    except Exception as exc:  # noqa: BLE001
        return f"called without out=: {_short_exception(exc)}"
    atol, rtol = spec.tolerance(case.dtype)
    cmp = compare(result, spec.reference_fp64(*inputs), atol=atol, rtol=rtol,
                  scale=spec.scale(*inputs) if spec.scale else None)
    return "" if cmp.ok else f"called without out=: {cmp.reason}"


# --------------------------------------------------------------------------------------------------
# Performance (GPU only)


def _measure(fn, spec: GradedFunction, config, seed: int, expected_rows: dict | None) -> PerfResult:
    from grading import expected as expected_table

    gen = generator(seed, "cuda")
    inputs = spec.make_inputs(config.shape, config.dtype, "cuda", gen)
    outs = {name: torch.empty(config.shape, dtype=config.dtype, device="cuda")
            for name in ("student", "reference", "torch")}
    poison_(outs["student"])
    timings = bench.benchmark({
        "student": lambda: fn(*inputs, out=outs["student"]),
        "reference": lambda: spec.course_kernel(*inputs, out=outs["reference"]),
        "torch": lambda: spec.torch_native(*inputs, out=outs["torch"]),
    })
    atol, rtol = spec.tolerance(config.dtype)
    cmp = compare(outs["student"], spec.reference_fp64(*inputs), atol=atol, rtol=rtol,
                  scale=spec.scale(*inputs) if spec.scale else None)
    student = timings["student"]
    nbytes = spec.bytes_moved(*inputs)
    floor = bench.floor_us(nbytes=nbytes)
    result = PerfResult(
        config=config.id,
        student_us=student.median_us,
        reference_us=timings["reference"].median_us,
        torch_us=timings["torch"].median_us,
        spread_us=list(student.spread_us),
        ratio_to_reference=bench.ratio(timings["reference"], student),
        ratio_to_torch=bench.ratio(timings["torch"], student),
        gbps=student.gbps(nbytes),
        nbytes=nbytes,
        percent_of_floor=100 * floor / student.median_us if floor else None,
        correct=cmp.ok,
        expected=expected_table.row(expected_rows, config.id),
    )
    if not cmp.ok:
        result.note = f"output wrong at this size ({cmp.reason}): not credited"
        result.tier = "F"
    elif floor and student.median_us < 0.9 * floor:
        result.note = "faster than the hardware floor for the bytes it must move: not credited"
        result.tier = "F"
    else:
        result.tier = tier(result.ratio_to_reference)
    return result


# --------------------------------------------------------------------------------------------------


def check_function(lab, name: str, fn, *, seed: int | None = None, perf: bool | None = None) -> FunctionResult:
    """Grade one function of `lab` (a LabSpec). perf=None measures performance on a GPU only."""
    from grading import expected as expected_table

    spec = lab.function(name)
    seed = secrets.randbits(31) if seed is None else seed
    result = FunctionResult(spec.name, spec.backend, spec.description, "fail", 0, spec.points, seed=seed)
    if fn is None:
        result.status, result.message = "missing", f"no function named {name} was defined"
        return result
    if spec.backend == "cupy" and not runtime.cupy_status()[0]:
        result.status, result.message = "needs a GPU", runtime.cupy_status()[1]
        return result
    # On a GPU, profile the largest case to see which kernels ran (one profile: it is slow to start).
    profiled = max((c for c in spec.cases if c.layout == "contiguous"), key=lambda c: torch.Size(c.shape).numel())
    try:
        for i, case in enumerate(spec.cases):
            result.cases.append(_run_case(fn, spec, case, seed + i, profile=runtime.ON_GPU and case == profiled))
    except NotImplementedError:
        result.status, result.message, result.cases = "not implemented", "not implemented yet", []
        return result
    failures = [c for c in result.cases if not c.ok]
    if not failures:
        problem = _allocating_call_ok(fn, spec, seed)
        if problem:
            failures = [CaseResult("without out=", False, problem)]
            result.cases.append(failures[0])
    if failures:
        result.message = f"{len(failures)} of {len(result.cases)} cases fail; first: {failures[0].case}: " \
                         f"{failures[0].reason}"
        if spec.hint:
            result.message += f" (hint: {spec.hint})"
        return result
    result.status, result.points = "pass", spec.points
    if perf if perf is not None else runtime.ON_GPU:
        rows = expected_table.load(lab.id)
        result.perf = [_measure(fn, spec, config, seed, rows) for config in spec.perf]
    return result
