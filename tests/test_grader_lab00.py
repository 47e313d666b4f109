"""Lab 00 (profiling): wrong answers and wrong fixes are caught with a reason; the solution passes;
on a GPU a correct fix that is no faster than the slow kernel gets a failing speed grade."""


import pytest

from grading.harness import check_function
from grading.labs import get_lab
from kernels import runtime
from kernels.profiling import lab
from tests.grader_corpus_lab00 import BOTTLENECK, NOT_FASTER, RIGHT_FIX, TRANSPOSE, answer
from tests.grading_cli import grade_solution_and_lab

LAB = get_lab("00_profiling")


@pytest.mark.parametrize("name", sorted(BOTTLENECK))
def test_wrong_answer_is_caught(name):
    fn, phrase = BOTTLENECK[name]
    result = check_function(LAB, "bottleneck", fn, seed=3, perf=False)
    assert result.status == "fail" and result.points == 0
    assert phrase in result.message, result.message


def test_right_answer_passes_and_is_the_committed_profiles():
    values, _ = lab.readings()
    result = check_function(LAB, "bottleneck", answer(lab.ANSWER, lab.ANSWER), seed=3, perf=False)
    assert result.status == "pass", result.message
    # the answer is the uncoalesced loads: each bf16 element (2 bytes) costs a 32-byte sector
    assert values[lab.ANSWER] > 8


@pytest.mark.parametrize("name", sorted(TRANSPOSE))
def test_wrong_fix_is_caught(name):
    fn, phrase = TRANSPOSE[name]
    result = check_function(LAB, "transpose", fn, seed=3, perf=False)
    assert result.status == "fail" and result.points == 0
    assert phrase in result.message, result.message


def test_fix_that_is_not_faster():
    result = check_function(LAB, "transpose", NOT_FASTER, seed=3, perf=None)
    assert result.status == "pass", result.message  # correct: only the timing can tell
    if not runtime.ON_GPU:
        assert not result.perf
        return
    [perf] = result.perf
    assert perf.correct and perf.tier in "DF", perf  # below 60% of the course's fix


def test_right_fix_passes():
    result = check_function(LAB, "transpose", RIGHT_FIX, seed=3, perf=False)
    assert result.status == "pass", result.message


def test_solution_full_marks_and_untouched_lab_zero(tmp_path):
    """`python -m grading` on the solution notebook and on the untouched lab, as an instructor runs
    it."""
    labs = grade_solution_and_lab(tmp_path, "00_profiling_lab.ipynb")
    solution, stub = labs["solution"], labs["lab"]
    assert solution["score"]["points"] == solution["score"]["max_points"] == 8, solution
    assert stub["score"]["points"] == 0
    assert [f["status"] for f in stub["functions"]] == ["not implemented", "not implemented"]
