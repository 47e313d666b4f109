"""A measured roofline: where a kernel sits, from Nsight Compute's counters and the GPU's measured
ceilings.

The roofs are the course's measured ceilings (`kernels.bench.ceilings()`: device copy GB/s, cuBLAS
bf16 matmul TFLOP/s), not the datasheet's. A kernel's point:

* **bytes**: what it moved to and from DRAM (ncu: dram__bytes_read.sum + dram__bytes_write.sum);
* **flops**: the arithmetic its result needs (the workload's count). ncu's instruction counters
  (fp32 FMA x 2 + adds + multiplies + tensor-core ops) are shown beside it as a check: they also
  count work the kernel does beyond the count (exp, rescaling, padding rows);
* **time**: ncu's gpu__time_duration (one launch, caches flushed, the GPU's own clocks);
* intensity = flops / bytes, achieved = flops / time, and the roof at that intensity
  min(F, intensity * B): `fraction_of_roof` says how close the kernel is to its ceiling. For a
  kernel with no flops (a copy, a transpose) the point is its bandwidth: bytes / time against B.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kernels.profiling.ncu import KernelProfile

TENSOR_OPS = (
    "sm__ops_path_tensor_src_bf16_dst_fp32.sum",
    "sm__ops_path_tensor_src_fp16_dst_fp32.sum",
)


@dataclass(frozen=True)
class Placement:
    name: str
    duration_us: float
    required_bytes: int  # compulsory: inputs once, outputs once
    dram_bytes: float  # what ncu counted
    flops: int  # the workload's count
    counted_flops: float  # from ncu's instruction counters (0 if it has none)
    intensity: float | None  # flops / DRAM byte (None without flops)
    achieved_tflops: float
    achieved_gbps: float  # DRAM bytes / time
    roof_tflops: float | None  # min(F, intensity * B) at this intensity
    bound: str  # "memory" or "compute": which roof is lower at this intensity
    fraction_of_roof: float  # achieved / roof (TFLOP/s), or GB/s / copy GB/s without flops
    bytes_ratio: float  # DRAM bytes / required bytes: > 1 means re-reads or wasted sectors

    def as_dict(self) -> dict:
        return asdict(self)


def dram_bytes(k: KernelProfile) -> float:
    return k["dram__bytes_read.sum"] + k["dram__bytes_write.sum"]


def counted_flops(k: KernelProfile) -> float:
    """Floating-point operations ncu counted: 2 per fp32 FMA, 1 per add and multiply, plus the
    tensor-core "math ops" (sm__ops_path_tensor_*; the notebook compares them with the workload's
    count, 2 per multiply-add, to show how ncu counts them)."""
    fp32 = (
        2 * k.get("smsp__sass_thread_inst_executed_op_ffma_pred_on.sum", 0.0)
        + k.get("smsp__sass_thread_inst_executed_op_fadd_pred_on.sum", 0.0)
        + k.get("smsp__sass_thread_inst_executed_op_fmul_pred_on.sum", 0.0)
    )
    return fp32 + sum(k.get(m, 0.0) for m in TENSOR_OPS)


def place(
    name: str, kernels: list[KernelProfile], required_bytes: int, flops: int, ceilings: dict
) -> Placement:
    """Place a workload (all its profiled kernels together) under the roofs `ceilings`
    ({"copy_gbps": ..., "matmul_bf16_tflops": ...})."""
    if not kernels:
        raise ValueError(f"{name}: no profiled kernels")
    seconds = sum(k["gpu__time_duration.sum"] for k in kernels) * 1e-9  # ncu reports nanoseconds
    moved = sum(dram_bytes(k) for k in kernels)
    counted = sum(counted_flops(k) for k in kernels)
    bw, peak = ceilings["copy_gbps"] * 1e9, ceilings["matmul_bf16_tflops"] * 1e12
    gbps = moved / seconds / 1e9
    if flops:
        intensity = flops / moved
        roof = min(peak, intensity * bw)
        achieved = flops / seconds
        bound = "compute" if intensity * bw >= peak else "memory"
        fraction = achieved / roof
        roof_tflops = roof / 1e12
    else:
        intensity, roof_tflops, achieved, bound = None, None, 0.0, "memory"
        fraction = gbps * 1e9 / bw
    return Placement(
        name=name,
        duration_us=seconds * 1e6,
        required_bytes=required_bytes,
        dram_bytes=moved,
        flops=flops,
        counted_flops=counted,
        intensity=intensity,
        achieved_tflops=achieved / 1e12,
        achieved_gbps=gbps,
        roof_tflops=roof_tflops,
        bound=bound,
        fraction_of_roof=fraction,
        bytes_ratio=moved / required_bytes,
    )


def ridge_point(ceilings: dict) -> float:
    """The intensity (flop/byte) where the two roofs meet: F / B."""
    return ceilings["matmul_bf16_tflops"] * 1e12 / (ceilings["copy_gbps"] * 1e9)


def roof(intensity, ceilings: dict):
    """Attainable TFLOP/s at `intensity` (a number or a numpy array)."""
    import numpy as np

    return np.minimum(
        ceilings["matmul_bf16_tflops"], np.asarray(intensity) * ceilings["copy_gbps"] / 1e3
    )
