"""Which kernels a graded function launched, listed from outside the process that ran it (GPU).

The watch around a graded call (grading/watch.py) lives in the student's own process: its hooks
and its profiler are objects that code set on cheating can reach. This audit lists the kernels
again with NVIDIA Nsight Compute (`ncu`), which starts the worker, injects itself into CUDA before
any student code runs, and writes its list only after the worker has ended, through a pipe that
only this process reads.

After a lab's functions have been graded, the functions that passed are called once more in a
fresh worker under ncu, each on one case judged here as usual, between two marker launches of the
grader's own (`grading_audit_marker`, grid k + 1 before function k). What ncu lists between the
markers of function k is function k's. A library kernel there -- PyTorch's (other than the fills
and copies the grader's own bookkeeping launches), cuBLAS's, cuDNN's, CuPy's built-in ufuncs,
torch.compile's generated Triton -- means the function did not compute with its own kernels, and it
gets no points. A list that is missing, inconsistent or out of order counts against the functions
it should have covered: nothing a worker writes becomes a verdict unless it reads as ncu wrote it.

What the audit does not see: kernels of functions the spec allows PyTorch ops (their GEMMs are
cuBLAS's by design), and code that behaves differently when it detects ncu (its environment
variables are visible to the worker). A worker stopped by a limit under ncu (which serializes
and slows every launch: an autotuner's many trial runs) leaves the audit inconclusive, changing no
verdict: an honest slow call and one that detected ncu look the same there. The audit raises the
cost of hiding; the sandbox and the parent's verdicts stay the line (grading/README.md, "The
kernel audit").
"""
from __future__ import annotations

import contextlib
import csv
import fcntl
import functools
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

MARKER = "grading_audit_marker"
# Launch metrics come from the launch itself: no counter passes, no replay, nothing that needs
# the profiling permission some drivers restrict.
# A CUDA graph's launch is one row named GRAPH_LAUNCH (--graph-profiling graph): the replay of a
# captured call is seen as a graph, not as kernels launched one by one.
NCU_ARGS = ["--target-processes", "all", "--metrics", "launch__grid_size", "--csv", "--page", "raw",
            "--print-kernel-base", "demangled", "--cache-control", "none", "--clock-control",
            "none", "--graph-profiling", "graph"]
GRAPH_LAUNCH = "graph"
# What the audit's worker does after each marker: a function's call, its capture in a CUDA graph
# (where the lab asks for one), that graph's replay; the last marker ends the list.
CALL, CAPTURE, REPLAY, END = "call", "capture", "replay", "end"
LOG_LIMIT = 16 * 2**20  # bytes of ncu output read; more means something is writing into the pipe
# After the last marker the worker exits, and ncu writes its list once every process it profiles
# has: what is still running this long after is the student's code's, and is stopped.
WORKER_EXIT_S = 30

# Kernels of libraries, by the start of their (demangled, "void "-less) names. A student's own
# kernel named like one of these is counted as the library's (grading/README.md says so).
LIBRARY_PREFIXES = {
    "PyTorch": ("at::", "c10::", "pytorch_flash::"),
    "cuBLAS": ("sm90_xmma", "sm80_xmma", "sm75_xmma", "sm70_xmma", "nvjet_", "ampere_", "volta_",
               "turing_", "gemv2T_kernel", "gemv2N_kernel", "gemvNSP_kernel", "gemmSN_",
               "gemmk1_kernel", "splitKreduce_kernel", "cublas", "cublasLt::"),
    "CUTLASS": ("cutlass", "fmha_cutlass"),
    "cuDNN": ("cudnn",),
    "CUB/Thrust": ("cub::", "thrust::"),
    "CuPy's built-in kernels": ("cupy_",),
    "torch.compile": ("triton_poi_", "triton_red_", "triton_per_", "triton_tem_"),
}
# The grader's own bookkeeping between the markers: poisoning outputs (fill), snapshots and new
# trial values (copies), and the side-stream delay (torch.cuda._sleep's spin kernel).
GRADER_KERNELS = ("FillFunctor", "copy_kernel", "spin_kernel")


def is_grader_kernel(kernel: str) -> bool:
    """A fill or a copy of PyTorch's: the grader's bookkeeping (poison, new input values)."""
    name = kernel.removeprefix("void ").strip()
    return name.startswith(("at::", "c10::")) and any(k in name for k in GRADER_KERNELS)


def library_of(kernel: str) -> str | None:
    """The library a kernel name belongs to, or None for the student's own (or the grader's)."""
    name = kernel.removeprefix("void ").strip()
    if is_grader_kernel(name):
        return None
    if "at::native" in name:
        return "PyTorch"
    for library, prefixes in LIBRARY_PREFIXES.items():
        if name.startswith(prefixes):
            return library
    return None


def find_ncu() -> str | None:
    found = shutil.which("ncu")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root and Path(root, "bin", "ncu").is_file():
            return str(Path(root, "bin", "ncu"))
    return None


class AuditError(Exception):
    """ncu's list could not be read as ncu writes it."""


def parse_ncu_csv(text: str) -> list[tuple[str, int, str]]:
    """(kernel name, grid size, process id) per launch, in launch order, from `ncu --csv --page
    raw` output (its "==PROF==" lines skipped). Exactly one header is expected."""
    lines = [line for line in text.splitlines() if line.startswith('"')]
    rows = list(csv.reader(lines))
    headers = [i for i, row in enumerate(rows) if "Kernel Name" in row and "ID" in row]
    if len(headers) != 1:
        raise AuditError(f"{len(headers)} kernel tables in ncu's output (1 expected)")
    header = rows[headers[0]]
    at = {name: header.index(name) for name in ("ID", "Kernel Name", "Process ID", "Grid Size")}
    launches, ids = [], []
    for row in rows[headers[0] + 1:]:
        if len(row) != len(header):
            raise AuditError(f"a row of {len(row)} fields under a header of {len(header)}")
        if not row[at["ID"]].strip():
            continue  # the units row
        try:
            ids.append(int(row[at["ID"]]))
            grid = math.prod(int(d) for d in row[at["Grid Size"]].strip("()").split(","))
        except ValueError as exc:
            raise AuditError(f"a launch row that ncu would not write: {row[:9]}") from exc
        launches.append((row[at["Kernel Name"]], grid, row[at["Process ID"]]))
    if ids and ids != list(range(ids[0], ids[0] + len(ids))):
        raise AuditError("kernel IDs out of order, repeated or missing")
    return launches


def kernels_between_markers(launches, functions: list[str]) -> dict[str, list[str]]:
    """Each function's kernels: those after its marker (grid k + 1) and before the next."""
    markers = [i for i, (name, _, _) in enumerate(launches) if name.removeprefix("void ") == MARKER]
    grids = [launches[i][1] for i in markers]
    expected = list(range(1, len(functions) + 2))
    if grids != expected:
        raise AuditError(f"the grader's markers came as grids {grids[:8]}, not {expected[:8]}")
    return {fn: [launches[i][0] for i in range(markers[k] + 1, markers[k + 1])]
            for k, fn in enumerate(functions)}


class _PipeReader(threading.Thread):
    """Reads ncu's log pipe to the end (or LOG_LIMIT), so ncu never blocks on a full pipe."""

    def __init__(self, fd: int):
        super().__init__(daemon=True)
        self.fd, self.data, self.overflow = fd, bytearray(), False

    def run(self) -> None:
        with os.fdopen(self.fd, "rb") as pipe:
            while chunk := pipe.read(1 << 16):
                if len(self.data) + len(chunk) > LOG_LIMIT:
                    self.overflow = True
                    continue
                self.data += chunk


@functools.cache
def _marker_kernel():
    import triton

    @triton.jit
    def grading_audit_marker(unused):
        pass

    return grading_audit_marker


@contextlib.contextmanager
def one_audit_at_a_time(lock_path: Path | None = None):
    """Holds a lock while ncu runs, shared by the grading processes whose temporary folder is the
    same (those of one machine, unless $TMPDIR differs): one audit at a time. Two at once (two
    labs graded side by side, `--jobs 2`) ended the second one's worker with exit status 9 on an
    H200, failing honest functions; the same lab alone passed.
    The lock lives outside the sandbox (the worker's /tmp is its own), so the student's code
    cannot take it, and flock releases it when its holder dies."""
    lock_path = lock_path or Path(tempfile.gettempdir(), f"course-kernel-audit-{os.getuid()}.lock")
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def marker_launch(index: int) -> None:
    """In the worker (op "mark"): the grader's marker, grid index + 1, alone on the GPU."""
    import torch

    torch.cuda.synchronize()
    _marker_kernel()[(index + 1,)](0)
    torch.cuda.synchronize()


_probe_lock = threading.Lock()  # one probe per process; a caller waits for one in progress
_probe_thread: threading.Thread | None = None
_probe_thread_lock = threading.Lock()


def start_probe() -> None:
    """Run `status()` in a thread, once per process, holding the audit lock as an audit does: its
    ncu run (about 8 s on an H200) then overlaps the first lab's grading instead of adding to that
    lab's audit."""
    global _probe_thread
    with _probe_thread_lock:
        if _probe_thread is None:
            _probe_thread = threading.Thread(target=_status_under_the_lock, name="ncu-probe")
            _probe_thread.start()


def _status_under_the_lock() -> None:
    with one_audit_at_a_time():
        status()


def status() -> tuple[bool, str]:
    """(usable, why not): ncu is installed and lists a marker launched by a Python worker here
    (probed once per process)."""
    with _probe_lock:
        return _probe()


@functools.cache
def _probe() -> tuple[bool, str]:
    from kernels import runtime

    if not runtime.ON_GPU:
        return False, "no GPU"
    ncu = find_ncu()
    if ncu is None:
        return False, "Nsight Compute (ncu) is not installed"
    # os._exit, as the worker leaves: ncu must list what ran without Python's own shutdown
    probe = ("import os, grading.kernel_audit as a; a.marker_launch(0); a.marker_launch(1); "
             "os._exit(0)")
    read_fd, write_fd = os.pipe()
    reader = _PipeReader(read_fd)
    reader.start()
    from grading.protocol import Options, worker_env

    try:
        done = subprocess.run([ncu, *NCU_ARGS, "--log-file", f"/dev/fd/{write_fd}",
                               sys.executable, "-c", probe], pass_fds=[write_fd],
                              env=worker_env(Options()),
                              capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        os.close(write_fd)
        return False, f"ncu could not be run: {exc}"
    os.close(write_fd)
    reader.join(timeout=30)
    try:
        kernels_between_markers(parse_ncu_csv(reader.data.decode(errors="replace")), ["probe"])
    except AuditError as exc:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or [""]
        return False, f"ncu did not list a test launch ({exc}; exit {done.returncode}) {tail[0]}"
    return True, ""


def audited_functions(spec, done: dict) -> tuple[list, dict]:
    """(the functions to audit, {name: why not} for the passed ones left out)."""
    chosen, left_out = [], {}
    for fn_spec in spec.functions:
        if done.get(fn_spec.name, {}).get("status") != "pass":
            continue
        if fn_spec.allowed_ops:
            left_out[fn_spec.name] = "may call PyTorch ops (its spec allows them)"
        elif fn_spec.grade_group is not None or fn_spec.backend == "gloo":
            left_out[fn_spec.name] = "runs in a process group of CPU processes"
        else:
            chosen.append(fn_spec)
    return chosen, left_out


def _fail(entry: dict, why: str) -> None:
    entry["status"], entry["points"] = "fail", 0
    entry["message"] = f"kernel audit: {why}"


def audit_lab(lab: dict, spec, done: dict, seed: int, opts, env: dict, cmd: list[str],
              work: Path, sandboxed: bool, early: EarlyStart | None = None) -> None:
    """Call the lab's passed functions again under ncu (one worker) and fail those whose calls
    ran a library's kernels; records what was seen in lab["kernel_audit"], with the seconds it
    waited for another lab's audit (`waited_s`) and the seconds it took (`seconds`): what the
    audit adds to grading a lab. `early`: the worker, started when the lab's grading started."""
    chosen, left_out = audited_functions(spec, done)
    report = {"tool": "ncu", "functions": {}, "left_out": left_out}
    lab["kernel_audit"] = report
    if not chosen:
        return
    asked = time.monotonic()
    with contextlib.ExitStack() as stack:
        if early is None:
            stack.enter_context(one_audit_at_a_time())  # status() runs ncu too, once a process
        else:
            early.wait()  # it holds the lock until the caller closes it
        started = time.monotonic()
        report["waited_s"] = round(started - asked, 2)
        try:
            usable, why = status() if early is None else (early.usable, early.why)
            if not usable:
                report["error"] = f"not run: {why}"
                return
            if early is None:
                worker, reader = _start_under_ncu(cmd, work, opts, env, sandboxed)
            elif early.error is not None:
                _fail_all(report, chosen, done, AuditError(early.error))
                return
            else:
                worker, reader = early.worker, early.reader
                worker.deadline = time.monotonic() + opts.timeout  # the audit's own time
            _audit_under_ncu(report, chosen, done, seed, opts, worker, reader, work)
        finally:
            report["seconds"] = round(time.monotonic() - started, 2)


class EarlyStart:
    """The audit's worker, started under ncu in a thread as soon as a lab's grading starts, and
    holding the audit lock from then on: its start (Python, PyTorch and CUDA under ncu: 5.3-6.5 s
    of each audit on an H200) then overlaps the grading instead of adding to it. Used where labs
    are graded one at a time (it holds the lock for the whole lab). `close()` stops an unused
    worker and lets go of the lock.

    The thread lives until `close()`: the worker is started with "die with parent" (Linux's
    parent-death signal, which bubblewrap's --die-with-parent uses too), and that parent is the
    thread that started it, not the process: a thread that ended at once killed the worker."""

    def __init__(self, cmd: list[str], work: Path, opts, env: dict, sandboxed: bool) -> None:
        self.usable, self.why, self.error = False, "", None
        self.worker = self.reader = None
        self._ready, self._closing = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, name="ncu-audit-worker",
                                        args=(cmd, work, opts, env, sandboxed))
        self._thread.start()

    def _run(self, cmd, work, opts, env, sandboxed) -> None:
        with one_audit_at_a_time():
            try:
                self.usable, self.why = status()
                if self.usable:
                    self.worker, self.reader = _start_under_ncu(cmd, work, opts, env, sandboxed)
            except Exception as exc:  # noqa: BLE001 - reported by the audit as its own failure
                self.error = f"the audit's worker could not be started: {type(exc).__name__}: {exc}"
            finally:
                self._ready.set()
            self._closing.wait()  # the worker's parent-death signal fires when this thread ends

    def wait(self) -> None:
        self._ready.wait()

    def close(self) -> None:
        self._ready.wait()
        try:
            if self.worker is not None:
                self.worker.close()
                self.reader.join(timeout=60)
        finally:
            self._closing.set()
            self._thread.join()


def _start_under_ncu(cmd: list[str], work: Path, opts, env: dict, sandboxed: bool):
    """The worker under ncu, which writes its list of launches into a pipe only this process
    reads: (worker, the pipe's reader)."""
    from grading import protocol

    read_fd, write_fd = os.pipe()
    reader = _PipeReader(read_fd)
    reader.start()
    prefix = [find_ncu(), *NCU_ARGS, "--log-file", f"/dev/fd/{write_fd}"]
    worker = protocol.WorkerProcess(cmd, work, time.monotonic() + opts.timeout, opts, env,
                                    sandboxed, prefix=prefix, extra_fds=[write_fd])
    return worker, reader


def _fail_all(report: dict, chosen: list, done: dict, exc: AuditError) -> None:
    report["error"] = str(exc)
    for fn_spec in chosen:
        _fail(done[fn_spec.name], f"the list of kernels your code ran could not be read ({exc})")


def _audit_under_ncu(report: dict, chosen: list, done: dict, seed: int, opts, worker, reader,
                     work: Path) -> None:
    from grading import protocol
    from grading.correctness import run_case

    failure, failed_cases = None, {}
    segments: list[tuple[str, str]] = []  # (function, CALL | CAPTURE | REPLAY) after each marker
    phases = report["phase_seconds"] = {}  # where the audit's time goes: start, import, calls, exit
    clock = time.monotonic()

    def phase_done(name: str) -> None:
        nonlocal clock
        now = time.monotonic()
        phases[name] = round(now - clock, 2)
        clock = now

    try:
        worker.set_step(None, "starting the kernel audit's worker", "import")
        worker.receive()
        phase_done("start")
        worker.set_step(None, "importing the solution cells (kernel audit)", "import")
        if worker.request({"op": "import"}).get("import_error"):
            raise AuditError("the solution cells failed to import under the audit")
        phase_done("import")

        def mark(label: tuple[str, str]) -> None:  # what ncu lists after it is `label`'s
            worker.request({"op": "mark", "index": len(segments)})
            segments.append(label)

        for k, fn_spec in enumerate(chosen):
            worker.set_step(fn_spec.name, "kernel audit")
            mark((fn_spec.name, CALL))
            case = fn_spec.cases_for(seed)[0]
            caller = protocol.WorkerCaller(worker, work, fn_spec.name)
            outcome = run_case(caller, fn_spec, case, protocol.derived_seed(seed, "audit", k))
            if outcome.ok and fn_spec.graph_capture:
                worker.set_step(fn_spec.name, "kernel audit (CUDA graph)")
                mark((fn_spec.name, CAPTURE))
                problem = caller.graph_capture(
                    fn_spec, case, protocol.derived_seed(seed, "audit graph", k),
                    between=lambda name=fn_spec.name: mark((name, REPLAY)))
                outcome = problem or outcome  # None: the replay's outputs were right
            if not outcome.ok:
                failed_cases[fn_spec.name] = (f"case {outcome.case} failed when called again "
                                              f"under Nsight Compute: {outcome.reason}")
        worker.set_step(None, "kernel audit")
        mark(("", END))
        phase_done("calls")
        returncode = worker.finish(timeout=WORKER_EXIT_S)
        if returncode is None:  # ncu is waiting for processes the student's code left running
            report["left_running"] = protocol.stop_processes_below(worker.pid, keep="ncu")
            returncode = worker.finish(timeout=120)
        phase_done("exit")
        if returncode != 0:
            raise AuditError(f"ncu and the worker ended with exit status {returncode}")
    except protocol.WorkerGone as gone:
        if gone.attempt.stopped:  # a limit (time, memory, output) or Ctrl-C: no verdict either way
            report["error"] = (f"inconclusive, the audit's worker was stopped: "
                               f"{protocol.death_reason(gone.attempt, opts)}")
            return
        failure = f"the audit's worker ended early: {protocol.death_reason(gone.attempt, opts)}"
    except (protocol.GraderError, protocol.WorkerReplyError, AuditError) as exc:
        failure = f"{type(exc).__name__}: {exc}"
    finally:
        worker.close()
    reader.join(timeout=60)
    try:
        if failure:
            raise AuditError(failure)
        if reader.overflow:
            raise AuditError(f"more than {LOG_LIMIT} bytes in ncu's log")
        launches = parse_ncu_csv(reader.data.decode(errors="replace"))
        seen = kernels_between_markers(launches, segments[:-1])
    except AuditError as exc:
        _fail_all(report, chosen, done, exc)
        return
    judge_seen(report, [f.name for f in chosen], done, seen, failed_cases)


def judge_seen(report: dict, names: list[str], done: dict, seen: dict, failed_cases: dict) -> None:
    """Each audited function's verdict from what ncu listed after its markers (`seen`, by
    (function, CALL | CAPTURE | REPLAY)), and the cases that failed when called again."""
    for name in names:
        by_kind = {kind: kernels for (fn, kind), kernels in seen.items() if fn == name}
        kernels = [k for kind in (CALL, CAPTURE) for k in by_kind.get(kind, [])]
        foreign = sorted({k for k in kernels if library_of(k)})
        entry = report["functions"][name] = {"kernels": sorted(set(kernels)), "library": foreign}
        if REPLAY in by_kind:
            entry["graph_replay"] = by_kind[REPLAY]
        why = (_library_kernels(foreign) if foreign  # the strongest evidence: named first
               else _graph_inside(kernels) or _replay_not_a_graph(by_kind.get(REPLAY))
               or failed_cases.get(name))
        if why:
            _fail(done[name], why)


def _library_kernels(foreign: list[str]) -> str:
    libraries = sorted({library_of(k) for k in foreign})
    return (f"Nsight Compute, outside your code's process, saw kernels of {', '.join(libraries)} "
            f"in its call ({foreign[0][:120]}): a graded function computes with its own kernels")


def _graph_inside(kernels: list[str]) -> str | None:
    """A graph launched by the call itself hides its kernels from the audit's list."""
    if GRAPH_LAUNCH not in kernels:
        return None
    return ("Nsight Compute, outside your code's process, saw a CUDA graph launched inside its "
            "call, whose kernels it does not list one by one: a graded call launches its kernels "
            "itself (the grader captures it in a graph where the lab asks for one)")


def _replay_not_a_graph(replay: list[str] | None) -> str | None:
    """What ncu lists while the captured call is replayed: the grader's copies and fills, then
    the graph; a kernel of the call there ran outside the graph, and no graph means none ran."""
    if replay is None:
        return None
    launched = [k for k in replay if not is_grader_kernel(k)]
    if GRAPH_LAUNCH not in launched:
        return ("Nsight Compute, outside your code's process, saw no CUDA graph launched when the "
                "captured call was replayed: its outputs were not the graph's")
    outside = [k for k in launched if k != GRAPH_LAUNCH]
    if outside:
        return (f"Nsight Compute, outside your code's process, saw kernels launched outside the "
                f"CUDA graph while it was replayed ({outside[0][:120]}): the outputs must be the "
                f"graph's")
    return None
