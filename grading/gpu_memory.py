"""GPU memory of the student's worker, seen from the grading process through NVML.

A lab's memory budget (`GradedFunction.memory_budget`) is first checked in the worker, from
PyTorch's own count (grading/correctness.py): that check names what went wrong, but its figure is
the worker's to report, and code that rewrites the worker's record can report 0. So the grading
process also reads the driver's figure: NVML's GPU memory per process (`pynvml`, from the
`nvidia-ml-py` package of the GPU extras), summed over every GPU and over every process below the
worker's root (bubblewrap's process: a helper process the student's code starts cannot hide its
memory). It samples every millisecond from just before it sends a budgeted call until the reply
(`CallMemory`); the growth is the largest rise over that window (the peak minus the lowest
reading before it). PyTorch's caching allocator keeps what it reserved, so even a peak between
two samples leaves its mark on the readings after it.

`OutsideMemory.over` judges the growth against the budget plus what the grader's own copies in
the call may add plus `RESOLUTION`; a growth over the budget but within that allowance is not
judged here (the worker's figure applies). Where NVML cannot be read (no GPU, `pynvml` missing,
a driver that does not report per-process memory, a container whose process IDs NVML does not
share) the observation says why, and the verdict is the worker's; the lab's notes say so
(`budget_note`).
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

SAMPLE_S = 0.001
# What NVML's figure cannot tell apart from the call's own work. Derived, not measured: NVML
# counts what CUDA maps, not tensors. PyTorch's caching allocator maps whole segments (a block
# of up to 1 MiB from a 2 MiB segment, up to 10 MiB from a 20 MiB one, larger blocks rounded up
# to 2 MiB), and a kernel launched for the first time maps its code in 2 MiB pages. Two 20 MiB
# segments and a dozen 2 MiB ones stay under 64 MiB. A growth within this much of what the call
# may allocate is left to the worker's own (exact) count: the outside check abstains.
RESOLUTION = 64 * 2**20
# The copies the worker makes of the outputs inside the call's window, beside the student's
# function: the watcher's snapshot, the returned results and the outputs after the streams.
OUTPUT_COPIES = 3


class ProcessMemory(Protocol):
    """Per-process GPU memory (`Nvml`, or a fake in the tests)."""

    why_not: str  # "" where it can be read

    def used_by_process(self) -> dict[int, int | None]:
        """{host PID: bytes, summed over the GPUs, None where the driver does not say}."""
        ...


class Nvml:
    """The driver's per-process GPU memory on every GPU (NVML through `pynvml`). `why_not` says
    why it cannot be read ("" where it can)."""

    def __init__(self):
        self.why_not, self._nvml, self._handles = "", None, []
        try:
            import pynvml

            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
            self._nvml = pynvml
        except ImportError:
            self.why_not = "pynvml is not installed (pip install nvidia-ml-py)"
        except Exception as exc:  # noqa: BLE001 - NVMLError_* (no driver, no permission, ...)
            self.why_not = f"NVML cannot be used ({type(exc).__name__}: {exc})"
        if not self.why_not and not self._handles:
            self.why_not = "NVML sees no GPU"

    def used_by_process(self) -> dict[int, int | None]:
        used: dict[int, int | None] = {}
        for handle in self._handles:
            for proc in self._nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                mine = proc.usedGpuMemory  # None: NVML_VALUE_NOT_AVAILABLE
                before = used.get(proc.pid, 0)
                used[proc.pid] = None if mine is None or before is None else before + mine
        return used


@functools.cache
def shared_nvml() -> Nvml:
    """One NVML session for the grading process."""
    return Nvml()


def parent_pid(pid: int) -> int | None:
    """A process's parent (Linux /proc), None where it is gone or cannot be read."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def is_below(pid: int, root: int) -> bool:
    """`pid` is `root` or one of its descendants (its parents followed up through /proc)."""
    for _ in range(64):  # deeper than any process tree the worker builds
        if pid == root:
            return True
        if pid is None or pid <= 1:
            return False
        pid = parent_pid(pid)
    return False


@dataclass
class OutsideMemory:
    """One call's GPU memory as the grading process saw it through NVML."""

    growth: int | None = None  # bytes: the largest rise over the call; None: not observed
    own: int = 0  # bytes the grader's own copies inside the call may add
    samples: int = 0
    why_not: str = ""  # why nothing was observed

    def allowance(self, budget: int) -> int:
        return budget + self.own + RESOLUTION

    def over(self, budget: int) -> bool:
        """The growth is more than the call may allocate, beyond what NVML cannot resolve."""
        return self.growth is not None and self.growth > self.allowance(budget)


class CallMemory:
    """Samples the GPU memory of `root`'s process tree on a thread while one call runs (a `with`
    block around the request); `observed` is the `OutsideMemory` when the block ends."""

    def __init__(self, nvml: ProcessMemory, root: int, own: int, period: float = SAMPLE_S):
        self.nvml, self.root, self.own, self.period = nvml, root, own, period
        self.observed = OutsideMemory(own=own, why_not=nvml.why_not)
        self._below: dict[int, bool] = {}
        self._low = self._peak_rise = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def tree_bytes(self) -> int | None:
        """GPU memory of every process below the root; None where it cannot be read."""
        try:
            used = self.nvml.used_by_process()
        except Exception as exc:  # noqa: BLE001 - an NVML error mid-run: nothing observed
            self.observed.why_not = f"NVML failed ({type(exc).__name__}: {exc})"
            return None
        total, seen = 0, False
        for pid, size in used.items():
            if pid not in self._below:
                self._below[pid] = is_below(pid, self.root)
            if self._below[pid]:
                if size is None:
                    self.observed.why_not = "NVML does not report per-process memory here"
                    return None
                total, seen = total + size, True
        if not seen:  # the worker holds a CUDA context: a tree NVML does not list is not seen
            self.observed.why_not = ("NVML lists no process of the worker's (process IDs of "
                                     "another namespace?)")
            return None
        return total

    def _sample(self) -> None:
        now = self.tree_bytes()
        if now is None:
            self._done.set()
            return
        self.observed.samples += 1
        self._low = now if self._low is None else min(self._low, now)
        rise = now - self._low
        self._peak_rise = rise if self._peak_rise is None else max(self._peak_rise, rise)

    def _run(self) -> None:
        while not self._done.wait(self.period):
            self._sample()

    def __enter__(self) -> CallMemory:
        if not self.nvml.why_not:
            self._sample()  # the baseline, before the request is sent
            if not self._done.is_set():
                self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread.is_alive():
            self._done.set()
            self._thread.join()
            self._sample()  # the caching allocator keeps what the call reserved
        if self._peak_rise is not None and not self.observed.why_not:
            self.observed.growth = self._peak_rise


def budget_note(lab_spec, memory: ProcessMemory) -> str | None:
    """The lab's note where its memory budgets are judged on the worker's figure alone."""
    if memory.why_not and any(f.memory_budget is not None for f in lab_spec.functions):
        return unobserved_note("GPU memory budgets", memory.why_not)
    return None


def unobserved_note(what: str, why: str) -> str:
    return (f"{what} judged on the figure the worker reported only: the grading process could "
            f"not observe it ({why})")
