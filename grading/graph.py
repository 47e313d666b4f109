"""CUDA-graph capture (GPU only): where the spec says `graph_capture`, the call is captured in a
CUDA graph, and the graph, replayed on new input values, must compute them right."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from grading import diagnosis as dx
from grading.cases import make_inputs, new_outputs, out_argument, output_names, references
from grading.results import CaseResult
from grading.spec import Case, GradedFunction
from kernels import runtime
from kernels.testing import compare, generator, poison_

GRAPH_NOT_CHECKED = "CUDA-graph capture not checked: needs a GPU"
GRAPH_SYNC_HINT = ("does it synchronize with the host inside the call: .item(), .cpu(), .tolist(), "
                   "int(tensor), a grid or a buffer sized from a tensor's value? Size buffers by "
                   "the data-independent bound")


def graph_inputs(spec: GradedFunction, case: Case, seed: int) -> tuple[tuple, tuple]:
    """The inputs the call is captured on, and the new values the graph is replayed on."""
    gen = generator(seed, runtime.DEVICE)
    return make_inputs(spec, case, gen), make_inputs(spec, case, gen)


@dataclass
class CapturedCall:
    """A call captured in a CUDA graph: the graph, the input buffers it reads, its outputs."""

    graph: torch.cuda.CUDAGraph
    inputs: tuple
    outs: tuple


def capture(fn, spec: GradedFunction, case: Case, captured: tuple) -> CapturedCall | str:
    """The call on `captured` (once outside, then in a CUDA graph), or why it could not be
    captured. A host synchronization inside the call (`.item()`) makes the capture fail."""
    kw = case.kwargs
    outs = new_outputs(spec, case)
    warm_up = torch.cuda.Stream()  # compiling and autotuning happen here, outside the capture
    warm_up.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.stream(warm_up):
            fn(*captured, **kw, out=out_argument(outs))
        torch.cuda.current_stream().wait_stream(warm_up)
        with torch.cuda.graph(graph):
            fn(*captured, **kw, out=out_argument(outs))
    except Exception as exc:  # noqa: BLE001 - a capture fails with whatever the forbidden call raises
        dx.check_context(f"CUDA graph {case.label}", exc)
        return (f"could not be captured in a CUDA graph ({dx.short_exception(exc)}): "
                f"{GRAPH_SYNC_HINT}")
    return CapturedCall(graph, captured, tuple(outs))


def replay(call: CapturedCall, replayed: tuple) -> tuple:
    """`replayed`'s values copied into the captured inputs, the outputs poisoned, the graph
    replayed: its outputs. Only the copies, the poison and the graph launch run here, which is
    what the kernel audit checks from outside (grading/kernel_audit.py)."""
    for t, fresh in zip(call.inputs, replayed):
        t.copy_(fresh)
    for out in call.outs:
        poison_(out)
    call.graph.replay()
    torch.cuda.synchronize()
    return call.outs


def replay_outputs(fn, spec: GradedFunction, case: Case, captured: tuple,
                   replayed: tuple) -> tuple | str:
    """The call captured on `captured` and replayed on `replayed`: its outputs, or why it could
    not be captured."""
    call = capture(fn, spec, case, captured)
    return call if isinstance(call, str) else replay(call, replayed)


def judge_replay(spec: GradedFunction, case: Case, replayed: tuple,
                 found: tuple | str) -> CaseResult | None:
    """The replayed graph's outputs (or why there was no graph) against the references of the
    values it was replayed on, as the judging process made them (None if right). A graph that
    replays what the host decided during capture is wrong for the new values."""
    label = f"CUDA graph {case.label}"
    if isinstance(found, str):
        return CaseResult(label, False, found)
    atol, rtol = spec.tolerance(case.dtype)
    wants, scales = references(spec, replayed, case.kwargs)
    for oname, out, want, scale in zip(output_names(spec), found, wants, scales):
        cmp = compare(out, want, atol=atol, rtol=rtol, scale=scale)
        if not cmp.ok:
            prefix = "" if spec.n_outputs == 1 else f"{oname}: "
            return CaseResult(label, False, f"{prefix}the CUDA graph replayed on new inputs is "
                              f"wrong ({cmp.reason}): does the call depend on values the host read "
                              f"while it was captured?", cmp.as_dict())
    return None


def graph_capture(fn, spec: GradedFunction, case: Case, seed: int) -> CaseResult | None:
    """Capture, replay and judge in this process (the notebooks' check cells); the grader's worker
    only captures and replays, and the grader judges (protocol.WorkerCaller.graph_capture)."""
    captured, replayed = graph_inputs(spec, case, seed)
    found = replay_outputs(fn, spec, case, captured, tuple(t.clone() for t in replayed))
    return judge_replay(spec, case, replayed, found)
