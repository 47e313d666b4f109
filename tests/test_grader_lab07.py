"""Lab 07's wrong submissions are caught, each with the reason a student can act on; the course's
kernels pass."""
import pytest

from grading.harness import check_function
from grading.labs import get_lab
from tests.grader_corpus_lab07 import CORPUS

LAB = get_lab("07_decoder")


@pytest.mark.parametrize("mistake", sorted(CORPUS))
def test_wrong_submission_is_caught(mistake):
    function, submission, phrase = CORPUS[mistake]
    result = check_function(LAB, function, submission, seed=7, perf=False)
    assert result.status == "fail" and result.points == 0
    assert phrase in result.message, result.message


@pytest.mark.parametrize("function", ["rope", "argmax"])
def test_course_kernels_pass(function):
    from kernels.decoder import triton_ops, triton_rope

    kernel = {"rope": triton_rope.rope, "argmax": triton_ops.argmax}[function]
    result = check_function(LAB, function, kernel, seed=7, perf=False)
    assert result.status == "pass", result.message
