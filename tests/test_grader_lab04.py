"""Lab 04's wrong submissions are caught, each with the reason a student can act on; the course's kernels
pass."""
import pytest

from grading.harness import check_function
from grading.labs import get_lab
from tests.grader_corpus_lab04 import CORPUS

LAB = get_lab("04_mixed_precision")


@pytest.mark.parametrize("mistake", sorted(CORPUS))
def test_wrong_submission_is_caught(mistake):
    name, factory, message, diagnosis = CORPUS[mistake]
    result = check_function(LAB, name, factory(mistake), seed=7, perf=False)
    assert result.status == "fail" and result.points == 0
    assert message in result.message, result.message
    assert diagnosis in result.message, result.message


@pytest.mark.parametrize("name", ["kahan_sum", "fp8_block_fake_quant"])
def test_reference_kernels_pass(name):
    result = check_function(LAB, name, LAB.function(name).course_kernel, seed=7, perf=False)
    assert result.status == "pass", result.message


def test_correct_submissions_pass():
    """The corpus's own code without a mistake: the corpus is wrong only where it says so."""
    for name, factory, *_ in CORPUS.values():
        result = check_function(LAB, name, factory("none"), seed=7, perf=False)
        assert result.status == "pass", result.message
