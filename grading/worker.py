"""`python -m grading.worker`: imports a lab's graded module and calls its functions, on request.

The parent (grading/runner.py) writes the graded module, `student_<lab>.py`, into a temporary
directory, starts this process there (inside bubblewrap where it can: grading/sandbox.py) and sends
requests, one JSON object per line on the file descriptor --requests; the worker answers each on
--replies. Tensors travel as files in the temporary directory (`torch.save`). The worker makes no
verdict and never sees the seed of the correctness cases: it calls a function on the inputs it is
sent and returns what the call did (a `CallRecord`); the parent, which made the inputs, judges.

  {"op": "import"}                                -> {"import_error", "limits"}
  {"op": "function", "name"}                      -> {"kind": null | "function" | a type's name}
  {"op": "begin", "name", "case", "inputs"}       -> {}            (the case's first inputs)
  {"op": "call", "trial", "inputs", "profile"}    -> {"record"}    (new values, same buffers)
  {"op": "allocating", "name", "case", "inputs"}  -> {"record"}    (called without out=)
  {"op": "capture", "name", "case", "captured"}   -> {} | {"error"} (GPU: the call captured in
                                                  a CUDA graph; the replayed values are sent only
                                                  after it, so they cannot be computed eagerly
                                                  before the replay)
  {"op": "replay", "replayed"}                    -> {"outputs"} (the graph replayed on those
                                                  values: its outputs, judged by the grader)
  {"op": "perf", "name", "config", "seed", "rounds"} -> {"result"} (a timed batch: its times and
                                                  wrong elements per round)
  {"op": "wall_ready", "name", "config", "seed"}  -> {}            (inputs made, one call made)
  {"op": "wall_go", "calls"}                      -> {}            (that many calls, synchronized)
  {"op": "guard"}                                 -> {"changed"}   (the grader's functions)
  {"op": "mark", "index"}                         -> {}            (the kernel audit's marker)

A clean worker (--clean) never imports the module: it answers only

  {"op": "course", "name", "config", "who", "seed", "rounds"} -> {"result"}  (the course's
                                                  kernel or PyTorch timed, and the floor)

and "wall_ready" / "wall_go" on the course's kernel, and refuses every other request, so the
course's times and the floor come from a process the student's code never ran in
(grading/performance.py).

Any request may instead be answered {"not_implemented": true}, {"context_lost": message} (the
worker then exits with EXIT_CONTEXT_LOST) or {"grader_error": message}: a bug in the grader's own
code, never blamed on the student. Limits it sets on itself: host memory (RLIMIT_AS, CPU mode,
Linux) and GPU memory (a fraction of the device for PyTorch's and CuPy's allocators).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import traceback
from pathlib import Path

from grading.protocol import EXIT_CONTEXT_LOST, record_to_dict

CLEAN_OPS = ("course", "wall_ready", "wall_go")  # all a clean worker does


def _proc_status_bytes(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def limit_memory(host_gib: float, gpu_fraction: float) -> dict:
    """Cap this process's memory; returns what was capped (for the report and the watchdog)."""
    import torch

    from kernels import runtime

    limits = {"host_memory_gib": host_gib, "host_rlimit": False, "gpu_memory_gib": None}
    if runtime.ON_GPU:
        # CUDA reserves far more address space than it uses, so RLIMIT_AS cannot be used with it;
        # the parent watches this process's resident memory instead (baseline: after CUDA starts).
        torch.cuda.set_per_process_memory_fraction(gpu_fraction)
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        limits["gpu_memory_gib"] = round(gpu_fraction * total / 2**30, 1)
        if runtime.cupy_status()[0]:
            import cupy
            cupy.get_default_memory_pool().set_limit(fraction=gpu_fraction)
    limits["baseline_rss"] = _proc_status_bytes("VmRSS")
    limits["baseline_vm"] = _proc_status_bytes("VmSize")
    if not runtime.ON_GPU and limits["baseline_vm"] is not None:
        try:
            import resource
            cap = limits["baseline_vm"] + int(host_gib * 2**30)
            resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
            limits["host_rlimit"] = True
        except (ImportError, ValueError, OSError):
            pass
    return limits


class Worker:
    def __init__(self, lab_id: str, host_gib: float, gpu_fraction: float, clean: bool = False):
        import torch

        from grading import diagnosis
        from grading.integrity import GraderGuard
        from grading.labs import LAB_MODULES, get_lab
        from grading.watch import install_launch_hooks, watch
        from kernels import runtime

        self.torch, self.runtime = torch, runtime
        self.lab = get_lab(lab_id)
        install_launch_hooks()  # before the guard's snapshot: the hooks are the grader's own
        with watch():  # the first op under a dispatch mode imports torch._dynamo: not the student's
            torch.ones(2, device=runtime.DEVICE).add(1)
        self.guard = GraderGuard((LAB_MODULES[lab_id],))
        self.limits = limit_memory(host_gib, gpu_fraction)
        self.diag_limits = diagnosis.Limits(host_gib, self.limits["gpu_memory_gib"])
        self.module = None
        self.caller = None
        self.clean = clean  # imports no student code: times the course's kernel only
        self.wall = None  # `op_wall_ready`'s back-to-back calls
        self.captured = None  # `op_capture`'s graph, for `op_replay`

    def _load(self, name: str):
        return self.torch.load(Path(name).name, weights_only=True)

    def _save(self, obj, name: str) -> str:
        self.torch.save(obj, name)
        return name

    def _fn(self, name: str):
        return getattr(self.module, name, None)

    def op_import(self, req) -> dict:
        from grading.diagnosis import describe_exception
        from grading.notebooks import no_magics

        path = Path.cwd() / f"student_{self.lab.id}.py"
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        module.get_ipython = no_magics  # what magics and shell escapes became: they do not run
        error = None
        try:
            spec.loader.exec_module(module)
        except SystemExit as exc:
            error = f"the solution cells called sys.exit({exc.code!r})"
        except BaseException as exc:  # noqa: BLE001 - any error in the student's cells
            if isinstance(exc, KeyboardInterrupt):
                raise
            error = (f"the solution cells failed to run: "
                     f"{describe_exception(exc, self.diag_limits)}")
        self.module = module
        return {"import_error": error, "limits": self.limits}

    def op_function(self, req) -> dict:
        fn = self._fn(req["name"])
        kind = None if fn is None else "function" if callable(fn) else type(fn).__name__
        return {"kind": kind}

    def op_begin(self, req) -> dict:
        from grading.correctness import LocalCaller
        from grading.spec import Case

        spec = self.lab.function(req["name"])
        self.caller = LocalCaller(self._fn(req["name"]), self.diag_limits)
        inputs = tuple(self._load(req["inputs"]))
        self.caller.begin_case(spec, Case.from_json(req["case"]), inputs)
        return {}

    def op_call(self, req) -> dict:
        if req["trial"]:  # new values in the same buffers
            for t, fresh in zip(self.caller.inputs, self._load(req["inputs"])):
                t.copy_(fresh)
        record = self.caller.call(req["trial"], self.caller.inputs, profile=req["profile"])
        return {"record": self._save(record_to_dict(record), f"record-{req['id']}.pt")}

    def op_allocating(self, req) -> dict:
        from grading.correctness import LocalCaller
        from grading.spec import Case

        spec = self.lab.function(req["name"])
        caller = LocalCaller(self._fn(req["name"]), self.diag_limits)
        inputs = tuple(self._load(req["inputs"]))
        record = caller.call_allocating(spec, Case.from_json(req["case"]), inputs)
        return {"record": self._save(record_to_dict(record), f"record-{req['id']}.pt")}

    def op_capture(self, req) -> dict:
        from grading.graph import capture
        from grading.spec import Case

        spec = self.lab.function(req["name"])
        self.captured = capture(self._fn(req["name"]), spec, Case.from_json(req["case"]),
                                tuple(self._load(req["captured"])))
        if isinstance(self.captured, str):
            return {"error": self.captured}
        return {}

    def op_replay(self, req) -> dict:
        from grading.graph import CapturedCall, replay

        if not isinstance(self.captured, CapturedCall):
            return {"grader_error": "replay requested with no captured graph"}
        call, self.captured = self.captured, None
        outputs = replay(call, tuple(self._load(req["replayed"])))
        return {"outputs": self._save(outputs, f"graph-{req['id']}.pt")}

    def op_perf(self, req) -> dict:
        from grading.performance import config_from_json, time_batch

        spec = self.lab.function(req["name"])
        if self.runtime.ON_GPU:  # the clean worker shares the GPU: what the cases left is freed
            self.torch.cuda.empty_cache()
        return {"result": time_batch(self._fn(req["name"]), spec,
                                     config_from_json(req["config"]), req["seed"], req["rounds"])}

    def op_course(self, req) -> dict:
        from grading.performance import config_from_json, time_course

        spec = self.lab.function(req["name"])
        return {"result": time_course(req["who"], spec, config_from_json(req["config"]),
                                      req["seed"], req["rounds"])}

    def op_wall_ready(self, req) -> dict:
        from grading.performance import config_from_json, wall_ready

        spec = self.lab.function(req["name"])
        fn = spec.course_kernel if self.clean else self._fn(req["name"])
        self.wall = wall_ready(fn, spec, config_from_json(req["config"]), req["seed"])
        return {}

    def op_wall_go(self, req) -> dict:
        self.wall(int(req["calls"]))
        return {}

    def op_guard(self, req) -> dict:
        return {"changed": self.guard.changed()}

    def op_mark(self, req) -> dict:
        from grading.kernel_audit import marker_launch

        marker_launch(int(req["index"]))
        return {}

    def answer(self, req: dict) -> dict:
        from grading.results import ContextLost

        if self.clean and req["op"] not in CLEAN_OPS or not self.clean and req["op"] == "course":
            who = "a clean worker imports no student code" if self.clean else \
                "the course's kernel is timed in a clean worker"
            return {"grader_error": f"{who}: request {req['op']!r} refused"}
        try:
            return getattr(self, f"op_{req['op']}")(req)
        except NotImplementedError:
            return {"not_implemented": True}
        except ContextLost as exc:
            return {"context_lost": str(exc)}
        except Exception as exc:  # noqa: BLE001 - the grader's own code failed: say so
            tb = traceback.extract_tb(exc.__traceback__)[-1:]
            where = f" ({tb[0].filename.rsplit('/', 1)[-1]}:{tb[0].lineno})" if tb else ""
            return {"grader_error": f"{type(exc).__name__}: {exc}{where}"}


def serve(worker: Worker, requests, replies) -> int:
    for line in requests:
        req = json.loads(line)
        reply = worker.answer(req)
        reply["id"] = req.get("id")
        replies.write(json.dumps(reply, default=str) + "\n")
        replies.flush()
        if "context_lost" in reply:
            return EXIT_CONTEXT_LOST
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lab", required=True)
    parser.add_argument("--notebook", help="the graded notebook (for process listings only: the "
                                           "worker never reads it)")
    parser.add_argument("--requests", type=int, required=True, help="file descriptor to read")
    parser.add_argument("--replies", type=int, required=True, help="file descriptor to write")
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--memory-gib", type=float, default=16.0)
    parser.add_argument("--gpu-memory-fraction", type=float, default=0.9)
    parser.add_argument("--clean", action="store_true",
                        help="time the course's kernels only; never import the graded module")
    args = parser.parse_args(argv)
    if args.cpu:
        os.environ["KERNELS_MODE"] = "cpu"
    import kernels  # noqa: F401 - decides the mode before anything imports triton
    from kernels import runtime

    if not runtime.ON_GPU:
        import torch
        torch.set_num_threads(1)  # the interpreter is single-threaded; OpenMP threads only contend
    requests = os.fdopen(args.requests, "r", encoding="utf-8")
    replies = os.fdopen(args.replies, "w", encoding="utf-8")
    worker = Worker(args.lab, args.memory_gib, args.gpu_memory_fraction, clean=args.clean)
    replies.write(json.dumps({"ready": True}) + "\n")
    replies.flush()
    status = serve(worker, requests, replies)
    # Leave without tearing down (a broken CUDA context can hang there); replies are flushed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    sys.exit(main())
