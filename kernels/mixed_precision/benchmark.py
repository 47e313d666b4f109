"""Benchmarks of the precision kernels: the measurements behind notebook 04 and data/results/<gpu>/.

Run on a GPU: `python -m kernels.mixed_precision.benchmark` writes
data/results/<gpu>/04_mixed_precision.json (with the environment fingerprint and the measured
ceilings) and prints the performance targets.

Convention: a reduction's GB/s counts the bytes it reads (4 bytes per float32 element; the partial
sums it writes are 1/32768 of that); a copy's GB/s counts bytes read plus bytes written (as
`kernels.bench` always does). "% of copy" divides the two: the floor of a read-only kernel is its
bytes over the copy's GB/s. The copy of the same 256M floats is timed in the same interleaved run,
beside `torch.sum`.
"""

from __future__ import annotations

import sys

import torch

from kernels import bench, runtime
from kernels.mixed_precision import cupy_reduce, reference, triton_fp8, triton_reduce
from kernels.testing import generator

N = 256 * 2**20  # 256M float32 elements, 1 GiB: far past L2, so DRAM bound


def _input(n=N, seed=0):
    return torch.rand(n, device="cuda", generator=generator(seed, "cuda"))


def sums(n: int = N) -> dict:
    """Every fp32-accumulator sum, torch.sum and a copy of the same data, interleaved."""
    x = _input(n)
    dst = torch.empty_like(x)
    fns = {"copy (read + write)": lambda: dst.copy_(x), "torch.sum": lambda: torch.sum(x)}
    for algorithm in ("naive", "pairwise", "kahan"):
        fns[f"triton {algorithm}"] = lambda a=algorithm: triton_reduce.sum(x, torch.float32, a)
        if runtime.cupy_status()[0]:
            fns[f"cupy {algorithm}"] = lambda a=algorithm: cupy_reduce.sum(x, torch.float32, a)
    timings = bench.benchmark(fns)
    copy_gbps = timings["copy (read + write)"].gbps(2 * x.numel() * 4)
    rows = {}
    for name, t in timings.items():
        nbytes = 2 * x.numel() * 4 if name.startswith("copy") else x.numel() * 4
        rows[name] = {
            **t.summary(),
            "gbps": t.gbps(nbytes),
            "fraction_of_copy": t.gbps(nbytes) / copy_gbps,
            "speedup_vs_torch.sum": bench.ratio(timings["torch.sum"], t),
        }
    return rows


def accumulators(n: int = N) -> dict:
    """Each algorithm with each accumulator dtype (Triton, CUDA C): what explicit rounding costs."""
    x = _input(n, seed=1)
    fns = {}
    for acc in reference.ACC_DTYPES:
        for algorithm in ("naive", "pairwise", "kahan"):
            key = f"{algorithm} {str(acc).removeprefix('torch.')}"
            fns[f"triton {key}"] = lambda a=algorithm, c=acc: triton_reduce.sum(x, c, a)
            if runtime.cupy_status()[0]:
                fns[f"cupy {key}"] = lambda a=algorithm, c=acc: cupy_reduce.sum(x, c, a)
    timings = bench.benchmark(fns, target_ms=100)
    return {name: {**t.summary(), "gbps": t.gbps(x.numel() * 4)} for name, t in timings.items()}


def accuracy(n: int = N) -> dict:
    """Relative error (|err| / sum|x|, in units of u) of each GPU sum of 256M uniform values."""
    x = _input(n, seed=2)
    exact, scale = reference.sum_fp64(x).item(), reference.abs_sum_fp64(x).item()
    rows = {
        "torch.sum": abs(torch.sum(x).double().item() - exact)
        / scale
        / reference.UNIT_ROUNDOFF[torch.float32]
    }
    for algorithm in ("naive", "pairwise", "kahan"):
        for name, fn in (("triton", triton_reduce.sum), ("cupy", cupy_reduce.sum)):
            if name == "cupy" and not runtime.cupy_status()[0]:
                continue
            got = fn(x, torch.float32, algorithm).double().item()
            rows[f"{name} {algorithm}"] = (
                abs(got - exact) / scale / reference.UNIT_ROUNDOFF[torch.float32]
            )
    return rows


def fp8(n: int = N) -> dict:
    """Quantizing 256M float32 values to e4m3: per block of 128 and per tensor (Triton), and
    PyTorch's unfused version; bytes = 4 read + 1 written per element (+ 4 per 128 for the block
    scales)."""
    x = torch.randn(n, device="cuda", generator=generator(3, "cuda"))
    dst = torch.empty_like(x)
    fns = {
        "copy (read + write)": lambda: dst.copy_(x),
        "triton per block": lambda: triton_fp8.quantize(x, torch.float8_e4m3fn, 128),
        "triton per block, pow2 scales": lambda: triton_fp8.quantize(
            x, torch.float8_e4m3fn, 128, pow2=True
        ),
        "triton per tensor": lambda: triton_fp8.quantize(x, torch.float8_e4m3fn, None),
        "torch per block (unfused)": lambda: reference.quantize(x, torch.float8_e4m3fn, 128),
    }
    timings = bench.benchmark(fns)
    copy_gbps = timings["copy (read + write)"].gbps(8 * n)
    block_bytes = 5 * n + 4 * (n // 128)
    nbytes = {"copy (read + write)": 8 * n, "triton per tensor": 5 * n}
    return {
        name: {
            **t.summary(),
            "gbps": t.gbps(nbytes.get(name, block_bytes)),
            "fraction_of_copy": t.gbps(nbytes.get(name, block_bytes)) / copy_gbps,
        }
        for name, t in timings.items()
    }


def performance_targets(results: dict) -> list[dict]:
    checks = []
    for impl in ("triton", "cupy"):
        for algorithm, threshold in (("naive", 0.90), ("kahan", 0.85)):
            row = results["sums"].get(f"{impl} {algorithm}")
            if row:
                checks.append(
                    {
                        "target": f"{impl} {algorithm} fp32 accumulator, 256M fp32: "
                        f">= {threshold:.0%} of copy",
                        "value": row["fraction_of_copy"],
                        "threshold": threshold,
                    }
                )
    checks.append(
        {
            "target": "fp8 e4m3 quantize per block of 128 (triton), 256M fp32: >= 85% of copy",
            "value": results["fp8"]["triton per block"]["fraction_of_copy"],
            "threshold": 0.85,
        }
    )
    for c in checks:
        c["pass"] = bool(c["value"] >= c["threshold"])
    return checks


def main() -> int:
    if not runtime.ON_GPU:
        print(bench.NOT_MEASURED)
        return 1
    ceilings = bench.ceilings()
    results = {
        "fingerprint": runtime.fingerprint(),
        "ceilings": {k: v for k, v in ceilings.items() if k != "fingerprint"},
        "n": N,
        "sums": sums(),
        "accumulators": accumulators(),
        "accuracy_in_u": accuracy(),
        "fp8": fp8(),
    }
    results["targets"] = performance_targets(results)
    path = bench.save_results("04_mixed_precision", results)
    print(
        bench.table(
            [
                {k: c[k] for k in ("target", "value", "threshold", "pass")}
                for c in results["targets"]
            ],
            floatfmt=".3f",
        )
    )
    for section in ("sums", "accumulators", "fp8"):
        print(f"\n{section}")
        print(
            bench.table(
                [
                    {"impl": k, **{kk: vv for kk, vv in v.items() if not isinstance(vv, str)}}
                    for k, v in results[section].items()
                ],
                floatfmt=".2f",
            )
        )
    print("\nrelative error of 256M uniform values, in units of u = 2**-24")
    print(
        bench.table(
            [{"impl": k, "error_u": v} for k, v in results["accuracy_in_u"].items()], floatfmt=".3f"
        )
    )
    print(f"wrote {path}")
    return 0 if all(c["pass"] for c in results["targets"]) else 2


if __name__ == "__main__":
    sys.exit(main())
