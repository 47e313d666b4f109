"""Compiling ahead: a second worker calls the student's functions on the cases the graded worker
reaches last, so that their kernels are compiled by the time the graded worker calls them.

On an H200 about half of a lab's grading time was kernels compiling on each case's first call, one
compile at a time, while the machine's other cores idled
(`data/results/h200/grading/compile-ahead/README.md`). Both workers run in the same folder, whose
Triton and CuPy caches the sandbox points them to; a kernel either compiled is found there by the
other. This worker walks the functions and their cases in reverse order, so the two meet in the
middle instead of compiling the same kernel at once.

Nothing it returns is read: it makes no verdict. It is stopped before the lab's first timed round,
so its GPU work never runs beside a timing, and when the lab's correctness cases end. It runs only
where it cannot change a verdict: sandboxed (bubblewrap ends every process it started with it), on
a GPU with memory for both workers, its own share capped at `GPU_MEMORY_FRACTION`.
"""

from __future__ import annotations

import contextlib
import threading

from grading.protocol import Options, WorkerProcess, _kill

# Of the GPU's memory: what this worker may allocate, beside the graded worker's cap.
GPU_MEMORY_FRACTION = 0.2
# The GPU memory and CPU cores below which a second worker could cost the graded one more than it
# saves it: the labs' largest cases must still fit in the rest of the memory (80% of 32 GiB is
# far above any of them), and compiles need cores.
MIN_GPU_MEMORY_GIB = 32
MIN_CPUS = 4


def worth_it(sandboxed: bool, opts: Options) -> bool:
    """Whether to compile ahead here: graded on a GPU, sandboxed, with memory and cores to spare."""
    import os

    from kernels import runtime

    if opts.cpu or not sandboxed or not runtime.ON_GPU or (os.cpu_count() or 1) < MIN_CPUS:
        return False
    import torch

    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return total >= MIN_GPU_MEMORY_GIB * 2**30


def ahead_command(cmd: list[str]) -> list[str]:
    """The graded worker's command with this worker's share of GPU memory."""
    cmd = list(cmd)
    at = cmd.index("--gpu-memory-fraction")
    cmd[at + 1] = str(GPU_MEMORY_FRACTION)
    return cmd


class CompileAhead:
    """Started beside the graded worker (`start`), stopped by `stop`; `calls` counts the calls it
    made (for the report)."""

    def __init__(self, cmd: list[str], folder, spec, seed: int, deadline: float, opts: Options,
                 env: dict, sandboxed: bool):
        self._args = (ahead_command(cmd), folder, deadline, opts, env, sandboxed)
        self._spec, self._seed, self._folder = spec, seed, folder
        self._stopping = threading.Event()
        self._worker: WorkerProcess | None = None
        self._started = threading.Event()
        self.calls = 0
        # The worker is started by this thread: it dies with it (the parent-death signal).
        self._thread = threading.Thread(target=self._run, name="compile-ahead", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Kill the worker (it may be inside a call) and wait for the thread to end."""
        self._stopping.set()
        self._started.wait(timeout=30)
        if self._worker is not None:
            _kill(self._worker.proc)
        self._thread.join(timeout=30)

    def _run(self) -> None:
        try:
            if not self._stopping.is_set():
                self._worker = WorkerProcess(*self._args)
        finally:
            self._started.set()
        if self._worker is None:
            return
        try:
            self._compile(self._worker)
        except Exception:  # noqa: BLE001 - its death, a reply it garbled: the graded worker compiles
            pass
        finally:
            self._worker.close()

    def _compile(self, worker: WorkerProcess) -> None:
        from grading.cases import make_inputs
        from grading.protocol import WorkerCaller
        from kernels import runtime
        from kernels.testing import generator

        worker.set_step(None, "compiling ahead", "call")
        worker.receive()  # {"ready": true}
        if worker.request({"op": "import"}).get("import_error"):
            return
        functions = [f for f in self._spec.functions if f.grade_group is None]
        for fn in reversed(functions):
            if worker.request({"op": "function", "name": fn.name}).get("kind") != "function":
                continue
            caller = WorkerCaller(worker, self._folder, fn.name)
            cases = list(enumerate(fn.cases_for(self._seed)))
            for i, case in reversed(cases):  # the graded worker's case i has seed + i (harness)
                if self._stopping.is_set():
                    return
                inputs = make_inputs(fn, case, generator(self._seed + i, runtime.DEVICE))
                with contextlib.suppress(NotImplementedError):
                    caller.begin_case(fn, case, inputs)
                    worker.request({"op": "call", "trial": 0, "inputs": None, "profile": False})
                    self.calls += 1
