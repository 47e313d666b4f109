"""Correctness: every case of a graded function, called with fresh inputs and judged in named steps.

Per case and per trial (`GradedFunction.trials`, 2 by default): fresh random inputs from the run's
seed, and for every later trial new values in the *same* input buffers (a function that caches its
previous output returns stale values and fails); the output buffer poisoned with NaN; the call
watched for PyTorch compute ops and for kernel launches (grading/watch.py); on a GPU, the output
read back in the order of PyTorch's current stream, before any other synchronization.

A call and its verdict are apart. A `Caller` runs the student's function once and returns a
`CallRecord`: what it raised or returned, copies of its results as they were when it returned, the
inputs after it, and what the watcher saw. `judge` turns a record into a `CaseResult` through
`STEPS`, a list of named checks. `LocalCaller` calls in this process (the notebook's
`grading.check`); the grader's parent process uses a caller that sends the inputs to a sandboxed
worker and judges what comes back (grading/runner.py), so no verdict is made where the student's
code runs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from grading import diagnosis as dx
from grading.cases import (
    GUARD_BYTE,
    GUARD_ELEMENTS,
    as_tuple,
    guarded_outputs,
    make_inputs,
    new_outputs,
    out_argument,
    output_names,
    output_shapes,
    references,
)
from grading.gpu_memory import OutsideMemory
from grading.results import CaseResult
from grading.spec import Case, GradedFunction
from grading.watch import Watched, is_torch_kernel, watch
from kernels import interpreter_poison, runtime
from kernels.testing import compare, generator, poison_

# --------------------------------------------------------------------------------------------------
# One call of the student's function, recorded


@dataclass
class CallRecord:
    """What one call did, as facts; the verdict is the judge's."""

    error: str | None = None  # None, "exit", "rejected" (ValueError/TypeError) or "raised"
    error_text: str = ""  # str(exc), or sys.exit's code
    error_message: str = ""  # the exception described for a reason (type, message, line)
    returned: str = "NoneType"  # the type of what the call returned
    not_plain: str = ""  # a returned tensor's subclass (a lazy result), "" if all are plain tensors
    results: tuple | None = None  # copies of the returned tensors, None if not n_outputs tensors
    aliases: tuple[str, ...] = ()  # per result: "out", the name of an input, or "another tensor"
    inputs_after: tuple = ()  # the inputs as the call left them
    outputs_after: tuple = ()  # GPU: the out buffers after every stream finished
    guards_after: tuple = ()  # the guard band after each output, as bytes
    watched: Watched = field(default_factory=lambda: Watched([], 0))
    extra_bytes: int | None = None  # device memory beyond inputs and outputs at the peak (GPU)
    # The grading process's own reading (grading/gpu_memory.py), set there, never by the worker
    outside_memory: OutsideMemory | None = None


def _alias(result: torch.Tensor, out: torch.Tensor | None, inputs, names) -> str:
    if out is not None and (not out.numel() or result.data_ptr() == out.data_ptr()):
        return "out"
    mine = [n for n, t in zip(names, inputs) if t.numel() and t.data_ptr() == result.data_ptr()]
    return mine[0] if mine else "another tensor"


def _record_error(record: CallRecord, label: str, exc: BaseException, limits) -> None:
    if isinstance(exc, NotImplementedError):
        raise exc
    if isinstance(exc, SystemExit):
        record.error, record.error_text = "exit", repr(exc.code)
        return
    dx.check_context(label, exc)
    record.error_text = str(exc)
    if isinstance(exc, (ValueError, TypeError)):
        record.error, record.error_message = "rejected", dx.short_exception(exc)
    else:
        record.error, record.error_message = "raised", dx.describe_exception(exc, limits)


def _record_results(record: CallRecord, spec: GradedFunction, returned, inputs, outs) -> None:
    record.returned = type(returned).__name__
    results = as_tuple(returned, spec.n_outputs)
    if results is None or not all(isinstance(r, torch.Tensor) for r in results):
        return
    subclasses = [type(r).__name__ for r in results if type(r) is not torch.Tensor]
    if subclasses:  # its values could be computed later, when read: outside the watched call
        record.not_plain = subclasses[0]
        return
    names = dx.input_names(spec, len(inputs))
    outs = outs or (None,) * len(results)
    record.aliases = tuple(_alias(r, o, inputs, names) for r, o in zip(results, outs))
    record.results = tuple(r.detach().clone() for r in results)


class Caller(Protocol):
    """Runs the student's function; `LocalCaller` here, the runner's `WorkerCaller` in a sandbox."""

    def begin_case(self, spec: GradedFunction, case: Case, inputs: tuple) -> None: ...

    def call(self, trial: int, inputs: tuple, *, profile: bool) -> CallRecord: ...

    def call_allocating(self, spec: GradedFunction, case: Case, inputs: tuple) -> CallRecord: ...

    def graph_capture(self, spec: GradedFunction, case: Case, seed: int) -> CaseResult | None: ...

    def measure(self, spec: GradedFunction, config, seed: int, rows: dict | None): ...


class LocalCaller:
    """Calls `fn` in this process, on the inputs the case loop made (which it may change)."""

    def __init__(self, fn: Callable, limits: dx.Limits | None = None):
        self.fn, self.limits = fn, limits or dx.Limits()

    def begin_case(self, spec: GradedFunction, case: Case, inputs: tuple) -> None:
        self.spec, self.case, self.inputs = spec, case, inputs
        self.outs, self.guards = guarded_outputs(spec, case)

    def call(self, trial: int, inputs: tuple, *, profile: bool) -> CallRecord:
        spec, case, outs = self.spec, self.case, self.outs
        inputs = self.inputs  # the case loop writes each trial's values into the same buffers
        kw = case.kwargs
        for out in outs:
            poison_(out)
        record = CallRecord(inputs_after=inputs)
        budget = spec.memory_budget is not None and runtime.ON_GPU
        if budget:
            torch.cuda.synchronize()
            # what earlier calls left cached is given back, so what this one reserves is seen
            # from outside the process as growth (grading/gpu_memory.py)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            allocated_before = torch.cuda.memory_allocated()
        interpreter_poison.clear()  # CPU mode: the masked loads without other= of this call only
        try:
            with watch(profile_cuda=profile, snapshot=outs, allowed_ops=spec.allowed_ops) as seen:
                returned = self.fn(*inputs, **kw, out=out_argument(outs))
        except BaseException as exc:  # noqa: BLE001 - a student's code may raise anything
            if isinstance(exc, KeyboardInterrupt):
                raise
            _record_error(record, case.label, exc, self.limits)
            return record
        record.watched = seen
        if budget:
            # the watcher's output snapshot (one copy of the outputs) is not the function's
            record.extra_bytes = (torch.cuda.max_memory_allocated() - allocated_before
                                  - sum(out.numel() * out.element_size() for out in outs))
        _record_results(record, spec, returned, inputs, outs)
        if seen.stream_snapshot is not None:
            record.outputs_after = tuple(out.clone() for out in outs)
        record.guards_after = tuple(g.view(torch.uint8).clone() for g in self.guards)
        return record

    def call_allocating(self, spec: GradedFunction, case: Case, inputs: tuple) -> CallRecord:
        # Poison the allocator: the next blocks of this size it hands out hold NaN, so a result
        # that is an unwritten torch.empty cannot pass by luck.
        junk = [poison_(out) for _ in range(4) for out in new_outputs(spec, case)]
        del junk
        record = CallRecord(inputs_after=inputs)
        try:
            with watch(allowed_ops=spec.allowed_ops) as seen:
                returned = self.fn(*inputs, **case.kwargs)
        except BaseException as exc:  # noqa: BLE001
            if isinstance(exc, KeyboardInterrupt):
                raise
            _record_error(record, "without out=", exc, self.limits)
            return record
        record.watched = seen
        _record_results(record, spec, returned, inputs, None)
        return record

    def graph_capture(self, spec: GradedFunction, case: Case, seed: int) -> CaseResult | None:
        from grading.graph import graph_capture

        return graph_capture(self.fn, spec, case, seed)

    def measure(self, spec: GradedFunction, config, seed: int, rows: dict | None):
        """In this process (the notebook's check cells): the course's kernel is timed beside the
        student's function, as the grader times it in a clean worker (grading/performance.py)."""
        import time

        from grading import performance as perf

        def wall(fn, calls: int) -> float:
            go = perf.wall_ready(fn, spec, config, seed)
            start = time.perf_counter()
            go(calls)
            return time.perf_counter() - start

        return perf.measure(perf.Sides(
            student=lambda batch, rounds: perf.time_batch(self.fn, spec, config, seed + batch,
                                                          rounds),
            course=lambda who, batch, rounds: perf.time_course(who, spec, config, seed + batch,
                                                               rounds),
            student_wall=lambda calls: wall(self.fn, calls),
            course_wall=lambda calls: wall(spec.course_kernel, calls)), config, rows)


# --------------------------------------------------------------------------------------------------
# The verdict on one call: named steps, in order; the first that finds a fault decides


@dataclass
class Judgement:
    spec: GradedFunction
    case: Case
    inputs: tuple  # as made for the call (views, strides): the reference is computed from these
    originals: tuple  # copies taken before the call
    record: CallRecord
    seed: int
    trial: int
    previous: tuple | None  # the previous trial's results
    comparisons: list = field(default_factory=list)

    def fail(self, reason: str, cmp=None, detail=None) -> CaseResult:
        again = "" if self.trial == 0 else \
            "called again with new values in the same input buffers: "
        return CaseResult(self.case.label, False, again + reason, cmp,
                          detail or dx.detail(self.spec, self.case, self.inputs, self.seed,
                                              self.trial))


def _raised(j: Judgement) -> CaseResult | None:
    r = j.record
    if r.error == "exit":
        return j.fail(f"called sys.exit({r.error_text}): a graded function must return its result")
    if r.error == "rejected" and j.case.layout == "strided" and j.trial == 0:
        return CaseResult(j.case.label, True, f"rejected clearly: {r.error_text}")
    if r.error:
        return j.fail(r.error_message)
    return None


def _watch_intact(j: Judgement) -> CaseResult | None:
    if j.record.watched.tampered:
        return j.fail(f"{j.record.watched.tampered}: a graded function must leave the grader alone")
    return None


def _host_reads(j: Judgement) -> CaseResult | None:
    reads = j.record.watched.host_reads
    if reads:
        return j.fail(f"reads a tensor's value on the host inside the call "
                      f"({', '.join(reads[:3])}): a host synchronization, which stalls the GPU's "
                      f"queue and cannot be captured "
                      f"in a CUDA graph; keep counts and sizes on the device")
    return None


def _host_round_trip(j: Judgement) -> CaseResult | None:
    trips = j.record.watched.host_trips
    if trips:
        return j.fail(f"moves tensors to the host inside the call ({', '.join(trips[:3])}): a "
                      f"result computed there (NumPy, Python) is not a kernel of its own")
    return None


def _pytorch_compute(j: Judgement) -> CaseResult | None:
    ops = j.record.watched.forbidden_ops
    if ops:
        return j.fail("computes with PyTorch instead of its own kernel: " + ", ".join(ops[:3]))
    return None


COURSE_KERNEL = ("launches the course's kernel instead of its own (write the kernel in the "
                 "notebook): ")


def _course_kernels(j: Judgement) -> CaseResult | None:
    used = j.record.watched.course_kernels
    if j.spec.own_kernels_only and used:
        return j.fail(COURSE_KERNEL + ", ".join(used[:3]))
    return None


def _memory_budget(j: Judgement) -> CaseResult | None:
    """The worker's own count first (its message names the peak exactly), then the grading
    process's reading through NVML, which the worker cannot forge: over the budget by more than
    it can resolve, it decides, whatever the worker reported."""
    if j.spec.memory_budget is None:
        return None
    budget = j.spec.memory_budget(*j.inputs, **j.case.kwargs)
    extra, outside = j.record.extra_bytes, j.record.outside_memory
    hint = "does it materialize an intermediate it should stream through on-chip memory?"
    if extra is not None and extra > budget:
        return j.fail(f"{dx.size_context(j.case)}: allocated {extra / 2**20:.1f} MiB of device "
                      f"memory beyond its inputs and outputs at its peak; the budget is "
                      f"{budget / 2**20:.1f} MiB ({hint})")
    if outside is not None and outside.over(budget):
        return j.fail(f"{dx.size_context(j.case)}: its processes' GPU memory grew by "
                      f"{outside.growth / 2**20:.1f} MiB during the call, as the grading process "
                      f"saw it through NVML, outside the process that ran it; the budget is "
                      f"{budget / 2**20:.1f} MiB, and at most "
                      f"{outside.allowance(budget) / 2**20:.1f} MiB with the grader's own copies "
                      f"and the allocator's rounding ({hint})")
    return None


def _returned_tensors(j: Judgement) -> CaseResult | None:
    if j.record.not_plain:
        return j.fail(f"returned a {j.record.not_plain}, not a plain torch.Tensor: the result "
                      f"must be computed when the call returns")
    if j.record.results is not None:
        return None
    n = j.spec.n_outputs
    expected = ("the output tensor" if n == 1 else
                f"a tuple of {n} tensors ({', '.join(output_names(j.spec))})")
    return j.fail(f"returned {j.record.returned}, expected {expected}")


def _returned_out(j: Judgement) -> CaseResult | None:
    for oname, alias in zip(output_names(j.spec), j.record.aliases):
        if alias != "out":
            what = "another tensor" if alias == "another tensor" else f"its input {alias}"
            where = "out" if j.spec.n_outputs == 1 else f"out ({oname})"
            return j.fail(f"given out=, it must write into {where} and return it (it returned "
                          f"{what})")
    return None


def _inputs_unchanged(j: Judgement) -> CaseResult | None:
    names = dx.input_names(j.spec, len(j.originals))
    for name, now, before in zip(names, j.record.inputs_after, j.originals):
        if not dx.same_bits(now, before):
            return j.fail(f"modified its input {name} (inputs must be left as they were)")
    return None


def _guard_band(j: Judgement) -> CaseResult | None:
    for oname, guard in zip(output_names(j.spec), j.record.guards_after):
        changed = (guard.reshape(-1) != GUARD_BYTE).nonzero()
        if changed.numel():
            where = "out" if j.spec.n_outputs == 1 else f"out ({oname})"
            first = int(changed[0]) // max(1, guard.numel() // GUARD_ELEMENTS)
            return j.fail(f"{dx.size_context(j.case)}: wrote past the end of {where} (the element "
                          f"{first} after its last one changed): mask the stores with offsets < n")
    return None


def _stream_order(j: Judgement) -> CaseResult | None:
    snapshots = j.record.watched.stream_snapshot or ()
    for oname, snap, out in zip(output_names(j.spec), snapshots, j.record.outputs_after):
        if out.numel() and not dx.same_bits(snap, out):
            prefix = "" if j.spec.n_outputs == 1 else f"{oname}: "
            return j.fail(prefix + "the output was not ready on PyTorch's current stream when the "
                          "function returned: work on a side stream without synchronizing? "
                          "(torch.cuda.current_stream().wait_stream(side))")
    return None


def _values(j: Judgement) -> CaseResult | None:
    spec, case, kw = j.spec, j.case, j.case.kwargs
    atol, rtol = spec.tolerance(case.dtype)
    wants, scales = references(spec, j.inputs, kw)
    exacts = (as_tuple(spec.bit_exact(*j.inputs, **kw), spec.n_outputs)
              if spec.bit_exact is not None and case.dtype in spec.exact_dtypes
              else (None,) * spec.n_outputs)
    rows = zip(output_names(spec), j.record.results, wants, scales, exacts)
    for i, (oname, result, want, scale, exact) in enumerate(rows):
        prefix = "" if spec.n_outputs == 1 else f"{oname}: "
        where = dx.size_context(case)
        cmp = compare(result, want, atol=atol, rtol=rtol, scale=scale)
        j.comparisons.append(cmp)

        def detail(result=result, want=want, scale=scale, oname=oname):
            d = dx.detail(spec, case, j.inputs, j.seed, j.trial, result, want, atol, rtol, scale)
            if spec.n_outputs > 1:
                d["output"] = oname
            return d

        if not cmp.ok:
            if j.previous is not None and dx.same_bits(result, j.previous[i]):
                return j.fail(f"{prefix}returned the previous call's result for new inputs: does "
                              f"it cache outputs between calls? ({where}: {cmp.reason})",
                              cmp.as_dict(), detail())
            why = (dx.lab_diagnosis(spec, case, j.inputs, oname, result, want, atol, rtol, scale)
                   or dx.diagnose(case, result, want, cmp, atol, rtol, scale))
            return j.fail(f"{prefix}{where}: {cmp.reason}" + (f"; {why}" if why else ""),
                          cmp.as_dict(), detail())
        if exact is not None:
            differ = (result.reshape(-1) != exact.reshape(-1)).nonzero()
            if differ.numel():
                k = int(differ[0])
                return j.fail(f"{prefix}{where}: not bit-identical to PyTorch: {differ.numel()} "
                              f"elements differ, first at {k} (PyTorch "
                              f"{exact.reshape(-1)[k].item():.9g}, yours "
                              f"{result.reshape(-1)[k].item():.9g})", cmp.as_dict(), detail())
    return None


def _own_kernel(j: Judgement) -> CaseResult | None:
    """Right answer, but from where? A graded function must compute with its own kernel."""
    seen, case = j.record.watched, j.case
    if (j.spec.backend == "triton" and case.shape and min(case.shape) > 0
            and seen.triton_launches == 0):
        return j.fail("launched no Triton kernel")
    if seen.cuda_kernels and all(is_torch_kernel(k) for k in seen.cuda_kernels):
        return j.fail("launched only PyTorch kernels: " + ", ".join(seen.cuda_kernels[:3]))
    return None


STEPS: tuple[tuple[str, Callable[[Judgement], CaseResult | None]], ...] = (
    ("raised or exited", _raised),
    ("left the grader's watch on", _watch_intact),
    ("read a value on the host", _host_reads),
    ("computed on the host", _host_round_trip),
    ("computed with PyTorch", _pytorch_compute),
    ("launched the course's kernel", _course_kernels),
    ("over its memory budget", _memory_budget),
    ("returned the outputs", _returned_tensors),
    ("wrote into out", _returned_out),
    ("left its inputs alone", _inputs_unchanged),
    ("nothing written past out", _guard_band),
    ("ready in stream order", _stream_order),
    ("right values", _values),
    ("launched its own kernel", _own_kernel),
)


def judge(j: Judgement) -> CaseResult:
    for _, step in STEPS:
        found = step(j)
        if found is not None:
            return found
    # The report keeps the comparison of the output that came closest to failing.
    worst = max(j.comparisons, key=lambda c: c.max_rel_err if c.numel else 0.0)
    return CaseResult(j.case.label, True, "", worst.as_dict())


def run_case(caller: Caller, spec: GradedFunction, case: Case, seed: int,
             profile: bool = False) -> CaseResult:
    gen = generator(seed, runtime.DEVICE)
    inputs = make_inputs(spec, case, gen)
    caller.begin_case(spec, case, inputs)
    previous = None
    for trial in range(max(1, spec.trials)):
        if trial:  # new values, same buffers: nothing about the call but the values changes
            for t, fresh in zip(inputs, make_inputs(spec, case, gen)):
                t.copy_(fresh)
        originals = tuple(t.clone() for t in inputs)
        record = caller.call(trial, inputs, profile=profile and trial == 0)
        result = judge(Judgement(spec, case, inputs, originals, record, seed, trial, previous))
        if not result.ok or result.reason.startswith("rejected clearly"):
            return result
        previous = record.results
    return result


# --------------------------------------------------------------------------------------------------
# Called without out=


def allocating_cases(spec: GradedFunction, cases: tuple[Case, ...]) -> list[Case]:
    """One plain case per dtype (the first without parameters, where there is one)."""
    plain = [c for c in cases if c.layout == "contiguous" and c.shape and min(c.shape) > 1]
    plain = [c for c in plain if not c.params] + [c for c in plain if c.params]
    return list({c.dtype: c for c in reversed(plain)}.values())[::-1]


def judge_allocating(spec: GradedFunction, case: Case, inputs: tuple, record: CallRecord,
                     seed: int) -> CaseResult | None:
    """Called without out=, the function must allocate and return a correct result (None if so)."""
    label, head = "without out=", "called without out=: "
    if record.error == "exit":
        return CaseResult(label, False, f"{head}called sys.exit({record.error_text})")
    if record.error:
        return CaseResult(label, False, head + record.error_message)
    if record.watched.forbidden_ops:
        return CaseResult(label, False, f"{head}computes with PyTorch instead of its own kernel: "
                          + ", ".join(record.watched.forbidden_ops[:3]))
    if record.watched.host_trips:
        return CaseResult(label, False, f"{head}moves tensors to the host inside the call "
                          f"({', '.join(record.watched.host_trips[:3])})")
    if record.not_plain:
        return CaseResult(label, False, f"{head}returned a {record.not_plain}, not a plain "
                          f"torch.Tensor")
    if record.results is None:
        return CaseResult(label, False, f"{head}returned {record.returned}, expected "
                          f"{spec.n_outputs} tensors")
    atol, rtol = spec.tolerance(case.dtype)
    wants, scales = references(spec, inputs, case.kwargs)
    rows = zip(output_names(spec), record.results, record.aliases, wants, scales,
               output_shapes(spec, case))
    for oname, result, alias, want, scale, (shape, dtype) in rows:
        prefix = "" if spec.n_outputs == 1 else f"{oname}: "
        if alias != "another tensor":
            return CaseResult(label, False, f"{head}{prefix}returned one of its inputs")
        if result.dtype != dtype or tuple(result.shape) != tuple(shape):
            got = f"{str(result.dtype).removeprefix('torch.')} {tuple(result.shape)}"
            return CaseResult(label, False, f"{head}{prefix}returned {got} where "
                              f"{str(dtype).removeprefix('torch.')} {tuple(shape)} is expected "
                              f"({case.label})")
        cmp = compare(result, want, atol=atol, rtol=rtol, scale=scale)
        if not cmp.ok:
            return CaseResult(label, False, f"{head}{prefix}{dx.size_context(case)}: {cmp.reason}",
                              cmp.as_dict(), dx.detail(spec, case, inputs, seed, 0, result, want,
                                                       atol, rtol, scale))
    return None


def allocating_call(caller: Caller, spec: GradedFunction, seed: int,
                    cases: tuple[Case, ...]) -> CaseResult | None:
    for case in allocating_cases(spec, cases):
        inputs = make_inputs(spec, case, generator(seed, runtime.DEVICE))
        record = caller.call_allocating(spec, case, inputs)
        problem = judge_allocating(spec, case, inputs, record, seed)
        if problem is not None:
            return problem
    return None
