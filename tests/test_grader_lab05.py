"""Lab 05's wrong submissions are caught, each with the reason a student can act on; the solution
passes."""

import pytest

from grading.harness import check_function
from grading.labs import get_lab
from kernels import runtime
from tests.grader_corpus_lab05 import CORPUS, GPU_ONLY, submission

LAB = get_lab("05_memory_profiling")


@pytest.mark.parametrize("mistake", sorted(CORPUS))
def test_wrong_token_losses_is_caught(mistake):
    result = check_function(LAB, "token_losses", submission(mistake), seed=7, perf=False)
    assert result.status == "fail" and result.points == 0
    assert CORPUS[mistake] in result.message, result.message


@pytest.mark.parametrize("mistake", sorted(GPU_ONLY))
def test_materialized_logits_break_the_memory_budget(mistake):
    result = check_function(LAB, "token_losses", submission(mistake), seed=7, perf=False)
    if runtime.ON_GPU:
        assert result.status == "fail" and GPU_ONLY[mistake] in result.message, result.message
    else:  # the values are right: only a GPU's allocator sees the logits it should not store
        assert result.status == "pass", result.message


def test_course_kernel_passes():
    from kernels.memory_profiling import triton_chunked_loss

    result = check_function(
        LAB, "token_losses", triton_chunked_loss.token_losses, seed=7, perf=False
    )
    assert result.status == "pass", result.message


def test_estimator_check_passes_the_course_estimator_and_fails_a_wrong_one(capsys):
    from grading.labs.lab05_memory_profiling import check_estimator
    from kernels.memory_profiling import estimator, gpt

    def course(batch, seq, d_model, layers, heads, vocab):
        return estimator.estimate(
            gpt.GPTConfig(vocab, seq, d_model, layers, heads), batch, seq
        ).peak_step

    assert check_estimator(course)
    # forgetting that backward holds three (N, V) tensors at once, not one
    assert not check_estimator(
        lambda *a: course(*a)
        - 2 * estimator.estimate(gpt.GPTConfig(a[5], a[1], a[2], a[3], a[4]), a[0], a[1]).logits
    )
    assert "FAIL" in capsys.readouterr().out


def test_solution_full_marks_and_untouched_lab_zero(tmp_path):
    """`python -m grading` on the solution notebook and on the untouched lab, as an instructor
    runs it."""
    from tests.grading_cli import grade_solution_and_lab

    labs = grade_solution_and_lab(tmp_path, "05_memory_profiling_lab.ipynb")
    solution, stub = labs["solution"], labs["lab"]
    assert solution["score"]["points"] == solution["score"]["max_points"] == 6, solution
    assert stub["score"]["points"] == 0
    assert [f["status"] for f in stub["functions"]] == ["not implemented"]
