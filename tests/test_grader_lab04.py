"""Lab 04's wrong submissions are caught, each with the reason a student can act on; the course's
kernels
pass."""

import random
from dataclasses import replace

import pytest

from grading.harness import check_function
from grading.labs import get_lab
from kernels import runtime
from tests.grader_corpus_lab04 import CORPUS, DRAWN_CORPUS

LAB = get_lab("04_mixed_precision")


@pytest.mark.parametrize("mistake", sorted(CORPUS))
def test_wrong_submission_is_caught(mistake):
    name, factory, message, diagnosis = CORPUS[mistake]
    result = check_function(LAB, name, factory(mistake), seed=7, perf=False)
    assert result.status == "fail" and result.points == 0
    assert message in result.message, result.message
    assert diagnosis in result.message, result.message


def only(name, cases, **changes):
    """The lab with function `name` graded on `cases` alone (no cases drawn from the seed)."""
    spec = replace(LAB.function(name), cases=tuple(cases), draw_cases=None, **changes)
    return replace(LAB, functions=(spec,))


def drawn(name, seed: int) -> tuple:
    """The cases function `name` draws for `seed`, as the grader draws them."""
    return LAB.function(name).draw_cases(random.Random(f"cases {seed}"))


@pytest.mark.parametrize("mistake", sorted(DRAWN_CORPUS))
def test_only_a_drawn_case_catches(mistake):
    """Every fixed case lets the mistake through (one call each: it does not depend on the
    values); the class of cases drawn for it catches it, whatever the seed draws there."""
    name, factory, index, phrase = DRAWN_CORPUS[mistake]
    spec = LAB.function(name)
    fixed = check_function(
        only(name, spec.cases, trials=1), name, factory(mistake), seed=7, perf=False
    )
    # a GPU's fixed rows are 65536 long, a multiple of its 1024-lane block: caught there already
    blind = not (runtime.ON_GPU and mistake == "skips_last_full_block")
    assert (fixed.status == "pass") == blind, fixed.message
    case = drawn(name, 7)[index]
    # behind the first fixed case where it lets the mistake through (the harness wants a
    # contiguous case to profile); on a GPU that case catches this one already (above)
    cases = [spec.cases[0], case] if blind else [case]
    result = check_function(only(name, cases), name, factory(mistake), seed=7, perf=False)
    assert result.status == "fail" and result.points == 0
    assert result.message.startswith(
        f"1 of {len(cases)} cases fail; first: {case.label}: "
    ), result.message
    assert phrase in result.message, result.message


def test_every_draw_has_every_class():
    """Whatever the seed, each drawn class is there: what the corpus above relies on."""
    for seed in range(300):
        multiple, long_rows, padded = drawn("kahan_sum", seed)
        assert int(multiple.layout.removeprefix("n=")) % 16384 == 0
        n = int(long_rows.layout.removeprefix("n="))
        assert n % 2 == 0 and n > 2**17
        assert padded.layout.startswith("padded n=")
        whole, cube, large, scalar = drawn("fp8_block_fake_quant", seed)
        assert whole.shape[0] * whole.shape[1] % 32768 == 0
        assert len(cube.shape) == 3
        numel = large.shape[0] * large.shape[1]
        assert numel > 2**17 and numel % 2 == 0 and numel % 128
        assert scalar.shape == ()


@pytest.mark.parametrize("name", ["kahan_sum", "fp8_block_fake_quant"])
def test_reference_kernels_pass(name):
    result = check_function(LAB, name, LAB.function(name).course_kernel, seed=7, perf=False)
    assert result.status == "pass", result.message


def test_correct_submissions_pass():
    """The corpus's own code without a mistake: the corpus is wrong only where it says so. Several
    mistakes share a submission factory, whose code without a mistake is graded once."""
    for name, factory in dict.fromkeys((name, factory) for name, factory, *_ in CORPUS.values()):
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
