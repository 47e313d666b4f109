"""The course's kernel is timed in a clean worker (grading/protocol.py `CleanWorker`): a worker on
the same lab, in the same sandbox, that never imports the student's code. The grading process
alternates its batches with the student's worker's and computes the ratio itself
(grading/performance.py `measure`); the student's worker is stopped while the clean one runs.

In CPU mode the timings are the host's (they say nothing about a GPU), but everything that decides
where a number comes from runs: a submission whose import slows the course's kernel in its own
process leaves the course's times untouched. The GPU attacks are in tests/grader_corpus_lab01.py
`PERF_CORPUS`, graded by tests/test_grader_lab01.py."""
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from grading import performance, sandbox
from grading.labs import get_lab
from grading.protocol import (
    CleanWorker,
    GraderError,
    Options,
    WorkerCaller,
    WorkerProcess,
    worker_env,
)
from grading.spec import PerfConfig
from kernels import runtime

# The interpreter's path (deselected on a GPU, where test_grader_lab01's
# test_performance_is_judged_from_outside_the_student_s_worker grades the same forgeries).
cpu_only = pytest.mark.cpu

LAB = "01_elementwise_add"
TINY = PerfConfig("add/fp32/tiny", (4099,), torch.float32)  # a size the interpreter times fast
SLOW_S = 0.2  # what the hook below adds to every launch of the course's kernel

# The student's module: a correct add of its own; at import it marks the folder it was imported
# in and slows every launch of the course's kernel in its process (on a GPU the hook would queue a
# spin on the device; here the host timer sees a sleep).
STUDENT = textwrap.dedent(f"""
    import pathlib, time
    import triton
    import triton.language as tl
    from kernels.elementwise_add import triton_add as _course

    pathlib.Path("imported").write_text("the graded module was imported here")
    _course.add_kernel.pre_run_hooks.append(lambda *args, **kwargs: time.sleep({SLOW_S}))


    @triton.jit
    def _add_kernel(a_ptr, b_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        a = tl.load(a_ptr + offsets, mask=mask)
        b = tl.load(b_ptr + offsets, mask=mask)
        tl.store(out_ptr + offsets, a + b, mask=mask)


    def add(a, b, out=None):
        _add_kernel[(triton.cdiv(a.numel(), 8192),)](a, b, out, a.numel(), BLOCK=8192)
        return out
""")
# Rewrites the worker's timing replies: every round "took" a nanosecond.
FORGED_TIMES = textwrap.dedent("""
    import sys

    _worker = sys.modules["__main__"].Worker
    _honest = _worker.op_perf

    def _forged(self, req):
        reply = _honest(self, req)
        reply["result"]["times_us"] = [1e-3] * len(reply["result"]["times_us"])
        return reply

    _worker.op_perf = _forged
""")


class WatchedClean(CleanWorker):
    """Records, at each of its batches, the state of the student's worker (/proc: "T" stopped)."""

    student_pid = 0
    states: list = []

    def time(self, *args, **kwargs):
        stat = Path(f"/proc/{self.student_pid}/stat").read_text()
        self.states.append(stat.rpartition(")")[2].split()[0])
        return super().time(*args, **kwargs)


def _measure(tmp_path: Path, module: str):
    """Time TINY through a student worker on `module` and a clean worker: (result, the student's
    folder, the clean worker's folder, the student worker's states seen at each clean batch)."""
    opts = Options(cpu=True)
    sandboxed = sandbox.status()[0]
    cmd = [sys.executable, "-m", "grading.worker", "--lab", LAB, *opts.worker_args()]
    env = worker_env(opts)
    deadline = time.monotonic() + 300
    student_dir = tmp_path / "student"
    student_dir.mkdir()
    (student_dir / f"student_{LAB}.py").write_text(module)
    worker = WorkerProcess(cmd, student_dir, deadline, opts, env, sandboxed)
    clean = WatchedClean(cmd, tmp_path / "clean", deadline, opts, env, sandboxed,
                         seed_caches=False)
    clean.student_pid, clean.states = worker.pid, []
    clean.start()
    clean_dir = clean.worker_folder
    # The graded module beside the clean worker too: it is still never imported there.
    (clean_dir / f"student_{LAB}.py").write_text(module)
    try:
        worker.set_step(None, "start", "import")
        worker.receive()
        assert worker.request({"op": "import"})["import_error"] is None
        caller = WorkerCaller(worker, student_dir, "add", clean)
        result = caller.measure(get_lab(LAB).function("add"), TINY, 7, None)
        with pytest.raises(GraderError, match="a clean worker imports no student code"):
            clean.worker.request({"op": "import"})
        return result, student_dir, clean_dir, clean.states
    finally:
        clean.close()
        worker.close()


@cpu_only
def test_the_course_kernel_is_timed_where_the_student_s_code_never_ran(tmp_path):
    result, student_dir, clean_dir, states = _measure(tmp_path, STUDENT)
    assert (student_dir / "imported").exists()
    assert not (clean_dir / "imported").exists()  # the clean worker never imported it
    batches = performance.PERF_BATCHES
    assert result.rounds and result.rounds % batches == 0 and result.wrong_rounds == 0, result
    assert result.correct and result.student_us > 0 and result.ratio_to_reference > 0, result
    # Every launch of the course's kernel in the student's process sleeps SLOW_S: timed there,
    # the reference would take that long at least.
    assert result.reference_us < 1e6 * SLOW_S / 2, result
    # The student's worker was stopped during every batch of the clean one (reference, PyTorch).
    assert states == ["T"] * (2 * batches), states


@cpu_only
def test_forged_times_are_judged_on_the_calls_timed_from_outside(tmp_path):
    """Times of a nanosecond a round, the work still done: the reported ratio is millions, the
    back-to-back calls timed on the grading process's clock say otherwise, and the tier is theirs
    (on a GPU the reported median also falls below the clean worker's floor: F)."""
    result, *_ = _measure(tmp_path, STUDENT + FORGED_TIMES)
    assert result.student_us == pytest.approx(1e-3) and result.ratio_to_reference > 1e3, result
    assert result.reference_us < 1e6 * SLOW_S / 2, result
    assert 0 < result.outside_ratio < 10, result  # the same work as the course's kernel
    assert "disagree with its calls timed from outside its process" in result.note, result
    assert result.tier == performance.tier(result.outside_ratio), result


def test_the_tier_rests_on_the_outside_ratio_when_the_reported_one_is_far_better():
    from grading.results import PerfResult

    def judged(**facts):
        p = PerfResult("64M", **{"student_us": 100.0, "correct": True, "floor_us": 50.0,
                                 "reference_us": 90.0, "outside_reference_us": 85.0, **facts})
        performance.judge(p)
        return p

    assert judged(ratio_to_reference=0.9, outside_ratio=0.8).tier == "A"  # they agree
    forged = judged(ratio_to_reference=0.9, outside_ratio=0.3)  # a clock that runs slow
    assert forged.tier == "F" and "judged on the latter" in forged.note
    nothing_done = judged(ratio_to_reference=0.9, outside_ratio=5.0, outside_us=10.0,
                          outside_floor_us=50.0)
    assert nothing_done.tier == "F" and "did they do the work?" in nothing_done.note
    in_l2 = judged(ratio_to_reference=0.9, outside_ratio=1.0, outside_us=10.0)  # no floor: L2
    assert in_l2.tier == "A"
    if runtime.ON_GPU:  # the course's kernel is launch-bound back to back: that clock is the host's
        launch_bound = judged(ratio_to_reference=0.9, outside_ratio=0.3, outside_reference_us=200)
        assert launch_bound.tier == "A"
        short = judged(ratio_to_reference=0.9, outside_ratio=0.3, reference_us=20.0,
                       outside_reference_us=20.0, student_us=22.0, floor_us=1.0)
        assert short.tier == "A"  # a 20 us kernel: the host may set the student's pace
    below_floor = judged(ratio_to_reference=9.0, student_us=10.0)
    assert below_floor.tier == "F" and "faster than the hardware floor" in below_floor.note


@cpu_only
def test_a_clean_worker_that_dies_costs_the_tier_not_the_points(tmp_path):
    """The clean worker is the grader's: if it cannot time the course's kernel (here it cannot
    even start), the configuration gets F with the reason, and the function keeps the points its
    correct outputs earned (a wrong timed output is what takes them back)."""
    from grading.harness import judge_timed_outputs
    from grading.results import FunctionResult

    opts = Options(cpu=True)
    student_dir = tmp_path / "student"
    student_dir.mkdir()
    (student_dir / f"student_{LAB}.py").write_text(STUDENT)
    cmd = [sys.executable, "-m", "grading.worker", "--lab", LAB, *opts.worker_args()]
    worker = WorkerProcess(cmd, student_dir, time.monotonic() + 300, opts, worker_env(opts))
    broken = CleanWorker([sys.executable, "-c", "raise SystemExit(3)"], tmp_path / "clean",
                         time.monotonic() + 300, opts, worker_env(opts), False, False)
    try:
        worker.set_step(None, "start", "import")
        worker.receive()
        worker.request({"op": "import"})
        perf = WorkerCaller(worker, student_dir, "add", broken).measure(
            get_lab(LAB).function("add"), TINY, 7, None)
    finally:
        broken.close()
        worker.close()
    assert perf.tier == "F" and "the course's kernel could not be timed" in perf.note, perf
    assert "exited with code 3" in perf.note, perf
    result = FunctionResult("add", "triton", "", "pass", 3, 3, perf=[perf])
    judge_timed_outputs(result)
    assert result.status == "pass" and result.points == 3 and perf.tier == "F"
