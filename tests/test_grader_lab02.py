"""Lab 02's wrong submissions are caught, each with the reason a student can act on."""

import pytest

from grading.harness import check_function
from grading.labs import get_lab
from tests.grader_corpus_lab02 import CORPUS, DIAGNOSIS, submission

LAB = get_lab("02_rmsnorm")


@pytest.mark.parametrize("mistake", sorted(CORPUS))
def test_wrong_rmsnorm_is_caught(mistake):
    result = check_function(LAB, "rms_norm", submission(mistake), seed=7, perf=False)
    assert result.status == "fail" and result.points == 0
    # which of a case's two calls fails first depends on the random values, which differ between
    # modes
    message = result.message.replace("called again with new values in the same input buffers: ", "")
    assert CORPUS[mistake] in message, result.message
    assert DIAGNOSIS[mistake] in result.message, result.message


def test_reference_kernel_passes():
    from kernels.rmsnorm import triton_rmsnorm

    result = check_function(LAB, "rms_norm", triton_rmsnorm.rms_norm, seed=7, perf=False)
    assert result.status == "pass", result.message
