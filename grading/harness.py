"""Checks one student function against its lab spec: correctness, then (on a GPU) performance.

Both the notebook check cells (`grading.check`) and `python -m grading` grade through
`check_function`, so the notebook shows exactly what the grader will report. The checks live in:

* `grading/watch.py`: the launch hooks and op watchers around a call;
* `grading/correctness.py`: the cases, the call of the student's function (a `Caller`), and the
  verdict on it as named steps (`STEPS`);
* `grading/diagnosis.py`: what an exception or a pattern of wrong elements means;
* `grading/graph.py`: CUDA-graph capture (GPU); `grading/performance.py`: timing (GPU);
* `grading/results.py`: what is reported.

An exception is reported with a reason (out of host or GPU memory, `sys.exit`, ...); a CUDA error
that leaves the context unusable raises `ContextLost`, which ends the process (the worker grades the
rest of the lab in a new one).
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Callable

import torch

from grading.correctness import Caller, LocalCaller, allocating_call, run_case
from grading.diagnosis import Limits, diagnose
from grading.graph import GRAPH_NOT_CHECKED
from grading.performance import judge as judge_perf
from grading.performance import timed_rounds
from grading.results import CaseResult, ContextLost, FunctionResult, PerfResult, error_result
from grading.watch import watch
from kernels import runtime

__all__ = ["GRAPH_NOT_CHECKED", "CaseResult", "ContextLost", "FunctionResult", "GradingContext",
           "Limits", "PerfResult", "check_function", "diagnose", "error_result", "function_kind",
           "grade_function", "timed_rounds", "watch"]


@dataclass
class GradingContext:
    """What the caller of `check_function` tells the checks: the memory caps in force (for
    messages), and `on_step(function, step, kind)`, called before every step that runs student
    code (kind "call" or "perf"), so a watching parent knows what was running if it hangs."""

    limits: Limits = field(default_factory=Limits)
    on_step: Callable[[str, str, str], None] | None = None

    def step(self, function: str, step: str, kind: str = "call") -> None:
        if self.on_step is not None:
            self.on_step(function, step, kind)


def function_kind(fn) -> str | None:
    """None (missing), "function" (callable) or the name of the type it is instead."""
    return None if fn is None else "function" if callable(fn) else type(fn).__name__


def check_function(lab, name: str, fn, *, seed: int | None = None, perf: bool | None = None,
                   context: GradingContext | None = None) -> FunctionResult:
    """Grade one function of `lab` (a LabSpec), calling it in this process (the notebook's
    check cells). perf=None measures performance on a GPU only."""
    context = context or GradingContext()
    return grade_function(lab, name, function_kind(fn), LocalCaller(fn, context.limits),
                          seed=seed, perf=perf, context=context)


def grade_function(lab, name: str, kind: str | None, caller: Caller, *, seed: int | None = None,
                   perf: bool | None = None,
                   context: GradingContext | None = None) -> FunctionResult:
    """Grade one function through `caller` (in this process, or a sandboxed worker's: the verdicts
    are made here either way). `kind` is what `function_kind` says of the student's function."""
    from grading import expected as expected_table

    context = context or GradingContext()
    spec = lab.function(name)
    seed = secrets.randbits(31) if seed is None else seed
    result = FunctionResult(spec.name, spec.backend, spec.description, "fail", 0, spec.points,
                            seed=seed, extra_credit=spec.extra_credit)
    if kind is None:
        result.status, result.message = "missing", f"no function named {name} was defined"
        return result
    if kind != "function":
        result.message = f"{name} is a {kind}, not a function"
        return result
    if spec.backend == "cupy" and not runtime.cupy_status()[0]:
        result.status, result.message = "needs a GPU", runtime.cupy_status()[1]
        return result
    # On a GPU, profile the largest case to see which kernels ran (one profile: slow to start).
    plain = [c for c in spec.cases if c.layout == "contiguous"]
    profiled = max([c for c in plain if not c.params] or plain or [None],
                   key=lambda c: 0 if c is None else torch.Size(c.shape).numel())
    try:
        for i, case in enumerate(spec.cases_for(seed)):
            context.step(name, f"case {case.label}")
            outcome = run_case(caller, spec, case, seed + i,
                               profile=runtime.ON_GPU and case == profiled)
            result.cases.append(outcome)
            if not outcome.ok and "ran out of" in outcome.reason:
                if runtime.ON_GPU:
                    torch.cuda.empty_cache()  # give back what the failed case's allocations held
                break  # every other case would allocate the same way: one is enough
    except NotImplementedError:
        result.status, result.message, result.cases = "not implemented", "not implemented yet", []
        return result
    failures = [c for c in result.cases if not c.ok]
    if not failures:
        context.step(name, "case without out=")
        problem = allocating_call(caller, spec, seed, spec.cases_for(seed))
        if problem is None and spec.graph_capture and runtime.ON_GPU:
            context.step(name, "CUDA graph capture")
            problem = caller.graph_capture(spec, profiled, seed)
        if problem is not None:
            failures = [problem]
            result.cases.append(problem)
    if failures:
        result.message = (f"{len(failures)} of {len(result.cases)} cases fail; first: "
                          f"{failures[0].case}: {failures[0].reason}")
        if spec.hint and failures[0].comparison is not None:  # the hint is about wrong values
            result.message += f" (hint: {spec.hint})"
        return result
    result.status, result.points = "pass", spec.points
    if spec.graph_capture and not runtime.ON_GPU:
        result.message = GRAPH_NOT_CHECKED
    if runtime.ON_GPU and (perf is None or perf):  # no timing without a GPU, whatever was asked
        rows = expected_table.load(lab.id)
        for config in spec.perf:
            context.step(name, f"performance {config.id}", "perf")
            result.perf.append(caller.measure(spec, config, seed, rows))
        judge_timed_outputs(result)
    return result


def judge_timed_outputs(result: FunctionResult) -> None:
    """The tiers as this process reads the timings (not as the worker named them), and the
    correctness points taken back where a timed call's output was wrong: a function that is right
    only when it is not timed (a cache, a shortcut for large inputs) is not right."""
    for p in result.perf:
        judge_perf(p)
    wrong = [p for p in result.perf if p.correct is False]  # None: not timed, not judged wrong
    if wrong and result.status == "pass":
        result.status, result.points = "fail", 0
        why = wrong[0].note or "output wrong in a timed repetition"
        result.message = (f"performance {wrong[0].config}: {why}; the outputs of timed calls "
                          f"must be right too, so the correctness points are not credited")
