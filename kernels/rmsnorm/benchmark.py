"""Benchmarks of the RMSNorm kernels: the measurements behind notebook 02 and data/results/<gpu>/.

Run on a GPU: `python -m kernels.rmsnorm.benchmark` writes data/results/<gpu>/02_rmsnorm.json (with
the environment fingerprint and the measured ceilings) and prints the performance targets.

Bytes counted: the forward reads x and w and writes y (w is negligible beside x); the fused residual
version reads x and residual and writes y and h (4 tensors; w again negligible); forward + backward
moves 5 tensors (forward: read x, write y; backward: read x and dy, write dx).
"""

from __future__ import annotations

import sys

import torch

from kernels import bench, runtime
from kernels.bench import (
    RESULTS_DIR,  # noqa: F401 (the notebooks find the committed results through it)
)
from kernels.rmsnorm import cupy_rmsnorm, reference, triton_pdl, triton_rmsnorm
from kernels.testing import generator, poison_, random_tensor

SHAPE = (32768, 4096)  # the targets' shape: 128M bf16 elements, 256 MiB per tensor
DTYPE = torch.bfloat16


def forward_implementations() -> dict:
    impls = {
        "naive torch": reference.naive,
        "F.rms_norm": reference.rms_norm,
        "triton": triton_rmsnorm.rms_norm,
    }
    if runtime.cupy_status()[0]:
        impls["cupy"] = cupy_rmsnorm.rms_norm
    return impls


def _inputs(shape, dtype=DTYPE, seed=0):
    g = generator(seed, "cuda")
    return random_tensor(shape, dtype, "cuda", g), random_tensor((shape[-1],), dtype, "cuda", g)


def forward(shape=SHAPE, dtype=DTYPE, compiled: bool = True) -> dict:
    """Every forward implementation at one shape, interleaved: median us, GB/s (x read, y out)."""
    x, w = _inputs(shape, dtype)
    fns = {name: (lambda fn=fn: fn(x, w, 1e-6)) for name, fn in forward_implementations().items()}
    if compiled:
        compiled_naive = torch.compile(reference.naive)
        fns["torch.compile(naive)"] = lambda: compiled_naive(x, w, 1e-6)
    timings = bench.benchmark(fns)
    nbytes = 2 * x.numel() * x.element_size() + w.numel() * w.element_size()
    return {
        name: {
            **t.summary(),
            "gbps": t.gbps(nbytes),
            "speedup_vs_F.rms_norm": bench.ratio(timings["F.rms_norm"], t),
        }
        for name, t in timings.items()
    }


def width_sweep(
    widths=(512, 1024, 2048, 4096, 5120, 8192, 16384), elements: int = 64 * 2**20, dtype=DTYPE
) -> list[dict]:
    """GB/s at a fixed 64M elements, width varying (rows = elements / width)."""
    from tqdm.auto import tqdm

    rows = []
    for width in tqdm(widths, desc="rmsnorm widths"):
        for row in forward((elements // width, width), dtype, compiled=False).items():
            rows.append({"width": width, "rows": elements // width, "impl": row[0], **row[1]})
    return rows


def rows_sweep(width: int = 4096, counts=(1, 8, 64, 512, 4096, 32768), dtype=DTYPE) -> list[dict]:
    rows = []
    for n in counts:
        for name, row in forward((n, width), dtype, compiled=False).items():
            rows.append({"width": width, "rows": n, "impl": name, **row})
    return rows


def fused_residual(shape=SHAPE, dtype=DTYPE) -> dict:
    x, w = _inputs(shape, dtype)
    res = random_tensor(shape, dtype, "cuda", generator(1, "cuda"))
    compiled = torch.compile(reference.fused_add_rms_norm)
    timings = bench.benchmark(
        {
            "torch (add, then F.rms_norm)": lambda: reference.fused_add_rms_norm(x, res, w),
            "torch.compile": lambda: compiled(x, res, w),
            "triton fused": lambda: triton_rmsnorm.fused_add_rms_norm(x, res, w),
        }
    )
    nbytes = 4 * x.numel() * x.element_size()
    return {name: {**t.summary(), "gbps": t.gbps(nbytes)} for name, t in timings.items()}


def forward_backward(shape=SHAPE, dtype=DTYPE) -> dict:
    x, w = _inputs(shape, dtype)
    dy = random_tensor(shape, dtype, "cuda", generator(2, "cuda"))
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    compiled = torch.compile(reference.naive)

    def run(fn):
        return lambda: torch.autograd.grad(fn(xg, wg, 1e-6), (xg, wg), dy)

    timings = bench.benchmark(
        {
            "F.rms_norm": run(reference.rms_norm),
            "torch.compile(naive)": run(compiled),
            "triton": run(triton_rmsnorm.rms_norm_autograd),
        }
    )
    return {
        name: {**t.summary(), "speedup_vs_compile": bench.ratio(timings["torch.compile(naive)"], t)}
        for name, t in timings.items()
    }


def decode_in_graph(width: int = 4096, calls: int = 32, dtype=DTYPE) -> dict:
    """`calls` RMSNorms of one token (1 x width) in one CUDA graph: device time per call."""
    x, w = _inputs((1, width), dtype)
    outs = {}
    impls = {"F.rms_norm": reference.rms_norm, "triton": triton_rmsnorm.rms_norm}
    if runtime.cupy_status()[0]:
        impls["cupy"] = cupy_rmsnorm.rms_norm
    for name, fn in impls.items():
        t = bench.graph_replay_us(lambda fn=fn: [fn(x, w, 1e-6) for _ in range(calls)])
        outs[name] = {"us_per_call": t.median_us / calls}
    for row in outs.values():
        row["speedup_vs_F.rms_norm"] = outs["F.rms_norm"]["us_per_call"] / row["us_per_call"]
    return outs


def cupy_threads_sweep(shape=SHAPE, dtype=DTYPE) -> dict:
    """The CuPy kernel's threads per row, at the target shape (the wrapper's default picks one)."""
    if not runtime.cupy_status()[0]:
        return {}
    x, w = _inputs(shape, dtype)
    fns = {"default": lambda: cupy_rmsnorm.rms_norm(x, w)}
    fns.update(
        {
            f"{t} threads": (lambda t=t: cupy_rmsnorm.rms_norm(x, w, threads=t))
            for t in (64, 128, 256, 512)
        }
    )
    nbytes = 2 * x.numel() * x.element_size()
    return {
        name: {"median_us": t.median_us, "gbps": t.gbps(nbytes)}
        for name, t in bench.benchmark(fns).items()
    }


def cupy_wide_rows_sweep(
    widths=(4096, 8192, 16384), elements: int = 64 * 2**20, dtype=DTYPE
) -> list[dict]:
    """Wide rows at 64M elements: the register-resident kernel at each thread count that fits, the
    two-pass kernel, and the shared-memory-staged kernel, against F.rms_norm."""
    if not runtime.cupy_status()[0]:
        return []
    rows = []
    for width in widths:
        x, w = _inputs((elements // width, width), dtype)
        fns = {
            "F.rms_norm": lambda: reference.rms_norm(x, w, 1e-6),
            "cupy default": lambda: cupy_rmsnorm.rms_norm(x, w),
        }
        fns.update(
            {
                f"registers {t} threads": (lambda t=t: cupy_rmsnorm.rms_norm(x, w, threads=t))
                for t in (128, 256, 512, 1024)
            }
        )
        fns.update(
            {
                f"staged {t} threads x {u}": (
                    lambda t=t, u=u: cupy_rmsnorm.rms_norm(x, w, threads=t, staged=True, unroll=u)
                )
                for t, u in ((128, 4), (256, 4), (512, 4), (128, 8), (256, 8), (512, 8))
            }
        )
        nbytes = 2 * x.numel() * x.element_size()
        rows += [
            {"width": width, "impl": name, "median_us": t.median_us, "gbps": t.gbps(nbytes)}
            for name, t in bench.benchmark(fns).items()
        ]
    return rows


PDL_TOKENS = (16, 512, 4096)  # a decode batch, a small prefill, a large one


def _check_pdl(stack: triton_pdl.GemmNormLayers, graphs: dict) -> None:
    """Before timing: PDL and plain give the same bits, eagerly and replayed from a CUDA graph, and
    both match float64. Raises instead of timing a wrong kernel."""
    stack.run(pdl=False)
    wrong = {name: c.reason for name, c in stack.check().items() if not c.ok}
    if wrong:
        raise AssertionError(f"GEMM -> RMSNorm, T={stack.x.shape[0]}, against float64: {wrong}")
    plain = [t.clone() for t in stack.outputs()]
    runs = {
        "eager, PDL": lambda: stack.run(pdl=True),
        "graph, plain": graphs["pair"].replay,
        "graph, PDL": graphs["pair, PDL"].replay,
    }
    for name, run in runs.items():
        for t in stack.outputs():
            poison_(t)
        run()
        torch.cuda.synchronize()
        if not all(torch.equal(got, want) for got, want in zip(stack.outputs(), plain)):
            raise AssertionError(
                f"GEMM -> RMSNorm, T={stack.x.shape[0]}: {name} differs from the plain eager pair"
            )


def pdl_pair(tokens=PDL_TOKENS, hidden: int = 4096, layers: int = 8, dtype=DTYPE) -> list[dict]:
    """GEMM -> RMSNorm with and without programmatic dependent launch (triton_pdl.py): us per pair.

    `layers` pairs chained with distinct weights (triton_pdl.GemmNormLayers), checked first
    (`_check_pdl`), then timed two ways, L2 flushed before each repetition: replayed from a CUDA
    graph (no host in the loop, where the gap between kernels is the GPU's own) and eagerly (the
    host launches every kernel). Also the GEMMs alone and the norms alone (launched normally). [] in
    CPU mode (no PDL there)."""
    if not runtime.ON_GPU:
        return []
    rows = []
    for t in tokens:
        stack = triton_pdl.GemmNormLayers.random(t, hidden, layers, dtype)
        # every layer's input holds real data before the GEMMs and norms are captured alone
        stack.run()
        variants = {
            "GEMM": stack.gemms,
            "norm": stack.norms,
            "pair": lambda: stack.run(pdl=False),
            "pair, PDL": lambda: stack.run(pdl=True),
        }
        graphs = {name: bench.capture_graph(fn) for name, fn in variants.items()}
        _check_pdl(stack, graphs)
        for launch, fns in (
            ("CUDA graph", {name: g.replay for name, g in graphs.items()}),
            ("eager", variants),
        ):
            timings = bench.benchmark(fns)
            us = {name: timing.median_us / layers for name, timing in timings.items()}
            rows.append(
                {
                    "T": t,
                    "launch": launch,
                    "GEMM us": us["GEMM"],
                    "norm us": us["norm"],
                    "pair us": us["pair"],
                    "pair PDL us": us["pair, PDL"],
                    "saving us": us["pair"] - us["pair, PDL"],
                    "saving %": 100 * (us["pair"] - us["pair, PDL"]) / us["pair"],
                    "PDL speedup": bench.ratio(timings["pair"], timings["pair, PDL"]),
                }
            )
    return rows


def pdl_lines(rows: list[dict]) -> list[str]:
    """One informational line per token count (a demonstration, not a target)."""
    return [
        f"PDL, informational: GEMM -> RMSNorm at T={r['T']} ({r['launch']}): {r['pair us']:.2f} -> "
        f"{r['pair PDL us']:.2f} us per pair, {r['saving us']:+.2f} us ({r['saving %']:+.1f}%)"
        for r in rows
    ]


def pdl_summary(rows: list[dict]) -> str:
    """The table and the informational lines, or "not measured: no GPU"."""
    if not rows:
        return bench.NOT_MEASURED
    return bench.table(rows, floatfmt=".2f") + "\n\n" + "\n".join(pdl_lines(rows))


def performance_targets(ceilings: dict, results: dict) -> list[dict]:
    copy = ceilings["copy_gbps"]
    fwd, checks = results["forward"], []
    for name in ("cupy", "triton"):
        if name in fwd:
            checks.append(
                {
                    "target": f"forward {name} 32768x4096 bf16: >= 90% of copy",
                    "value": fwd[name]["gbps"] / copy,
                    "threshold": 0.90,
                }
            )
            checks.append(
                {
                    "target": f"forward {name} 32768x4096 bf16: >= 1.12x F.rms_norm",
                    "value": fwd[name]["speedup_vs_F.rms_norm"],
                    "threshold": 1.12,
                }
            )
    checks.append(
        {
            "target": "fused add+RMSNorm triton: >= 85% of copy "
            "(x, residual, w read; y, h written)",
            "value": results["fused_residual"]["triton fused"]["gbps"] / copy,
            "threshold": 0.85,
        }
    )
    checks.append(
        {
            "target": "forward+backward triton: >= 1.5x torch.compile",
            "value": results["forward_backward"]["triton"]["speedup_vs_compile"],
            "threshold": 1.5,
        }
    )
    for name in ("cupy", "triton"):
        sweep = [r for r in results["width_sweep"] if r["impl"] == name]
        if sweep:
            worst = min(sweep, key=lambda r: r["gbps"])
            checks.append(
                {
                    "target": f"widths 512-16384 at 64M elements, {name}: "
                    ">= 85% of copy throughout "
                    f"(worst: width {worst['width']})",
                    "value": worst["gbps"] / copy,
                    "threshold": 0.85,
                }
            )
    for name in ("cupy", "triton"):
        if name in results["decode_graph"]:
            checks.append(
                {
                    "target": f"decode (1, 4096) in a CUDA graph, {name}: >= 1.5x F.rms_norm",
                    "value": results["decode_graph"][name]["speedup_vs_F.rms_norm"],
                    "threshold": 1.5,
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
        "forward": forward(),
        "cupy_threads": cupy_threads_sweep(),
        "fused_residual": fused_residual(),
        "forward_backward": forward_backward(),
        "width_sweep": width_sweep(),
        "rows_sweep": rows_sweep(),
        "decode_graph": decode_in_graph(),
        "cupy_wide_rows": cupy_wide_rows_sweep(),
        "pdl_pair": pdl_pair(),
    }
    results["targets"] = performance_targets(ceilings, results)
    path = bench.save_results("02_rmsnorm", results)
    print(
        bench.table(
            [
                {k: c[k] for k in ("target", "value", "threshold", "pass")}
                for c in results["targets"]
            ],
            floatfmt=".3f",
        )
    )
    for section in (
        "forward",
        "cupy_threads",
        "fused_residual",
        "forward_backward",
        "decode_graph",
    ):
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
    print(f"\npdl_pair\n{pdl_summary(results['pdl_pair'])}")
    print(f"wrote {path}")
    return 0 if all(c["pass"] for c in results["targets"]) else 2


def main_pdl() -> int:
    """`python -m kernels.rmsnorm.benchmark pdl`: the PDL pair alone, to
    data/results/<gpu>/02_rmsnorm_pdl.json."""
    rows = pdl_pair()
    print(pdl_summary(rows))
    if not rows:
        return 1
    path = bench.save_results(
        "02_rmsnorm_pdl", {"fingerprint": runtime.fingerprint(), "pdl_pair": rows}
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main_pdl() if sys.argv[1:] == ["pdl"] else main())
