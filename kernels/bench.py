"""Timing GPU code honestly, and the ceilings to compare it with.

The method (notebook 00 explains each step):

1. **Count first.** Bytes that must move and flops that must happen, over the *measured* ceilings of
   this GPU (`ceilings()`), give a floor no kernel can beat.
2. **Warm up** so compilation, module loading and allocator growth stay out of the numbers.
3. **Flush L2** before every repetition by reading a buffer larger than L2: otherwise a 32 MB
   working set is served from a 50-60 MB cache and "bandwidth" exceeds what HBM can deliver.
4. **Device events** around each repetition: the host clock measures launch, not execution. A spin
   kernel before each start event, twice as long as the host took to queue the call in the warm-up,
   keeps the GPU busy while the host queues it, so no event pair includes host launch time. (For
   launch-bound code, where host time *is* the cost, use `host_loop_us`: back-to-back calls, one
   synchronization, wall time per call.)
5. **Median and spread** of many repetitions; one number is an anecdote.
6. **Interleave** the variants being compared (A, B, A, B, ...) so clock and thermal drift hit both
   equally, and quote their ratio from the same run.

`triton.testing.do_bench` follows steps 2-5 for a single function; `benchmark` below adds step 6,
which is why the course uses it for every comparison. In CPU mode the same calls fall back to a host
timer and label the numbers ``cpu-host``: they say nothing about a GPU.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from kernels import runtime

NOT_MEASURED = "not measured: no GPU"


@dataclass
class Timing:
    """Repeated measurements of one function, in microseconds."""

    name: str
    times_us: list[float] = field(repr=False)
    clock: str  # "cuda-events" or "cpu-host"

    @property
    def median_us(self) -> float:
        return statistics.median(self.times_us)

    @property
    def spread_us(self) -> tuple[float, float]:
        """10th and 90th percentile."""
        q = (
            statistics.quantiles(self.times_us, n=10, method="inclusive")
            if len(self.times_us) > 1
            else None
        )
        return (q[0], q[-1]) if q else (self.times_us[0], self.times_us[0])

    @property
    def min_us(self) -> float:
        return min(self.times_us)

    def gbps(self, nbytes: float) -> float:
        return nbytes / (self.median_us * 1e-6) / 1e9

    def tflops(self, flops: float) -> float:
        return flops / (self.median_us * 1e-6) / 1e12

    def summary(self) -> dict:
        lo, hi = self.spread_us
        return {
            "name": self.name,
            "clock": self.clock,
            "median_us": self.median_us,
            "p10_us": lo,
            "p90_us": hi,
            "min_us": self.min_us,
            "reps": len(self.times_us),
        }


@functools.cache
def _l2_flush_buffer() -> torch.Tensor:
    info = runtime.gpu_info()
    return torch.ones(2 * info.l2_bytes // 4 + 1, dtype=torch.float32, device="cuda")


def flush_l2() -> None:
    """Evict L2 by *reading* a buffer twice its size.

    Reading leaves L2 full of clean lines, which cost nothing to evict. A flush that writes (a fill)
    leaves dirty lines that the timed kernel then pays to write back: measured on an H200, that made
    a 64M-element fp16 add read 4109 GB/s instead of 4347 (notebook 00).
    """
    if runtime.ON_GPU:
        _l2_flush_buffer().sum()


# The spin kernel queued before each repetition runs at least this many GPU clock cycles (about 100
# us).
GUARD_CYCLES = 200_000
# Hopper's highest SM clock is about 2 GHz: a spin of 2000 cycles per microsecond lasts at least
# that long.
CYCLES_PER_US = 2000
# A call whose host side takes longer than 10 ms (a first call that compiles, with a single warm-up)
# is launch-bound or not warmed up: no spin hides that, and a longer one would only slow every
# repetition.
MAX_GUARD_CYCLES = 10_000 * CYCLES_PER_US


def guard_cycles(host_us: float) -> int:
    """Cycles of spin that outlast `host_us` of host time spent queueing the timed call, twice over.

    The start event must not be reached before the host has queued the work behind it, or the events
    time the host's launch path (a Python wrapper: 10-30 us a kernel) instead of the kernels. Seen
    on an H200: a 1-element CuPy add "took" 28 us; flash-decoding (two Triton launches, two
    allocations) "took" 48 us at a 4k cache and 100 us in a sweep whose calls passed keyword
    arguments, whatever the kernel.
    """
    return min(MAX_GUARD_CYCLES, max(GUARD_CYCLES, int(2 * host_us * CYCLES_PER_US)))


def benchmark(
    fns: dict[str, Callable[[], object]],
    *,
    reps: int | None = None,
    warmup: int = 5,
    flush: bool = True,
    target_ms: float = 200.0,
    max_reps: int = 1000,
    min_reps: int = 10,
    before_round: Callable[[], None] | None = None,
    after_round: Callable[[], None] | None = None,
) -> dict[str, Timing]:
    """Time several functions interleaved, each repetition bracketed by device events.

    `reps=None` picks the number of repetitions so the whole run takes about `target_ms` (at least
    `min_reps`). `before_round()` runs before each round (warm-up rounds too) and `after_round()`
    after each timed round, both outside the timed regions: the grader uses them to draw new inputs
    and to check every round's outputs without stalling the queue. Returns one `Timing` per name,
    in the order given.
    """
    before = before_round or (lambda: None)
    after = after_round or (lambda: None)
    if not runtime.ON_GPU:
        return _benchmark_host(
            fns, reps=reps or 3, warmup=min(warmup, 1), before=before, after=after
        )
    names = list(fns)
    host_us = dict.fromkeys(names, 0.0)
    for _ in range(warmup):
        before()
        for name in names:
            t0 = time.perf_counter()
            fns[name]()
            host_us[name] = (
                time.perf_counter() - t0
            ) * 1e6  # the last warm-up's: compilation is over
    torch.cuda.synchronize()
    spin = guard_cycles(max(host_us.values()))
    if reps is None:
        t0 = time.perf_counter()
        before()
        for name in names:
            flush_l2()
            fns[name]()
        torch.cuda.synchronize()
        per_round_ms = max((time.perf_counter() - t0) * 1e3, 1e-3)
        reps = int(min(max_reps, max(min_reps, target_ms / per_round_ms)))
    starts = {n: [torch.cuda.Event(enable_timing=True) for _ in range(reps)] for n in names}
    ends = {n: [torch.cuda.Event(enable_timing=True) for _ in range(reps)] for n in names}
    for i in range(reps):
        before()
        # Rotate the order too, so no variant always runs right after another's memory traffic.
        order = names[i % len(names) :] + names[: i % len(names)]
        for name in order:
            if flush:
                flush_l2()
            torch.cuda._sleep(spin)  # the GPU spins while the host queues the call (guard_cycles)
            starts[name][i].record()
            fns[name]()
            ends[name][i].record()
        after()
    # Synchronize the whole device (every stream), not just the timing stream.
    torch.cuda.synchronize()
    return {
        n: Timing(n, [s.elapsed_time(e) * 1e3 for s, e in zip(starts[n], ends[n])], "cuda-events")
        for n in names
    }


def _benchmark_host(fns, *, reps: int, warmup: int, before, after) -> dict[str, Timing]:
    for _ in range(warmup):
        before()
        for fn in fns.values():
            fn()
    times = {n: [] for n in fns}
    for _ in range(reps):
        before()
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e6)
        after()
    return {n: Timing(n, t, "cpu-host") for n, t in times.items()}


def host_loop_us(fn: Callable[[], object], *, iters: int = 2000, warmup: int = 10) -> float:
    """Wall time per call of `fn` called back to back, synchronized only at the end.

    For small work this measures how fast the host can launch, which is what an eager decode step
    pays.
    """
    for _ in range(warmup):
        fn()
    sync = torch.cuda.synchronize if runtime.ON_GPU else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - t0) / iters * 1e6


def ratio(baseline: Timing, candidate: Timing) -> float:
    """How many times faster `candidate` is than `baseline`: the median per-repetition ratio.

    Pairing repetition i of each removes drift that a ratio of two medians would keep.
    """
    pairs = [b / c for b, c in zip(baseline.times_us, candidate.times_us) if c > 0]
    return statistics.median(pairs)


def capture_graph(fn: Callable[[], object], *, warmup: int = 3) -> "torch.cuda.CUDAGraph":
    """Capture `fn` in a CUDA graph (it may launch many kernels: PyTorch's, Triton's, CuPy's)."""
    if not runtime.ON_GPU:
        raise RuntimeError("CUDA graphs need a GPU")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up off the capture stream, as torch.cuda.graphs recommends
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def graph_replay_us(fn: Callable[[], object], *, reps: int = 50) -> Timing:
    """Device time of one replay of `fn` captured in a CUDA graph.

    A graph launch submits all of `fn`'s kernels at once, so what remains is the GPU's own time per
    kernel, without the host's per-launch overhead.
    """
    graph = capture_graph(fn)
    return benchmark({"graph replay": graph.replay}, reps=reps, flush=False)["graph replay"]


# --------------------------------------------------------------------------------------------------
# Ceilings: what this GPU can actually do, measured, not read off a datasheet.

CACHE_DIR = Path(os.environ.get("KERNELS_CACHE_DIR", Path.home() / ".cache" / "gpu-kernels-course"))


def measure_copy_gbps(nbytes: int = 2 * 2**30) -> float:
    """Device-to-device copy bandwidth, bytes read plus written (as every GB/s here counts)."""
    src = torch.randn(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    t = benchmark({"copy": lambda: dst.copy_(src)}, reps=30, flush=False)["copy"]
    return t.gbps(2 * src.numel() * 4)


def measure_matmul_tflops(n: int = 8192, dtype: torch.dtype = torch.bfloat16) -> float:
    """Dense n x n x n matrix product through cuBLAS, on random data (zeros run faster)."""
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    t = benchmark({"matmul": lambda: a @ b}, reps=20, flush=False)["matmul"]
    return t.tflops(2 * n**3)


RESULTS_DIR = Path(__file__).resolve().parents[1] / "data" / "results"


def save_results(name: str, results: dict, gpu_slug: str | None = None) -> Path:
    """Write a benchmark's results (which carry their environment fingerprint) to
    data/results/<gpu>/<name>.json, <gpu> being this GPU's short name unless `gpu_slug` says
    otherwise."""
    path = RESULTS_DIR / (gpu_slug or runtime.gpu_info().slug) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1, default=str))
    return path


def ceilings(refresh: bool = False) -> dict | None:
    """Copy GB/s and bf16 matmul TFLOP/s of this GPU, measured once and cached per GPU and software.

    Returns None in CPU mode.
    """
    if not runtime.ON_GPU:
        return None
    fp = runtime.fingerprint()
    key = f"{fp['gpu_slug']}_driver-{fp['driver']}_torch-{fp['torch']}"
    path = CACHE_DIR / "ceilings.json"
    cache = json.loads(path.read_text()) if path.exists() else {}
    if key not in cache or refresh:
        cache[key] = {
            "copy_gbps": measure_copy_gbps(),
            "matmul_bf16_tflops": measure_matmul_tflops(),
            "fingerprint": fp,
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(cache, indent=1))
        tmp.replace(path)
    return cache[key]


def floor_us(nbytes: float = 0.0, flops: float = 0.0, ceil: dict | None = None) -> float | None:
    """The time below which no kernel can go: max(bytes / copy bandwidth, flops / matmul rate)."""
    ceil = ceil or ceilings()
    if ceil is None:
        return None
    return (
        max(nbytes / (ceil["copy_gbps"] * 1e9), flops / (ceil["matmul_bf16_tflops"] * 1e12)) * 1e6
    )


def table(rows: list[dict], columns: list[str] | None = None, floatfmt: str = ".1f") -> str:
    """A plain-text table (for printing in notebooks and logs)."""
    if not rows:
        return "(no rows)"
    columns = columns or list(rows[0])

    def cell(v):
        if isinstance(v, float):
            return format(v, floatfmt)
        return "" if v is None else str(v)

    cells = [[cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = [
        "  ".join(c.rjust(w) for c, w in zip(columns, widths)),
        "  ".join("-" * w for w in widths),
    ]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)
