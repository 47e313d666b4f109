"""torch.profiler on a training step, and the Chrome trace it exports read back.

`profile_step` runs one training step of the small GPT (kernels.memory_profiling.gpt) under
`torch.profiler.profile` with CPU and CUDA activity, its forward, backward and optimizer phases
marked twice: `torch.profiler.record_function` (seen by torch.profiler) and an NVTX range (seen by
Nsight Systems and Nsight Compute). `export_trace` writes the Chrome trace, trimmed to what a
timeline needs (so it is small enough to commit); Perfetto (https://ui.perfetto.dev) or
chrome://tracing open it.

The rest reads such a trace with nothing but `json`:
* `read_trace` -> `Trace`: CPU ops, runtime calls (cudaLaunchKernel, ...), GPU kernels and the
phases;
* `kernel_totals`: GPU time per kernel name and per category (matmul, attention, other);
* `phase_of_kernels`: which phase launched each kernel (through the launch's correlation id);
* `gpu_gaps`: the idle stretches between kernels on the GPU: the host not keeping up.
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kernels import runtime

PHASES = ("forward", "backward", "optimizer")
# Kernel names -> category, the first pattern that matches. SDPA's kernels (fmha_cutlass*, *flash*,
# cudnn *sdpa*) before the GEMMs (sm80_xmma_gemm_*, nvjet_*, cutlass_*), whose names they share.
CATEGORIES = (
    ("attention", re.compile(r"flash|fmha|attention|sdpa", re.I)),
    ("matmul", re.compile(r"gemm|nvjet|cutlass|xmma|matmul|wgmma", re.I)),
)
KEEP = {
    "kernel",
    "gpu_memcpy",
    "gpu_memset",
    "cuda_runtime",
    "cuda_driver",
    "user_annotation",
    "gpu_user_annotation",
    "cpu_op",
}
KEEP_ARGS = (
    "correlation",
    "stream",
    "device",
    "grid",
    "block",
    "registers per thread",
    "shared memory",
    "est. achieved occupancy %",
)


def category(kernel_name: str) -> str:
    for name, pattern in CATEGORIES:
        if pattern.search(kernel_name):
            return name
    return "other"


# --------------------------------------------------------------------------------------------------
# Recording


def _nvtx_range(name: str):
    try:
        import nvtx
    except ImportError:  # the pinned environment has it; without it, torch.profiler's ranges remain
        return contextlib.nullcontext()
    return nvtx.annotate(name, domain="training step")


@contextlib.contextmanager
def phase(name: str):
    """A phase of the step, for torch.profiler (record_function) and for Nsight (NVTX)."""
    with _nvtx_range(name), torch.profiler.record_function(name):
        yield


def profile_step(
    cfg, batch: int, seq: int, *, autocast: torch.dtype | None = None, warmup: int = 2
):
    """One training step of GPT(cfg) in float32 weights (autocast to `autocast` if given), after
    `warmup` steps; returns the finished torch.profiler.profile."""
    from torch.profiler import ProfilerActivity, profile

    from kernels.memory_profiling.gpt import GPT, make_batch

    torch.manual_seed(0)
    model = GPT(cfg).to(runtime.DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    idx, targets = make_batch(cfg, batch, seq, runtime.DEVICE)
    mixed = (
        torch.autocast(runtime.DEVICE, dtype=autocast)
        if autocast is not None
        else contextlib.nullcontext()
    )

    def step():
        with phase("forward"), mixed:
            loss = model(idx, targets)
        with phase("backward"):
            loss.backward()
        with phase("optimizer"):
            opt.step()
            opt.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if runtime.ON_GPU else [])
    if runtime.ON_GPU:
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        with torch.profiler.record_function("training step"):
            step()
        if runtime.ON_GPU:
            torch.cuda.synchronize()
    return prof


def key_averages_table(prof, rows: int = 12) -> str:
    """The ops that took the most device time (host time on a CPU), as torch.profiler prints
    them."""
    key = "self_cuda_time_total" if runtime.ON_GPU else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=48)


def trim(trace: dict) -> dict:
    """Keep the events a timeline needs (ops, runtime calls, kernels, ranges) with a few
    arguments."""
    events = []
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "X" and e.get("cat") in KEEP:
            kept = {k: e[k] for k in ("ph", "cat", "name", "pid", "tid", "ts", "dur") if k in e}
            args = {k: e["args"][k] for k in KEEP_ARGS if k in e.get("args", {})}
            if args:
                kept["args"] = args
            events.append(kept)
        elif e.get("ph") == "M" and e.get("name") in ("process_name", "thread_name"):
            events.append(e)
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        **{k: trace[k] for k in ("deviceProperties", "distributedInfo") if k in trace},
    }


def export_trace(prof, path) -> Path:
    """Write the profile's Chrome trace, trimmed (see `trim`), compact JSON."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    raw = path.with_suffix(".raw.json")
    prof.export_chrome_trace(str(raw))
    path.write_text(json.dumps(trim(json.loads(raw.read_text())), separators=(",", ":")))
    raw.unlink()
    return path


# --------------------------------------------------------------------------------------------------
# Reading


@dataclass(frozen=True)
class Event:
    name: str
    cat: str
    start_us: float
    dur_us: float
    tid: object
    args: dict = field(default_factory=dict, hash=False, compare=False)

    @property
    def end_us(self) -> float:
        return self.start_us + self.dur_us


@dataclass
class Trace:
    kernels: list[Event]  # GPU kernels (and memcpy/memset), by start time
    launches: list[Event]  # runtime/driver calls on the host (cudaLaunchKernel, ...)
    ops: list[Event]  # CPU ops (aten::...)
    phases: list[Event]  # record_function ranges on the host

    @property
    def gpu_window_us(self) -> tuple[float, float]:
        return self.kernels[0].start_us, max(k.end_us for k in self.kernels)


def parse_trace(trace: dict) -> Trace:
    groups = {"kernels": [], "launches": [], "ops": [], "phases": []}
    where = {
        "kernel": "kernels",
        "gpu_memcpy": "kernels",
        "gpu_memset": "kernels",
        "cuda_runtime": "launches",
        "cuda_driver": "launches",
        "cpu_op": "ops",
        "user_annotation": "phases",
    }
    for e in trace["traceEvents"]:
        group = where.get(e.get("cat"))
        if group and e.get("ph") == "X":
            groups[group].append(
                Event(
                    e["name"],
                    e["cat"],
                    float(e["ts"]),
                    float(e.get("dur", 0.0)),
                    e.get("tid"),
                    e.get("args", {}),
                )
            )
    for events in groups.values():
        events.sort(key=lambda ev: ev.start_us)
    if not groups["kernels"]:
        raise ValueError(
            "the trace has no GPU kernels (was it recorded with ProfilerActivity.CUDA?)"
        )
    return Trace(**groups)


def read_trace(path) -> Trace:
    return parse_trace(json.loads(Path(path).read_text()))


def kernel_totals(trace: Trace) -> dict:
    """{"by_name": {name: {"count", "us", "category"}}, "by_category": {category: us},
    "total_us"}."""
    by_name: dict[str, dict] = {}
    by_category = {name: 0.0 for name, _ in CATEGORIES} | {"other": 0.0}
    for k in trace.kernels:
        row = by_name.setdefault(k.name, {"count": 0, "us": 0.0, "category": category(k.name)})
        row["count"] += 1
        row["us"] += k.dur_us
        by_category[row["category"]] += k.dur_us
    ordered = dict(sorted(by_name.items(), key=lambda item: -item[1]["us"]))
    return {
        "by_name": ordered,
        "by_category": by_category,
        "total_us": sum(k.dur_us for k in trace.kernels),
    }


def phase_of_kernels(trace: Trace) -> list[str | None]:
    """For each kernel, the innermost phase (of `PHASES`) whose host range contains its launch."""
    launch_ts = {
        ev.args["correlation"]: ev.start_us for ev in trace.launches if "correlation" in ev.args
    }
    phases = [p for p in trace.phases if p.name in PHASES]
    out = []
    for k in trace.kernels:
        ts = launch_ts.get(k.args.get("correlation"))
        hits = [p for p in phases if ts is not None and p.start_us <= ts <= p.end_us]
        out.append(min(hits, key=lambda p: p.dur_us).name if hits else None)
    return out


def phase_totals(trace: Trace) -> dict:
    """Per phase: host time of its range, GPU kernel time it launched, and its kernel count."""
    totals = {p: {"host_us": 0.0, "gpu_us": 0.0, "kernels": 0} for p in PHASES}
    for p in trace.phases:
        if p.name in totals:
            totals[p.name]["host_us"] += p.dur_us
    for k, name in zip(trace.kernels, phase_of_kernels(trace)):
        if name:
            totals[name]["gpu_us"] += k.dur_us
            totals[name]["kernels"] += 1
    return totals


def gpu_gaps(trace: Trace, min_gap_us: float = 0.0) -> dict:
    """Idle time of the GPU between its first kernel's start and its last kernel's end.

    Overlapping kernels (several streams) are merged first. Returns the window, busy and idle
    microseconds, and the gaps longer than `min_gap_us` as (start, length) pairs."""
    start, end = trace.gpu_window_us
    busy, gaps, cursor = 0.0, [], start
    for k in trace.kernels:
        if k.start_us > cursor:
            if k.start_us - cursor > min_gap_us:
                gaps.append((cursor, k.start_us - cursor))
        busy += max(0.0, k.end_us - max(cursor, k.start_us))
        cursor = max(cursor, k.end_us)
    window = end - start
    return {
        "window_us": window,
        "busy_us": busy,
        "idle_us": window - busy,
        "idle_fraction": (window - busy) / window if window else 0.0,
        "gaps": gaps,
    }


def summary(trace: Trace) -> dict:
    """What the notebook prints about a step: the window, the split by category and by phase, the
    gaps."""
    totals = kernel_totals(trace)
    gaps = gpu_gaps(trace)
    return {
        "kernels": len(trace.kernels),
        "window_us": gaps["window_us"],
        "kernel_us": totals["total_us"],
        "by_category": totals["by_category"],
        "by_phase": phase_totals(trace),
        "idle_us": gaps["idle_us"],
        "idle_fraction": gaps["idle_fraction"],
        "gaps_over_10us": sum(1 for _, g in gaps["gaps"] if g > 10.0),
        "top_kernels": [{"name": n, **row} for n, row in list(totals["by_name"].items())[:8]],
    }
