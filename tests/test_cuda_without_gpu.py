"""CPU mode compiles a lab's CUDA C with nvcc and says what the compiler found, without a score.

A student without a GPU cannot run lab 01 part 1 (or lab 02 part 1, lab 04 part 2, lab 07 part 3),
but nvcc compiles the same text: the check cell reports the errors, or each kernel's registers and
spills, and says that the code was not run and earns no points."""

import pytest

import grading
from kernels import nvcc_report

GOOD = r"""
#include "elementwise.cuh"
extern "C" __global__ void scale_f32(const float* x, float* y, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = 2.f * x[i];
}
"""
BROKEN = GOOD.replace("2.f * x[i];", "2.f * x[i]")  # a missing semicolon
# An array indexed by a value known only at run time cannot live in registers: a stack frame.
LOCAL_ARRAY = r"""
extern "C" __global__ void pick(const float* x, float* y, int k) {
    float v[64] = {0.f};
    for (int j = 0; j < 64; ++j) v[(j * k) & 63] += x[threadIdx.x * 64 + j];
    y[threadIdx.x] = v[k & 63];
}
"""


def test_a_kernel_that_compiles_reports_its_registers():
    report = nvcc_report.compile_report(GOOD)
    assert report.ok and [k.name for k in report.kernels] == ["scale_f32"]
    assert report.kernels[0].registers > 0
    text = nvcc_report.feedback("scale", GOOD)
    assert "not run" in text and "no points" in text and "scale_f32:" in text
    assert "no spills" in text


def test_a_compile_error_is_reported_with_its_line():
    report = nvcc_report.compile_report(BROKEN)
    assert not report.ok
    assert any("kernel.cu(6): error" in line for line in report.errors), report.errors
    assert "does not compile" in nvcc_report.feedback("scale", BROKEN)


def test_a_local_array_shows_as_a_stack_frame():
    (kernel,) = nvcc_report.compile_report(LOCAL_ARRAY).kernels
    assert kernel.stack_frame >= 64 * 4, kernel
    assert "local memory" in nvcc_report.feedback("pick", LOCAL_ARRAY)


def scale_source():
    return GOOD


@pytest.mark.cpu
def test_the_check_cell_compiles_a_cupy_function_it_cannot_run(capsys):
    grading.check("01_elementwise_add", "add_vectorized", _named("add_vectorized"))
    printed = capsys.readouterr().out
    assert "not run (no GPU here: no points)" in printed, printed
    assert "scale_f32:" in printed and "registers" in printed, printed


def _named(name):
    """`scale` as the lab's function `name`, with `<name>_source` beside it in its globals."""
    namespace = {"__builtins__": __builtins__, f"{name}_source": scale_source}
    exec(f"def {name}(a, b, out=None):\n    raise AssertionError('not in CPU mode')", namespace)
    return namespace[name]
