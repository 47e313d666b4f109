"""Lab 00 (profiling): read the slow transpose's Nsight Compute profile, then fix the kernel.

* `bottleneck(readings, out)`: which of the profile's readings shows why the kernel is slow, and its
  value. The grader's answer comes from the committed profile (kernels.profiling.lab), so it follows
  whatever GPU the course's profiles were last refreshed on.
* `transpose(x, out)`: the fixed kernel, bit-exact against x.T on every dtype and odd shapes, and
on a
  GPU timed against the course's tiled transpose and PyTorch's copy of x.t().
"""

from __future__ import annotations

import torch

from grading.spec import Case, GradedFunction, LabSpec, PerfConfig
from kernels.profiling import lab, transpose

# --------------------------------------------------------------------------------------------------
# The question


def _readings(shape, dtype, device, gen):
    values, _ = lab.readings()
    return (torch.tensor(values, dtype=torch.float64, device=device),)


def _course_bottleneck(readings, out=None):
    answer = lab.bottleneck_answer(readings)
    return answer if out is None else out.copy_(answer)


def _diagnose_bottleneck(output_name, result, want, bad, readings):
    """Say what the chosen reading does and does not show, without giving the answer away."""
    picked = result[0].item()
    if not bool(bad[0]):
        return (
            f"the reading is right; its value in the profile is {want[1].item():.4g} "
            f"(reading {lab.ANSWER} as the table prints it, you wrote {result[1].item():.4g})"
        )
    if picked != picked or not float(picked).is_integer() or not 0 <= picked < len(lab.READINGS):
        return f"out[0] must be the number of a reading, 0 to {len(lab.READINGS) - 1}"
    name = lab.READINGS[int(picked)][0]
    why = {
        0: "the duration says that it is slow, not why",
        1: "low DRAM throughput is the symptom: the kernel moves few bytes per second. Why?",
        2: "the SMs are not the limit of a kernel that only moves bytes",
        3: "occupancy is not what keeps this kernel from moving bytes",
        4: "the register count is small: it does not limit occupancy here",
        5: "DRAM moves about the bytes it must: the waste happens closer to the SMs",
        7: "the stores are fine: compare them with the loads",
    }.get(int(picked), "")
    return f"reading {int(picked)} ({name}) does not show the cause" + (f": {why}" if why else "")


# --------------------------------------------------------------------------------------------------
# The fix

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# A single element, odd shapes, shapes one past a tile, a tall and a wide matrix.
SHAPES = ((1, 1), (7, 5), (65, 130), (300, 17), (3, 1000), (129, 64))
CASES = tuple(Case(shape, dtype) for shape in SHAPES for dtype in DTYPES) + (
    Case((65, 33), torch.float16, "strided"),
    Case((0, 4), torch.float32),
)
PERF_SHAPE = (8192, 8192)  # 128 MiB of bf16 each way: far beyond L2


def _matrix(shape, dtype, device, gen):
    return (torch.randn(shape, device=device, generator=gen).to(dtype),)


def _transposed(shape, dtype):
    return (((shape[1], shape[0]), dtype),)


def _torch_transpose(x, out=None):
    return x.t().contiguous() if out is None else out.copy_(x.t())


LAB = LabSpec(
    id="00_profiling",
    title="Profiling: read the slow transpose's Nsight Compute profile, then fix it",
    functions=(
        GradedFunction(
            name="bottleneck",
            points=3,
            backend="triton",
            description="the reading of the slow kernel's profile that shows why, and its value",
            make_inputs=_readings,
            reference_fp64=lab.bottleneck_answer,
            tolerance=lambda dtype: (0.0, 0.01),  # the reading's number exact, its value within 1%
            course_kernel=_course_bottleneck,
            torch_native=_course_bottleneck,
            bytes_moved=lambda readings: 0,
            cases=(Case((2,), torch.float64),),
            trials=1,
            input_names=("readings",),
            diagnose=_diagnose_bottleneck,
            allowed_ops=(
                "aten._local_scalar_dense.default",
                "aten.div.Tensor",
                "aten.mul.Tensor",
                "aten.add.Tensor",
                "aten.sub.Tensor",
                "aten.div.Scalar",
                "aten.mul.Scalar",
                "aten.stack.default",
                "aten.index.Tensor",
            ),
            hint="out = [the reading's number, its value as the table prints it]",
        ),
        GradedFunction(
            name="transpose",
            points=5,
            backend="triton",
            description="Triton: out = x.T (contiguous), coalesced loads and stores",
            make_inputs=_matrix,
            reference_fp64=transpose.reference_fp64,
            tolerance=lambda dtype: (0.0, 0.0),
            bit_exact=lambda x: x.t().contiguous(),
            exact_dtypes=DTYPES,
            course_kernel=transpose.transpose_tiled,
            torch_native=_torch_transpose,
            bytes_moved=transpose.bytes_moved,
            cases=CASES,
            output_shapes=_transposed,
            perf=(PerfConfig("transpose/bf16/8192x8192", PERF_SHAPE, torch.bfloat16),),
            own_kernels_only=True,
            hint="load a 2-D tile along x's rows, store its transpose along out's rows",
        ),
    ),
)
