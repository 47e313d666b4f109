"""Lab 05's wrong submissions are caught, each with the reason a student can act on; the solution
passes."""

import random
from dataclasses import replace

import pytest

from grading.harness import check_function
from grading.labs import get_lab
from grading.spec import Case
from kernels import runtime
from tests.grader_corpus_lab05 import (
    CORPUS,
    DRAWN_CORPUS,
    GPU_ONLY,
    LARGE_VOCABULARY,
    forged_memory_record,
    streaming_submission,
    submission,
)

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


@pytest.mark.gpu
def test_a_forged_memory_record_is_judged_on_the_memory_seen_from_outside(tmp_path):
    """`python -m grading` on a notebook whose token_losses holds the whole logits and rewrites
    the worker's record to claim no memory beyond its inputs and outputs: the grading process's
    own reading of the worker's GPU memory (NVML) fails it, naming the 4096-token case."""
    import json

    from tests.grader_corpus_generic import TARGETS, lab_notebook_with
    from tests.test_grader_lab01 import LIMITS, grade, strict_json

    target = TARGETS["05_memory_profiling"]
    submission = forged_memory_record()
    (tmp_path / "student").mkdir()
    notebook = lab_notebook_with(target, submission.cells)
    (tmp_path / "student" / target.notebook).write_text(json.dumps(notebook))
    proc = grade(tmp_path / "student", "--lab", target.lab, "--out", tmp_path / "out",
                 "--seed", "1234", "--no-perf", *LIMITS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (lab,) = strict_json(tmp_path / "out" / "report.json")["labs"]
    graded = {f["name"]: f for f in lab["functions"]}["token_losses"]
    status, phrase = submission.expected(runtime.ON_GPU)["token_losses"]
    assert graded["status"] == status and graded["points"] == 0, graded["message"]
    assert phrase in graded["message"] and "n=4096" in graded["message"], graded["message"]
    assert not any("figure the worker reported only" in note for note in lab["notes"])


def only(cases, **changes):
    """The lab with token_losses graded on `cases` alone (no cases drawn from the seed)."""
    spec = replace(LAB.function("token_losses"), cases=tuple(cases), draw_cases=None, **changes)
    return replace(LAB, functions=(spec,))


SPEC = LAB.function("token_losses")
FIXED = tuple(c for c in SPEC.cases if c.shape[0] < 4096)  # a GPU adds 4096 tokens


def caught(mistake, case) -> str:
    """The message of grading the mistake on the first fixed case and `case`, which must fail."""
    result = check_function(
        only([SPEC.cases[0], case]), "token_losses", streaming_submission(mistake), seed=7,
        perf=False,
    )
    assert result.status == "fail" and result.points == 0
    assert result.message.startswith(f"1 of 2 cases fail; first: {case.label}: "), result.message
    return result.message


@pytest.mark.parametrize("mistake", sorted(DRAWN_CORPUS))
def test_only_a_drawn_case_catches(mistake):
    """Every fixed case lets the mistake through (one call each: it does not depend on the
    values); the class of cases drawn for it catches it, whatever the seed draws there."""
    index, phrase = DRAWN_CORPUS[mistake]
    fixed = check_function(
        only(FIXED, trials=1), "token_losses", streaming_submission(mistake), seed=7, perf=False
    )
    assert fixed.status == "pass", fixed.message
    case = SPEC.draw_cases(random.Random("cases 7"))[index]
    assert phrase in caught(mistake, case)


def test_a_vocabulary_past_32768_is_drawn_on_a_gpu():
    """The class a GPU draws (the interpreter would take 13 s) catches a kernel that stops at
    32768 vocabulary rows; in CPU mode the class's smallest members show it, 2 chunks past."""
    from grading.labs.lab05_memory_profiling import large_vocabulary_case

    mistake, phrase = LARGE_VOCABULARY
    fixed = check_function(
        only(FIXED, trials=1), "token_losses", streaming_submission(mistake), seed=7, perf=False
    )
    assert fixed.status == "pass", fixed.message
    draws = [large_vocabulary_case(random.Random(seed)) for seed in range(200)]
    assert all(c.shape[2] > 2**16 for c in draws) and max(c.shape[2] for c in draws) > 120000
    case = runtime.pick(gpu=draws[0], cpu=Case((3, 16, 32768 + 300), draws[0].dtype))
    assert phrase in caught(mistake, case)
    assert len(SPEC.draw_cases(random.Random("cases 7"))) == runtime.pick(gpu=5, cpu=4)


def test_every_draw_has_every_class():
    """Whatever the seed, each drawn class is there: what the corpus above relies on."""
    for seed in range(300):
        multiple, chunks, wide, ignoring = SPEC.draw_cases(random.Random(f"cases {seed}"))[:4]
        assert multiple.shape[0] % 64 == 0 and multiple.shape[0] > 64
        assert chunks.shape[2] % 256 == 0 and chunks.shape[1] % 2 == 1
        assert wide.shape[1] > 1024 and wide.shape[1] * wide.shape[2] > 2**17
        ignore_index = ignoring.kwargs["ignore_index"]
        assert 0 <= ignore_index < ignoring.shape[2] and ignoring.shape[0] > 3


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
