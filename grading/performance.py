"""Performance (GPU only): the student's function timed in its worker, the course's kernel, PyTorch
and the hardware floor in a clean worker that never imports the student's code, in batches the
grading process interleaves (course kernel, student, PyTorch, course kernel, ...) and judges.

A batch is `kernels.bench.benchmark`'s method (L2 flushed, a spin ahead of each start event, CUDA
events) with new input values before every round and every round's output checked on the device;
kernels launched on side streams are joined before the end event, so hidden work is timed. What a
worker sends back is its batch's per-round times and wrong-element counts, as data; the ratio to
the course's kernel, the floor check and the tier are computed by `measure` in the grading process.
Nothing timed in the student's worker can slow the course's kernel (a launch hook installed at
import) or move the floor (a patched `torch.cuda.Event.elapsed_time` shrinks the student's times
only, which then fall below the floor the clean worker measured)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from grading import devices, watch
from grading.cases import make_inputs, new_outputs, out_argument, references
from grading.diagnosis import bad_mask
from grading.results import PerfResult
from grading.spec import Case, GradedFunction, PerfConfig
from kernels import bench, runtime
from kernels.testing import generator, poison_

# Boundaries as a fraction of the course kernel's speed in the same run.
TIERS = ((0.8, "A"), (0.7, "B"), (0.6, "C"), (0.4, "D"))
PERF_WARMUP_ROUNDS = 3
PERF_TARGET_MS = 200.0
PERF_MAX_ROUNDS = 100
PERF_MIN_ROUNDS = 10  # over all batches: a slow configuration is not timed 10 rounds a batch
# Batches per configuration: course kernel, student, PyTorch, then again. More batches follow
# drift more closely; each costs its warm-up rounds and its inputs made again.
PERF_BATCHES = 3
# The outside check: both sides called back to back for about this long, timed by the grading
# process; a reported ratio more than OUTSIDE_TOLERANCE times the outside one is judged on the
# outside one, and outside times below OUTSIDE_FLOOR of the floor get F.
WALL_TARGET_MS = 20.0
WALL_MIN_CALLS = 3
OUTSIDE_TOLERANCE = 1.5
OUTSIDE_FLOOR = 0.5
# The course kernel's back-to-back time over its event time above which the host sets the pace.
OUTSIDE_HOST_BOUND = 1.25
OUTSIDE_MIN_US = 50.0  # the course kernel's time below which the outside ratio is not judged


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
                 after_round: Callable[[], torch.Tensor], rounds: int | None = None,
                 target_ms: float = PERF_TARGET_MS, max_rounds: int = PERF_MAX_ROUNDS,
                 min_rounds: int = PERF_MIN_ROUNDS
                 ) -> tuple[dict[str, bench.Timing], list[int]]:
    """`kernels.bench.benchmark` (interleaved, rotated order, L2 flushed, a spin ahead of each start
    event, device events) with every call made with side streams joined (GPU), `before_round()`
    before each round (new input values, a freshly poisoned output) and `after_round()` after each
    timed round, returning a tensor (the number of wrong output elements) that is read only at the
    end, so checking never stalls the queue. `rounds` None: as many as fill `target_ms`. Returns
    the timings and each timed round's count."""
    def joined(call):
        def run():
            with watch.joined_side_streams():
                call()
        return run

    wrong = []
    timings = bench.benchmark({name: joined(call) if runtime.ON_GPU else call
                               for name, call in calls.items()},
                              reps=rounds, warmup=PERF_WARMUP_ROUNDS, target_ms=target_ms,
                              max_reps=max_rounds, min_reps=min_rounds,
                              before_round=before_round,
                              after_round=lambda: wrong.append(after_round()))
    return timings, [int(w) for w in torch.stack(wrong).tolist()]


def _config_case(config) -> Case:
    return Case(tuple(config.shape), config.dtype, params=tuple(config.params))


def config_json(config: PerfConfig) -> dict:
    """A configuration as a request carries it to a worker."""
    return {"id": config.id, **_config_case(config).as_json()}


def config_from_json(d: dict) -> PerfConfig:
    case = Case.from_json(d)
    return PerfConfig(str(d["id"]), case.shape, case.dtype, case.params)


def time_batch(fn, spec: GradedFunction, config, seed: int, rounds: int | None,
               course: bool = False) -> dict:
    """One batch of timed rounds of `fn` (called as the student's function is, with `out=`) on the
    configuration's inputs drawn from `seed`, in the process that calls it: the facts a worker
    sends back (per-round times, wrong elements per round, side streams used). `course`: the clean
    worker's batch of the course's own code, whose outputs are not checked (its rounds then cost
    no reference computation), with the bytes the call must move and the hardware floor."""
    gen = generator(seed, runtime.DEVICE)
    case = _config_case(config)
    kw = case.kwargs
    inputs = make_inputs(spec, case, gen, runtime.DEVICE)
    outs = new_outputs(spec, case, runtime.DEVICE)
    atol, rtol = spec.tolerance(config.dtype)
    side = {"streams": 0}

    def timed():
        fn(*inputs, **kw, out=out_argument(outs))
        if runtime.ON_GPU:
            side["streams"] = max(side["streams"], len(watch.ACTIVE.side_streams))

    def new_inputs():
        for t, fresh in zip(inputs, make_inputs(spec, case, gen, runtime.DEVICE)):
            t.copy_(fresh)
        for out in outs:
            poison_(out)

    def count_wrong():
        wants, scales = references(spec, inputs, kw)
        return sum(bad_mask(out, want, atol, rtol, scale).sum()
                   for out, want, scale in zip(outs, wants, scales))

    no_check = torch.zeros((), dtype=torch.int64, device=runtime.DEVICE)
    timings, wrong = timed_rounds({"timed": timed}, new_inputs,
                                  (lambda: no_check) if course else count_wrong, rounds,
                                  target_ms=PERF_TARGET_MS / PERF_BATCHES,
                                  max_rounds=-(-PERF_MAX_ROUNDS // PERF_BATCHES),
                                  min_rounds=-(-PERF_MIN_ROUNDS // PERF_BATCHES))
    facts = {"times_us": list(timings["timed"].times_us), "wrong": wrong,
             "side_streams": side["streams"]}
    if course:
        nbytes = spec.bytes_moved(*inputs, **kw)
        flops = spec.flops(*inputs, **kw) if spec.flops else 0.0
        facts.update(nbytes=int(nbytes), floor_us=floor_us(nbytes, flops, config.dtype))
    if runtime.ON_GPU:
        torch.cuda.synchronize()  # every stream: nothing of this batch runs into the next one
    return facts


def time_course(who: str, spec: GradedFunction, config, seed: int, rounds: int | None) -> dict:
    """A batch of the course's kernel ("reference") or PyTorch ("torch"), with the floor of the
    configuration: what the clean worker, which never imports the student's code, measures."""
    fn = {"reference": spec.course_kernel, "torch": spec.torch_native}[who]
    return time_batch(fn, spec, config, seed, rounds, course=True)


class BatchError(ValueError):
    """A batch reply that is not what `time_batch` returns: the student's code wrote it."""


def checked_batch(facts, rounds: int | None) -> dict:
    """A worker's batch as data, every field checked: times positive and finite, one per round
    (`rounds` as asked, where asked), wrong counts non-negative integers."""
    if not isinstance(facts, dict):
        raise BatchError(f"a timing reply that is a {type(facts).__name__}")
    times, wrong = facts.get("times_us"), facts.get("wrong")
    if (not isinstance(times, list) or not isinstance(wrong, list) or not times
            or len(times) != len(wrong) or (rounds is not None and len(times) != rounds)
            or not all(type(t) in (int, float) and math.isfinite(t) and t > 0 for t in times)
            or not all(type(w) is int and w >= 0 for w in wrong)
            or type(facts.get("side_streams", 0)) is not int):
        raise BatchError("a timing reply whose fields are not what a timed batch returns")
    return {"times_us": [float(t) for t in times], "wrong": wrong,
            "side_streams": facts.get("side_streams", 0)}


def wall_ready(fn, spec: GradedFunction, config, seed: int) -> Callable[[int], None]:
    """Inputs and outputs for `fn` on the configuration, one call made (compilation, autotuning)
    and the device synchronized; returns `go(calls)`, which calls `fn` that many times back to
    back and synchronizes the device: what the grading process times with its own clock."""
    case = _config_case(config)
    kw = case.kwargs
    inputs = make_inputs(spec, case, generator(seed, runtime.DEVICE), runtime.DEVICE)
    out = out_argument(new_outputs(spec, case, runtime.DEVICE))
    sync = torch.cuda.synchronize if runtime.ON_GPU else (lambda: None)

    def go(calls: int) -> None:
        for _ in range(calls):
            fn(*inputs, **kw, out=out)
        sync()  # every stream: the reply comes when the work is done

    go(1)
    return go


@dataclass
class Sides:
    """Where the two sides of a comparison are timed: `student(batch, rounds)` a batch of the
    student's function, `course(who, batch, rounds)` one of the course's kernel or PyTorch (facts
    of `time_batch`); `student_wall(calls)`, `course_wall(calls)` the seconds that many calls back
    to back took (`wall_ready`), on the grading process's own clock."""

    student: Callable[[int, int], dict]
    course: Callable[[str, int, int | None], dict]
    student_wall: Callable[[int], float]
    course_wall: Callable[[int], float]


def measure(sides: Sides, config, rows: dict | None) -> PerfResult:
    """Time one configuration: batches of the course's kernel, the student's function and PyTorch
    alternated `PERF_BATCHES` times (each batch on inputs of its own, the same for all three; the
    first course batch sets the rounds of every batch), then both sides called back to back on
    the grading process's clock. The result is computed here from those facts (`judge`): the
    student's worker never sees the course's times or the floor."""
    from grading import expected as expected_table

    batches = {"reference": [], "student": [], "torch": []}
    rounds = None
    floor = nbytes = None
    for b in range(PERF_BATCHES):
        ref = sides.course("reference", b, rounds)
        rounds = rounds or len(ref["times_us"])
        floor, nbytes = ref.get("floor_us"), ref.get("nbytes")
        batches["reference"].append(checked_batch(ref, rounds))
        batches["student"].append(checked_batch(sides.student(b, rounds), rounds))
        batches["torch"].append(checked_batch(sides.course("torch", b, rounds), rounds))
    timing = {who: bench.Timing(who, [t for b in found for t in b["times_us"]], "batches")
              for who, found in batches.items()}
    wrong = [w for b in batches["student"] for w in b["wrong"]]
    student_t = timing["student"]
    bad_rounds = [i for i, w in enumerate(wrong) if w]
    calls = max(WALL_MIN_CALLS, math.ceil(WALL_TARGET_MS * 1e3 / timing["reference"].median_us))
    outside_ref = 1e6 * sides.course_wall(calls) / calls
    outside = 1e6 * sides.student_wall(calls) / calls
    l2_bytes = runtime.gpu_info().l2_bytes if runtime.ON_GPU else 0
    result = PerfResult(
        config=config.id,
        student_us=student_t.median_us,
        reference_us=timing["reference"].median_us,
        torch_us=timing["torch"].median_us,
        spread_us=list(student_t.spread_us),
        ratio_to_reference=bench.ratio(timing["reference"], student_t),
        ratio_to_torch=bench.ratio(timing["torch"], student_t),
        gbps=student_t.gbps(nbytes) if nbytes else None,
        nbytes=nbytes,
        percent_of_floor=100 * floor / student_t.median_us if floor else None,
        correct=not bad_rounds,
        expected=expected_table.row(rows, config.id),
        floor_us=floor,
        rounds=len(wrong),
        wrong_rounds=len(bad_rounds),
        side_streams=max(b["side_streams"] for b in batches["student"]),
        outside_us=outside,
        outside_reference_us=outside_ref,
        outside_ratio=outside_ref / outside,
        outside_floor_us=floor if floor and nbytes and nbytes >= 2 * l2_bytes else None,
    )
    if bad_rounds:
        result.note = (f"output wrong in {len(bad_rounds)} of {len(wrong)} timed repetitions "
                       f"(first: repetition {bad_rounds[0] + 1}; inputs change before every "
                       f"repetition): not credited -- does it cache results between calls?")
    judge(result)
    return result


def judge(p: PerfResult) -> None:
    """The tier of one configuration from its facts, in the grading process. F: an output wrong in
    a timed round (or not timed), a reported median below 90% of the floor, or calls that, timed
    back to back from outside the worker, took less than half the floor where the inputs cannot
    stay in L2 ("did they do the work?"). Otherwise the tier of the ratio to the course's kernel:
    the reported one, unless it is more than `OUTSIDE_TOLERANCE` times the ratio seen from outside
    the worker (where the course's kernel is not launch-bound), which is then the one judged."""
    if not p.correct:
        p.tier = "F"
        p.note = p.note or "not timed: not credited"
        return
    if p.floor_us and p.student_us is not None and p.student_us < 0.9 * p.floor_us:
        p.tier = "F"
        p.note = "faster than the hardware floor for the bytes it must move: not credited"
        return
    if p.outside_floor_us and p.outside_us is not None \
            and p.outside_us < OUTSIDE_FLOOR * p.outside_floor_us:
        p.tier = "F"
        p.note = (f"its calls, timed back to back from outside its process, took "
                  f"{p.outside_us:.1f} us each, below the hardware floor of {p.floor_us:.1f} us: "
                  f"did they do the work? Not credited")
        return
    ratio = p.ratio_to_reference or 0.0
    # Where the course's kernel called back to back takes longer than its events say, the host's
    # launches set the pace (a few microseconds of work): that clock sees the host, not the GPU.
    # Below OUTSIDE_MIN_US a call's host side (a Python wrapper: 10-30 us) can set the pace of
    # the student's calls too. (In CPU mode both clocks are the host's.)
    comparable = not runtime.ON_GPU or (
        p.outside_reference_us is not None and p.reference_us is not None
        and p.reference_us >= OUTSIDE_MIN_US
        and p.outside_reference_us <= OUTSIDE_HOST_BOUND * p.reference_us)
    if comparable and p.outside_ratio is not None and ratio > OUTSIDE_TOLERANCE * p.outside_ratio:
        p.note = (f"its reported times ({ratio:.2f}x the course's kernel) disagree with its "
                  f"calls timed from outside its process ({p.outside_ratio:.2f}x): judged on the "
                  f"latter")
        ratio = p.outside_ratio
    p.tier = tier(ratio)
