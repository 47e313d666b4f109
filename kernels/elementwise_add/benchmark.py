"""Benchmarks of the add kernels: the measurements behind notebook 01 and data/results/<gpu>/.

Run on a GPU: `python -m kernels.elementwise_add.benchmark` writes
data/results/<gpu>/01_elementwise_add.json (with the environment fingerprint and the measured
ceilings) and prints the performance targets.

Every number is a median of interleaved, L2-flushed, event-timed repetitions (kernels.bench),
measured in the same process as the torch equivalent it is compared with.
"""

from __future__ import annotations

import functools
import math
import sys

import torch

from kernels import bench, runtime
from kernels.bench import (
    RESULTS_DIR,  # noqa: F401 (the notebooks find the committed results through it)
)
from kernels.elementwise_add import cupy_add, reference, triton_add
from kernels.testing import generator, random_tensor

TARGET_N = 64 * 2**20  # the bandwidth targets' size: 64M elements, far beyond L2


def add_implementations() -> dict:
    """name -> fn(a, b, out); the CuPy kernels only where CuPy can run."""
    impls = {"torch": lambda a, b, out: torch.add(a, b, out=out)}
    if runtime.cupy_status()[0]:
        impls["cupy naive"] = cupy_add.add_naive
        impls["cupy vectorized"] = cupy_add.add_vectorized
    impls["triton"] = triton_add.add
    return impls


def bandwidth_sweep(
    sizes, dtype=torch.float16, impls: dict | None = None, seed: int = 0, progress: bool = True
) -> list[dict]:
    """GB/s (3 tensors moved) of each implementation at each size; [] in CPU mode."""
    if not runtime.ON_GPU:
        return []
    from tqdm import tqdm  # text bars (stderr): a notebook saved after the run shows them finished

    impls = impls or add_implementations()
    g = generator(seed, "cuda")
    rows = []
    for n in tqdm(
        list(sizes), desc=f"add sweep {str(dtype).removeprefix('torch.')}", disable=not progress
    ):
        a, b = random_tensor((n,), dtype, "cuda", g), random_tensor((n,), dtype, "cuda", g)
        out = torch.empty_like(a)
        timings = bench.benchmark(
            {name: functools.partial(fn, a, b, out) for name, fn in impls.items()}, target_ms=100
        )
        for name, t in timings.items():
            lo, hi = t.spread_us
            rows.append(
                {
                    "impl": name,
                    "dtype": str(dtype).removeprefix("torch."),
                    "n": n,
                    "median_us": t.median_us,
                    "p10_us": lo,
                    "p90_us": hi,
                    "gbps": t.gbps(3 * n * a.element_size()),
                }
            )
        del a, b, out
    return rows


def decode_residual_stream(
    layers: int = 32, width: int = 2560, dtype=torch.float16, seed: int = 0, progress: bool = True
) -> dict:
    """A decode step's residual adds: `layers` updates h = mlp + attn + h of one token.

    The token is a (1, width) row.

    Eager PyTorch (2 adds = 2 launches per layer), the fused kernels eager (1 launch per layer), and
    both captured in a CUDA graph (one launch for the whole stack). A decode step of one token is
    launch-bound, so each way is timed as the caller sees it: wall time per step, steps back to
    back, one synchronization at the end (`bench.host_loop_us`).
    """
    if not runtime.ON_GPU:
        return {}
    g = generator(seed, "cuda")
    h0 = random_tensor((1, width), dtype, "cuda", g)
    attn = [random_tensor((1, width), dtype, "cuda", g) for _ in range(layers)]
    mlp = [random_tensor((1, width), dtype, "cuda", g) for _ in range(layers)]

    def stack(kernel):
        def step():
            h = h0
            for a, m in zip(attn, mlp):
                h = kernel(h, a, m)
            return h

        return step

    kernels = {"torch": reference.residual_add, "triton fused": triton_add.residual_add}
    if runtime.cupy_status()[0]:
        kernels["cupy fused"] = cupy_add.residual_add
    launches_per_layer = {"torch": 2, "triton fused": 1, "cupy fused": 1}
    from tqdm import tqdm  # text bars (stderr): a notebook saved after the run shows them finished

    ways = {}
    for name, kernel in tqdm(
        list(kernels.items()), desc="decode step, eager and graph", disable=not progress
    ):
        step = stack(kernel)
        ways[f"{name} eager"] = {
            "us_per_step": bench.host_loop_us(step, iters=500),
            "launches": launches_per_layer[name] * layers,
        }
        graph = bench.capture_graph(step)
        ways[f"{name} graph replay"] = {
            "us_per_step": bench.host_loop_us(graph.replay, iters=500),
            "launches": 1,
        }
    # Bit for bit: the fused kernel must give the unfused model's exact hidden state after all
    # layers.
    bitwise = bool(torch.equal(stack(triton_add.residual_add)(), stack(reference.residual_add)()))
    return {
        "ways": ways,
        "fused equals torch bitwise": bitwise,
        "layers": layers,
        "width": width,
        "dtype": str(dtype).removeprefix("torch."),
    }


def fused_vs_two_adds(shape, dtype=torch.float16, seed: int = 0) -> dict:
    """One fused residual add against PyTorch's two adds, device time (events), for one shape.

    `gbps` counts the 4 tensors a fused pass must move, for every row; PyTorch's two adds actually
    move 6 (the intermediate is written and read back), which is why they are slower.
    """
    if not runtime.ON_GPU:
        return {}
    g = generator(seed, "cuda")
    x, attn, mlp = (random_tensor(shape, dtype, "cuda", g) for _ in range(3))
    out = torch.empty_like(x)
    fns = {
        "torch (2 adds)": lambda: reference.residual_add(x, attn, mlp),
        "triton fused": lambda: triton_add.residual_add(x, attn, mlp, out),
    }
    if runtime.cupy_status()[0]:
        fns["cupy fused"] = lambda: cupy_add.residual_add(x, attn, mlp, out)
    t = bench.benchmark(fns)
    nbytes = 4 * x.numel() * x.element_size()
    rows = {
        name: {
            **timing.summary(),
            "gbps": timing.gbps(nbytes),
            "speedup_vs_torch": bench.ratio(t["torch (2 adds)"], timing),
        }
        for name, timing in t.items()
    }
    return {"shape": list(shape), "dtype": str(dtype).removeprefix("torch."), "rows": rows}


def performance_targets(ceilings: dict, seed: int = 0, progress: bool = True) -> list[dict]:
    """The module's performance targets (data/expected), each measured as a ratio in this run."""
    from tqdm import tqdm  # text bars (stderr): a notebook saved after the run shows them finished

    g = generator(seed, "cuda")
    copy = ceilings["copy_gbps"]
    checks = []
    for dtype in tqdm(
        (torch.float16, torch.float32), desc="targets: add at 64M", disable=not progress
    ):
        a, b = (
            random_tensor((TARGET_N,), dtype, "cuda", g),
            random_tensor((TARGET_N,), dtype, "cuda", g),
        )
        out = torch.empty_like(a)
        t = bench.benchmark(
            {name: functools.partial(fn, a, b, out) for name, fn in add_implementations().items()}
        )
        for name in ("cupy vectorized", "triton", "cupy naive", "torch"):
            gbps = t[name].gbps(3 * a.numel() * a.element_size())
            graded = name in ("cupy vectorized", "triton")
            checks.append(
                {
                    "target": f"add {name} {str(dtype)[6:]} 64M: "
                    + (">= 95% of copy" if graded else "fraction of copy (for contrast)"),
                    "value": gbps / copy,
                    "threshold": 0.95 if graded else None,
                    "gbps": gbps,
                    "median_us": t[name].median_us,
                }
            )
        del a, b, out
    fused = fused_vs_two_adds((TARGET_N,), torch.float16, seed)
    for name in ("triton fused", "cupy fused"):
        if name in fused["rows"]:
            row = fused["rows"][name]
            checks.append(
                {
                    "target": f"residual add {name} fp16 64M: >= 90% of copy (4 tensors)",
                    "value": row["gbps"] / copy,
                    "threshold": 0.90,
                    "gbps": row["gbps"],
                    "median_us": row["median_us"],
                }
            )
            checks.append(
                {
                    "target": f"residual add {name} fp16 64M: >= 1.4x two torch adds",
                    "value": row["speedup_vs_torch"],
                    "threshold": 1.4,
                }
            )
    decode = decode_residual_stream()
    eager = decode["ways"]["torch eager"]["us_per_step"]
    graph = decode["ways"]["torch graph replay"]["us_per_step"]
    checks.append(
        {
            "target": "64 decode-size (1x2560 fp16) adds: graph replay >= 4x eager "
            "(wall time per step)",
            "value": eager / graph,
            "threshold": 4.0,
            "eager_us": eager,
            "graph_us": graph,
        }
    )
    for c in checks:
        c["pass"] = None if c["threshold"] is None else bool(c["value"] >= c["threshold"])
    return checks


def log2_sizes(max_exp: int = 28, per_octave: int = 1) -> list[int]:
    """1, 2, 4, ... 2**max_exp elements (256M by default); odd sizes between if per_octave > 1."""
    return sorted(
        {max(1, round(2 ** (e / per_octave))) for e in range(0, max_exp * per_octave + 1)}
    )


def main() -> int:
    if not runtime.ON_GPU:
        print(bench.NOT_MEASURED)
        return 1
    ceilings = bench.ceilings(refresh=True)
    results = {
        "fingerprint": runtime.fingerprint(),
        "ceilings": {k: v for k, v in ceilings.items() if k != "fingerprint"},
        "targets": performance_targets(ceilings),
        "sweep": bandwidth_sweep(log2_sizes(), torch.float16)
        + bandwidth_sweep(log2_sizes(), torch.float32),
        "micro_vs_decode": [fused_vs_two_adds((1024, 2560)), fused_vs_two_adds((1, 2560))],
        "decode": decode_residual_stream(),
    }
    path = bench.save_results("01_elementwise_add", results)
    print(
        bench.table(
            [
                {
                    k: (v if not isinstance(v, float) or math.isfinite(v) else None)
                    for k, v in c.items()
                    if k in ("target", "value", "threshold", "pass")
                }
                for c in results["targets"]
            ],
            floatfmt=".3f",
        )
    )
    print(f"wrote {path}")
    return 0 if all(c["pass"] is not False for c in results["targets"]) else 2


if __name__ == "__main__":
    sys.exit(main())
