"""Lab 04's wrong submissions are caught, each with the reason a student can act on; the course's
kernels
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


def test_solution_gets_full_marks_and_the_untouched_lab_zero(tmp_path):
    """`python -m grading`, as an instructor runs it, on the lab with the solution's code and on
    the stub."""
    import json
    import subprocess
    import sys

    import nbformat

    from grading.notebooks import LABS_DIR, SOLUTIONS_DIR, grade_id, role
    from kernels import runtime

    name = "04_mixed_precision_lab.ipynb"
    solution = {
        grade_id(c): c.source
        for c in nbformat.read(SOLUTIONS_DIR / name, as_version=4).cells
        if grade_id(c)
    }
    lab = nbformat.read(LABS_DIR / name, as_version=4)
    for cell in lab.cells:
        if role(cell) == "solution":
            cell.source = solution[grade_id(cell)]
    (tmp_path / "solution").mkdir()
    nbformat.write(lab, tmp_path / "solution" / name)
    (tmp_path / "stub").mkdir()
    (tmp_path / "stub" / name).write_bytes((LABS_DIR / name).read_bytes())
    out = tmp_path / "report"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "grading",
            tmp_path / "solution",
            tmp_path / "stub",
            "--out",
            out,
            "--seed",
            "1234",
            "--no-perf",
            "--call-timeout",
            str(runtime.pick(gpu=60, cpu=60)),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    labs = {
        p["notebook"].split("/")[-2]: p
        for p in json.loads((out / "report.json").read_text())["labs"]
    }
    solved, stub = labs["solution"], labs["stub"]
    assert solved["score"]["points"] == solved["score"]["max_points"] > 0, solved
    cupy = "pass" if runtime.cupy_status()[0] else "needs a GPU"
    assert {f["name"]: f["status"] for f in solved["functions"]} == {
        "kahan_sum": "pass",
        "kahan_sum_cuda": cupy,
        "fp8_block_fake_quant": "pass",
    }
    assert stub["score"]["points"] == 0
    assert all(f["status"] in ("not implemented", "needs a GPU") for f in stub["functions"])
