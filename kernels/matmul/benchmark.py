"""Benchmarks of the matrix-product kernels: the measurements behind notebook 02b and
data/results/<gpu>/02b_matmul.json.

    python -m kernels.matmul.benchmark                 # every section
    python -m kernels.matmul.benchmark cuda triton     # some: cuda, triton, skinny, launch-order,
                                                       # mma-variants, mma-peak

Each section is checked against float64 before it is timed (a wrong kernel raises instead of
getting a number), then timed interleaved with its anchor, cuBLAS (`a @ b`), L2 flushed before every
repetition (kernels.bench). Ratios are to cuBLAS in the same run. A run of some sections updates
those sections of the results file and keeps the others.

Counted: flops 2 M N K; bytes the floor's, A and B read once and C written once
(reference.matmul_bytes). The floor is the larger of bytes / copy bandwidth and flops / cuBLAS's
bf16 rate at 8192^3 (bench.ceilings).
"""

from __future__ import annotations

import json
import sys

import torch

from kernels import bench, runtime
from kernels.decoder import triton_gemv
from kernels.matmul import reference, triton_matmul, triton_skinny
from kernels.matmul.reference import check_matmul, make_inputs

RESULTS_NAME = "02b_matmul"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
CUDA_SHAPE = (4096, 4096, 4096)  # the CUDA C steps: large enough to fill the GPU, naive in ~0.1 s
TRITON_SHAPES = [(8192, 8192, 8192), (8192, 11008, 4096), (4096, 4096, 4096)]
SKINNY_SHAPES = [(1, 8192, 2048), (32, 8192, 2048)]  # decode: B is an nn.Linear weight, W.T
MMA_SHAPES = [(4096, 4096, 4096), (8192, 8192, 8192)]  # step 5's configurations
MMA_CHECK_SHAPE = (1000, 1032, 1000)  # multiples of no tile, rows of 16-byte packs (cp.async)


def checked(name: str, c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    result = check_matmul(c, a, b)
    if not result.ok:
        raise AssertionError(f"{name}, {tuple(a.shape)} @ {tuple(b.shape)}: {result.reason}")


def timed(fns: dict, shape, dtype, ceil: dict) -> dict:
    """fns timed interleaved ("cuBLAS" among them): median us, TFLOP/s, GB/s, ratio to cuBLAS,
    and the floor."""
    M, N, K = shape
    flops, nbytes = reference.matmul_flops(M, N, K), reference.matmul_bytes(M, N, K, dtype)
    timings = bench.benchmark(fns)
    rows = {
        name: {
            **t.summary(),
            "tflops": t.tflops(flops),
            "gbps": t.gbps(nbytes),
            "vs_cublas": bench.ratio(timings["cuBLAS"], t),
        }
        for name, t in timings.items()
    }
    return {
        "shape": list(shape),
        "dtype": str(dtype).removeprefix("torch."),
        "arithmetic_intensity": reference.arithmetic_intensity(M, N, K, dtype),
        "floor_us": bench.floor_us(nbytes, flops, ceil),
        "impls": rows,
    }


# --------------------------------------------------------------------------------------------------
# Sections


def cuda_steps(ceil: dict) -> list[dict]:
    """The five CUDA C steps and cuBLAS at CUDA_SHAPE, both dtypes: the roofline's points."""
    if not runtime.cupy_status()[0]:
        return []
    from kernels.matmul import cupy_matmul

    out = []
    for dtype in DTYPES.values():
        a, b = make_inputs(*CUDA_SHAPE, dtype, seed=1)
        fns = {"cuBLAS": lambda a=a, b=b: a @ b}
        for step in cupy_matmul.STEPS:
            checked(f"cuda {step}", cupy_matmul.matmul(a, b, step=step), a, b)
            fns[f"cuda {step}"] = lambda a=a, b=b, step=step: cupy_matmul.matmul(a, b, step=step)
        # x @ W.T, nn.Linear's layout: the _kmajor kernel
        w_t = make_inputs(*CUDA_SHAPE, dtype, layout="nt", seed=1)[1]
        checked("cuda mma, B = W.T", cupy_matmul.matmul(a, w_t, step="mma"), a, w_t)
        fns["cuda mma, B = W.T"] = lambda a=a, w_t=w_t: cupy_matmul.matmul(a, w_t, step="mma")
        out.append(timed(fns, CUDA_SHAPE, dtype, ceil))
    return out


def mma_variants(ceil: dict) -> list[dict]:
    """Every configuration of step 5 (cupy_matmul.MMA_VARIANTS), checked against float64 at an odd
    shape on both B layouts, then timed interleaved with cuBLAS at MMA_SHAPES, both dtypes; the
    default configuration on B = W.T too."""
    if not runtime.cupy_status()[0]:
        return []
    from kernels.matmul import cupy_matmul

    fitting = {
        name: config
        for name, config in cupy_matmul.MMA_VARIANTS.items()
        if config.shared_bytes() <= runtime.shared_memory_budget()
    }
    for dtype in DTYPES.values():
        for layout in ("nn", "nt"):
            a, b = make_inputs(*MMA_CHECK_SHAPE, dtype, layout, seed=4)
            exact = reference.matmul_reference(a, b)
            for name, config in fitting.items():
                c = cupy_matmul.matmul(a, b, mma=config)
                result = check_matmul(c, a, b, exact)
                if not result.ok:
                    raise AssertionError(f"mma {name}, {layout} {dtype}: {result.reason}")
    out = []
    for shape in MMA_SHAPES:
        for dtype in DTYPES.values():
            a, b = make_inputs(*shape, dtype, seed=5)
            w_t = make_inputs(*shape, dtype, layout="nt", seed=5)[1]
            fns = {"cuBLAS": lambda a=a, b=b: a @ b}
            for name, config in fitting.items():
                fns[f"mma {name}"] = lambda a=a, b=b, c=config: cupy_matmul.matmul(a, b, mma=c)
            default = cupy_matmul.MMA_DEFAULT
            fns[f"mma {default.name}, B = W.T"] = lambda a=a, w_t=w_t: cupy_matmul.matmul(a, w_t)
            out.append(timed(fns, shape, dtype, ceil))
    return out


PEAK_ITERS = 4096  # per warp, 8 instructions each: about a millisecond on an H200
# (blocks of 8 warps an SM, independent accumulators a warp, kernel): the instruction's rate with
# many warps, with as few warps as step 5's blocks leave an SM, with those warps holding as many
# accumulators as step 5's 64 x 64 warps do, and reading a 64 x 64 warp's operands
# (mma_peak_warp_tile: a different pair of fragments for each instruction)
PEAK_CASES = (
    (4, 8, "mma_peak_8"),
    (2, 8, "mma_peak_8"),
    (1, 8, "mma_peak_8"),
    (1, 32, "mma_peak_32"),
    (1, 32, "mma_peak_warp_tile"),
)


def mma_peak(ceil: dict) -> list[dict]:
    """The rate of back-to-back mma.sync on registers (mma_peak.cu: no memory, every SM busy)
    for each of PEAK_CASES, against cuBLAS at 8192^3, the same dtype, timed interleaved: the
    instruction's ceiling next to wgmma's (what cuBLAS runs on Hopper), and how many warps or
    independent accumulators it takes to reach it (step 5's blocks leave 8 warps an SM)."""
    if not runtime.cupy_status()[0]:
        return []
    import numpy as np

    from kernels import cuda
    from kernels.matmul import cupy_matmul

    sms, threads, n = runtime.features().sm_count, 256, 8192  # threads: mma_peak.cu's
    most_blocks = max(per_sm for per_sm, _, _ in PEAK_CASES) * sms
    sink = torch.empty(most_blocks * threads, dtype=torch.float32, device="cuda")
    out = []
    for dtype in DTYPES.values():
        a, b = make_inputs(n, n, n, dtype, seed=6)
        fns, flops = {"cuBLAS": lambda a=a, b=b: a @ b}, {"cuBLAS": reference.matmul_flops(n, n, n)}
        for per_sm, chains, stem in PEAK_CASES:
            name = f"mma.sync peak, {per_sm * threads // 32} warps an SM, {chains} accumulators"
            if stem == "mma_peak_warp_tile":
                name += ", a 64 x 64 warp's operands"
            kernel = cuda.load_kernel("matmul/mma_peak.cu", f"{stem}_{cupy_matmul.SUFFIX[dtype]}")
            iters = PEAK_ITERS * 8 // chains
            args, blocks = (cuda.pointer(sink), np.int32(iters)), per_sm * sms
            fns[name] = lambda k=kernel, g=blocks, args=args: cuda.launch(
                k, g, threads, args, sink.device
            )
            flops[name] = 2 * 16 * 8 * 16 * chains * iters * blocks * (threads // 32)
        timings = bench.benchmark(fns, flush=False)
        rates = {name: t.tflops(flops[name]) for name, t in timings.items()}
        impls = {
            name: {**t.summary(), "tflops": rates[name], "vs_cublas": rates[name] / rates["cuBLAS"]}
            for name, t in timings.items()
        }
        out.append({"shape": [n, n, n], "dtype": str(dtype).removeprefix("torch."), "impls": impls})
    return out


def triton_kernels(ceil: dict) -> list[dict]:
    """The tiled kernel (grouped and row-major order) and the persistent one against cuBLAS, with
    the configuration the autotuner picked."""
    out = []
    for shape in TRITON_SHAPES:
        for dtype in DTYPES.values():
            a, b = make_inputs(*shape, dtype, seed=2)
            fns = {
                "cuBLAS": lambda a=a, b=b: a @ b,
                "triton": lambda a=a, b=b: triton_matmul.matmul(a, b),
                "triton row-major order": lambda a=a, b=b: triton_matmul.matmul(a, b, group_m=1),
                "triton persistent": lambda a=a, b=b: triton_matmul.matmul_persistent(a, b),
            }
            for name, fn in fns.items():
                if name != "cuBLAS":
                    checked(name, fn(), a, b)
            row = timed(fns, shape, dtype, ceil)
            row["configs"] = {
                "triton": str(triton_matmul.tuned_matmul_kernel.best_config),
                "triton persistent": str(triton_matmul.tuned_persistent_kernel.best_config),
            }
            out.append(row)
    return out


def skinny(ceil: dict) -> list[dict]:
    """M = 1 and 32 against a (N, K) weight W, b = W.T: cuBLAS, the decoder's GEMV, split-K and
    the tiled kernel."""
    out = []
    for shape in SKINNY_SHAPES:
        a, b = make_inputs(*shape, torch.bfloat16, layout="nt", seed=3)
        weight = b.T  # contiguous (N, K), as nn.Linear stores it
        fns = {
            "cuBLAS": lambda a=a, b=b: a @ b,
            "GEMV (decoder)": lambda a=a, w=weight: triton_gemv.linear(a, w),
            "split-K": lambda a=a, b=b: triton_skinny.matmul_split_k(a, b),
            "triton tiled": lambda a=a, b=b: triton_matmul.matmul(a, b),
        }
        for name, fn in fns.items():
            if name != "cuBLAS":
                checked(name, fn(), a, b)
        row = timed(fns, shape, torch.bfloat16, ceil)
        row["splits"] = triton_skinny.default_splits(shape[1], shape[2])
        out.append(row)
    return out


def launch_order() -> dict:
    """ncu's L2 hit rate and DRAM bytes of the Triton GEMM in grouped and row-major order
    (workloads triton_matmul_grouped / _row_major, 8192^3 bf16), through kernels.profiling.ncu."""
    from kernels.profiling import ncu

    if ncu.ncu_path() is None:
        return {"not_measured": "ncu is not on PATH"}
    rows = {}
    for order in ("grouped", "row_major"):
        csv_path = ncu.profile(f"triton_matmul_{order}", ncu.results_dir())
        kernel = ncu.main_kernel(ncu.read_csv(csv_path), "matmul_kernel")
        rows[order] = {
            "l2_hit_rate_pct": kernel.get("lts__t_sector_hit_rate.pct"),
            "dram_read_bytes": kernel.get("dram__bytes_read.sum"),
            "duration_ns": kernel.get("gpu__time_duration.sum"),
            "profile": csv_path.name,
        }
    return rows


SECTIONS = {
    "cuda": cuda_steps,
    "triton": triton_kernels,
    "skinny": skinny,
    "launch-order": lambda ceil: launch_order(),
    "mma-variants": mma_variants,
    "mma-peak": mma_peak,
}


# --------------------------------------------------------------------------------------------------
# Targets


def _rows(results, section, shape, dtype="bfloat16"):
    return next(
        (
            r["impls"]
            for r in results.get(section, [])
            if r["shape"] == list(shape) and r["dtype"] == dtype
        ),
        None,
    )


def _best(impls: dict, names: tuple[str, ...], what: str, threshold: float) -> dict:
    """The target met by the fastest of `names` (x cuBLAS)."""
    best = max(names, key=lambda n: impls[n]["vs_cublas"])
    value = impls[best]["vs_cublas"]
    return {
        "target": f"{what} ({best}): >= {threshold}x cuBLAS",
        "value": value,
        "threshold": threshold,
        "pass": bool(value >= threshold),
    }


def performance_targets(results: dict) -> list[dict]:
    checks = []
    steps = _rows(results, "cuda", CUDA_SHAPE)
    if steps:
        checks.append(_best(steps, ("cuda mma",), "CUDA C, 4096^3 bf16", 0.70))
    variants = _rows(results, "mma-variants", CUDA_SHAPE)
    if variants:
        names = tuple(n for n in variants if n.startswith("mma ") and "W.T" not in n)
        checks.append(
            _best(variants, names, "CUDA C mma.sync, best configuration, 4096^3 bf16", 0.70)
        )
    for shape in TRITON_SHAPES[:2]:
        for dtype in ("bfloat16", "float16"):
            impls = _rows(results, "triton", shape, dtype)
            if impls:
                what = f"Triton, {'x'.join(map(str, shape))} {dtype}"
                checks.append(_best(impls, ("triton", "triton persistent"), what, 1.0))
    for shape in SKINNY_SHAPES:
        impls = _rows(results, "skinny", shape)
        if impls:
            what = f"M={shape[0]}, {'x'.join(map(str, shape))} bf16"
            checks.append(_best(impls, ("GEMV (decoder)", "split-K"), what, 0.95))
    return checks


# --------------------------------------------------------------------------------------------------
# Main


def print_section(name: str, rows) -> None:
    print(f"\n{name}")
    if isinstance(rows, dict):  # launch-order
        print(json.dumps(rows, indent=1))
        return
    for row in rows:
        floor = f", floor {row['floor_us']:.1f} us" if row.get("floor_us") else ""
        print(f"{'x'.join(map(str, row['shape']))} {row['dtype']}{floor}")
        columns = ("median_us", "tflops", "gbps", "vs_cublas")
        table = [{"impl": k, **{c: v.get(c) for c in columns}} for k, v in row["impls"].items()]
        print(bench.table(table, floatfmt=".2f"))


def main(
    argv: list[str],
    *,
    sections: dict | None = None,
    results_name: str = RESULTS_NAME,
    targets=None,
    printers: dict | None = None,
    requires: str | None = None,
) -> int:
    """Run the sections named in argv (all of `sections` when none; this module's by default),
    print each (`printers[section]`, else `print_section`), check `targets(results)` and save
    data/results/<gpu>/<results_name>.json, keeping the sections not run. `requires`: a device
    feature (runtime.require) the kernels need. Exit status 2 when a target is missed."""
    sections = sections or SECTIONS
    targets = targets or performance_targets
    printers = printers or {}
    wanted = argv or list(sections)
    unknown = [s for s in wanted if s not in sections]
    if unknown:
        print(f"unknown sections {unknown}; known: {', '.join(sections)}")
        return 1
    if not runtime.ON_GPU:
        print(bench.NOT_MEASURED)
        return 1
    if requires:
        runtime.require(requires, results_name)
    ceil = bench.ceilings()
    path = bench.RESULTS_DIR / runtime.gpu_info().slug / f"{results_name}.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    results["fingerprint"] = runtime.fingerprint()
    results["ceilings"] = {k: v for k, v in ceil.items() if k != "fingerprint"}
    for section in wanted:
        results[section] = sections[section](ceil)
        printers.get(section, print_section)(section, results[section])
    results["targets"] = targets(results)
    bench.save_results(results_name, results)
    print()
    print(bench.table(results["targets"], floatfmt=".3f"))
    print(f"wrote {path}")
    return 0 if all(c["pass"] for c in results["targets"]) else 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
