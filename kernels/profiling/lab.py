"""The profiling lab's question, answered from the committed Nsight Compute profile of the slow
transpose.

The lab shows eight readings of `transpose_naive`'s profile (`READINGS`, in this order) and asks
which one shows *why* the kernel is slow, and its value. The grader's answer comes from the same
committed CSV, data/results/<gpu>/00_profiling/ncu_transpose_naive.csv, so it never goes stale:
re-profile on another GPU and the expected value follows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.profiling import ncu, workloads

SLOW, FIXED = "transpose_naive", "transpose_tiled"
SECTOR = 32  # bytes: the unit in which L1 and L2 fetch global memory


def _read_bytes(meta: dict) -> float:
    return meta["bytes"] / 2  # a transpose reads half of what it moves and writes the other half


def _sector_bytes(k, op: str) -> float:
    return SECTOR * k[f"l1tex__t_sectors_pipe_lsu_mem_global_op_{op}.sum"]


# name -> value from (kernel profile, workload metadata)
READINGS = (
    ("duration (us)", lambda k, m: k["gpu__time_duration.sum"] / 1e3),
    (
        "DRAM throughput (% of peak)",
        lambda k, m: k["dram__throughput.avg.pct_of_peak_sustained_elapsed"],
    ),
    (
        "compute (SM) throughput (% of peak)",
        lambda k, m: k["sm__throughput.avg.pct_of_peak_sustained_elapsed"],
    ),
    (
        "achieved occupancy (% of the SM's warps)",
        lambda k, m: k["sm__warps_active.avg.pct_of_peak_sustained_active"],
    ),
    ("registers per thread", lambda k, m: k["launch__registers_per_thread"]),
    (
        "DRAM bytes read / bytes the kernel must read",
        lambda k, m: k["dram__bytes_read.sum"] / _read_bytes(m),
    ),
    (
        "bytes of the sectors its global loads touch / bytes it must read",
        lambda k, m: _sector_bytes(k, "ld") / _read_bytes(m),
    ),
    (
        "bytes of the sectors its global stores touch / bytes it must write",
        lambda k, m: _sector_bytes(k, "st") / _read_bytes(m),
    ),
)
ANSWER = 6  # the loads fetch a whole sector for every 2-byte element: uncoalesced


def profile_gpu() -> str:
    """The GPU whose committed profile the lab asks about (the H100's where there is one)."""
    gpus = [g for g in ncu.committed_gpus() if (ncu.results_dir(g) / f"ncu_{SLOW}.csv").exists()]
    if not gpus:
        raise FileNotFoundError(
            "no committed profile of the slow transpose in data/results/*/00_profiling/ "
            "(run `python -m kernels.profiling.ncu transpose_naive` on a GPU)"
        )
    return "h100-80gb-hbm3" if "h100-80gb-hbm3" in gpus else gpus[0]


def readings(name: str = SLOW, gpu: str | None = None, folder=None) -> tuple[list[float], dict]:
    """The values of `READINGS` for workload `name`, from its committed profile (or one written into
    `folder` by `ncu.profile`), and the profile's metadata."""
    kernels, meta = ncu.load(name, gpu or (None if folder else profile_gpu()), folder)
    kernel = ncu.main_kernel(kernels, workloads.get(name).kernel)
    return [float(fn(kernel, meta)) for _, fn in READINGS], meta


def readings_table(names=(SLOW,), gpu: str | None = None, folder=None) -> str:
    """The readings of the named workloads' profiles (committed, or in `folder`), one column
    each."""
    columns = [readings(name, gpu, folder)[0] for name in names]
    lines = [f"{'#':>2}  {'reading':68}" + "".join(f" {name:>16}" for name in names)]
    for i, (label, _) in enumerate(READINGS):
        lines.append(f"{i:>2}  {label:68}" + "".join(f" {col[i]:16.2f}" for col in columns))
    return "\n".join(lines)


@triton.jit
def _answer_kernel(out_ptr, reading, value):
    tl.store(out_ptr, reading)  # converted to out's float64
    tl.store(out_ptr + 1, value)


def store_answer(out: torch.Tensor, reading, value) -> torch.Tensor:
    """out[0] = reading, out[1] = value (out: 2 float64), written by one Triton program: the grader
    wants every graded function to launch a kernel of its own, and an answer is no exception."""
    if out.shape != (2,) or out.dtype != torch.float64:
        raise ValueError(
            f"store_answer: out must be 2 float64 values, got {tuple(out.shape)} {out.dtype}"
        )
    _answer_kernel[(1,)](out, float(reading), float(value))
    return out


def bottleneck_answer(values: torch.Tensor) -> torch.Tensor:
    """[index of the reading that shows the cause, its value], float64, from the readings tensor."""
    return torch.stack(
        [
            torch.tensor(float(ANSWER), dtype=torch.float64, device=values.device),
            values[ANSWER].to(torch.float64),
        ]
    )
