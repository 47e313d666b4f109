"""Benchmarks of the Hopper and fp8 matrix products: the measurements behind notebook 02b's Hopper
and fp8 parts and data/results/<gpu>/02b_matmul_hopper.json.

    python -m kernels.matmul.benchmark_hopper                       # every section
    python -m kernels.matmul.benchmark_hopper hopper fp8 variants   # some

`hopper`: cuBLAS, the tiled and persistent Triton kernels (`triton_matmul.py`), the persistent TMA
kernel (`triton_matmul_tma.py`) and the warp-specialized Gluon kernel (`gluon_matmul.py`), bf16 and
fp16, at the shapes of the targets. `fp8`: cuBLAS in bf16 and in fp8 per tensor
(`torch._scaled_mm`), the course's per-tensor kernel promoted every 128 and never promoted, and the
block-scaled ones (Triton, and the warp-specialized Gluon kernel's fp8 mode); each with its error
against float64 products (`triton_fp8_matmul.fp8_errors`). `variants`: every candidate
configuration of the Gluon kernel and of both block-scaled kernels at the target shapes, against
the same anchors: what picks each kernel's default. A candidate that fails its check is reported
and left out of the timing.

As `kernels.matmul.benchmark`: every kernel is checked against float64 before it is timed (a wrong
kernel raises instead of getting a number), timed interleaved with its anchors, L2 flushed before
every repetition, ratios per repetition in the same run (kernels.bench). A run of one section keeps
the other's rows in the results file. Needs an sm_90 GPU: on any other the kernels refuse
(FeatureMissing) and so does this script.
"""

from __future__ import annotations

import functools
import sys

import torch

from kernels import bench
from kernels.matmul import benchmark, gluon_matmul, reference, triton_fp8_matmul, triton_matmul
from kernels.matmul import triton_matmul_tma as tma
from kernels.matmul.benchmark import DTYPES, TRITON_SHAPES, checked, print_section, timed
from kernels.matmul.reference import make_inputs

RESULTS_NAME = "02b_matmul_hopper"
# calc_diff against the product of the kernel's own (dequantized) inputs past which a kernel is
# wrong, not imprecise: a 10% relative error (a misplaced scale block or tile gives ~1).
WRONG_KERNEL_DIFF = 1e-2
TARGET_SHAPES = TRITON_SHAPES[:2]
BLOCK_SCALED = (
    "fp8 block-scaled",
    "gluon fp8 block-scaled",
)  # the fp8 target takes the faster  # 8192^3 and 8192 x 11008 x 4096 (the targets' shapes)


def hopper(ceil: dict) -> list[dict]:
    """Every 16-bit kernel against cuBLAS at TRITON_SHAPES, both dtypes, with the configuration
    the TMA kernel's autotuner picked."""
    out = []
    for shape in TRITON_SHAPES:
        for dtype in DTYPES.values():
            a, b = make_inputs(*shape, dtype, seed=2)
            fns = {
                "cuBLAS": lambda a=a, b=b: a @ b,
                "triton": lambda a=a, b=b: triton_matmul.matmul(a, b),
                "triton persistent": lambda a=a, b=b: triton_matmul.matmul_persistent(a, b),
                "triton TMA": lambda a=a, b=b: tma.matmul_tma(a, b),
                "gluon warp-specialized": lambda a=a, b=b: gluon_matmul.gluon_matmul(a, b),
            }
            for name, fn in fns.items():
                if name != "cuBLAS":
                    checked(name, fn(), a, b)
            row = timed(fns, shape, dtype, ceil)
            row["configs"] = {"triton TMA": tma.config_name(tma.matmul_tma_kernel.best_config)}
            out.append(row)
    return out


def fp8(ceil: dict) -> list[dict]:
    """At each shape (A (M, K) activations, W (N, K) weights, both bf16 standard normal, quantized
    once before timing): cuBLAS bf16, cuBLAS fp8 per tensor, and the course's fp8 kernels. Each row
    has its TFLOP/s, its ratios to both cuBLAS products, and its errors."""
    f8 = triton_fp8_matmul
    out = []
    for M, N, K in TRITON_SHAPES:
        a, w = make_inputs(M, N, K, torch.bfloat16, layout="nt", seed=4)  # w: b.T, (N, K)
        w = w.T
        (a8, sa), (w8, sw) = f8.quantize_per_tensor(a), f8.quantize_per_tensor(w)
        (ab8, sab), (wb8, swb) = f8.quantize_activation(a), f8.quantize_weight(w)
        per_tensor = (f8.dequantize(a8, sa, None), f8.dequantize(w8, sw, None))
        blocked = (f8.dequantize(ab8, sab, 1), f8.dequantize(wb8, swb, f8.SCALE_BLOCK))
        fns = {
            "cuBLAS": lambda: a @ w.T,
            "cuBLAS fp8 per-tensor": lambda: f8.fp8_matmul_scaled_mm(a8, w8, sa, sw),
            "fp8 per-tensor, promoted every 128": lambda: f8.fp8_matmul_per_tensor(
                a8, w8, sa, sw, promote_k=128
            ),
            "fp8 per-tensor, never promoted": lambda: f8.fp8_matmul_per_tensor(
                a8, w8, sa, sw, promote_k=0
            ),
            "fp8 block-scaled": lambda: f8.fp8_matmul_block_scaled(ab8, sab, wb8, swb),
            "gluon fp8 block-scaled": lambda: gluon_matmul.gluon_fp8_matmul_block_scaled(
                ab8, sab, wb8, swb
            ),
        }
        inputs = dict.fromkeys(fns, per_tensor) | dict.fromkeys(BLOCK_SCALED, blocked)
        # The errors; a wrong kernel (scales or tiles misplaced: calc_diff near 1 against the
        # product of its own inputs) raises before it is timed. How far each is from DeepGEMM's
        # bound is a result, not a gate: the never-promoted product is here to miss it.
        errors = {}
        for name, fn in fns.items():
            deq = (a.double(), w.double()) if name == "cuBLAS" else inputs[name]
            errors[name] = f8.fp8_errors(fn(), deq, (a, w))
            if not errors[name]["dequantized"]["calc_diff"] < WRONG_KERNEL_DIFF:
                raise AssertionError(f"{name} at {(M, N, K)}: {errors[name]}")
        timings = bench.benchmark(fns)
        flops = reference.matmul_flops(M, N, K)
        nbytes = M * K + N * K + 2 * M * N  # fp8 A and W read once, bf16 C written once
        rows = {
            name: {
                **t.summary(),
                "tflops": t.tflops(flops),
                "gbps": t.gbps(nbytes),
                "vs_cublas": bench.ratio(timings["cuBLAS"], t),
                "vs_cublas_fp8": bench.ratio(timings["cuBLAS fp8 per-tensor"], t),
                "errors": errors[name],
            }
            for name, t in timings.items()
        }
        autotuned = f8.fp8_matmul_kernel.cache  # {autotuner key: configuration}, key (M, N, K, ..)
        out.append(
            {
                "shape": [M, N, K],
                "dtype": "float8_e4m3fn",
                # fp8 tensor cores multiply at twice the bf16 rate: the floor takes the
                # measured bf16 matmul rate doubled
                "floor_us": bench.floor_us(nbytes, flops / 2, ceil),
                "impls": rows,
                "configs": {
                    str(key): str(c) for key, c in autotuned.items() if tuple(key[:3]) == (M, N, K)
                },
            }
        )
    return out


# The candidates timed against each other by the `variants` section: keyword arguments of
# gluon_matmul (16-bit) and gluon_fp8_matmul_block_scaled; the Triton block-scaled kernel's are
# its GPU_TILES that fit a promoted product (with the weight scale as one scalar).
GLUON_VARIANTS = {
    "128x256 s3 g16": dict(stages=3, group_m=16),
    "128x256 s3 g8": dict(stages=3, group_m=8),
}
GLUON_FP8_VARIANTS = {
    "s4 g8": dict(stages=4, group_m=8),
    "s5 g8": dict(stages=5, group_m=8),
    "s4 g16": dict(stages=4, group_m=16),
}


def _checked_or_reason(check) -> str | None:
    """None when `check()` passes, else why not: a variant that fails is reported, not timed,
    and does not stop the others."""
    try:
        check()
    except Exception as error:  # noqa: BLE001 (any failure of a candidate is its result)
        return f"{type(error).__name__}: {str(error)[:300]}"
    return None


def variants(ceil: dict) -> list[dict]:
    """Every candidate configuration of the Gluon and TMA kernels (16-bit, at the target shapes,
    both dtypes) and of the two block-scaled fp8 kernels, timed in one run against their anchors
    (cuBLAS; cuBLAS fp8 per tensor): the measurements that pick each kernel's default."""
    out = []
    for shape in TARGET_SHAPES:
        for dtype in DTYPES.values():
            a, b = make_inputs(*shape, dtype, seed=2)
            fns = {"cuBLAS": lambda a=a, b=b: a @ b}
            failed = {}
            candidates = {
                f"gluon {name}": functools.partial(gluon_matmul.gluon_matmul, a, b, **options)
                for name, options in GLUON_VARIANTS.items()
            }
            for config in tma.candidate_configs():
                candidates[f"triton TMA {tma.config_name(config)}"] = functools.partial(
                    tma.matmul_tma, a, b, config=config
                )
            for name, fn in candidates.items():
                reason = _checked_or_reason(lambda fn=fn, name=name: checked(name, fn(), a, b))
                if reason:
                    failed[name] = reason
                else:
                    fns[name] = fn
            row = timed(fns, shape, dtype, ceil)
            row["failed"] = failed
            out.append(row)
    f8 = triton_fp8_matmul
    for M, N, K in TARGET_SHAPES:
        a, w = make_inputs(M, N, K, torch.bfloat16, layout="nt", seed=4)
        w = w.T
        (a8, sa), (w8, sw) = f8.quantize_per_tensor(a), f8.quantize_per_tensor(w)
        (ab8, sab), (wb8, swb) = f8.quantize_activation(a), f8.quantize_weight(w)
        blocked = (f8.dequantize(ab8, sab, 1), f8.dequantize(wb8, swb, f8.SCALE_BLOCK))
        candidates = {
            f"gluon fp8 {name}": functools.partial(
                gluon_matmul.gluon_fp8_matmul_block_scaled, ab8, sab, wb8, swb, **options
            )
            for name, options in GLUON_FP8_VARIANTS.items()
        }
        for tile in f8.GPU_TILES:
            config = f8.tile_config(*tile, one_w_scale=True)
            if f8.fits(config, promoted=True):
                bm, bn, warps, stages, k_blocks = tile
                candidates[f"triton fp8 {bm}x{bn} w{warps} s{stages} k{k_blocks}"] = (
                    functools.partial(f8.fp8_matmul_block_scaled, ab8, sab, wb8, swb, config=config)
                )
        fns = {"cuBLAS fp8 per-tensor": lambda: f8.fp8_matmul_scaled_mm(a8, w8, sa, sw)}
        errors, failed = {}, {}

        def check(name, fn):
            errors[name] = f8.fp8_errors(fn(), blocked, (a, w))
            if not errors[name]["dequantized"]["calc_diff"] < WRONG_KERNEL_DIFF:
                raise AssertionError(f"{name} at {(M, N, K)}: {errors[name]}")

        for name, fn in candidates.items():
            reason = _checked_or_reason(functools.partial(check, name, fn))
            if reason:
                failed[name] = reason
            else:
                fns[name] = fn
        timings = bench.benchmark(fns)
        flops = reference.matmul_flops(M, N, K)
        anchor = timings["cuBLAS fp8 per-tensor"]
        out.append(
            {
                "shape": [M, N, K],
                "dtype": "float8_e4m3fn",
                "impls": {
                    name: {
                        **t.summary(),
                        "tflops": t.tflops(flops),
                        "vs_cublas_fp8": bench.ratio(anchor, t),
                        "errors": errors.get(name),
                    }
                    for name, t in timings.items()
                },
                "failed": failed,
            }
        )
    return out


def print_variants(section: str, rows) -> None:
    """Each candidate's rate and ratio to its anchor, then those that failed their check."""
    for row in rows:
        ratio = "vs_cublas_fp8" if row["dtype"] == "float8_e4m3fn" else "vs_cublas"
        print(f"\n{section} {'x'.join(map(str, row['shape']))} {row['dtype']}")
        table = [
            {"impl": name, "tflops": impl["tflops"], ratio: impl[ratio]}
            for name, impl in row["impls"].items()
        ]
        print(bench.table(table, floatfmt=".3f"))
        for name, reason in row["failed"].items():
            print(f"FAILED {name}: {reason}")


SECTIONS = {"hopper": hopper, "fp8": fp8, "variants": variants}


def _impls(results, section, shape, dtype):
    return next(
        (
            r["impls"]
            for r in results.get(section, [])
            if r["shape"] == list(shape) and r["dtype"] == dtype
        ),
        None,
    )


def performance_targets(results: dict) -> list[dict]:
    """Triton TMA >= 1.0x cuBLAS and Gluon >= 1.05x at the two target shapes in bf16 and fp16;
    fp8 block-scaled >= 1.0x cuBLAS's per-tensor fp8 with its error within DeepGEMM's bound."""
    checks = []
    for shape in TARGET_SHAPES:
        name = "x".join(map(str, shape))
        for dtype in ("bfloat16", "float16"):
            impls = _impls(results, "hopper", shape, dtype)
            if impls:
                for impl, threshold in (("triton TMA", 1.0), ("gluon warp-specialized", 1.05)):
                    checks.append(
                        {
                            "target": f"{impl}, {name} {dtype}: >= {threshold}x cuBLAS",
                            "value": impls[impl]["vs_cublas"],
                            "threshold": threshold,
                        }
                    )
        impls = _impls(results, "fp8", shape, "float8_e4m3fn")
        if impls:
            best = max(BLOCK_SCALED, key=lambda n: impls[n]["vs_cublas_fp8"])
            block = impls[best]
            checks.append(
                {
                    "target": f"{best}, {name}: >= 1.0x cuBLAS fp8 per-tensor",
                    "value": block["vs_cublas_fp8"],
                    "threshold": 1.0,
                }
            )
            checks.append(
                {
                    "target": f"{best}, {name}: calc_diff vs the bf16 inputs' product "
                    "< DeepGEMM's 1e-3 (value: 1e-3 / calc_diff)",
                    "value": triton_fp8_matmul.DEEPGEMM_DIFF_BOUND
                    / max(block["errors"]["original"]["calc_diff"], 1e-30),
                    "threshold": 1.0,
                }
            )
    for c in checks:
        c["pass"] = bool(c["value"] >= c["threshold"])
    return checks


def print_fp8(section: str, rows) -> None:
    """The fp8 rows as every section's, then their ratio to cuBLAS's fp8 and their errors."""
    print_section(section, rows)
    for row in rows:
        print(f"\n{'x'.join(map(str, row['shape']))} fp8: x cuBLAS fp8, calc_diff")
        table = [
            {
                "impl": name,
                "vs_cublas_fp8": impl["vs_cublas_fp8"],
                "diff vs dequantized": impl["errors"]["dequantized"]["calc_diff"],
                "diff vs bf16 inputs": impl["errors"]["original"]["calc_diff"],
            }
            for name, impl in row["impls"].items()
        ]
        print(bench.table(table, floatfmt=".3g"))


def main(argv: list[str]) -> int:
    return benchmark.main(
        argv,
        sections=SECTIONS,
        results_name=RESULTS_NAME,
        targets=performance_targets,
        printers={"fp8": print_fp8, "variants": print_variants},
        requires="wgmma",
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
