"""Measuring memory: allocated, reserved and peak per phase, and allocator snapshots.

On a GPU the numbers come from PyTorch's caching allocator:
  * **allocated** -- bytes in blocks handed to live tensors (rounded up to the allocator's 512-byte
    granularity);
  * **reserved** -- bytes the allocator holds from the driver (cudaMalloc'd segments), allocated or
    not: what `nvidia-smi` sees, minus the CUDA context;
  * **peak** -- the largest `allocated` since the phase began (`torch.cuda.max_memory_allocated`
    after `reset_peak_memory_stats`).
Without a GPU, `torch.cuda.memory_allocated()` returns 0 and tells nothing, so the same helpers fall
back to `torch.profiler(profile_memory=True)`, which sees every CPU tensor's allocation and free:
allocated and peak then count the bytes of CPU tensors (no rounding, no reserve), relative to the
phase's start plus a `baseline` you pass (e.g. the bytes of the model's parameters). The `source`
field says which one you got.
"""

from __future__ import annotations

import pickle
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kernels import runtime

GPU_SOURCE = "CUDA caching allocator"
CPU_SOURCE = "torch.profiler (CPU tensors)"
# Trace entries the recorder keeps (a ring buffer: beyond this it drops the oldest).
MAX_ENTRIES = 1_000_000


@dataclass
class PhaseStats:
    name: str
    allocated_start: int  # bytes
    allocated_end: int
    peak: int
    reserved_end: int | None  # None on the CPU: there is no reserve
    source: str

    @property
    def peak_above_start(self) -> int:
        return self.peak - self.allocated_start


def _cpu_profile():
    """The CPU fallback: the profiler records every allocation and free of a CPU tensor, with the op
    that made it. (Not `with_stack=True`: that records every Python call, and under the Triton
    interpreter -- Python executing a kernel -- that is millions of records and gigabytes.)"""
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU], profile_memory=True)


def _live_curve(prof) -> list[int]:
    """Running sum of the bytes of a profile's CPU allocations (+) and frees (-), from 0."""
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]"
    )
    total, curve = 0, [0]
    for _, nbytes in events:
        total += nbytes
        curve.append(total)
    return curve


def _cpu_snapshot(prof) -> dict:
    """A profile's allocations as a snapshot in `torch.cuda.memory._snapshot()`'s format (device 0).

    Each allocation's one "frame" names the outermost PyTorch op that made it (what your code
    called: aten::linear, aten::cross_entropy_loss, ...) and the innermost
    `torch.profiler.record_function` range around it, if any -- the CPU stand-in for the Python
    frame a GPU snapshot records."""
    from torch._C._profiler import _EventType

    found = []
    frames_of: dict[str, list] = {}

    def walk(nodes, op, note):
        for node in nodes:
            if node.tag == _EventType.Allocation:
                label = f"{note}: {op}" if note and op else (op or note or "outside any op")
                found.append(
                    (
                        node.start_time_ns,
                        node.extra_fields.ptr,
                        node.extra_fields.alloc_size,
                        frames_of.setdefault(
                            label, [{"filename": "none", "line": 0, "name": label}]
                        ),
                    )
                )
            elif node.tag == _EventType.TorchOp:
                name = node.name
                if name.startswith("aten::"):
                    walk(node.children, op or name, note)
                else:  # a record_function range
                    walk(node.children, None, name)
            else:
                walk(node.children, op, note)

    walk(prof.profiler.kineto_results.experimental_event_tree(), None, None)
    trace = []
    for _, addr, size, frames in sorted(found, key=lambda f: f[0]):
        if size >= 0:
            trace.append(
                {"action": "alloc", "addr": addr, "size": size, "stream": 0, "frames": frames}
            )
        else:
            for action in ("free_requested", "free_completed"):
                trace.append(
                    {"action": action, "addr": addr, "size": -size, "stream": 0, "frames": frames}
                )
    return {"segments": [], "device_traces": [trace]}


class PhaseRecorder:
    """Allocated, reserved and peak memory per named phase:

        rec = PhaseRecorder(baseline=param_bytes)     # baseline: used on the CPU only
        with rec.phase("forward"):
            loss = model(x)
        with rec.phase("backward"):
            loss.backward()
        print(rec.table())

    On a GPU, `exclude` bytes (what the process held before the workload was built, e.g.
    `torch.cuda.memory_allocated()` before creating the model) are subtracted from allocated and
    peak.
    """

    def __init__(self, baseline: int = 0, exclude: int = 0):
        self.phases: list[PhaseStats] = []
        self._cpu_allocated = baseline
        self._exclude = exclude

    @contextmanager
    def phase(self, name: str):
        if runtime.ON_GPU:
            torch.cuda.synchronize()
            start = torch.cuda.memory_allocated() - self._exclude
            torch.cuda.reset_peak_memory_stats()
            yield
            torch.cuda.synchronize()
            self.phases.append(
                PhaseStats(
                    name,
                    start,
                    torch.cuda.memory_allocated() - self._exclude,
                    torch.cuda.max_memory_allocated() - self._exclude,
                    torch.cuda.memory_reserved(),
                    GPU_SOURCE,
                )
            )
            return
        start = self._cpu_allocated
        with _cpu_profile() as prof:
            yield
        curve = _live_curve(prof)
        self._cpu_allocated = start + curve[-1]
        self.phases.append(
            PhaseStats(name, start, self._cpu_allocated, start + max(curve), None, CPU_SOURCE)
        )

    def table(self, unit: str = "MiB") -> str:
        scale = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]
        lines = [
            f"{'phase':<12}{'allocated at start':>20}{'at end':>12}{'peak':>12}{'reserved':>12}   "
            f"({unit}, "
            f"{self.phases[0].source if self.phases else ''})"
        ]
        for p in self.phases:
            reserved = "-" if p.reserved_end is None else f"{p.reserved_end / scale:,.1f}"
            lines.append(
                f"{p.name:<12}{p.allocated_start / scale:>20,.1f}{p.allocated_end / scale:>12,.1f}"
                f"{p.peak / scale:>12,.1f}{reserved:>12}"
            )
        return "\n".join(lines)


def peak_bytes(fn, *args, **kwargs) -> tuple[object, int]:
    """(fn's result, its extra memory): the peak bytes allocated above those before the call.

    GPU: the caching allocator's peak; CPU: the peak of CPU tensors live during the call
    (torch.profiler).
    """
    if runtime.ON_GPU:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        result = fn(*args, **kwargs)
        torch.cuda.synchronize()
        return result, torch.cuda.max_memory_allocated() - before
    with _cpu_profile() as prof:
        result = fn(*args, **kwargs)
    return result, max(_live_curve(prof))


@dataclass
class Recording:
    """What `record_snapshot` yields; `snapshot` is filled when the block ends."""

    snapshot: dict = field(default_factory=dict)
    source: str = GPU_SOURCE
    path: Path | None = None


@contextmanager
def record_snapshot(path: str | Path | None = None, max_entries: int = MAX_ENTRIES):
    """Record every allocation and free inside the block, with the Python stack that made it.

    GPU: `torch.cuda.memory._record_memory_history(stacks="python")` -- Python frames only, because
    symbolizing C++ stacks makes dumping a snapshot take minutes -- then
    `torch.cuda.memory._snapshot()`. CPU: `torch.profiler(profile_memory=True)`, converted into the
    same format; allocations are labelled by the PyTorch op that made them (and `record_function`
    ranges), not by Python frame. With `path`, the snapshot is also pickled there: drag the file
    onto https://pytorch.org/memory_viz.
    """
    rec = Recording()
    if runtime.ON_GPU:
        torch.cuda.synchronize()
        torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")
        try:
            yield rec
            torch.cuda.synchronize()
            rec.snapshot = torch.cuda.memory._snapshot()
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
    else:
        rec.source = CPU_SOURCE
        with _cpu_profile() as prof:
            yield rec
        rec.snapshot = _cpu_snapshot(prof)
    if path is not None:
        rec.path = save_snapshot(rec.snapshot, path)


def save_snapshot(snapshot: dict, path: str | Path) -> Path:
    """Pickle a snapshot where pytorch.org/memory_viz can open it (it reads exactly this pickle)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        pickle.dump(snapshot, f)
    return path


def load_snapshot(path: str | Path) -> dict:
    with open(path, "rb") as f:
        return pickle.load(f)  # noqa: S301 - our own files
