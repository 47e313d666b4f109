"""Lab 02b: the solution gets full marks, the untouched lab zero, and every wrong matrix product in
the corpus (tests/grader_corpus_lab02b.py) is caught with the reason a student can act on -- in
this mode. The CUDA C mistakes show on a GPU; on a CPU their function says it needs one."""

import random
from dataclasses import replace

import pytest
import torch

from grading import watch
from grading.harness import check_function
from grading.labs import get_lab
from kernels import runtime
from tests.grader_corpus_lab02b import CORPUS, SOLUTION
from tests.grading_cli import grade_solution_and_lab

LAB = get_lab("02b_matmul")


@pytest.mark.parametrize(
    "name", sorted(CORPUS), ids=lambda n: n + ("[gpu-only]" if CORPUS[n].gpu_only else "")
)
def test_submission_is_classified(name, tmp_path):
    submission = CORPUS[name]
    module = SOLUTION.module(submission.cells, tmp_path)
    for function, (status, phrase) in submission.expected(runtime.ON_GPU).items():
        result = check_function(LAB, function, getattr(module, function), seed=7, perf=False)
        assert result.status == status, (function, result.message)
        assert phrase in result.message, result.message
        if status == "fail":
            assert result.points == 0
            assert submission.diagnosis in result.message, result.message


def test_every_triton_mistake_runs_in_both_modes():
    """The CPU shows every Triton mistake; only the CUDA C part waits for a GPU."""
    cpu_only_shows = {n for n, s in CORPUS.items() if not s.gpu_only}
    assert cpu_only_shows == {n for n in CORPUS if not n.startswith("cuda_")}
    assert all("matmul" in s.expect for n, s in CORPUS.items() if n in cpu_only_shows)


def test_every_draw_has_every_class():
    """Whatever the seed, each drawn class is there: odd sides, multiples of 128, a transposed
    operand, a skinny M."""
    for seed in range(300):
        odd, whole, transposed, skinny = LAB.function("matmul").draw_cases(
            random.Random(f"cases {seed}")
        )
        assert all(side % 2 == 1 for side in odd.shape)
        assert all(side % 128 == 0 for side in whole.shape)
        assert "t" in transposed.layout and all(side % 2 == 1 for side in transposed.shape)
        assert 2 <= skinny.shape[0] <= 32


def test_course_triton_kernel_passes():
    from kernels.matmul import triton_matmul

    # the course's own kernel, so the check that forbids it in a submission is off
    lab = replace(LAB, functions=(replace(LAB.function("matmul"), own_kernels_only=False),))
    result = check_function(lab, "matmul", triton_matmul.matmul, seed=7, perf=False)
    assert result.status == "pass", result.message


def test_solution_gets_full_marks_and_the_untouched_lab_zero(tmp_path):
    """`python -m grading` on the solution notebook and the untouched lab, as an instructor runs
    it."""
    labs = grade_solution_and_lab(tmp_path, "02b_matmul_lab.ipynb")
    solution, stub = labs["solution"], labs["lab"]
    statuses = {f["name"]: f["status"] for f in solution["functions"]}
    cuda_status = runtime.pick(gpu="pass", cpu="needs a GPU")
    assert statuses == {"matmul_cuda": cuda_status, "matmul": "pass"}, solution["functions"]
    # a CPU grades the Triton part alone: the CUDA C part's points wait for a GPU
    max_points = runtime.pick(gpu=10, cpu=5)
    assert solution["score"]["points"] == solution["score"]["max_points"] == max_points
    assert stub["score"]["points"] == 0
    assert {f["status"] for f in stub["functions"]} <= {"not implemented", "needs a GPU"}


def test_a_cupy_kernel_compiled_from_the_course_s_cuda_c_is_the_course_s():
    """CPU mode cannot launch CuPy: what the launch hook is given is a RawKernel, and whether it
    is the course's is read from its code (RawModule.get_function's kernels carry the module's),
    its options and the file it was loaded from. The corpus's cuda_calls_the_course_kernel and
    cuda_compiles_the_course_source show it on a GPU."""
    from types import SimpleNamespace as RawKernel

    from kernels import cuda

    course = cuda.source_path("matmul/matmul_register.cu")
    text = course.read_text()
    caught = {
        "the file's text": RawKernel(code=text, name="matmul_register_bf16"),
        "with comments and spacing changed": RawKernel(
            code="// mine\n" + text.replace("\n", "\n\n"), name="k"
        ),
        "a course header included": RawKernel(code='#include "../matmul/matmul_tiles.cuh"\n',
                                              name="k"),
        "pre-included by an option": RawKernel(code="", options=("-include", "matmul_tiles.cuh"),
                                               name="k"),
        "loaded from the course's folder": RawKernel(code=None, file_path=str(course), name="k"),
    }
    for how, kernel in caught.items():
        assert watch.course_kernel_name(kernel), how
    assert watch.course_kernel_name(caught["the file's text"]) == (
        "kernels/matmul/matmul_register.cu:matmul_register_bf16"
    )
    solution = RawKernel(code='#include "elementwise.cuh"\n__global__ void k() {}', name="k")
    assert watch.course_kernel_name(solution) is None  # the shared header the lab offers


def test_the_launch_hook_names_the_course_s_cuda_c_kernel():
    """kernels.cuda.launch, hooked, notes the course's kernel before CuPy is asked (here it then
    fails: no CuPy on a CPU)."""
    from types import SimpleNamespace as RawKernel

    from kernels import cuda

    kernel = RawKernel(code=cuda.source_path("matmul/matmul_naive.cu").read_text(), name="k")
    with watch.watch() as record:
        with pytest.raises(Exception):  # noqa: B017 - CuPy's absence, whatever it raises
            cuda.launch(kernel, 1, 1, (), torch.device("cpu"))
    assert record.course_kernels == ["kernels/matmul/matmul_naive.cu:k"]
