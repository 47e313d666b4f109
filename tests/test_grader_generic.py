"""The generic mistakes, in labs 02-06 (tests/grader_corpus_generic.py): each is caught, in
this mode, with the reason the grader must give; the solution is flagged by none of them.

`[gpu-only]` marks a mistake only a GPU can show: on a CPU the test asserts what the interpreter
shows instead (its `cpu` expectation, as lab 01's corpus does), on a GPU the failure itself:

    KERNELS_MODE=gpu python -m pytest tests/test_grader_generic.py
"""

import pytest

from grading.harness import check_function
from grading.labs import get_lab
from kernels import runtime
from tests.grader_corpus_generic import (
    IN_PROCESS,
    PROCESS_LEVEL,
    TARGETS,
    Target,
    graded_module,
    lab_notebook_with,
    mistake,
)
from tests.grader_corpus_lab01 import PASS, Submission
from tests.test_grader_lab01 import LIMITS, grade, strict_json

STUB_STATUSES = ("not implemented", "needs a GPU")  # the lab's other functions, left as handed out
# Lab 01's limits, with 15 s a call: the slowest honest call of a target function takes 3.3 s of
# CPU time in the interpreter (flash_attention's largest case; rms_norm's 0.8 s). The limit counts
# CPU time (grading/runner.py), so a machine busy with other work (two gradings and two test
# workers at once on 2 cores, or stress-ng beside it) does not turn a slow call into a "hang".
CASE_SECONDS = 15
# The infinite loops are graded in a run of their own, where no target function is ever called
# honestly (each hangs in its first case; the lab's other functions are stubs that raise at once):
# on a CPU its slowest honest step is starting the grader's worker, which imports torch in under
# 3 s of CPU time, so the loops are stopped at 8 s instead of 15 (35 s of CPU time less for the 5
# labs). A GPU worker's start also brings up CUDA, unmeasured here: it keeps CASE_SECONDS.
HANG_SECONDS = runtime.pick(gpu=CASE_SECONDS, cpu=8)
HANGS = ("infinite_loop",)


def runner_limits(call_seconds: int) -> list[str]:
    """Lab 01's limits, with `call_seconds` of CPU time a call."""
    at = LIMITS.index("--call-timeout")
    return [*LIMITS[:at], "--call-timeout", str(call_seconds), *LIMITS[at + 2 :]]


def cases(names):
    return [
        pytest.param(
            lab, name, id=f"{lab}-{name}" + ("[gpu-only]" if mistake(target, name).gpu_only else "")
        )
        for lab, target in TARGETS.items()
        for name in names
    ]


def matches(status: str, message: str, expected: tuple[str, str]) -> bool:
    want_status, phrase = expected
    return status == want_status and phrase in message


def check(target: Target, cells: dict[str, str], folder):
    module = graded_module(target, cells, folder)
    return check_function(
        get_lab(target.lab), target.function, getattr(module, target.function), seed=7, perf=False
    )


@pytest.mark.parametrize("lab, name", cases(IN_PROCESS))
def test_mistake_is_caught(lab, name, tmp_path):
    target = TARGETS[lab]
    submission = mistake(target, name)
    result = check(target, submission.cells, tmp_path)
    expected = submission.expected(runtime.ON_GPU)[target.function]
    assert matches(result.status, result.message, expected), (
        expected,
        result.status,
        result.message,
    )
    assert result.points == (result.max_points if expected == PASS else 0)


@pytest.mark.parametrize("lab", sorted(TARGETS))
def test_solution_is_flagged_by_no_mistake(lab, tmp_path):
    """The negative check: the expectations can say no. The solution passes with full points, and
    matches no failing expectation of any mistake, in either mode."""
    target = TARGETS[lab]
    result = check(target, {}, tmp_path)
    assert result.status == "pass" and result.points == result.max_points > 0, result.message
    for name in IN_PROCESS + PROCESS_LEVEL:
        submission = mistake(target, name)
        for expected in (submission.expect, submission.cpu or {}):
            if target.function in expected and expected[target.function] != PASS:
                assert not matches(result.status, result.message, expected[target.function]), name


def test_every_mistake_changes_the_solution():
    """A mistake whose rewrite left the solution as it was would test nothing."""
    for target in TARGETS.values():
        for name in IN_PROCESS + PROCESS_LEVEL:
            cells = mistake(target, name).cells
            assert any(source != target.solution.cells[gid] for gid, source in cells.items()), (
                target.lab,
                name,
            )


# --------------------------------------------------------------------------------------------------
# Hangs, memory exhaustion, crashes, edited check cells: only the runner's watched worker can grade
# them. Two `python -m grading --submissions` runs (the hangs at HANG_SECONDS, the rest at
# CASE_SECONDS): a student per mistake, each handing in every lab with that mistake in its target
# function (the other functions left as handed out, so they cost no time).


@pytest.fixture(scope="module")
def graded_by_runner(tmp_path_factory):
    import json

    graded = {}
    the_rest = tuple(name for name in PROCESS_LEVEL if name not in HANGS)
    runs = [(HANGS, HANG_SECONDS), (the_rest, CASE_SECONDS)]
    for names, call_seconds in runs:
        root = tmp_path_factory.mktemp("submissions")
        for name in names:
            (root / name).mkdir()
            for target in TARGETS.values():
                notebook = lab_notebook_with(target, mistake(target, name).cells)
                (root / name / target.notebook).write_text(json.dumps(notebook))
        out = tmp_path_factory.mktemp("grades")
        proc = grade(
            "--submissions",
            root,
            "--out",
            out,
            "--seed",
            "1234",
            "--jobs",
            "2",
            "--no-perf",
            *runner_limits(call_seconds),
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        for name in names:
            for lab in strict_json(out / "students" / name / "report.json")["labs"]:
                graded[(name, lab["lab"])] = lab
    return graded


@pytest.mark.parametrize("lab, name", cases(PROCESS_LEVEL))
def test_process_level_mistake_is_caught(graded_by_runner, lab, name):
    """The mistake costs its function, with the reason; the lab's other functions are still
    graded."""
    target = TARGETS[lab]
    submission: Submission = mistake(target, name)
    report = graded_by_runner[(name, lab)]
    functions = {f["name"]: f for f in report["functions"]}
    graded = functions.pop(target.function)
    expected = submission.expected(runtime.ON_GPU)[target.function]
    assert matches(graded["status"], graded["message"], expected), (
        expected,
        graded["status"],
        graded["message"],
    )
    assert graded["points"] == (graded["max_points"] if expected == PASS else 0)
    assert all(f["status"] in STUB_STATUSES for f in functions.values()), functions
    for phrase in submission.notes:
        assert any(phrase in note for note in report["notes"]), report["notes"]
