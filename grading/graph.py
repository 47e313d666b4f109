"""CUDA-graph capture (GPU only): where the spec says `graph_capture`, the call is captured in a
CUDA graph, and the graph, replayed on new input values, must compute them right."""
from __future__ import annotations

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


def graph_capture(fn, spec: GradedFunction, case: Case, seed: int) -> CaseResult | None:
    """The call captured in a CUDA graph, then the graph replayed on new input values and checked
    (None if both work). A host synchronization inside the call (`.item()`) makes the capture fail;
    a graph that replays what the host decided during capture is wrong for the new values."""
    label = f"CUDA graph {case.label}"
    kw = case.kwargs
    gen = generator(seed, runtime.DEVICE)
    inputs = make_inputs(spec, case, gen)
    outs = new_outputs(spec, case)
    warm_up = torch.cuda.Stream()  # compiling and autotuning happen here, outside the capture
    warm_up.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.stream(warm_up):
            fn(*inputs, **kw, out=out_argument(outs))
        torch.cuda.current_stream().wait_stream(warm_up)
        with torch.cuda.graph(graph):
            fn(*inputs, **kw, out=out_argument(outs))
    except Exception as exc:  # noqa: BLE001 - a capture fails with whatever the forbidden call raises
        dx.check_context(label, exc)
        return CaseResult(label, False, f"could not be captured in a CUDA graph "
                          f"({dx.short_exception(exc)}): {GRAPH_SYNC_HINT}")
    for t, fresh in zip(inputs, make_inputs(spec, case, gen)):
        t.copy_(fresh)
    for out in outs:
        poison_(out)
    graph.replay()
    torch.cuda.synchronize()
    atol, rtol = spec.tolerance(case.dtype)
    wants, scales = references(spec, inputs, kw)
    for oname, out, want, scale in zip(output_names(spec), outs, wants, scales):
        cmp = compare(out, want, atol=atol, rtol=rtol, scale=scale)
        if not cmp.ok:
            prefix = "" if spec.n_outputs == 1 else f"{oname}: "
            return CaseResult(label, False, f"{prefix}the CUDA graph replayed on new inputs is "
                              f"wrong "
                              f"({cmp.reason}): does the call depend on values the host read while "
                              f"it was captured?", cmp.as_dict())
    return None
