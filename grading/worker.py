"""Grade one lab notebook in this process; `python -m grading` runs one of these per lab (grading/runner.py).

The worker builds a module from the notebook's solution cells (and the source's locked cells) in its
working directory (a temporary directory of the parent's; never the student's folder), imports it, and
checks each graded function. It reports as it goes, one JSON object per line, to the `--progress` file:

  {"event": "step", "function": ..., "step": ..., "kind": "call" | "perf" | "import", "limit_s": ...}
      before anything that runs the student's code, so the parent can stop a step that runs too long
      and say which one it was;
  {"event": "lab", ...}        the lab's title, fingerprint, notes and the memory limits in force;
  {"event": "function", "result": {...}}   each graded function, as soon as it is done;
  {"event": "done"}            the end.

A process that dies leaves everything before its death in that file. The limits it sets on itself:
host memory (RLIMIT_AS, CPU mode, Linux) and GPU memory (a fraction of the device for PyTorch's and
CuPy's allocators). After a CUDA error that leaves the context unusable it records the function as an
error and exits with EXIT_CONTEXT_LOST; the parent grades the rest of the lab in a new process.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

STARTED = time.monotonic()

EXIT_CONTEXT_LOST = 75


class Progress:
    def __init__(self, path: Path, call_timeout: float, perf_timeout: float):
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - open for the process's lifetime
        self.limits = {"call": call_timeout, "import": call_timeout, "perf": perf_timeout}

    def emit(self, **event) -> None:
        event["t"] = round(time.monotonic() - STARTED, 3)  # seconds since the process started
        self._file.write(json.dumps(event, default=str) + "\n")
        self._file.flush()

    def step(self, function: str | None, step: str, kind: str = "call") -> None:
        self.emit(event="step", function=function, step=step, kind=kind, limit_s=self.limits[kind])


def _proc_status_bytes(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def limit_memory(host_gib: float, gpu_fraction: float) -> dict:
    """Cap this process's memory; returns what was capped (for the report and the parent's watchdog)."""
    import torch

    from grading import harness
    from kernels import runtime

    limits = {"host_memory_gib": host_gib, "host_rlimit": False, "gpu_memory_gib": None}
    harness.Limits.host_memory_gib = host_gib
    if runtime.ON_GPU:
        # CUDA reserves far more address space than it uses, so RLIMIT_AS cannot be used with it; the
        # parent watches this process's resident memory instead (baseline: after CUDA's start-up).
        torch.cuda.set_per_process_memory_fraction(gpu_fraction)
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        limits["gpu_memory_gib"] = harness.Limits.gpu_memory_gib = round(gpu_fraction * total / 2**30, 1)
        if runtime.cupy_status()[0]:
            import cupy
            cupy.get_default_memory_pool().set_limit(fraction=gpu_fraction)
    limits["baseline_rss"], limits["baseline_vm"] = _proc_status_bytes("VmRSS"), _proc_status_bytes("VmSize")
    if not runtime.ON_GPU and limits["baseline_vm"] is not None:
        try:
            import resource
            cap = limits["baseline_vm"] + int(host_gib * 2**30)
            resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
            limits["host_rlimit"] = True
        except (ImportError, ValueError, OSError):
            pass
    return limits


def _warm_up(harness, runtime) -> None:
    """Pay the one-time costs of the checks (the first op under a TorchDispatchMode imports
    torch._dynamo: about a second) before any step is timed, so a step's limit is the student's."""
    import torch

    with harness.watch():
        torch.ones(2, device=runtime.DEVICE).add(1)


def grade(notebook: Path, source: Path, lab_id: str, seed: int, progress: Progress, *, skip=(),
          perf: bool | None = None, host_gib: float = 16.0, gpu_fraction: float = 0.9) -> int:
    from grading import harness
    from grading.integrity import GraderGuard
    from grading.labs import LAB_MODULES, get_lab
    from grading.notebooks import locked_cell_status, read_notebook, solution_module
    from kernels import runtime

    lab = get_lab(lab_id)
    source_nb = read_notebook(source)
    try:
        student_nb = read_notebook(notebook)
    except (OSError, ValueError) as exc:  # not JSON, not a notebook: nothing of it can be graded
        student_nb = {"cells": []}
        unreadable = f"the notebook cannot be read: {type(exc).__name__}: {exc}"
    else:
        unreadable = None
    code, notes = solution_module(student_nb, source_nb)
    locked = locked_cell_status(student_nb, source_nb)
    if unreadable:
        notes, locked = [], []
    harness.on_step = progress.step
    harness._install_launch_hooks()  # before the guard's snapshot: the hooks are the grader's own
    _warm_up(harness, runtime)
    guard = GraderGuard((LAB_MODULES[lab_id],))
    limits = limit_memory(host_gib, gpu_fraction)
    info = {"event": "lab", "lab": lab_id, "title": lab.title, "fingerprint": runtime.fingerprint(),
            "notes": notes, "locked_cells": locked, "limits": limits}
    # Triton reads a kernel's source with inspect, so the module must be a real file.
    module_path = Path.cwd() / f"student_{lab_id}.py"
    module_path.write_text(code)
    spec = importlib.util.spec_from_file_location(module_path.stem, module_path)
    module = importlib.util.module_from_spec(spec)
    progress.step(None, "importing the solution cells", "import")
    import_error = unreadable
    try:
        if unreadable is None:
            spec.loader.exec_module(module)
    except SystemExit as exc:
        import_error = f"the solution cells called sys.exit({exc.code!r})"
    except BaseException as exc:  # noqa: BLE001 - any error in the student's cells, KeyboardInterrupt aside
        if isinstance(exc, KeyboardInterrupt):
            raise
        import_error = f"the solution cells failed to run: {harness._describe_exception(exc)}"
    tampered = guard.changed()
    if tampered:
        import_error = (f"the solution cells replaced part of the grader ({', '.join(tampered[:3])}): "
                        "not graded")
    if import_error:
        info["import_error"] = import_error
    progress.emit(**info)
    for fn_spec in lab.functions:
        if fn_spec.name in skip:
            continue
        if import_error:
            if fn_spec.backend == "cupy" and not runtime.cupy_status()[0]:  # as check_function would say
                result = harness.error_result(fn_spec, seed, "needs a GPU", runtime.cupy_status()[1])
            else:
                result = harness.error_result(fn_spec, seed, "error", import_error)
            progress.emit(event="function", result=result)
            continue
        try:
            fr = harness.check_function(lab, fn_spec.name, getattr(module, fn_spec.name, None), seed=seed,
                                        perf=perf).as_dict()
        except harness.ContextLost as exc:
            progress.emit(event="function", result=harness.error_result(
                fn_spec, seed, "error", f"case {exc}; the rest of the lab was graded in a new process"))
            return EXIT_CONTEXT_LOST
        tampered = guard.changed()
        if tampered:
            import_error = f"{fn_spec.name} replaced part of the grader ({', '.join(tampered[:3])}): not graded"
            fr = harness.error_result(fn_spec, seed, "error", import_error)
        progress.emit(event="function", result=fr)
    progress.emit(event="done")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--notebook", type=Path, required=True)
    parser.add_argument("--source", type=Path, required=True)
    parser.add_argument("--lab", required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--progress", type=Path, required=True, help="JSON-lines file the events are appended to")
    parser.add_argument("--skip", default="", help="comma-separated functions already graded")
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--no-perf", action="store_true")
    parser.add_argument("--call-timeout", type=float, default=60.0)
    parser.add_argument("--perf-timeout", type=float, default=300.0)
    parser.add_argument("--memory-gib", type=float, default=16.0)
    parser.add_argument("--gpu-memory-fraction", type=float, default=0.9)
    args = parser.parse_args(argv)
    if args.cpu:
        os.environ["KERNELS_MODE"] = "cpu"
    import kernels  # noqa: F401 - decides the mode before anything imports triton
    from kernels import runtime

    if not runtime.ON_GPU:
        import torch
        torch.set_num_threads(1)  # the interpreter is single-threaded; OpenMP threads only contend
    progress = Progress(args.progress, args.call_timeout, args.perf_timeout)
    status = grade(args.notebook, args.source, args.lab, args.seed, progress,
                   skip=set(filter(None, args.skip.split(","))), perf=False if args.no_perf else None,
                   host_gib=args.memory_gib, gpu_fraction=args.gpu_memory_fraction)
    if status == EXIT_CONTEXT_LOST:
        # Tearing down a broken CUDA context can fail or hang: leave without it (events are flushed).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status


if __name__ == "__main__":
    sys.exit(main())
