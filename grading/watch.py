"""Watching a graded call: which PyTorch ops it ran (named by the torch function that issued them),
how many kernels it launched, which of them are the course's, and on which streams.

`install_launch_hooks` wraps Triton's launch (compiled and interpreted) and `kernels.cuda.launch`
once per process; the hooks write into the `LaunchState` of the `watch` block in force (`ACTIVE`),
so what happens inside a launch (the interpreter's own copies) is not the student's PyTorch.
"""
from __future__ import annotations

import contextlib
import functools
import os
import re
import sys
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from kernels import runtime

_aten = torch.ops.aten
# Ops that allocate, describe or move memory without computing: a wrapper may use these freely.
ALLOWED_OPS = frozenset({
    _aten.empty.memory_format, _aten.empty_like.default, _aten.empty_strided.default,
    _aten.new_empty.default, _aten.zeros.default, _aten.zeros_like.default, _aten.fill_.Scalar,
    _aten.zero_.default, _aten.view.default, _aten._unsafe_view.default, _aten.reshape.default,
    _aten._reshape_alias.default, _aten.as_strided.default, _aten.alias.default,
    _aten.detach.default, _aten.t.default, _aten.transpose.int, _aten.permute.default,
    _aten.unsqueeze.default, _aten.squeeze.dim, _aten.squeeze.default, _aten.expand.default,
    _aten.slice.Tensor, _aten.select.int, _aten.flatten.using_ints, _aten.clone.default,
    _aten.copy_.default, _aten._to_copy.default, _aten.lift_fresh.default,
    _aten.is_same_size.default, _aten.sym_size.int, _aten.sym_stride.int, _aten.sym_numel.default,
    _aten.sym_storage_offset.default,
})
# Everything else is forbidden outside the student's own kernel launches -- in particular the
# PyTorch references of the labs: torch.add (lab 01), F.rms_norm (02),
# F.scaled_dot_product_attention (03), torch._grouped_mm and torch.matmul (06).
# tests/test_grader_harness.py proves each is caught.

# GPU clock cycles a launch on a side stream is held back during correctness checks (~50 ms): a
# function that does not make PyTorch's stream wait for its side stream then loses the race every
# time. (10 ms was not enough on an H200: a first call's host work after the launch, such as loading
# the copy kernel the output snapshot uses, outlasted it, and the first case passed by luck.)
SIDE_STREAM_DELAY_CYCLES = 100_000_000


@dataclass
class LaunchState:
    """What the launch hooks saw inside one `watch` (or `joined_side_streams`) block."""

    grader_stream: object = None  # PyTorch's current stream when the call started (GPU), else None
    delay_side_streams: bool = False
    depth: int = 0  # > 0 inside a launch
    launches: int = 0  # Triton launches (compiled and interpreted)
    cupy_launches: int = 0  # launches through kernels.cuda.launch
    side_streams: list = field(default_factory=list)
    course_kernels: list = field(default_factory=list)  # the course's kernels launched, by name
    profiling: bool = False  # the all-threads profiler is on: launches are marked


IDLE = LaunchState()  # launches outside any watch land here and are never read
ACTIVE = IDLE


@contextmanager
def _launch_state(state: LaunchState):
    global ACTIVE
    before, ACTIVE = ACTIVE, state
    try:
        yield state
    finally:
        ACTIVE = before


def _on_side_stream() -> bool:
    grader = ACTIVE.grader_stream
    return grader is not None and torch.cuda.current_stream() != grader


def _before_launch(state: LaunchState) -> None:
    """Called before every kernel launch: note (and, in correctness checks, delay) a side stream."""
    grader = state.grader_stream
    if grader is None:
        return
    stream = torch.cuda.current_stream()
    if stream == grader:
        return
    if all(stream != s for s in state.side_streams):
        state.side_streams.append(stream)
    stream.wait_stream(grader)  # side work cannot start before what the grader queued (poison, ...)
    if state.delay_side_streams:
        torch.cuda._sleep(SIDE_STREAM_DELAY_CYCLES)  # queued on the side stream, before the kernel


# --------------------------------------------------------------------------------------------------
# Every thread: PyTorch's own profiler (Kineto, CPU activity, all threads) records the aten ops of
# the call wherever they run -- another thread, a thread pool, under a disabled dispatch mode --
# which the dispatch modes below, being thread-local, cannot see. Launches are marked as ranges, so
# what the interpreter does inside one is not the student's.

LAUNCH_RANGE, CALL_RANGE = "grading::launch", "grading::call"
_PROFILER_OPS = ("set_.source_Storage", "set_.source_Storage_storage_offset")  # inside launches


def _record_function(name: str):
    return torch.ops.profiler._record_function_enter_new(name, None)


def _launch_mark():
    return _record_function(LAUNCH_RANGE) if ACTIVE.profiling else None


def _end_launch_mark(mark) -> None:
    if mark is not None:
        torch.ops.profiler._record_function_exit._RecordFunction(mark)


@contextmanager
def quiet_stderr():
    """Kineto announces every start and stop on the process's stderr (C++): not the
    student's output, so it goes to /dev/null while the profiler starts or stops."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class _AllThreads:
    """The aten ops of the block from every thread, outside the course's and the student's
    kernel launches, that are leaves (not composites such as aten::to, whose parts are seen)."""

    def __init__(self):
        from torch._C._profiler import _ExperimentalConfig
        from torch.autograd import ProfilerConfig, ProfilerState

        self.config = ProfilerConfig(ProfilerState.KINETO, False, False, False, False, False,
                                     _ExperimentalConfig(profile_all_threads=True,
                                                         capture_overload_names=True))
        self.events = []
        self.mark = None

    def __enter__(self):
        from torch.autograd import ProfilerActivity, _enable_profiler, _prepare_profiler

        with quiet_stderr():
            _prepare_profiler(self.config, {ProfilerActivity.CPU})
            _enable_profiler(self.config, {ProfilerActivity.CPU})
        self.mark = _record_function(CALL_RANGE)
        return self

    def __exit__(self, *exc):
        from torch.autograd import _disable_profiler

        try:
            torch.ops.profiler._record_function_exit._RecordFunction(self.mark)
            with quiet_stderr():
                self.events = list(_disable_profiler().events())
        except RuntimeError:  # the student's code stopped it ("not running"): no events, no range
            self.events = []

    def findings(self, allowed: set[str]) -> tuple[list[str], list[str]] | None:
        """(forbidden ops, host reads), None if the profiler was stopped inside the call.
        Skipped: ops inside a launch, allowed ops and what runs inside them, and composites
        (`aten::to`, `aten::rms_norm`: their parts are recorded, and judged, on their own)."""
        if not any(e.name() == CALL_RANGE for e in self.events):
            return None
        excused: dict[int, list] = {}  # per thread: launches and allowed ops, as (start, end)
        computing: dict[int, list] = {}  # per thread: the spans of ops not allowed
        candidates, composites = [], []
        for e in self.events:
            name = e.name()
            if name != LAUNCH_RANGE and not name.startswith("aten::"):
                continue
            op = f"aten.{name[6:]}.{e.overload_name() or 'default'}"
            thread, span = e.start_thread_id(), (e.start_ns(), e.end_ns())
            if name == LAUNCH_RANGE or op in allowed:
                excused.setdefault(thread, []).append(span)
                continue
            computing.setdefault(thread, []).append(span)
            kind = composites if _composite(name, e.overload_name()) else candidates
            kind.append((thread, span, op))
        # A composite with nothing but allowed ops inside it (allocations) that returns new
        # tensors ran a kernel of its own for this device (on a GPU, aten::_fused_rms_norm
        # allocates its outputs and runs one fused kernel): it is the leaf here. One that may
        # return its input (contiguous, reshape, to) may simply have had nothing to do.
        for thread, (start, end), op in composites:
            if _returns_new_tensors(op) and not any(
                    start <= a and b <= end and (a, b) != (start, end)
                    for a, b in computing.get(thread, ())):
                candidates.append((thread, (start, end), op))
        forbidden: list[str] = []
        reads: list[str] = []
        for thread, (start, end), op in candidates:
            if any(a <= start and end <= b for a, b in excused.get(thread, ())):
                continue
            seen = reads if op == "aten._local_scalar_dense.default" else forbidden
            if op not in seen:
                seen.append(op)
        return forbidden, reads


@functools.cache
def _returns_new_tensors(op: str) -> bool:
    """`aten.name.overload` returns tensors, none of them an alias of an input (`Tensor(a)`): a
    composite like that which called no computing op computed them itself. (`contiguous`,
    `reshape`, `to` may return their input; `item` returns a number.)"""
    _, name, overload = op.split(".")
    try:
        schema = getattr(getattr(torch.ops.aten, name), overload)._schema
    except (AttributeError, RuntimeError):
        return False  # unknown: not held against the student
    returns = schema.returns
    return bool(returns) and all(isinstance(r.type, torch._C.TensorType)
                                 and r.alias_info is None for r in returns)


@functools.cache
def _composite(name: str, overload: str) -> bool:
    """An op PyTorch implements by calling other ops (CompositeImplicitAutograd)."""
    qualified = f"{name}.{overload}" if overload else name
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(qualified,
                                                              "CompositeImplicitAutograd")
    except RuntimeError:
        return False


KERNELS_DIR = Path(runtime.__file__).resolve().parent
# The CUDA C headers a lab tells the student to include (fp16/bf16 conversions): not a kernel.
SHARED_CUDA = KERNELS_DIR / "include"


def _without_comments(code: str) -> str:
    """CUDA C with its comments and all whitespace removed: two texts that differ only there are
    the same kernel."""
    code = re.sub(r"/\*.*?\*/|//[^\n]*", "", code, flags=re.S)
    return re.sub(r"\s+", "", code)


@functools.cache
def _course_cuda() -> tuple[dict[str, str], dict[str, str]]:
    """The course's CUDA C outside the shared headers: {file name: path in the course} and
    {text without comments and whitespace: path in the course}."""
    files = [p for p in sorted(KERNELS_DIR.rglob("*.cu*")) if not p.is_relative_to(SHARED_CUDA)]
    names = {p.name: str(p.relative_to(KERNELS_DIR.parent)) for p in files}
    texts = {_without_comments(p.read_text()): str(p.relative_to(KERNELS_DIR.parent))
             for p in files}
    return names, texts


def course_cuda_source(code: str) -> str | None:
    """The course file a CUDA C text is (`kernels/matmul/matmul_register.cu`), or includes, else
    None: a kernel compiled from the course's .cu files, whatever module compiled it, is the
    course's. A copy edited beyond comments and spacing is the student's own text."""
    names, texts = _course_cuda()
    if (bare := _without_comments(code)) in texts:
        return texts[bare]
    for included in re.findall(r'#\s*include\s*["<]([^">]+)[">]', code):
        if Path(included).name in names:
            return names[Path(included).name]
    return None


def course_kernel_name(kernel) -> str | None:
    """The course kernel a launch ran, else None: `kernels.moe.triton_permute.histogram_kernel`
    for a Triton kernel defined in the course's package (by the file that defines it, so a course
    module loaded again under another name is still the course's), `kernels/matmul/
    matmul_register.cu:matmul_register_bf16` for a CuPy kernel compiled from the course's CUDA C.
    A graded function must launch kernels of its own, not the course's (which it is timed
    against). Called at every launch: the answers are cached by what they are read from."""
    fn = getattr(kernel, "fn", None)
    if fn is not None:
        filename = getattr(getattr(fn, "__code__", None), "co_filename", "")
        return _course_triton(getattr(fn, "__module__", None) or "", str(filename or "."),
                              fn.__name__)
    # CuPy's RawKernel, and RawModule.get_function's: the module's code, options and file
    code, options = getattr(kernel, "code", None), getattr(kernel, "options", None) or ()
    return _course_cupy(code if isinstance(code, str) else "",
                        tuple(o for o in options if isinstance(o, str)),
                        str(getattr(kernel, "file_path", None) or "."),
                        str(getattr(kernel, "name", "?")))


@functools.lru_cache(maxsize=4096)
def _course_triton(module: str, filename: str, name: str) -> str | None:
    path = Path(filename).resolve()
    if path.is_relative_to(KERNELS_DIR) and path.suffix == ".py":
        module = ".".join(path.relative_to(KERNELS_DIR.parent).with_suffix("").parts)
    return f"{module}.{name}" if module.split(".")[0] == "kernels" else None


@functools.lru_cache(maxsize=4096)
def _course_cupy(code: str, options: tuple, file_path: str, name: str) -> str | None:
    path = Path(file_path).resolve()
    if path.is_relative_to(KERNELS_DIR):
        source = str(path.relative_to(KERNELS_DIR.parent))
    else:  # options: a course file pre-included (-include matmul_tiles.cuh)
        source = course_cuda_source("\n".join([code] + [f'#include "{o}"' for o in options]))
    return f"{source}:{name}" if source else None


def _note_course_kernel(state: "LaunchState", kernel) -> None:
    name = course_kernel_name(kernel)
    if name and name not in state.course_kernels:
        state.course_kernels.append(name)


def _hook_triton(cls) -> None:
    if getattr(cls.run, "_grading_hook", False):
        return
    original = cls.run

    def run(self, *args, _original=original, **kwargs):
        state = ACTIVE
        warmup = kwargs.get("warmup", False)
        if not warmup:
            state.launches += 1
            _note_course_kernel(state, self)
        hooks = list(getattr(self, "pre_run_hooks", None) or ())
        for hook in hooks:  # the student's hooks are the student's code: watched like it
            hook(*args, **kwargs)
        state.depth += 1
        mark = _launch_mark()
        if hooks:
            self.pre_run_hooks = []
        try:
            if _on_side_stream() and not warmup:
                # compile first (a warm-up run launches nothing): the side stream's delay must not
                # elapse while the first call is still compiling, or that call wins the race by luck
                _original(self, *args, **{**kwargs, "warmup": True})
            _before_launch(state)
            return _original(self, *args, **kwargs)
        finally:
            if hooks:
                self.pre_run_hooks = hooks
            _end_launch_mark(mark)
            state.depth -= 1

    run._grading_hook = True
    cls.run = run


def install_launch_hooks() -> None:
    """Count Triton launches (compiled and interpreted) and CuPy launches made through
    `kernels.cuda.launch`, and let the op watcher ignore what happens inside them."""
    from triton.runtime import jit

    from kernels import cuda

    _hook_triton(jit.JITFunction)
    if runtime.MODE == "cpu":
        from triton.runtime import interpreter
        _hook_triton(interpreter.InterpretedFunction)
    if getattr(cuda.launch, "_grading_hook", False):
        return
    original_launch = cuda.launch

    def launch(*args, _original=original_launch, **kwargs):
        state = ACTIVE
        state.cupy_launches += 1
        _note_course_kernel(state, args[0] if args else kwargs.get("kernel"))
        state.depth += 1
        mark = _launch_mark()
        try:
            _before_launch(state)
            return _original(*args, **kwargs)
        finally:
            _end_launch_mark(mark)
            state.depth -= 1

    # The launcher's name, docstring and __wrapped__ (inspect.getsource reads the course's code)
    functools.update_wrapper(launch, original_launch)
    launch._grading_hook = True
    cuda.launch = launch


# Where PyTorch's C functions are documented (F.scaled_dot_product_attention is torch._C._nn's).
_PUBLIC_MODULE = {"torch._C._nn": "torch.nn.functional", "torch._C._linalg": "torch.linalg",
                  "torch._C._fft": "torch.fft", "torch._C._special": "torch.special"}


def torch_name(func) -> str:
    """`torch.add`, `Tensor.add`, `torch.nn.functional.rms_norm`: as a student would write it."""
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


# Torch functions that hand a tensor's values to the host or take them back from NumPy: a result
# computed there (NumPy, Python) is not the student's kernel.
HOST_ROUND_TRIPS = frozenset({torch.Tensor.numpy, torch.Tensor.__array__, torch.from_numpy,
                              torch.Tensor.__array_wrap__})
# Reads of a tensor's values by Python that dispatch no op (`.item()` dispatches one, seen below).
HOST_READS = frozenset({torch.Tensor.tolist})


class _FunctionWatcher(TorchFunctionMode):
    """Remembers which torch function the student called, to name it when it runs a forbidden op,
    and notes the host round trips (`Tensor.numpy`, `torch.from_numpy`, ...)."""

    def __init__(self, state: LaunchState):
        super().__init__()
        self.state = state
        self.current = None
        self.host_trips: list[str] = []
        self.host_reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.state.depth:
            return func(*args, **(kwargs or {}))
        if func in HOST_ROUND_TRIPS and torch_name(func) not in self.host_trips:
            self.host_trips.append(torch_name(func))
        if func in HOST_READS and torch_name(func) not in self.host_reads:
            self.host_reads.append(torch_name(func))
        self.current = func  # the mode is off inside this call: nested torch calls do not land here
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.current = None


class _OpWatcher(TorchDispatchMode):
    def __init__(self, state: LaunchState, functions: _FunctionWatcher,
                 also_allowed: tuple[str, ...] = ()):
        super().__init__()
        self.state = state
        self.functions = functions
        self.also_allowed = frozenset(also_allowed)
        self.forbidden: list[str] = []
        self.host_reads: list[str] = []  # a tensor's value read by Python: .item(), int(t), bool(t)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if (self.state.depth == 0 and func not in ALLOWED_OPS
                and str(func) not in self.also_allowed):
            caller = self.functions.current
            what = f"{torch_name(caller)} ({func})" if caller is not None else str(func)
            host_read = func is _aten._local_scalar_dense.default
            seen = self.host_reads if host_read else self.forbidden
            if what not in seen:
                seen.append(what)
        return func(*args, **(kwargs or {}))


# PyTorch wraps a mode's __torch_dispatch__ so that dynamo never traces it, and that wrapper imports
# torch._dynamo on its first call: a second of every grading process. Nothing watched here is
# compiled, so the wrapper may call the method directly (if PyTorch drops the wrapper: no effect).
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
    host_trips: list[str] = field(default_factory=list)  # NumPy round trips
    tampered: str = ""  # what the call did to the grader's own watch, if anything


@contextmanager
def watch(profile_cuda: bool = False, snapshot=None, allowed_ops: tuple[str, ...] = ()):
    """Record the PyTorch ops and kernel launches of the code inside the block (`allowed_ops`: op
    names, such as "aten.mm.default", not recorded as forbidden on top of `ALLOWED_OPS`).

    On a GPU, `snapshot` (the output buffer, or a tuple of them) is copied on the stream that was
    current when the block started, *before* the device is synchronized: the copies show what a
    caller reading the outputs in stream order would see (`record.stream_snapshot`, a tuple).
    """
    install_launch_hooks()
    grader = torch.cuda.current_stream() if runtime.ON_GPU else None
    # One profiler session at a time: the profiled GPU case lists kernels instead (below).
    threads = None if profile_cuda else _AllThreads()
    state = LaunchState(grader_stream=grader, delay_side_streams=True,
                        profiling=threads is not None)
    functions = _FunctionWatcher(state)
    watcher = _OpWatcher(state, functions, allowed_ops)
    record = Watched([], 0)
    prof = None
    if profile_cuda:
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
        with warnings.catch_warnings():  # "Profiler clears events at the end of each cycle"
            warnings.simplefilter("ignore", UserWarning)
            prof.__enter__()
    try:
        with _launch_state(state), contextlib.ExitStack() as stack:
            if threads is not None:
                stack.enter_context(threads)
            stack.enter_context(functions)
            stack.enter_context(watcher)
            yield record
    finally:
        record.side_streams = len(state.side_streams)
        record.course_kernels = list(state.course_kernels)
        record.forbidden_ops = watcher.forbidden
        record.host_reads = watcher.host_reads + functions.host_reads
        record.host_trips = functions.host_trips
        if threads is not None and not (record.forbidden_ops or record.host_reads):
            allowed = {str(op) for op in ALLOWED_OPS} | set(allowed_ops) | set(_PROFILER_OPS)
            found = threads.findings(allowed)
            if found is None:
                record.tampered = "stopped the grader's profiler inside the call"
            else:
                ops, record.host_reads = found
                record.forbidden_ops = [f"{op} (outside this thread's watch: another thread, "
                                        f"perhaps one an earlier call left running, a hook or a "
                                        f"disabled dispatch mode)" for op in ops]
        record.triton_launches, record.cupy_launches = state.launches, state.cupy_launches
        failure = None
        if runtime.ON_GPU:
            try:
                if snapshot is not None:
                    with torch.cuda.stream(grader):
                        tensors = (snapshot,) if isinstance(snapshot, torch.Tensor) else snapshot
                        record.stream_snapshot = tuple(t.clone() for t in tensors)
                torch.cuda.synchronize()  # every stream: what the call left running is finished
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


def is_torch_kernel(name: str) -> bool:
    return "at::native" in name or name.startswith(("void at::", "at::", "Memset", "Memcpy"))


@contextmanager
def joined_side_streams():
    """For timing: kernels launched on side streams wait for the current stream, and the current
    stream waits for them at the end, so an end event recorded after the block covers all the
    call's work. Yields the block's `LaunchState` (its `side_streams`)."""
    grader = torch.cuda.current_stream()
    with _launch_state(LaunchState(grader_stream=grader)) as state:
        try:
            yield state
        finally:
            for stream in state.side_streams:
                grader.wait_stream(stream)
