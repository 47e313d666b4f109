"""Performance (GPU only): the student's function, the course's kernel and PyTorch timed interleaved
with CUDA events and L2 flushed, as `kernels.bench.benchmark` does, but with new input values before
every round and every round's output checked on the device; kernels launched on side streams are
joined before the end event, so hidden work is timed."""
from __future__ import annotations

from typing import Callable

import torch

from grading import devices, watch
from grading.cases import make_inputs, new_outputs, out_argument, references
from grading.diagnosis import bad_mask
from grading.results import PerfResult
from grading.spec import Case, GradedFunction
from kernels import bench, runtime
from kernels.testing import generator, poison_

# Boundaries as a fraction of the course kernel's speed in the same run.
TIERS = ((0.8, "A"), (0.7, "B"), (0.6, "C"), (0.4, "D"))
PERF_WARMUP_ROUNDS = 3
PERF_TARGET_MS = 200.0
PERF_MAX_ROUNDS = 100


def tier(ratio_to_reference: float) -> str:
    for threshold, letter in TIERS:
        if ratio_to_reference > threshold:
            return letter
    return "F"


def floor_us(nbytes: float, flops: float, dtype: torch.dtype) -> float | None:
    """The time below which no kernel can go on this GPU: bytes over its measured copy bandwidth,
    flops over the fastest rate it has for `dtype` (grading/devices.py: a T4 has no bf16 tensor
    cores, so its fp16 rate; a rate the GPU lacks would flag honest kernels). A GPU missing from
    data/gpu_specs.yaml: its measured bf16 matmul rate where it has bf16, else bytes alone."""
    ceil = bench.ceilings()
    if ceil is None:
        return None
    rate = devices.fastest_tflops(runtime.gpu_info().slug, dtype)
    if rate is None and runtime.has("bf16"):
        rate = ceil["matmul_bf16_tflops"]
    compute = flops / (rate * 1e12) if flops and rate else 0.0
    return max(nbytes / (ceil["copy_gbps"] * 1e9), compute) * 1e6


def timed_rounds(calls: dict[str, Callable[[], object]], before_round: Callable[[], None],
                 after_round: Callable[[], torch.Tensor]
                 ) -> tuple[dict[str, bench.Timing], list[int]]:
    """`kernels.bench.benchmark` (interleaved, rotated order, L2 flushed, a spin ahead of each start
    event, device events) with every call made with side streams joined, `before_round()` before
    each round (new input values, a freshly poisoned output) and `after_round()` after each timed
    round, returning a device tensor (the number of wrong output elements) that is read only at the
    end, so checking never stalls the queue. Returns the timings and each timed round's count."""
    def joined(call):
        def run():
            with watch.joined_side_streams():
                call()
        return run

    wrong = []
    timings = bench.benchmark({name: joined(call) for name, call in calls.items()},
                              warmup=PERF_WARMUP_ROUNDS, target_ms=PERF_TARGET_MS,
                              max_reps=PERF_MAX_ROUNDS, before_round=before_round,
                              after_round=lambda: wrong.append(after_round()))
    return timings, [int(w) for w in torch.stack(wrong).tolist()]


def measure(fn, spec: GradedFunction, config, seed: int, expected_rows: dict | None) -> PerfResult:
    from grading import expected as expected_table

    gen = generator(seed, "cuda")
    case = Case(config.shape, config.dtype, params=config.params)
    kw = case.kwargs
    inputs = make_inputs(spec, case, gen, "cuda")
    outs = {name: new_outputs(spec, case, "cuda") for name in ("student", "reference", "torch")}
    atol, rtol = spec.tolerance(config.dtype)
    side = {"streams": 0}

    def student():
        fn(*inputs, **kw, out=out_argument(outs["student"]))
        side["streams"] = max(side["streams"], len(watch.ACTIVE.side_streams))

    def new_inputs():
        for t, fresh in zip(inputs, make_inputs(spec, case, gen, "cuda")):
            t.copy_(fresh)
        for out in outs["student"]:
            poison_(out)

    def count_wrong():
        wants, scales = references(spec, inputs, kw)
        return sum(bad_mask(out, want, atol, rtol, scale).sum()
                   for out, want, scale in zip(outs["student"], wants, scales))

    timings, wrong = timed_rounds({
        "student": student,
        "reference": lambda: spec.course_kernel(*inputs, **kw,
                                                out=out_argument(outs["reference"])),
        "torch": lambda: spec.torch_native(*inputs, **kw, out=out_argument(outs["torch"])),
    }, new_inputs, count_wrong)
    student_t = timings["student"]
    nbytes = spec.bytes_moved(*inputs, **kw)
    flops = spec.flops(*inputs, **kw) if spec.flops else 0.0
    floor = floor_us(nbytes, flops, config.dtype)
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
        result.note = (f"output wrong in {len(bad_rounds)} of {len(wrong)} timed repetitions "
                       f"(first: repetition {bad_rounds[0] + 1}; inputs change before every "
                       f"repetition): not credited -- does it cache results between calls?")
        result.tier = "F"
    elif floor and student_t.median_us < 0.9 * floor:
        result.note = "faster than the hardware floor for the bytes it must move: not credited"
        result.tier = "F"
    else:
        result.tier = tier(result.ratio_to_reference)
    return result
