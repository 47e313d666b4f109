"""Checks one student function against its lab spec: correctness, then (on a GPU) performance.

Both the notebook check cells (`grading.check`) and `python -m grading` call `check_function`, so the
notebook shows exactly what the grader will report.

Correctness, per case and per trial (`GradedFunction.trials`, 2 by default): fresh random inputs from the
run's seed, and for every later trial new values in the *same* input buffers (a function that caches its
previous output returns stale values and fails); the output buffer poisoned with NaN; the call watched
for PyTorch compute ops (a submission must launch its own kernel, not `torch.add`), named by the torch
function that issued them, and for kernel launches; on a GPU, the output read back in the order of
PyTorch's current stream, before any other synchronization (work left on a side stream is caught: a
launch on a side stream is also delayed, so the race is lost every time, not by chance); the result
compared with the float64 reference (per-dtype tolerance, NaN never passes) and, where the spec demands
it, with PyTorch bit for bit; the inputs compared with copies taken before the call. A non-contiguous
input must be rejected with ValueError/TypeError or handled correctly. An exception is reported with a
reason (out of host or GPU memory, `sys.exit`, ...); a CUDA error that leaves the context unusable
raises `ContextLost`, which ends the process (the worker grades the rest of the lab in a new one).

Performance (GPU only): the student's function, the course's kernel and PyTorch timed interleaved with
CUDA events and L2 flushed, as `kernels.bench.benchmark` does, but with new input values before every
round and every round's output checked on the device; kernels launched on side streams are joined
before the end event, so hidden work is timed.
"""
from __future__ import annotations

import inspect
import secrets
import traceback
import warnings
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from grading.spec import Case, GradedFunction
from kernels import bench, runtime
from kernels.testing import ULP, compare, generator, poison_, strided_view

TIERS = ((0.8, "A"), (0.7, "B"), (0.6, "C"), (0.4, "D"))  # seed 003's boundaries, as a fraction of reference speed


def tier(ratio_to_reference: float) -> str:
    for threshold, letter in TIERS:
        if ratio_to_reference > threshold:
            return letter
    return "F"


class ContextLost(RuntimeError):
    """The CUDA context is unusable (illegal memory access, device-side assert, ...): every later CUDA
    call in this process would fail too, so grading in this process must stop."""


class Limits:
    """The caps the worker set for this process (for messages); None where none is set."""

    host_memory_gib: float | None = None
    gpu_memory_gib: float | None = None


# Set by the worker: called with (function, step, kind) before every step that runs student code, so
# the parent process knows what was running if this process hangs or dies. kind: "call" or "perf".
on_step: Callable[[str, str, str], None] | None = None


def _step(function: str, step: str, kind: str = "call") -> None:
    if on_step is not None:
        on_step(function, step, kind)


# --------------------------------------------------------------------------------------------------
# Watching a call: which PyTorch ops it ran (and from which torch function), how many kernels it
# launched, and on which streams.

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
# Everything else is forbidden outside the student's own kernel launches -- in particular the PyTorch
# references of the labs: torch.add (lab 01), F.rms_norm (02), F.scaled_dot_product_attention (03),
# torch._grouped_mm and torch.matmul (06). tests/test_grader_harness.py proves each is caught.

# GPU clock cycles a launch on a side stream is held back during correctness checks (~50 ms): a
# function that does not make PyTorch's stream wait for its side stream then loses the race every time.
# (10 ms was not enough on an H200: a first call's host work after the launch, such as loading the copy
# kernel the output snapshot uses, outlasted it, and the first case passed by luck.)
SIDE_STREAM_DELAY_CYCLES = 100_000_000


class _LaunchState:
    depth = 0
    launches = 0  # Triton launches (compiled and interpreted)
    cupy_launches = 0  # launches through kernels.cuda.launch
    grader_stream = None  # PyTorch's current stream when the graded call started (GPU), else None
    delay_side_streams = False
    side_streams: list = []
    course_kernels: list = []  # the course's own kernels (defined under `kernels.`) launched, by name


def _on_side_stream() -> bool:
    grader = _LaunchState.grader_stream
    return grader is not None and torch.cuda.current_stream() != grader


def _before_launch() -> None:
    """Called before every kernel launch: note (and, in correctness checks, delay) a side stream."""
    grader = _LaunchState.grader_stream
    if grader is None:
        return
    stream = torch.cuda.current_stream()
    if stream == grader:
        return
    if all(stream != s for s in _LaunchState.side_streams):
        _LaunchState.side_streams.append(stream)
    stream.wait_stream(grader)  # the side work cannot start before what the grader queued (poison, start event)
    if _LaunchState.delay_side_streams:
        torch.cuda._sleep(SIDE_STREAM_DELAY_CYCLES)  # queued on the side stream, ahead of the kernel


def _install_launch_hooks() -> None:
    """Count Triton launches (compiled and interpreted) and CuPy launches made through
    `kernels.cuda.launch`, and let the op watcher ignore what happens inside them."""
    from triton.runtime import jit

    from kernels import cuda

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
                name = _course_kernel_name(self)
                if name and name not in _LaunchState.course_kernels:
                    _LaunchState.course_kernels.append(name)
            _LaunchState.depth += 1
            try:
                if _on_side_stream() and not kwargs.get("warmup", False):
                    # compile first (a warm-up run launches nothing): the side stream's delay must not
                    # elapse while the first call is still compiling, or that call wins the race by luck
                    _original(self, *args, **{**kwargs, "warmup": True})
                _before_launch()
                return _original(self, *args, **kwargs)
            finally:
                _LaunchState.depth -= 1

        run._grading_hook = True
        cls.run = run
    if not getattr(cuda.launch, "_grading_hook", False):
        original_launch = cuda.launch

        def launch(*args, _original=original_launch, **kwargs):
            _LaunchState.cupy_launches += 1
            _LaunchState.depth += 1
            try:
                _before_launch()
                return _original(*args, **kwargs)
            finally:
                _LaunchState.depth -= 1

        launch._grading_hook = True
        launch.__doc__ = original_launch.__doc__
        cuda.launch = launch


def _course_kernel_name(kernel) -> str | None:
    """`kernels.moe.triton_permute.histogram_kernel` for a kernel of the course's package, else None: a
    graded function must launch kernels of its own, not the course's (which the grader times it against)."""
    fn = getattr(kernel, "fn", None)
    module = getattr(fn, "__module__", None) or ""
    return f"{module}.{fn.__name__}" if module.split(".")[0] == "kernels" else None


# Where PyTorch's C functions are documented (F.scaled_dot_product_attention is torch._C._nn's).
_PUBLIC_MODULE = {"torch._C._nn": "torch.nn.functional", "torch._C._linalg": "torch.linalg",
                  "torch._C._fft": "torch.fft", "torch._C._special": "torch.special"}


def torch_name(func) -> str:
    """`torch.add`, `Tensor.add`, `torch.nn.functional.rms_norm`: how a student would have written it."""
    if isinstance(func, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return f"torch.ops.{func}"
    qual = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
    head, _, name = qual.rpartition(".")
    if head in ("TensorBase", "Tensor"):
        return f"Tensor.{name}"
    if head == "_VariableFunctionsClass":
        return f"torch.{name}"
    module = getattr(func, "__module__", None) or "torch"
    module = _PUBLIC_MODULE.get(module, module)
    return f"{module}.{qual}"


class _FunctionWatcher(TorchFunctionMode):
    """Remembers which torch function the student called, to name it when it runs a forbidden op."""

    def __init__(self):
        super().__init__()
        self.current = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if _LaunchState.depth:
            return func(*args, **(kwargs or {}))
        self.current = func  # the mode is off inside this call, so nested torch calls do not land here
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.current = None


class _OpWatcher(TorchDispatchMode):
    def __init__(self, functions: _FunctionWatcher, also_allowed: tuple[str, ...] = ()):
        super().__init__()
        self.functions = functions
        self.also_allowed = frozenset(also_allowed)
        self.forbidden: list[str] = []
        self.host_reads: list[str] = []  # a tensor's value read by Python: .item(), int(t), bool(t)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _LaunchState.depth == 0 and func not in ALLOWED_OPS and str(func) not in self.also_allowed:
            caller = self.functions.current
            what = f"{torch_name(caller)} ({func})" if caller is not None else str(func)
            seen = self.host_reads if func is _aten._local_scalar_dense.default else self.forbidden
            if what not in seen:
                seen.append(what)
        return func(*args, **(kwargs or {}))


# PyTorch wraps a mode's __torch_dispatch__ so that dynamo never traces it, and that wrapper imports
# torch._dynamo on its first call: a second of every grading process. Nothing watched here is compiled,
# so the wrapper may call the method directly (if a later PyTorch drops the wrapper, this does nothing).
_raw_dispatch = getattr(_OpWatcher.__dict__["__torch_dispatch__"], "__wrapped__", None)
if _raw_dispatch is not None:
    _raw_dispatch.__dynamo_disable = _raw_dispatch


@dataclass
class Watched:
    forbidden_ops: list[str]
    triton_launches: int
    cuda_kernels: list[str] = field(default_factory=list)
    cupy_launches: int = 0
    side_streams: int = 0
    stream_snapshot: tuple | None = None
    course_kernels: list[str] = field(default_factory=list)
    host_reads: list[str] = field(default_factory=list)


@contextmanager
def watch(profile_cuda: bool = False, snapshot=None, allowed_ops: tuple[str, ...] = ()):
    """Record the PyTorch ops and kernel launches of the code inside the block (`allowed_ops`: op
    names, such as "aten.mm.default", not recorded as forbidden on top of `ALLOWED_OPS`).

    On a GPU, `snapshot` (the output buffer, or a tuple of them) is copied on the stream that was
    current when the block started, *before* the device is synchronized: the copies show what a caller
    reading the outputs in stream order would see (`record.stream_snapshot`, a tuple).
    """
    _install_launch_hooks()
    before, before_cupy = _LaunchState.launches, _LaunchState.cupy_launches
    functions = _FunctionWatcher()
    watcher = _OpWatcher(functions, allowed_ops)
    record = Watched([], 0)
    prof = None
    if profile_cuda:
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
        with warnings.catch_warnings():  # "Profiler clears events at the end of each cycle": not the student's
            warnings.simplefilter("ignore", UserWarning)
            prof.__enter__()
    grader = torch.cuda.current_stream() if runtime.ON_GPU else None
    _LaunchState.grader_stream, _LaunchState.delay_side_streams, _LaunchState.side_streams = grader, True, []
    _LaunchState.course_kernels = []
    try:
        with functions, watcher:
            yield record
    finally:
        record.side_streams = len(_LaunchState.side_streams)
        record.course_kernels, _LaunchState.course_kernels = _LaunchState.course_kernels, []
        _LaunchState.grader_stream, _LaunchState.side_streams = None, []
        record.forbidden_ops, record.host_reads = watcher.forbidden, watcher.host_reads
        record.triton_launches = _LaunchState.launches - before
        record.cupy_launches = _LaunchState.cupy_launches - before_cupy
        failure = None
        if runtime.ON_GPU:
            try:
                if snapshot is not None:
                    with torch.cuda.stream(grader):
                        record.stream_snapshot = tuple(t.clone() for t in (
                            (snapshot,) if isinstance(snapshot, torch.Tensor) else snapshot))
                torch.cuda.synchronize()  # every stream: what the call left running is finished now
            except Exception as exc:  # noqa: BLE001 - e.g. an illegal memory access surfaces here
                failure = exc
        if prof is not None and failure is None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                prof.__exit__(None, None, None)
                record.cuda_kernels = sorted({e.name for e in prof.events()
                                              if e.device_type == torch.autograd.DeviceType.CUDA})
        if failure is not None:
            raise failure


def _is_torch_kernel(name: str) -> bool:
    return "at::native" in name or name.startswith(("void at::", "at::", "Memset", "Memcpy"))


@contextmanager
def _joined_side_streams():
    """For timing: kernels launched on side streams wait for the current stream, and the current stream
    waits for them at the end, so an end event recorded after the block covers all of the call's work."""
    grader = torch.cuda.current_stream()
    _LaunchState.grader_stream, _LaunchState.delay_side_streams, _LaunchState.side_streams = grader, False, []
    try:
        yield
    finally:
        for stream in _LaunchState.side_streams:
            grader.wait_stream(stream)
        _LaunchState.grader_stream, _LaunchState.side_streams = None, []


# --------------------------------------------------------------------------------------------------
# Results


@dataclass
class CaseResult:
    case: str
    ok: bool
    reason: str = ""
    comparison: dict | None = None
    detail: dict | None = None  # for failures: the inputs and the worst elements (`--explain`)


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
    floor_us: float | None = None
    rounds: int | None = None  # timed repetitions, each with new inputs and its output checked
    wrong_rounds: int | None = None
    side_streams: int = 0  # side streams the student's function launched on (joined before timing ends)


@dataclass
class FunctionResult:
    name: str
    backend: str
    description: str
    status: str  # "pass" | "fail" | "not implemented" | "needs a GPU" | "missing" | "error"
    points: int
    max_points: int
    message: str = ""
    cases: list[CaseResult] = field(default_factory=list)
    perf: list[PerfResult] = field(default_factory=list)
    seed: int | None = None
    extra_credit: bool = False

    @property
    def tier(self) -> str | None:
        tiers = [p.tier for p in self.perf if p.tier]
        return max(tiers) if tiers else None  # the worst letter: "F" > "D" > ... > "A"

    def as_dict(self) -> dict:
        d = asdict(self)
        d["tier"] = self.tier
        return d


def error_result(spec: GradedFunction, seed: int, status: str, message: str) -> dict:
    """The report entry of a function that could not be checked (status "error", "needs a GPU", ...)."""
    return FunctionResult(spec.name, spec.backend, spec.description, status, 0, spec.points, message, seed=seed,
                          extra_credit=spec.extra_credit).as_dict()


# --------------------------------------------------------------------------------------------------
# Explaining a failure


def _short_exception(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    # Where in the student's code (the graded module is student_<lab>.py), else the innermost frame.
    mine = [f for f in frames if f.filename.rsplit("/", 1)[-1].startswith("student_")]
    frames = mine or frames
    where = f" (at {frames[-1].name}, line {frames[-1].lineno})" if frames else ""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}{where}".strip()


def _gib(value: float | None) -> str:
    return "" if value is None else f" (a lab may use {value:.1f} GiB)"


def _is_host_oom(exc: BaseException) -> bool:
    text = str(exc)
    return isinstance(exc, MemoryError) or "can't allocate memory" in text or "DefaultCPUAllocator" in text


def _is_gpu_oom(exc: BaseException) -> bool:
    # torch.OutOfMemoryError ("CUDA out of memory"), cupy.cuda.memory.OutOfMemoryError
    return "OutOfMemoryError" in type(exc).__name__ or "out of memory" in str(exc).lower()


def _describe_exception(exc: BaseException) -> str:
    if _is_host_oom(exc):
        return f"ran out of host memory{_gib(Limits.host_memory_gib)}: {_short_exception(exc)}"
    if _is_gpu_oom(exc):
        return f"ran out of GPU memory{_gib(Limits.gpu_memory_gib)}: {_short_exception(exc)}"
    return _short_exception(exc)


def _check_context(label: str, exc: BaseException) -> None:
    """On a GPU, after an exception: raise ContextLost if the CUDA context no longer works.

    Running out of memory does not corrupt the context (and the failed call's tensors may still be
    alive, held by the traceback, so a probe could run out of memory itself): it is never a loss."""
    if not runtime.ON_GPU or _is_gpu_oom(exc) or _is_host_oom(exc):
        return
    try:
        torch.cuda.synchronize()
        torch.ones(1, device="cuda").add_(1).item()
    except Exception as probe:  # noqa: BLE001 - any failure but memory means the context is gone
        if _is_gpu_oom(probe):
            return
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        hint = " (an out-of-bounds read or write?)" if "illegal" in text or "address" in text else ""
        raise ContextLost(f"{label}: {text}{hint}; the CUDA context is lost") from exc


def _size_context(case: Case) -> str:
    if len(case.shape) > 2:  # a problem shape (attention's B x Hq x Hkv x Nq x Nk x D): its product means nothing
        return "shape " + "x".join(map(str, case.shape))
    n = 1
    for s in case.shape:
        n *= s
    return f"n={n}"


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def _bad_mask(result: torch.Tensor, want: torch.Tensor, atol: float, rtol: float, scale) -> torch.Tensor:
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
    bad = _bad_mask(result, want, atol, rtol, scale)
    got = result.detach().flatten()
    bad_idx = torch.nonzero(bad).flatten()
    k = int(bad_idx[0])
    nan_bad = int(torch.isnan(got[bad]).sum())
    if cmp.n_bad == numel and nan_bad == numel:
        return "no element was written (every one is still the NaN the grader put in out)"
    if k > 0 and bad_idx.numel() == numel - k:  # everything from index k on, nothing before
        never = " (never written)" if nan_bad == numel - k else ""
        if k % 16 == 0:  # k is where a block (of 16, 32, ... elements) begins
            return (f"wrong for n not a multiple of the block size (n={numel}, first bad index {k}): the last "
                    f"{numel - k} elements are wrong{never}; mask the loads and stores of the last block")
        return f"wrong from index {k} to the end (n={numel}): the last {numel - k} elements are wrong{never}"
    if nan_bad == cmp.n_bad:
        return f"{nan_bad} elements were never written (still NaN); does every element get a thread?"
    dtype = result.dtype if result.dtype in ULP else case.dtype  # an output may differ (attention's float32 lse)
    if cmp.n_nan == 0 and cmp.n_inf == 0 and dtype in ULP and cmp.max_rel_err < 0.05:
        ulps = cmp.max_rel_err / ULP[dtype]
        allowed = rtol / ULP[dtype]
        return (f"rounding error up to {ulps:.0f} ulp of {str(dtype).removeprefix('torch.')} where "
                f"{allowed:g} is allowed: is it computed in a lower precision? (compute in float32, round once)")
    return ""


def _references(spec: GradedFunction, inputs, kw: dict) -> tuple[tuple, tuple]:
    """The float64 reference of each output and the scale its tolerance is relative to (None: |want|)."""
    wants = _as_tuple(spec.reference_fp64(*inputs, **kw), spec.n_outputs)
    scales = _as_tuple(spec.scale(*inputs, **kw), spec.n_outputs) if spec.scale else (None,) * spec.n_outputs
    return wants, scales


def _lab_diagnosis(spec: GradedFunction, case: Case, inputs, oname: str, result, want, atol: float, rtol: float,
                   scale) -> str:
    """The lab's own reading of the wrong elements (`GradedFunction.diagnose`), or ""."""
    if spec.diagnose is None or tuple(result.shape) != tuple(want.shape):
        return ""
    bad = _bad_mask(result, want, atol, rtol, scale).view(want.shape)
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


def _detail(spec: GradedFunction, case: Case, inputs, seed: int, trial: int, result=None, want=None,
            atol: float = 0.0, rtol: float = 0.0, scale=None, worst: int = 5) -> dict:
    """The failing check's inputs and its worst elements, for the report and `--explain`."""
    names = input_names(spec, len(inputs))
    detail = {"case": case.label, "seed": seed, "trial": trial + 1,
              "inputs": [{"name": n, "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."),
                          "stride": list(t.stride())} for n, t in zip(names, inputs)],
              "worst": [], "first_bad": []}
    if result is None or want is None or tuple(result.shape) != tuple(want.shape) or not want.numel():
        return detail
    from kernels.testing import _unravel

    w = want.detach().to(torch.float64).flatten()
    g = result.detach().to(w.device, torch.float64).flatten()
    err = (g - w).abs()
    err = torch.where(torch.isnan(err), torch.full_like(err, float("inf")), err)
    same_shape = [(n, t) for n, t in zip(names, inputs) if tuple(t.shape) == tuple(result.shape)]

    def row(i: int) -> dict:
        return {"index": _unravel(i, want.shape), "expected": float(w[i]), "actual": float(g[i]),
                "inputs": {n: _value(t, i) for n, t in same_shape}}

    top = torch.topk(err, min(worst, err.numel())).indices.tolist()
    detail["worst"] = [row(i) for i in top]
    bad = torch.nonzero(_bad_mask(result, want, atol, rtol, scale)).flatten()[:3].tolist()
    detail["first_bad"] = [row(i) for i in bad]
    return detail


# --------------------------------------------------------------------------------------------------
# Correctness


def _make_inputs(spec: GradedFunction, case: Case, gen, device=None) -> tuple:
    inputs = spec.make_inputs(case.shape, case.dtype, device or runtime.DEVICE, gen)
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


def _as_tuple(value, n: int) -> tuple:
    """A function's (or reference's) outputs as an n-tuple; None if it did not return n of them."""
    if n == 1:
        return (value,)
    if isinstance(value, (tuple, list)) and len(value) == n:
        return tuple(value)
    return None


def _new_outputs(spec: GradedFunction, case: Case, device=None) -> tuple:
    shapes = (spec.output_shapes(case.shape, case.dtype) if spec.output_shapes is not None
              else ((case.shape, case.dtype),) * spec.n_outputs)
    return tuple(torch.empty(shape, dtype=dtype, device=device or runtime.DEVICE) for shape, dtype in shapes)


def _out_argument(outs: tuple):
    return outs[0] if len(outs) == 1 else outs


def _trial(fn, spec: GradedFunction, case: Case, inputs, outs: tuple, *, seed: int, trial: int,
           previous: tuple | None, profile: bool) -> CaseResult:
    label = case.label
    kw = case.kwargs
    again = "" if trial == 0 else "called again with new values in the same input buffers: "
    names, onames = input_names(spec, len(inputs)), output_names(spec)
    originals = tuple(t.clone() for t in inputs)
    for out in outs:
        poison_(out)

    def fail(reason: str, cmp=None, detail=None) -> CaseResult:
        return CaseResult(label, False, again + reason, cmp,
                          detail or _detail(spec, case, inputs, seed, trial))

    budget = spec.memory_budget(*inputs, **kw) if spec.memory_budget is not None and runtime.ON_GPU else None
    if budget is not None:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        allocated_before = torch.cuda.memory_allocated()
    try:
        with watch(profile_cuda=profile, snapshot=outs, allowed_ops=spec.allowed_ops) as seen:
            returned = fn(*inputs, **kw, out=_out_argument(outs))
    except NotImplementedError:
        raise
    except SystemExit as exc:
        return fail(f"called sys.exit({exc.code!r}): a graded function must return its result")
    except (ValueError, TypeError) as exc:
        _check_context(label, exc)
        if case.layout == "strided" and trial == 0:  # a non-contiguous view: rejecting it is fine
            return CaseResult(label, True, f"rejected clearly: {exc}")
        return fail(_short_exception(exc))
    except Exception as exc:  # noqa: BLE001 - a student's code may raise anything; report it
        _check_context(label, exc)
        return fail(_describe_exception(exc))
    if seen.host_reads:
        return fail(f"reads a tensor's value on the host inside the call ({', '.join(seen.host_reads[:3])}): a host "
                    f"synchronization, which stalls the GPU's queue and cannot be captured in a CUDA graph; keep "
                    f"counts and sizes on the device")
    if seen.forbidden_ops:
        return fail("computes with PyTorch instead of its own kernel: " + ", ".join(seen.forbidden_ops[:3]))
    if spec.own_kernels_only and seen.course_kernels:
        return fail(_COURSE_KERNEL + ", ".join(seen.course_kernels[:3]))
    if budget is not None:
        # the watcher's output snapshot (one copy of the outputs) is not the function's
        extra = (torch.cuda.max_memory_allocated() - allocated_before
                 - sum(out.numel() * out.element_size() for out in outs))
        if extra > budget:
            return fail(f"{_size_context(case)}: allocated {extra / 2**20:.1f} MiB of device memory beyond its "
                        f"inputs and outputs at its peak; the budget is {budget / 2**20:.1f} MiB (does it "
                        f"materialize an intermediate it should stream through on-chip memory?)")
    results = _as_tuple(returned, spec.n_outputs)
    if results is None or not all(isinstance(r, torch.Tensor) for r in results):
        expected = "the output tensor" if spec.n_outputs == 1 else f"a tuple of {spec.n_outputs} tensors " \
                                                                  f"({', '.join(onames)})"
        return fail(f"returned {type(returned).__name__}, expected {expected}")
    for oname, result, out in zip(onames, results, outs):
        if out.numel() and result.data_ptr() != out.data_ptr():
            mine = [n for n, t in zip(names, inputs) if t.numel() and t.data_ptr() == result.data_ptr()]
            what = f"its input {mine[0]}" if mine else "another tensor"
            where = "out" if spec.n_outputs == 1 else f"out ({oname})"
            return fail(f"given out=, it must write into {where} and return it (it returned {what})")
    for name, now, before in zip(names, inputs, originals):
        if not _same_bits(now, before):
            return fail(f"modified its input {name} (inputs must be left as they were)")
    for oname, snap, out in zip(onames, seen.stream_snapshot or (), outs):
        if out.numel() and not _same_bits(snap, out):
            return fail(("" if spec.n_outputs == 1 else f"{oname}: ") + "the output was not ready on PyTorch's "
                        "current stream when the function returned: work on a side stream without "
                        "synchronizing? (torch.cuda.current_stream().wait_stream(side))")
    atol, rtol = spec.tolerance(case.dtype)
    wants, scales = _references(spec, inputs, kw)
    exacts = (_as_tuple(spec.bit_exact(*inputs, **kw), spec.n_outputs)
              if spec.bit_exact is not None and case.dtype in spec.exact_dtypes else (None,) * spec.n_outputs)
    comparisons = []
    for i, (oname, result, want, scale, exact) in enumerate(zip(onames, results, wants, scales, exacts)):
        prefix = "" if spec.n_outputs == 1 else f"{oname}: "
        cmp = compare(result, want, atol=atol, rtol=rtol, scale=scale)
        comparisons.append(cmp)

        def detail(result=result, want=want, scale=scale, oname=oname):
            d = _detail(spec, case, inputs, seed, trial, result, want, atol, rtol, scale)
            if spec.n_outputs > 1:
                d["output"] = oname
            return d

        if not cmp.ok:
            if previous is not None and _same_bits(result, previous[i]):
                return fail(f"{prefix}returned the previous call's result for new inputs: does it cache outputs "
                            f"between calls? ({_size_context(case)}: {cmp.reason})", cmp.as_dict(), detail())
            why = (_lab_diagnosis(spec, case, inputs, oname, result, want, atol, rtol, scale)
                   or diagnose(case, result, want, cmp, atol, rtol, scale))
            return fail(f"{prefix}{_size_context(case)}: {cmp.reason}" + (f"; {why}" if why else ""),
                        cmp.as_dict(), detail())
        if exact is not None:
            differ = (result.reshape(-1) != exact.reshape(-1)).nonzero()
            if differ.numel():
                j = int(differ[0])
                return fail(f"{prefix}{_size_context(case)}: not bit-identical to PyTorch: {differ.numel()} elements "
                            f"differ, first at {j} (PyTorch {exact.reshape(-1)[j].item():.9g}, "
                            f"yours {result.reshape(-1)[j].item():.9g})", cmp.as_dict(), detail())
    # Right answer, but from where? A graded function must compute with its own kernel.
    if spec.backend == "triton" and case.shape and min(case.shape) > 0 and seen.triton_launches == 0:
        return fail("launched no Triton kernel")
    if seen.cuda_kernels and all(_is_torch_kernel(k) for k in seen.cuda_kernels):
        return fail("launched only PyTorch kernels: " + ", ".join(seen.cuda_kernels[:3]))
    # The report keeps the comparison of the output that came closest to failing.
    worst = max(comparisons, key=lambda c: c.max_rel_err if c.numel else 0.0)
    return CaseResult(label, True, "", worst.as_dict())


_COURSE_KERNEL = "launches the course's kernel instead of its own (write the kernel in the notebook): "


def _run_case(fn, spec: GradedFunction, case: Case, seed: int, profile: bool = False) -> CaseResult:
    gen = generator(seed, runtime.DEVICE)
    inputs = _make_inputs(spec, case, gen)
    outs = _new_outputs(spec, case)
    previous = None
    for trial in range(max(1, spec.trials)):
        if trial:  # new values, same buffers: nothing about the call but the values changes
            for t, fresh in zip(inputs, _make_inputs(spec, case, gen)):
                t.copy_(fresh)
        result = _trial(fn, spec, case, inputs, outs, seed=seed, trial=trial, previous=previous,
                        profile=profile and trial == 0)
        if not result.ok or result.reason.startswith("rejected clearly"):
            return result
        previous = tuple(out.clone() for out in outs)
    return result


def _allocating_call(fn, spec: GradedFunction, seed: int) -> CaseResult | None:
    """Called without out=, the function must allocate and return a correct result (None if it does)."""
    plain = [c for c in spec.cases if c.layout == "contiguous" and min(c.shape) > 1]
    case = next((c for c in plain if not c.params), plain[0])
    kw = case.kwargs
    label = "without out="
    inputs = _make_inputs(spec, case, generator(seed, runtime.DEVICE))
    # Poison the allocator: the next blocks of this size it hands out hold NaN, so a result that is an
    # unwritten torch.empty cannot pass by luck.
    junk = [poison_(out) for _ in range(4) for out in _new_outputs(spec, case)]
    del junk
    try:
        with watch(allowed_ops=spec.allowed_ops) as seen:
            returned = fn(*inputs, **kw)
    except SystemExit as exc:
        return CaseResult(label, False, f"called without out=: called sys.exit({exc.code!r})")
    except Exception as exc:  # noqa: BLE001
        _check_context(label, exc)
        return CaseResult(label, False, f"called without out=: {_describe_exception(exc)}")
    if seen.forbidden_ops:
        return CaseResult(label, False, "called without out=: computes with PyTorch instead of its own kernel: "
                          + ", ".join(seen.forbidden_ops[:3]))
    results = _as_tuple(returned, spec.n_outputs)
    if results is None:
        return CaseResult(label, False, f"called without out=: returned {type(returned).__name__}, expected "
                          f"{spec.n_outputs} tensors")
    atol, rtol = spec.tolerance(case.dtype)
    wants, scales = _references(spec, inputs, kw)
    for oname, result, want, scale in zip(output_names(spec), results, wants, scales):
        prefix = "" if spec.n_outputs == 1 else f"{oname}: "
        if isinstance(result, torch.Tensor) and any(t.data_ptr() == result.data_ptr() for t in inputs):
            return CaseResult(label, False, f"called without out=: {prefix}returned one of its inputs")
        cmp = compare(result, want, atol=atol, rtol=rtol, scale=scale)
        if not cmp.ok:
            return CaseResult(label, False, f"called without out=: {prefix}{_size_context(case)}: {cmp.reason}",
                              cmp.as_dict(), _detail(spec, case, inputs, seed, 0,
                                                     result if isinstance(result, torch.Tensor) else None,
                                                     want, atol, rtol, scale))
    return None


GRAPH_NOT_CHECKED = "CUDA-graph capture not checked: needs a GPU"
GRAPH_SYNC_HINT = ("does it synchronize with the host inside the call: .item(), .cpu(), .tolist(), int(tensor), "
                   "a grid or a buffer sized from a tensor's value? Size buffers by the data-independent bound")


def _graph_capture(fn, spec: GradedFunction, case: Case, seed: int) -> CaseResult | None:
    """GPU: the call captured in a CUDA graph, then the graph replayed on new input values and checked
    (None if both work). A host synchronization inside the call (`.item()`) makes the capture fail; a
    graph that replays what the host decided during capture gives wrong results for the new values."""
    label = f"CUDA graph {case.label}"
    kw = case.kwargs
    gen = generator(seed, runtime.DEVICE)
    inputs = _make_inputs(spec, case, gen)
    outs = _new_outputs(spec, case)
    warm_up = torch.cuda.Stream()  # compiling and autotuning happen here, outside the capture
    warm_up.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.stream(warm_up):
            fn(*inputs, **kw, out=_out_argument(outs))
        torch.cuda.current_stream().wait_stream(warm_up)
        with torch.cuda.graph(graph):
            fn(*inputs, **kw, out=_out_argument(outs))
    except Exception as exc:  # noqa: BLE001 - a capture fails with whatever the forbidden call raises
        _check_context(label, exc)
        return CaseResult(label, False, f"could not be captured in a CUDA graph ({_short_exception(exc)}): "
                          f"{GRAPH_SYNC_HINT}")
    for t, fresh in zip(inputs, _make_inputs(spec, case, gen)):
        t.copy_(fresh)
    for out in outs:
        poison_(out)
    graph.replay()
    torch.cuda.synchronize()
    atol, rtol = spec.tolerance(case.dtype)
    wants, scales = _references(spec, inputs, kw)
    for oname, out, want, scale in zip(output_names(spec), outs, wants, scales):
        cmp = compare(out, want, atol=atol, rtol=rtol, scale=scale)
        if not cmp.ok:
            prefix = "" if spec.n_outputs == 1 else f"{oname}: "
            return CaseResult(label, False, f"{prefix}the CUDA graph replayed on new inputs is wrong ({cmp.reason}): "
                              f"does the call depend on values the host read while it was captured?", cmp.as_dict())
    return None


# --------------------------------------------------------------------------------------------------
# Performance (GPU only)

PERF_WARMUP_ROUNDS = 3
PERF_TARGET_MS = 200.0
PERF_MAX_ROUNDS = 100


def timed_rounds(calls: dict[str, Callable[[], object]], before_round: Callable[[], None],
                 after_round: Callable[[], torch.Tensor]) -> tuple[dict[str, bench.Timing], list[int]]:
    """`kernels.bench.benchmark` (interleaved, rotated order, L2 flushed, a spin ahead of each start
    event, device events) with every call made with side streams joined, `before_round()` before each
    round (new input values, a freshly poisoned output) and `after_round()` after each timed round,
    returning a device tensor (the number of wrong output elements) that is read only at the end, so
    checking never stalls the queue. Returns the timings and each timed round's count."""
    def joined(call):
        def run():
            with _joined_side_streams():
                call()
        return run

    wrong = []
    timings = bench.benchmark({name: joined(call) for name, call in calls.items()}, warmup=PERF_WARMUP_ROUNDS,
                              target_ms=PERF_TARGET_MS, max_reps=PERF_MAX_ROUNDS, before_round=before_round,
                              after_round=lambda: wrong.append(after_round()))
    return timings, [int(w) for w in torch.stack(wrong).tolist()]


def _measure(fn, spec: GradedFunction, config, seed: int, expected_rows: dict | None) -> PerfResult:
    from grading import expected as expected_table

    gen = generator(seed, "cuda")
    case = Case(config.shape, config.dtype, params=config.params)
    kw = case.kwargs
    inputs = _make_inputs(spec, case, gen, "cuda")
    outs = {name: _new_outputs(spec, case, "cuda") for name in ("student", "reference", "torch")}
    atol, rtol = spec.tolerance(config.dtype)
    side = {"streams": 0}

    def student():
        fn(*inputs, **kw, out=_out_argument(outs["student"]))
        side["streams"] = max(side["streams"], len(_LaunchState.side_streams))

    def new_inputs():
        for t, fresh in zip(inputs, _make_inputs(spec, case, gen, "cuda")):
            t.copy_(fresh)
        for out in outs["student"]:
            poison_(out)

    def count_wrong():
        wants, scales = _references(spec, inputs, kw)
        return sum(_bad_mask(out, want, atol, rtol, scale).sum()
                   for out, want, scale in zip(outs["student"], wants, scales))

    timings, wrong = timed_rounds({
        "student": student,
        "reference": lambda: spec.course_kernel(*inputs, **kw, out=_out_argument(outs["reference"])),
        "torch": lambda: spec.torch_native(*inputs, **kw, out=_out_argument(outs["torch"])),
    }, new_inputs, count_wrong)
    student_t = timings["student"]
    nbytes = spec.bytes_moved(*inputs, **kw)
    flops = spec.flops(*inputs, **kw) if spec.flops else 0.0
    floor = bench.floor_us(nbytes=nbytes, flops=flops)
    bad_rounds = [i for i, w in enumerate(wrong) if w]
    result = PerfResult(
        config=config.id,
        student_us=student_t.median_us,
        reference_us=timings["reference"].median_us,
        torch_us=timings["torch"].median_us,
        spread_us=list(student_t.spread_us),
        ratio_to_reference=bench.ratio(timings["reference"], student_t),
        ratio_to_torch=bench.ratio(timings["torch"], student_t),
        gbps=student_t.gbps(nbytes),
        nbytes=nbytes,
        percent_of_floor=100 * floor / student_t.median_us if floor else None,
        correct=not bad_rounds,
        expected=expected_table.row(expected_rows, config.id),
        floor_us=floor,
        rounds=len(wrong),
        wrong_rounds=len(bad_rounds),
        side_streams=side["streams"],
    )
    if bad_rounds:
        result.note = (f"output wrong in {len(bad_rounds)} of {len(wrong)} timed repetitions (first: repetition "
                       f"{bad_rounds[0] + 1}; inputs change before every repetition): not credited -- does it "
                       f"cache results between calls?")
        result.tier = "F"
    elif floor and student_t.median_us < 0.9 * floor:
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
    result = FunctionResult(spec.name, spec.backend, spec.description, "fail", 0, spec.points, seed=seed,
                            extra_credit=spec.extra_credit)
    if fn is None:
        result.status, result.message = "missing", f"no function named {name} was defined"
        return result
    if not callable(fn):
        result.message = f"{name} is a {type(fn).__name__}, not a function"
        return result
    if spec.backend == "cupy" and not runtime.cupy_status()[0]:
        result.status, result.message = "needs a GPU", runtime.cupy_status()[1]
        return result
    # On a GPU, profile the largest case to see which kernels ran (one profile: it is slow to start).
    plain = [c for c in spec.cases if c.layout == "contiguous"]
    profiled = max([c for c in plain if not c.params] or plain, key=lambda c: torch.Size(c.shape).numel())
    try:
        for i, case in enumerate(spec.cases):
            _step(name, f"case {case.label}")
            outcome = _run_case(fn, spec, case, seed + i, profile=runtime.ON_GPU and case == profiled)
            result.cases.append(outcome)
            if not outcome.ok and "ran out of" in outcome.reason:
                if runtime.ON_GPU:
                    torch.cuda.empty_cache()  # give back what the failed case's allocations reserved
                break  # every other case would allocate the same way: one is enough
    except NotImplementedError:
        result.status, result.message, result.cases = "not implemented", "not implemented yet", []
        return result
    failures = [c for c in result.cases if not c.ok]
    if not failures:
        _step(name, "case without out=")
        problem = _allocating_call(fn, spec, seed)
        if problem is None and spec.graph_capture and runtime.ON_GPU:
            _step(name, "CUDA graph capture")
            problem = _graph_capture(fn, spec, profiled, seed)
        if problem is not None:
            failures = [problem]
            result.cases.append(problem)
    if failures:
        result.message = f"{len(failures)} of {len(result.cases)} cases fail; first: {failures[0].case}: " \
                         f"{failures[0].reason}"
        if spec.hint and failures[0].comparison is not None:  # the hint is about wrong values
            result.message += f" (hint: {spec.hint})"
        return result
    result.status, result.points = "pass", spec.points
    if spec.graph_capture and not runtime.ON_GPU:
        result.message = GRAPH_NOT_CHECKED
    if runtime.ON_GPU and (perf is None or perf):  # no timing without a GPU, whatever was asked
        rows = expected_table.load(lab.id)
        for config in spec.perf:
            _step(name, f"performance {config.id}", "perf")
            result.perf.append(_measure(fn, spec, config, seed, rows))
    return result
