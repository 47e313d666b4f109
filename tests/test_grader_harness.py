"""The checks of grading/harness.py, in this process: which PyTorch calls count as "calling the
reference" (including the later labs' references), what a failure message says, the allocation path,
and on a GPU, stream ordering and timing that covers side streams."""

import pytest
import torch
import torch.nn.functional as F

from grading import harness
from grading.cases import make_inputs
from grading.correctness import LocalCaller, run_case
from grading.harness import check_function, diagnose, watch
from grading.labs import LAB_MODULES, get_lab
from grading.spec import Case
from kernels import runtime
from kernels.elementwise_add import triton_add
from kernels.testing import compare, tolerance

DEVICE = runtime.DEVICE
LAB = get_lab("01_elementwise_add")


def forbidden(fn) -> list[str]:
    with watch() as seen:
        try:
            fn()
        except (
            RuntimeError,
            NotImplementedError,
        ):  # an op with no kernel here is still recorded first
            pass
    return seen.forbidden_ops


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda x: torch.add(x, x), "torch.add (aten.add.Tensor)"),
        (lambda x: x + x, "Tensor.add (aten.add.Tensor)"),
        (lambda x: torch.ops.aten.add.Tensor(x, x), "torch.ops.aten.add.Tensor (aten.add.Tensor)"),
        (lambda x: F.rms_norm(x, (x.shape[-1],)), "torch.nn.functional.rms_norm (aten."),  # lab 02
        (lambda x: F.layer_norm(x, (x.shape[-1],)), "torch.nn.functional.layer_norm (aten."),
        (
            lambda x: F.scaled_dot_product_attention(
                x[None, None], x[None, None], x[None, None]
            ),  # lab 03
            "torch.nn.functional.scaled_dot_product_attention (aten.",
        ),
        (lambda x: torch.softmax(x, -1), "torch.softmax (aten._softmax.default)"),
        (lambda x: torch.matmul(x, x.T), "torch.matmul (aten.mm.default)"),  # lab 06
        (
            lambda x: torch._grouped_mm(
                x.bfloat16(),
                torch.stack([x.bfloat16()] * 2).transpose(-2, -1),
                offs=torch.tensor([2, 4], dtype=torch.int32, device=x.device),
            ),
            "torch._grouped_mm (aten._grouped_mm.default)",
        ),
    ],
)
def test_the_pytorch_references_are_forbidden_and_named(call, name):
    x = torch.randn(4, 8, device=DEVICE)
    ops = forbidden(lambda: call(x))
    assert any(op.startswith(name) for op in ops), ops


def test_allocation_views_and_own_kernels_are_allowed():
    a, b = torch.randn(1000, device=DEVICE), torch.randn(1000, device=DEVICE)
    with watch() as seen:
        out = torch.empty_like(a)
        triton_add.add(a.view(10, 100).reshape(-1), b, out=out)
        out.view(-1).clone().copy_(out)
    assert seen.forbidden_ops == [] and seen.triton_launches == 1


def _case_result(fn, case=Case((1025,), torch.float32), trials=2):
    spec = LAB.function("add")
    if trials != spec.trials:
        from dataclasses import replace

        spec = replace(spec, trials=trials)
    return run_case(LocalCaller(fn), spec, case, seed=11)


def _caching_add():
    cache = {}

    def add(a, b, out=None):
        key = (a.shape, a.dtype)
        if key not in cache:
            cache[key] = triton_add.add(a, b).clone()
        return out.copy_(cache[key])

    return add


def test_a_cached_output_is_named():
    result = _case_result(_caching_add())
    assert not result.ok
    assert result.reason.startswith(
        "called again with new values in the same input buffers: returned the previous "
        "call's result for new inputs: does it cache outputs between calls?"
    )
    assert result.detail["trial"] == 2
    assert _case_result(_caching_add(), trials=1).ok  # one call per case could not have caught it


def test_an_unwritten_torch_empty_does_not_pass_by_luck():
    def add(a, b, out=None):
        if out is not None:
            return triton_add.add(a, b, out=out)
        scratch = triton_add.add(a, b)  # the right values, in a buffer then freed ...
        del scratch
        return torch.empty_like(a)  # ... and an uninitialized result that might reuse it

    result = check_function(LAB, "add", add, seed=3, perf=False)
    if runtime.ON_GPU:
        # Not defended on a GPU: PyTorch's caching allocator hands the block just freed
        # straight back, so
        # the uninitialized result holds the scratch's right values, every time (grading/README.md).
        assert result.status == "pass", result.message
        return
    assert result.status == "fail"
    assert result.cases[-1].case == "without out=" and "elements wrong" in result.cases[-1].reason


def test_diagnosis_of_a_missing_tail_and_of_low_precision():
    case = Case((1025,), torch.float32)
    want = torch.randn(1025, dtype=torch.float64)
    atol, rtol = tolerance(torch.float32)
    got = want.float()
    got[1024:] = float("nan")
    cmp = compare(got, want, atol=atol, rtol=rtol)
    assert diagnose(case, got, want, cmp, atol, rtol) == (
        "wrong for n not a multiple of the block size (n=1025, first bad index 1024): the last 1 "
        "elements are wrong "
        "(never written); mask the loads and stores of the last block"
    )
    low = want.half().float()
    cmp = compare(low, want, atol=atol, rtol=rtol)
    assert diagnose(case, low, want, cmp, atol, rtol).startswith("rounding error up to ")
    assert "ulp of float32 where 1 is allowed: is it computed in a lower precision?" in diagnose(
        case, low, want, cmp, atol, rtol
    )
    nothing = torch.full((1025,), float("nan"))
    cmp = compare(nothing, want, atol=atol, rtol=rtol)
    assert diagnose(case, nothing, want, cmp, atol, rtol).startswith("no element was written")


def test_an_exception_is_reported_and_memory_errors_are_named():
    def add(a, b, out=None):
        raise MemoryError()

    result = _case_result(add)
    assert not result.ok and result.reason.startswith("ran out of host memory")
    assert result.detail["inputs"][0] == {
        "name": "a",
        "shape": [1025],
        "dtype": "float32",
        "stride": [1],
    }


def test_no_timing_without_a_gpu_and_stream_checks_only_on_one():
    result = check_function(LAB, "add", triton_add.add, seed=1, perf=True)
    assert result.status == "pass"
    out = torch.empty(8, device=DEVICE)
    with watch(snapshot=out) as seen:
        triton_add.add(torch.ones(8, device=DEVICE), torch.ones(8, device=DEVICE), out=out)
    if not runtime.ON_GPU:
        assert result.perf == [] and seen.stream_snapshot is None and seen.side_streams == 0
    else:
        assert [p.config for p in result.perf] == ["add/fp16/64M", "add/fp32/64M"]
        assert seen.stream_snapshot is not None and torch.equal(seen.stream_snapshot[0], out)


def _add_on_side_stream(synced: bool, side=None):
    def add(a, b, out=None):
        side_stream = side or torch.cuda.Stream()
        if synced:
            side_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side_stream):
            triton_add.add(a, b, out=out)
        if synced:
            torch.cuda.current_stream().wait_stream(side_stream)
        return out

    return add


def test_side_streams_gpu_only():
    """GPU: work left on a side stream fails correctness (every time: its launch is delayed), the
    same code with the two waits passes, and the timing of a side-stream call covers its kernel.
    CPU: there are no streams, which is asserted instead."""
    if not runtime.ON_GPU:
        assert runtime.MODE == "cpu" and runtime.DEVICE == "cpu"
        with watch(snapshot=torch.empty(4)) as seen:  # nothing to order without streams
            torch.empty(4)
        assert seen.stream_snapshot is None and seen.side_streams == 0
        return
    for _ in range(3):
        assert (
            "not ready on PyTorch's current stream"
            in _case_result(_add_on_side_stream(False)).reason
        )
    assert _case_result(_add_on_side_stream(True)).ok
    n = 32 * 2**20
    a, b = (
        torch.randn(n, device="cuda", dtype=torch.float16),
        torch.randn(n, device="cuda", dtype=torch.float16),
    )
    outs = {"main": torch.empty_like(a), "side": torch.empty_like(a)}
    unsynced = _add_on_side_stream(
        False, side=torch.cuda.Stream()
    )  # one stream: creating one per call is host time
    timings, wrong = harness.timed_rounds(
        {
            "main": lambda: triton_add.add(a, b, out=outs["main"]),
            "side": lambda: unsynced(a, b, out=outs["side"]),
        },
        lambda: None,
        lambda: torch.zeros((), device="cuda", dtype=torch.int64),
    )
    ratio = timings["side"].median_us / timings["main"].median_us
    assert 0.8 < ratio < 1.5, (timings["side"].median_us, timings["main"].median_us)
    assert wrong == [0] * len(wrong)


def _two_output_lab(fn_points=1):
    """A made-up function with two outputs, a case with a keyword parameter and a custom layout."""
    from grading.spec import GradedFunction, LabSpec

    def reference(a, b, flag=0):
        total = a.double() + b.double()
        return total, total

    def course(a, b, flag=0, out=None):
        return triton_add.add(a, b, out=out[0]), triton_add.add(a, b, out=out[1])

    spec = GradedFunction(
        name="twice",
        points=fn_points,
        backend="triton",
        description="out[0] = out[1] = a + b",
        make_inputs=lambda shape, dtype, device, gen: tuple(
            torch.randn(shape, device=device, generator=gen).to(dtype) for _ in range(2)
        ),
        reference_fp64=reference,
        tolerance=lambda dtype: tolerance(dtype),
        course_kernel=course,
        torch_native=course,
        bytes_moved=lambda a, b: 4 * a.numel() * a.element_size(),
        cases=(
            Case((1025,), torch.float32),
            Case((7,), torch.float16, "halved", params=(("flag", 1),)),
        ),
        prepare=lambda layout, inputs: tuple(t * 0.5 for t in inputs)
        if layout == "halved"
        else inputs,
        n_outputs=2,
        output_names=("s", "t"),
    )
    return LabSpec(id="xx_twice", title="two outputs", functions=(spec,))


def test_functions_with_several_outputs_parameters_and_layouts():
    lab = _two_output_lab()
    seen = []

    def twice(a, b, flag=0, out=None):
        seen.append((flag, a.clone()))  # a copy is allowed inside a graded call; computing is not
        s, t = (torch.empty_like(a), torch.empty_like(a)) if out is None else out
        return triton_add.add(a, b, out=s), triton_add.add(a, b, out=t)

    result = check_function(lab, "twice", twice, seed=2, perf=False)
    assert result.status == "pass", result.message
    assert [c.case for c in result.cases] == ["1025 float32", "7 float16 halved flag=1"]
    flagged = [a for flag, a in seen if flag == 1]
    assert flagged and all(
        float(a.abs().max()) < 3 for a in flagged
    )  # the "halved" layout was applied

    def forgets_t(a, b, flag=0, out=None):
        s, t = (torch.empty_like(a), torch.empty_like(a)) if out is None else out
        return triton_add.add(a, b, out=s), t

    result = check_function(lab, "twice", forgets_t, seed=2, perf=False)
    assert result.status == "fail"
    assert result.cases[0].reason.startswith("t: n=1025: 1025 of 1025 elements wrong")
    assert (
        "no element was written" in result.cases[0].reason
        and result.cases[0].detail["output"] == "t"
    )

    result = check_function(
        lab,
        "twice",
        lambda a, b, flag=0, out=None: triton_add.add(a, b, out=out[0]),
        seed=2,
        perf=False,
    )
    assert result.cases[0].reason == "returned Tensor, expected a tuple of 2 tensors (s, t)"


def _wasteful_add(scratch_elements: int):
    """Right answer, but it first fills a scratch buffer as large as N x N scores would be."""

    def add(a, b, out=None):
        scratch = torch.empty(scratch_elements, dtype=torch.float32, device=a.device)
        triton_add.add(scratch, scratch, out=scratch)
        return triton_add.add(a, b, out=out)

    return add


def test_a_memory_budget_is_enforced_on_the_gpu_only():
    from dataclasses import replace

    spec = replace(
        LAB.function("add"), memory_budget=lambda a, b: 4 * 2**20
    )  # 4 MiB beyond inputs/outputs
    case = Case((1025,), torch.float32)
    lean = run_case(LocalCaller(_wasteful_add(2**18)), spec, case, seed=5)  # 1 MiB of scratch
    assert lean.ok, lean.reason
    wasteful = run_case(LocalCaller(_wasteful_add(2**21)), spec, case, seed=5)  # 8 MiB
    if runtime.ON_GPU:
        assert not wasteful.ok
        assert (
            "allocated 8.0 MiB of device memory beyond its inputs and outputs at its peak; "
            "the budget is "
            "4.0 MiB" in wasteful.reason
        ), wasteful.reason
    else:  # PyTorch's CPU allocator keeps no peak: the budget is a GPU check, and says nothing here
        assert wasteful.ok, wasteful.reason


def test_allowed_ops_are_named_per_function():
    x = torch.randn(8, 8, device=DEVICE)
    with watch(allowed_ops=("aten.mm.default",)) as seen:
        torch.matmul(x, x)
        torch.softmax(x, -1)
    assert seen.forbidden_ops == ["torch.softmax (aten._softmax.default)"]


def _hidden(how: str, compute):
    """A graded function that computes with PyTorch where the calling thread's watcher cannot see
    it: in another thread, a thread pool, or under disabled dispatch modes."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from torch.utils._python_dispatch import _disable_current_modes

    def fn(*args, out=None, **kwargs):
        if how == "thread":
            worker = threading.Thread(target=lambda: compute(*args, out=out, **kwargs))
            worker.start()
            worker.join()
        elif how == "pool":
            with ThreadPoolExecutor(1) as pool:
                pool.submit(lambda: compute(*args, out=out, **kwargs)).result()
        else:
            with _disable_current_modes():
                compute(*args, out=out, **kwargs)
        return out

    return fn


def _rms_norm(x, w, eps=1e-6, out=None):
    return out.copy_(F.rms_norm(x, (x.shape[-1],), w, eps))


@pytest.mark.parametrize("how", ["thread", "pool", "disabled_modes"])
@pytest.mark.parametrize(
    "lab, name, compute",
    [
        ("01_elementwise_add", "add", lambda a, b, out=None: torch.add(a, b, out=out)),
        ("02_rmsnorm", "rms_norm", _rms_norm),
    ],
)
def test_pytorch_out_of_the_watchers_sight_is_caught(lab, name, compute, how):
    """The profiler sees every thread: F.rms_norm (a composite) is caught by its parts."""
    result = check_function(get_lab(lab), name, _hidden(how, compute), seed=3, perf=False)
    assert result.status == "fail", result.message
    assert "computes with PyTorch instead of its own kernel: aten." in result.message, (
        result.message
    )
    assert "outside this thread's watch" in result.message


def test_composite_conversions_are_not_computing():
    """`x.to(x.dtype)`, `.contiguous()`, `.flatten()`: composites whose parts are allowed."""
    x = torch.randn(4, 8, device=DEVICE)
    with watch() as seen:
        x.to(x.dtype).contiguous().flatten().reshape(8, 4).to(torch.float16)
    assert seen.forbidden_ops == [], seen.forbidden_ops


def test_stopping_the_grader_s_profiler_is_caught():
    def stops_it(a, b, out=None):
        torch.autograd._disable_profiler()
        return triton_add.add(a, b, out=out)

    result = check_function(LAB, "add", stops_it, seed=3, perf=False)
    assert result.status == "fail", result.message
    assert "stopped the grader's profiler inside the call" in result.message, result.message


def test_a_spec_with_only_strided_cases_is_graded():
    """The case profiled on a GPU is the largest plain contiguous one; a spec without any is still
    graded (it used to fail inside the grader on an empty max())."""
    from dataclasses import replace

    lab = get_lab("01_elementwise_add")
    add = lab.function("add")
    strided = tuple(c for c in add.cases if c.layout != "contiguous")
    assert strided, "lab 01 has a strided case"
    only_strided = replace(lab, functions=(replace(add, cases=strided, draw_cases=None),))
    result = check_function(only_strided, "add", triton_add.add, seed=3, perf=False)
    assert result.status == "pass", result.message
    assert [c.case for c in result.cases] == [c.label for c in strided]


class _Event:
    """A profiler event as `_AllThreads.findings` reads it."""

    def __init__(self, name, start, end, overload="", thread=1):
        self._name, self._overload, self._span, self._thread = name, overload, (start, end), thread

    def name(self):
        return self._name

    def overload_name(self):
        return self._overload

    def start_ns(self):
        return self._span[0]

    def end_ns(self):
        return self._span[1]

    def start_thread_id(self):
        return self._thread


def test_a_composite_that_ran_its_own_kernel_is_pytorch_compute():
    """On a GPU, F.rms_norm reaches aten::_fused_rms_norm, a composite for the CPU that runs one
    fused kernel on CUDA: nothing is recorded inside it, so it is the leaf. A composite that
    returns a view (contiguous) and did nothing is not; one whose parts were recorded is judged by
    its parts."""
    from grading.watch import CALL_RANGE, _AllThreads

    threads = _AllThreads()
    threads.events = [
        _Event(CALL_RANGE, 0, 100),
        _Event("aten::contiguous", 1, 2),  # a no-op on a contiguous tensor
        _Event("aten::rms_norm", 10, 40, thread=2),  # another thread: F.rms_norm on a GPU
        _Event("aten::_fused_rms_norm", 11, 39, thread=2),
        _Event("aten::empty_like", 12, 13, thread=2),  # its outputs: allocations only
        _Event("aten::empty", 14, 15, "memory_format", thread=2),
        _Event("aten::type_as", 50, 60),  # judged by its part
        _Event("aten::to", 51, 59, "dtype"),
        _Event("aten::_to_copy", 52, 58),
        _Event("aten::item", 70, 80),  # returns a number: lab 00 may read one
        _Event("aten::_local_scalar_dense", 71, 79),
    ]
    allowed = {"aten._to_copy.default", "aten.empty_like.default", "aten.empty.memory_format",
               "aten._local_scalar_dense.default"}
    assert threads.findings(allowed) == (["aten._fused_rms_norm.default"], [])


def test_wrong_timed_outputs_cost_the_correctness_points_and_tiers_are_read_here():
    """What the timed rounds reported is judged in the grading process: a wrong output in any of
    them takes the function's points back, and a tier is derived from the timings, never taken
    from the worker's word."""
    from grading.harness import judge_timed_outputs
    from grading.results import FunctionResult, PerfResult

    def function(*perfs):
        result = FunctionResult("add", "triton", "", "pass", 4, 4, perf=list(perfs))
        judge_timed_outputs(result)
        return result

    honest = function(PerfResult("64M", student_us=100.0, ratio_to_reference=0.95, correct=True,
                                 floor_us=80.0, tier="F"))
    assert honest.status == "pass" and honest.points == 4 and honest.perf[0].tier == "A"
    slow = function(PerfResult("64M", student_us=300.0, ratio_to_reference=0.3, correct=True,
                               floor_us=80.0, tier="A"))  # a tier the worker made up
    assert slow.points == 4 and slow.perf[0].tier == "F"
    too_fast = function(PerfResult("64M", student_us=10.0, ratio_to_reference=9.0, correct=True,
                                   floor_us=80.0, tier="A"))
    assert too_fast.perf[0].tier == "F"
    cached = function(PerfResult("64M", student_us=50.0, ratio_to_reference=1.9, correct=False,
                                 floor_us=40.0, tier="A", note="output wrong in 99 of 100"))
    assert cached.status == "fail" and cached.points == 0 and cached.perf[0].tier == "F"
    assert "performance 64M: output wrong in 99 of 100" in cached.message
    assert "the outputs of timed calls must be right too" in cached.message


@pytest.mark.parametrize("lab_id", sorted(LAB_MODULES))
def test_every_memory_budget_takes_its_cases_parameters(lab_id):
    """The budget is asked on the GPU only, with the case's parameters as keywords (lab 05's drawn
    ignore_index once reached a budget that took none, and every GPU grade of the lab failed):
    ask it here, for the fixed cases and those drawn for a few seeds."""
    budgets = [f for f in get_lab(lab_id).functions if f.memory_budget is not None]
    for spec in budgets:
        for seed in range(3):
            for case in spec.cases_for(seed):
                inputs = make_inputs(spec, case, torch.Generator().manual_seed(seed), device="cpu")
                budget = spec.memory_budget(*inputs, **case.kwargs)
                assert isinstance(budget, int) and budget > 0, (case, budget)
