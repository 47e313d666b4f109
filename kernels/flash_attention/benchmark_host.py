"""Benchmark of the host cost of an eager attention call: the Triton wrappers beside SDPA's for the
same call (a decode step, a short causal prefill with and without autograd), and where the host
time goes (cProfile), with the cached launches (fast_launch.py) and with Triton's ordinary launch.

    python -m kernels.flash_attention.benchmark_host
        -> data/results/<gpu>/03_flash_attention_host.json
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F

from kernels import bench
from kernels.flash_attention import fast_launch, triton_decode, triton_flash
from kernels.flash_attention.benchmark import (
    DECODE_SHAPE,
    make_inputs,
    passed,
    run_to_own_file,
    runs,
    sdpa_backend,
)

HOST_CALLS = 200  # calls issued back to back without a sync, for the host time per call


def _issue_us(fn, calls: int = HOST_CALLS) -> float:
    """Host time per call: `calls` calls issued back to back (few enough that the launch queue never
    fills, so the host never waits for the GPU), then one sync outside the clock."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - t0
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def _ordinary_launch(fn):
    """`fn` with every Triton launch taking Triton's ordinary path (no cached launches)."""

    def run():
        fast_launch.ENABLED = False
        try:
            return fn()
        finally:
            fast_launch.ENABLED = True

    return run


def host_profile(fn, calls: int = 500, top: int = 12) -> list[dict]:
    """Where the host time of `fn` goes: cProfile over `calls` eager calls, the `top` functions by
    their own time (microseconds per call)."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(profiler).stats
    rows = [
        {"function": f"{path.split('/')[-1]}:{line} {name}", "own_us": tt / calls * 1e6,
         "cumulative_us": ct / calls * 1e6, "calls_per_call": nc / calls}
        for (path, line, name), (_, nc, tt, ct, _) in stats.items()
    ]  # fmt: skip
    return sorted(rows, key=lambda r: -r["own_us"])[:top]


def host_time(iters: int = 2000) -> dict:
    """Eager host cost per call of the attention wrappers beside SDPA's, for the same call: the host
    time (calls issued back to back, no sync), the wall time of `iters` back-to-back calls
    (`bench.host_loop_us`: what an eager loop pays, max(host, GPU) once the queue is full), and the
    GPU time (device events). "ordinary launch" is the same wrapper with Triton's own launch
    path."""
    from torch.nn.attention import SDPBackend

    b, hq, hkv, d = DECODE_SHAPE
    q, k, v = make_inputs(b, hq, 4096, d, torch.float16, h_kv=hkv, n_q=1)
    pq, pk, pv = make_inputs(1, 16, 512, 64, torch.float16)
    gq, gk, gv = make_inputs(1, 16, 512, 64, torch.float16, seed=1, requires_grad=True)
    flash, cudnn = (
        sdpa_backend(SDPBackend.FLASH_ATTENTION),
        sdpa_backend(SDPBackend.CUDNN_ATTENTION),
    )
    cases = {
        "decode (1, 32:8, 1, 4096, 128)": {
            "ours": lambda: triton_decode.flash_decode(q, k, v),
            "sdpa (enable_gqa)": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
        },
        "prefill (1, 16, 512, 64) causal, no grad": {
            "ours": lambda: triton_flash.flash_attention(pq, pk, pv, causal=True),
            "sdpa": lambda: F.scaled_dot_product_attention(pq, pk, pv, is_causal=True),
            "sdpa flash (backend forced)": lambda: flash(pq, pk, pv, True),
            "sdpa cudnn (backend forced)": lambda: cudnn(pq, pk, pv, True),
        },
        "prefill (1, 16, 512, 64) causal, requires_grad (forward)": {
            "ours": lambda: triton_flash.flash_attention(gq, gk, gv, causal=True),
            "sdpa": lambda: F.scaled_dot_product_attention(gq, gk, gv, is_causal=True),
        },
    }
    rows, profiles = [], {}
    for case, fns in cases.items():
        fns = {**fns, "ours (ordinary launch)": _ordinary_launch(fns["ours"])}
        fns = {n: f for n, f in fns.items() if runs(f)}
        gpu = bench.benchmark(fns, target_ms=50.0)
        for name, fn in fns.items():
            rows.append({"case": case, "impl": name, "host_us": _issue_us(fn),
                         "wall_us": bench.host_loop_us(fn, iters=iters),
                         "gpu_us": gpu[name].median_us})  # fmt: skip
        profiles[case] = host_profile(fns["ours"])
        profiles[case + ", ordinary launch"] = host_profile(fns["ours (ordinary launch)"])
    return {"rows": rows, "profiles": profiles}


def targets(host: dict) -> list[dict]:
    """Ours no slower on the host than SDPA for the same call, case by case."""
    checks = []
    for case in sorted({r["case"] for r in host["rows"]}):
        impls = {r["impl"]: r for r in host["rows"] if r["case"] == case}
        sdpa = impls.get("sdpa (enable_gqa)") or impls.get("sdpa")
        if sdpa and "ours" in impls:
            value = sdpa["host_us"] / impls["ours"]["host_us"]
            target = f"host time per call, {case}: ours <= SDPA"
            checks.append({"target": target, "value": value, "threshold": 1.0})
    return passed(checks)


def show(host: dict) -> None:
    print("\nhost cost per eager call (us)")
    print(bench.table(host["rows"], floatfmt=".1f"))
    for case, rows in host["profiles"].items():
        print(f"\nwhere the host time goes, {case} (us per call)")
        print(bench.table(rows, floatfmt=".2f"))


if __name__ == "__main__":
    sys.exit(run_to_own_file("host", host_time, targets, show))
