"""The grader's side of the worker protocol: starting `python -m grading.worker`, asking it one
request at a time, watching it while it works, and reading what it sends back as data.

The requests and replies are listed in grading/worker.py. A reply is a fact about one call; the
records it names are read here with `torch.load(weights_only=True)` and every field checked for its
type, and the verdict is made by whoever asked (grading/runner.py, grading/kernel_audit.py).

The worker is stopped (killed with everything it started) when:

* a step that runs the student's code (one correctness call, one performance configuration,
  importing the solution cells) uses more than its limit of CPU time (an infinite loop in Python,
  or a kernel that never ends, whose host thread spins in a synchronize), or more than
  `WALL_FACTOR` times the limit in wall-clock time (a process that sleeps). CPU time, not wall
  time, so that a busy machine does not turn a slow step into a "hang";
* the lab as a whole runs past `--timeout` (wall clock);
* it has printed more than `--output-limit-mib` (its output goes through a pipe that this process
  drains, keeping only a short tail);
* its resident memory exceeds the host-memory cap (on a GPU, where RLIMIT_AS cannot be used);
* the run is interrupted (Ctrl-C, SIGTERM): `STOP` is set.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import math
import os
import select
import signal
import stat
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

EXIT_CONTEXT_LOST = 75  # the worker's exit status after it reported {"context_lost": ...}
REPO = Path(__file__).resolve().parents[1]
RECORD_SLACK = 16 * 2**20  # bytes a record may hold beyond copies of its call's tensors
POLL_S = 0.1
WALL_FACTOR = 10.0  # a step may take this many times its CPU-time limit in wall-clock time
STOP = threading.Event()  # set on Ctrl-C / SIGTERM: workers are killed, their labs interrupted


@dataclass
class Options:
    """How labs are graded; the defaults are `python -m grading`'s."""

    cpu: bool = False
    perf: bool = True
    timeout: float = 900.0  # seconds per lab, all worker processes together (wall clock)
    call_timeout: float = 60.0  # CPU seconds per step that runs student code (one correctness call)
    perf_timeout: float = 300.0  # CPU seconds per performance configuration
    memory_gib: float = 16.0  # host memory a lab may use, on top of what the grader itself needs
    gpu_memory_fraction: float = 0.9  # of the GPU's memory
    output_limit_mib: float = 16.0  # stdout + stderr
    sandbox: str = "auto"  # "auto": bubblewrap where it works; "require"; "off"
    kernel_audit: bool = True  # on a GPU with Nsight Compute: grading/kernel_audit.py
    # Start the audit's worker when a lab's grading starts (kernel_audit.EarlyStart): only where
    # labs are graded one at a time, since it holds the audit lock for the whole lab.
    early_audit: bool = True
    # Folders the student's code never sees (shown empty in the sandbox): the report folder, whose
    # partial report holds every lab's secret seed, and a class's submissions.
    private: tuple[str, ...] = ()

    def worker_args(self) -> list[str]:
        args = ["--memory-gib", str(self.memory_gib),
                "--gpu-memory-fraction", str(self.gpu_memory_fraction)]
        return args + (["--cpu"] if self.cpu else [])

    def result_options(self) -> dict:
        """The options that can change a lab's result (part of its content hash)."""
        return {"cpu": self.cpu, "perf": self.perf, "kernel_audit": self.kernel_audit}

    def limit(self, kind: str) -> float:
        return self.perf_timeout if kind == "perf" else self.call_timeout


# --------------------------------------------------------------------------------------------------
# Watching one worker process


class _OutputTail(threading.Thread):
    """Drains a pipe, counting bytes and keeping only the last `keep` of them."""

    def __init__(self, pipe, keep: int = 4096):
        super().__init__(daemon=True)
        self.pipe, self.keep = pipe, keep
        self.total = 0
        self.tail = b""

    def run(self) -> None:
        fd = self.pipe.fileno()
        while True:
            try:
                chunk = os.read(fd, 1 << 16)
            except OSError:
                break
            if not chunk:
                break
            self.total += len(chunk)
            self.tail = (self.tail + chunk)[-self.keep:]

    def text(self, lines: int = 8) -> str:
        return "\n".join(self.tail.decode("utf-8", "replace").strip().splitlines()[-lines:])


def rss_bytes(pid: int) -> int | None:
    """Resident memory of a process (Linux /proc), or None where it cannot be read."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds(pid: int) -> float | None:
    """CPU time (user + system, all threads) a process has used (Linux /proc), or None."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / _TICKS
    except (OSError, ValueError, IndexError):
        return None


def _state(pid: int) -> str:
    """A process's state letter (/proc: "R", "S", "T" stopped, ...), "X" where it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return "X"


def process_tree(pid: int) -> list[int]:
    """`pid` and every process below it (Linux /proc; in a sandbox, `pid` is bwrap's init and
    the worker its child)."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        try:
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            pass
    return found


def stop_processes_below(pid: int, keep: str) -> int:
    """SIGKILL every process below `pid` but those whose name (/proc's comm) is `keep`; returns how
    many it stopped. The kernel audit's use: ncu waits for every process of the tree it profiles,
    so one the student's code started and left running would keep it, and its list, from ending."""
    stopped = 0
    for p in process_tree(pid)[1:]:
        try:
            if Path(f"/proc/{p}/comm").read_text().strip() == keep:
                continue
            os.kill(p, signal.SIGKILL)
            stopped += 1
        except (OSError, ValueError):  # gone already
            pass
    return stopped


def tree_cpu_seconds(pid: int) -> float:
    return sum(cpu_seconds(p) or 0.0 for p in process_tree(pid))


def tree_rss_bytes(pid: int) -> int | None:
    sizes = [rss_bytes(p) for p in process_tree(pid)]
    return sum(s for s in sizes if s is not None) if any(s is not None for s in sizes) else None


def memory_cap(limits: dict | None, opts: Options) -> int:
    """Resident bytes above which the parent stops a worker. With RLIMIT_AS in force (CPU mode)
    the cap sits above anything the limit allows, so the worker's own MemoryError comes first."""
    limits = limits or {}
    base = limits.get("baseline_vm") if limits.get("host_rlimit") else limits.get("baseline_rss")
    return int((base or 2 * 2**30) + opts.memory_gib * 2**30 + 2**29)


@dataclass
class Attempt:
    """How a worker ended, for `death_reason`."""

    returncode: int | None = None
    stopped: str | None = None  # "step" | "lab-timeout" | "output" | "memory" | "interrupted"
    step: dict | None = None  # the step that was running: function, step, kind, limit_s
    output_bytes: int = 0
    output_tail: str = ""
    memory_cap: int | None = None
    wall: bool = False  # a step stopped by its wall-clock backstop, not its CPU time
    wall_s: float = 0.0  # that backstop, in seconds


class WorkerGone(Exception):
    """The worker died or was stopped; `attempt` says how."""

    def __init__(self, attempt: Attempt):
        super().__init__(attempt.stopped or attempt.returncode)
        self.attempt = attempt


class WorkerReplyError(Exception):
    """A reply that is not what the protocol allows: the student's code wrote to the channel."""


class GraderError(Exception):
    """The grader's own code failed inside the worker."""


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the worker and anything it started (ptxas, ...)
    except (ProcessLookupError, PermissionError, AttributeError):
        try:
            proc.kill()
        except ProcessLookupError:
            pass


def _die_with_parent(parent: int) -> None:  # pragma: no cover - runs in the child before exec
    """The worker, or bwrap around it, gets SIGKILL when the grader dies (Linux), set before it
    starts: bwrap's own --die-with-parent comes a moment later, and a grader killed in that moment
    left a sandbox running, adopted by init. A parent already gone is caught by its PID."""
    try:
        import ctypes
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:
        os._exit(1)


def _pages(size: int) -> int:
    return -(-size // os.sysconf("SC_PAGE_SIZE")) * os.sysconf("SC_PAGE_SIZE")


class WorkerProcess:
    """One worker: started on `cmd` (the request and reply descriptors appended), asked one
    request at a time, watched while it works on one."""

    def __init__(self, cmd: list[str], cwd: Path, deadline: float, opts: Options,
                 env: dict | None = None, sandbox: bool = False, prefix: list[str] = (),
                 extra_fds: list[int] = ()):
        """`prefix` runs before the worker's command (the kernel audit's ncu), and `extra_fds`
        are passed to it, then closed here."""
        self.opts, self.deadline, self.sandboxed = opts, deadline, sandbox
        self.tmpfs_bytes = _pages(int(opts.memory_gib * 2**30))  # the sandbox's /tmp, /dev/shm
        req_r, self._req_w = os.pipe()
        self._rep_r, rep_w = os.pipe()
        cmd = [*prefix, *cmd]
        fds = [req_r, rep_w, *extra_fds]
        info_r = info_w = None
        if sandbox:
            from grading import sandbox as sb
            info_r, info_w = os.pipe()
            fds.append(info_w)
            cmd = sb.wrap(cmd + ["--requests", str(req_r), "--replies", str(rep_w)], str(cwd),
                          gpu=not opts.cpu and _on_gpu(), info_fd=info_w, hidden=opts.private,
                          tmpfs_bytes=self.tmpfs_bytes)
        else:
            cmd = cmd + ["--requests", str(req_r), "--replies", str(rep_w)]
        self.proc = subprocess.Popen(cmd, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                     pass_fds=fds,
                                     preexec_fn=functools.partial(_die_with_parent, os.getpid()))
        for fd in fds:
            os.close(fd)
        self.pid = self.proc.pid
        if info_r is not None:
            self.pid = self._child_pid(info_r)
        # Where CPU time cannot be read (no /proc: macOS), the limit is wall-clock time, as it was.
        self._wall_factor = WALL_FACTOR if cpu_seconds(self.pid) is not None else 1.0
        self.drain = _OutputTail(self.proc.stdout)
        self.drain.start()
        self.attempt = Attempt(memory_cap=memory_cap(None, opts))
        self._buffer = b""
        self._next_id = 0
        self.step: dict | None = None
        # Seconds spent in each kind of step ("import", "call", "perf"): where a lab's time goes.
        self.seconds_by_kind: dict[str, float] = {}
        # The correctness phase's round trips by part (WorkerCaller.timed): what in it to cut.
        self.call_seconds: dict[str, float] = {}
        self._step_started = time.monotonic()

    def _child_pid(self, info_r: int) -> int:
        """The sandboxed worker's PID as this process sees it (bwrap's --info-fd), for CPU time."""
        data = b""
        end = time.monotonic() + 30
        while time.monotonic() < end and b"}" not in data:
            ready, _, _ = select.select([info_r], [], [], 0.5)
            if ready:
                chunk = os.read(info_r, 4096)
                if not chunk:
                    break
                data += chunk
        os.close(info_r)
        try:
            return int(json.loads(data)["child-pid"])
        except (ValueError, KeyError, TypeError):
            return self.proc.pid

    def set_step(self, function: str | None, step: str, kind: str = "call") -> None:
        self._close_step()
        self.step = {"function": function, "step": step, "kind": kind,
                     "limit_s": self.opts.limit(kind)}

    def _close_step(self) -> None:
        now = time.monotonic()
        if self.step is not None:
            spent, kind = now - self._step_started, self.step["kind"]
            self.seconds_by_kind[kind] = self.seconds_by_kind.get(kind, 0.0) + spent
        self._step_started = now

    def _stop(self, why: str, wall: bool = False) -> None:
        self.attempt.stopped, self.attempt.wall = why, wall
        _kill(self.proc)

    def _gone(self) -> WorkerGone:
        if self.proc.poll() is None and not self.attempt.stopped:
            try:  # it closed its end of the pipe: let it finish dying, to read how it ended
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        if self.proc.poll() is None:
            _kill(self.proc)
        self.attempt.returncode = self.proc.wait()
        if self.sandboxed and self.attempt.returncode > 128 and not self.attempt.stopped:
            self.attempt.returncode = 128 - self.attempt.returncode  # bwrap: 128 + signal
        self.drain.join(timeout=5)
        self.attempt.step = self.step
        self.attempt.output_bytes, self.attempt.output_tail = self.drain.total, self.drain.text()
        return WorkerGone(self.attempt)

    def receive(self) -> dict:
        """The next reply line, watching the worker while it works; raises WorkerGone."""
        started, cpu_start = time.monotonic(), tree_cpu_seconds(self.pid)
        while b"\n" not in self._buffer:
            ready, _, _ = select.select([self._rep_r], [], [], POLL_S)
            if ready:
                chunk = os.read(self._rep_r, 1 << 16)
                if not chunk:  # the worker closed its end: it is gone
                    raise self._gone()
                self._buffer += chunk
                continue
            self._watch(started, cpu_start)
        line, _, self._buffer = self._buffer.partition(b"\n")
        try:
            reply = json.loads(line)
        except ValueError as exc:
            raise WorkerReplyError(f"a reply that is not JSON: {line[:80]!r}") from exc
        if not isinstance(reply, dict):
            raise WorkerReplyError(f"a reply that is not an object: {line[:80]!r}")
        return reply

    def _watch(self, started: float, cpu_start: float) -> None:
        now = time.monotonic()
        if self.proc.poll() is not None:
            raise self._gone()
        step = self.step
        if STOP.is_set():
            self._stop("interrupted")
        elif now > self.deadline:
            self._stop("lab-timeout")
        elif step is not None and tree_cpu_seconds(self.pid) - cpu_start > step["limit_s"]:
            self._stop("step")
        elif step is not None and now - started > self._wall_factor * step["limit_s"]:
            self.attempt.wall_s = self._wall_factor * step["limit_s"]
            self._stop("step", wall=True)
        elif self.drain.total > self.opts.output_limit_mib * 2**20:
            self._stop("output")
        else:
            rss = tree_rss_bytes(self.pid)
            if rss is not None and self.sandboxed:  # its /tmp and /dev/shm are memory too
                from grading.sandbox import tmpfs_bytes_used

                rss += tmpfs_bytes_used(self.pid, self.tmpfs_bytes)
            if rss is not None and rss > self.attempt.memory_cap:
                self._stop("memory")
        if self.attempt.stopped:
            raise self._gone()

    def request(self, message: dict) -> dict:
        self._next_id += 1
        message = {**message, "id": self._next_id}
        try:
            os.write(self._req_w, (json.dumps(message) + "\n").encode())
        except BrokenPipeError:
            # The worker has exited. What it wrote before it went is still read below, in order,
            # until receive() finds its end closed and reports how it ended: raising here would
            # make the verdict depend on whether it died just before this write or just after.
            pass
        except OSError:
            raise self._gone() from None
        while True:
            reply = self.receive()
            if reply.get("id") == self._next_id:
                break  # anything else was written by the student's code: ignored
        if "grader_error" in reply:
            raise GraderError(str(reply["grader_error"]))
        return reply

    @contextlib.contextmanager
    def paused(self):
        """Every process of this worker stopped (SIGSTOP) for the block, then continued: while the
        clean worker times the course's kernel, the student's code can launch nothing beside it
        (a thread that loads the GPU only while it is not being timed itself)."""
        stopped: list[int] = []
        try:
            for _ in range(2):  # a process forked while the first pass ran is found by the second
                for p in process_tree(self.proc.pid):
                    if p not in stopped:
                        with contextlib.suppress(OSError):
                            os.kill(p, signal.SIGSTOP)
                            stopped.append(p)
            end = time.monotonic() + 2  # a signal is delivered when the process is next scheduled
            while time.monotonic() < end and any(_state(p) not in "TtZX" for p in stopped):
                time.sleep(0.001)
            yield
        finally:
            for p in stopped:
                with contextlib.suppress(OSError):
                    os.kill(p, signal.SIGCONT)

    def finish(self, timeout: float) -> int | None:
        """Tell the worker there is nothing more (it exits) and wait for it: its exit status, or
        None if it is still running after `timeout` seconds."""
        try:
            os.close(self._req_w)
        except OSError:
            pass
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def close(self) -> None:
        self._close_step()
        for fd in (self._req_w, self._rep_r):
            try:
                os.close(fd)
            except OSError:
                pass
        if self.proc.poll() is None:
            _kill(self.proc)
        self.proc.wait()
        self.drain.join(timeout=5)
        self.proc.stdout.close()


def _on_gpu() -> bool:
    from kernels import runtime
    return runtime.ON_GPU


def death_reason(attempt: Attempt, opts: Options) -> str:
    """Why a worker did not finish, in words a student can act on."""
    if attempt.stopped == "step":
        limit = attempt.step["limit_s"]
        spent = f"{attempt.wall_s:g} s" if attempt.wall else f"{limit:g} s of CPU time"
        return f"did not finish within {spent}: an infinite loop, or a kernel that never ends?"
    if attempt.stopped == "lab-timeout":
        return f"timed out after {opts.timeout:.0f} s (an infinite loop or a hung kernel?)"
    if attempt.stopped == "output":
        return (f"printed more than {opts.output_limit_mib:g} MiB (print inside a loop?); the "
                "grading process "
                "was stopped")
    if attempt.stopped == "memory":
        return (f"used more than {attempt.memory_cap / 2**30:.1f} GiB of host memory; the "
                "grading process was "
                "stopped")
    if attempt.stopped == "interrupted":
        return "not graded: the grading run was interrupted"
    rc = attempt.returncode
    last = attempt.output_tail.strip().splitlines()[-1:] if attempt.output_tail.strip() else []
    tail = f" (last output: {last[0][:300]})" if last else ""
    if rc is not None and rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = f"signal {-rc}"
        if name in ("SIGSEGV", "SIGBUS"):
            return f"the grading process crashed with {name}: an out-of-bounds memory access?"
        if name == "SIGKILL":
            return "the grading process was killed (SIGKILL: the machine ran out of memory?)"
        return f"the grading process died of {name}{tail}"
    return (f"the grading process exited with code {rc} before it finished: does the code end "
            f"the process "
            f"(os._exit, exit in a thread)?{tail}")


# --------------------------------------------------------------------------------------------------
# Calls made in the worker, judged here


def derived_seed(seed: int, *parts) -> int:
    """A seed for work the worker does on its own (timing, graph capture): not the lab's seed."""
    digest = hashlib.sha256(repr((seed, *parts)).encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def _timed(worker: WorkerProcess, calls: int) -> float:
    """Seconds on this process's clock for the worker to make `calls` calls back to back and
    synchronize (after its "wall_ready"): no clock of the worker's is read."""
    start = time.perf_counter()
    worker.request({"op": "wall_go", "calls": calls})
    return time.perf_counter() - start


class CourseNotTimed(Exception):
    """The clean worker could not time the course's kernel; the message says why."""


class CleanWorker:
    """A worker on the same lab, in the same sandbox, that never imports the student's code
    (`python -m grading.worker --clean`): it times the course's kernel and PyTorch, and measures
    the hardware floor, for `WorkerCaller.measure`, which interleaves its batches with the
    student's. Its folder holds no graded module and is seeded with the user's compiled-kernel
    caches, never with a student worker's (which could hold a planted, slow build of the course's
    kernel). Started when asked (`start`: the process only, its start overlaps the grading),
    started again after it dies."""

    def __init__(self, cmd: list[str], folder: Path, deadline: float, opts: Options, env: dict,
                 sandbox: bool, seed_caches: bool):
        self.cmd, self.folder, self.deadline, self.opts = [*cmd, "--clean"], folder, deadline, opts
        self.env, self.sandbox, self.seed_caches = env, sandbox, seed_caches
        self.worker: WorkerProcess | None = None
        self.worker_folder: Path | None = None
        self.started = 0
        self.ready = False

    def start(self) -> None:
        work = self.worker_folder = self.folder / f"clean-worker-{self.started}"
        self.started += 1
        work.mkdir(parents=True)
        if self.seed_caches:
            from grading import sandbox as sb

            sb.seed_caches(work)
        self.worker = WorkerProcess(self.cmd, work, self.deadline, self.opts, self.env,
                                    self.sandbox)
        self.ready = False

    def time(self, name: str, config: dict, who: str, seed: int, rounds: int | None) -> dict:
        """A batch of the course's kernel ("reference") or PyTorch ("torch"): the worker's facts
        (grading/performance.py `time_course`), or CourseNotTimed."""
        reply = self._ask(name, f"timing the course's kernel ({who})",
                          lambda w: w.request({"op": "course", "name": name, "config": config,
                                               "who": who, "seed": seed, "rounds": rounds}))
        if "result" not in reply:
            self.close()
            raise CourseNotTimed(str(reply.get("context_lost") or reply))
        return reply["result"]

    def wall(self, name: str, config: dict, seed: int, calls: int) -> float:
        """Seconds, on this process's clock, that `calls` calls of the course's kernel took back
        to back (grading/performance.py `wall_ready`)."""
        def ask(worker: WorkerProcess) -> float:
            worker.request({"op": "wall_ready", "name": name, "config": config, "seed": seed})
            return _timed(worker, calls)

        return self._ask(name, "timing the course's kernel (back to back)", ask)

    def _ask(self, name: str, step: str, ask):
        if self.worker is None:
            self.start()
        worker = self.worker
        try:
            if not self.ready:
                worker.set_step(name, "starting the clean worker", "import")
                worker.receive()  # {"ready": true}
                self.ready = True
            worker.set_step(name, step, "perf")
            return ask(worker)
        except WorkerGone as gone:
            self.close()
            raise CourseNotTimed(death_reason(gone.attempt, self.opts)) from None
        except (GraderError, WorkerReplyError) as exc:
            self.close()
            raise CourseNotTimed(f"{type(exc).__name__}: {exc}") from None

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
            self.worker = None


# The parts of the correctness phase a WorkerCaller times; the rest of the phase is this process
# making inputs and references and judging (grading/runner.py names it).
CALL_PARTS = {
    "send": "inputs written for the worker",
    "begin": "worker loads a case",
    "first": "a case's first call (compiles)",
    "later": "a case's later calls",
    "read": "records read back",
    "other": "calls without out= and graph captures",
}


class WorkerCaller:
    """`grading.correctness.Caller` through a worker: inputs go as files, records come back;
    timing interleaves the worker's batches with a `CleanWorker`'s."""

    def __init__(self, worker: WorkerProcess, folder: Path, name: str,
                 clean: CleanWorker | None = None, memory=None):
        """`memory` (grading/gpu_memory.py `ProcessMemory`, on a GPU): the worker's GPU memory
        read from here around each call of a function with a memory budget."""
        self.worker, self.folder, self.name, self.clean = worker, folder, name, clean
        self.memory = memory
        self.unobserved = ""  # why a budgeted call's memory could not be read from here
        self.spec = None
        self.sent = 0
        self.sent_bytes = 0  # the last inputs sent: a record holds a few copies of them at most

    @contextlib.contextmanager
    def timed(self, part: str):
        """Adds the block's seconds to the worker's `call_seconds[part]`."""
        started = time.monotonic()
        try:
            yield
        finally:
            spent = time.monotonic() - started
            self.worker.call_seconds[part] = self.worker.call_seconds.get(part, 0.0) + spent

    def _send(self, tensors: tuple) -> str:
        with self.timed(CALL_PARTS["send"]):
            return self._write_inputs(tensors)

    def _write_inputs(self, tensors: tuple) -> str:
        import torch

        self.sent += 1
        name = f"inputs-{self.name}-{self.sent}-{os.urandom(4).hex()}.pt"
        # O_EXCL | O_NOFOLLOW: a name the worker planted (a symlink) is never written through
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        fd = os.open(self.folder / name, flags, 0o644)
        with os.fdopen(fd, "wb") as f:
            torch.save(tuple(t.detach() for t in tensors), f)
        self.sent_bytes = sum(t.numel() * t.element_size() for t in tensors)
        return name

    def record_limit(self) -> int:
        """The largest record an honest call can produce: its results, the inputs and outputs
        after it, the guard bands, a snapshot, each about the size of the inputs."""
        return RECORD_SLACK + 8 * self.sent_bytes

    def _record(self, reply: dict, spec, with_out: bool):
        from grading.correctness import CallRecord
        from grading.watch import Watched

        if reply.get("not_implemented"):
            raise NotImplementedError
        if "context_lost" in reply:
            raise ContextLostInWorker(str(reply["context_lost"]))
        with self.timed(CALL_PARTS["read"]):
            return read_record(self.folder, reply.get("record"), spec, CallRecord, Watched,
                               with_out, self.record_limit())

    def begin_case(self, spec, case, inputs) -> None:
        self.spec, self.case = spec, case
        message = {"op": "begin", "name": self.name, "case": case.as_json(),
                   "inputs": self._send(inputs)}
        with self.timed(CALL_PARTS["begin"]):
            self.worker.request(message)

    def call(self, trial: int, inputs: tuple, *, profile: bool):
        message = {"op": "call", "trial": trial, "profile": profile,
                   "inputs": self._send(inputs) if trial else None}
        # Not around the profiled call: the profiler the worker starts inside it (CUPTI) maps
        # device buffers of its own, of a size this process does not know. The case's other
        # calls are observed (the largest case is the profiled one: its second call is judged).
        part = CALL_PARTS["later" if trial else "first"]
        if self.memory is None or self.spec.memory_budget is None or profile:
            with self.timed(part):
                reply = self.worker.request(message)
            return self._record(reply, self.spec, with_out=True)
        with self._watch_memory(loaded=self.sent_bytes if trial else 0) as watch, self.timed(part):
            reply = self.worker.request(message)
        record = self._record(reply, self.spec, with_out=True)
        record.outside_memory = watch.observed
        self.unobserved = self.unobserved or watch.observed.why_not
        return record

    def _watch_memory(self, loaded: int):
        """The worker's GPU memory sampled from here during the call: what the grader's own
        work in it may add is the inputs it loads and the copies of the outputs."""
        from grading.cases import output_shapes
        from grading.gpu_memory import OUTPUT_COPIES, CallMemory

        outputs = sum(math.prod(shape) * dtype.itemsize
                      for shape, dtype in output_shapes(self.spec, self.case))
        return CallMemory(self.memory, self.worker.proc.pid, loaded + OUTPUT_COPIES * outputs)

    def call_allocating(self, spec, case, inputs):
        message = {"op": "allocating", "name": self.name, "case": case.as_json(),
                   "inputs": self._send(inputs)}
        with self.timed(CALL_PARTS["other"]):
            reply = self.worker.request(message)
        return self._record(reply, spec, with_out=False)

    def graph_capture(self, spec, case, seed: int, between=None):
        """The worker captures, then replays on values it is sent only after the capture; the
        replayed values are made and judged here, so a worker that returns something else than
        the graph's outputs for them fails. `between()` runs between the two requests (the
        kernel audit's marker, so that what ncu lists for the replay is the replay's alone)."""
        import torch

        from grading.graph import graph_inputs, judge_replay

        captured, replayed = graph_inputs(spec, case, derived_seed(seed, self.name, "graph"))
        reply = self._graph_request({"op": "capture", "name": self.name, "case": case.as_json(),
                                     "captured": self._send(captured)})
        if "error" in reply:
            return judge_replay(spec, case, replayed, str(reply["error"]))
        if between is not None:
            between()
        reply = self._graph_request({"op": "replay", "replayed": self._send(replayed)})
        outputs = load_worker_file(self.folder, reply.get("outputs"), self.record_limit())
        if (not isinstance(outputs, tuple) or len(outputs) != spec.n_outputs
                or not all(type(t) is torch.Tensor for t in outputs)):
            raise WorkerReplyError("graph outputs that are not the function's outputs")
        return judge_replay(spec, case, replayed, outputs)

    def _graph_request(self, message: dict) -> dict:
        with self.timed(CALL_PARTS["other"]):
            reply = self.worker.request(message)
        if "context_lost" in reply:
            raise ContextLostInWorker(str(reply["context_lost"]))
        return reply

    def run_group(self, groups: list):
        """Process groups' runs (`GradedFunction.grade_group`'s `call`): each rank a fresh
        process in a sandbox of its own, given only its own inputs, its messages relayed through
        this process (grading/ranks.py); the worker takes no part."""
        from grading import ranks

        opts = self.worker.opts
        return ranks.run_spawned(self.folder, self.name, groups, sandboxed=self.worker.sandboxed,
                                 memory_gib=opts.memory_gib, env=worker_env(opts),
                                 hidden=opts.private,
                                 preexec_fn=functools.partial(_die_with_parent, os.getpid()))

    def measure(self, spec, config, seed: int, rows):
        """The student's batches timed in its worker, the course's kernel's and PyTorch's in the
        clean worker, with the student's worker stopped meanwhile; judged here
        (grading/performance.py `measure`). A batch reply that is not one is the student's code
        writing to the channel."""
        from grading import performance
        from grading.results import PerfResult

        wire = performance.config_json(config)

        def student(batch: int, rounds: int) -> dict:
            reply = self.worker.request({"op": "perf", "name": self.name, "config": wire,
                                         "rounds": rounds,
                                         "seed": derived_seed(seed, self.name, config.id, batch)})
            if "context_lost" in reply:
                raise ContextLostInWorker(str(reply["context_lost"]))
            return reply.get("result")

        def course(who: str, batch: int, rounds: int | None) -> dict:
            with self.worker.paused():
                return self.clean.time(self.name, wire, who,
                                       derived_seed(seed, self.name, config.id, batch), rounds)

        wall_seed = derived_seed(seed, self.name, config.id, "wall")

        def student_wall(calls: int) -> float:
            self.worker.request({"op": "wall_ready", "name": self.name, "config": wire,
                                 "seed": wall_seed})
            return _timed(self.worker, calls)

        def course_wall(calls: int) -> float:
            with self.worker.paused():
                return self.clean.wall(self.name, wire, wall_seed, calls)

        try:
            return performance.measure(
                performance.Sides(student, course, student_wall, course_wall), config, rows)
        except performance.BatchError as exc:
            raise WorkerReplyError(str(exc)) from exc
        except CourseNotTimed as exc:
            return PerfResult(config.id, tier="F", note=(
                f"the course's kernel could not be timed beside this function in a clean "
                f"process ({exc}): not credited"))


class ContextLostInWorker(Exception):
    """The worker's CUDA context is lost (it exits); the message names the case."""


def load_worker_file(folder: Path, name, limit: int):
    """A file the worker wrote, loaded as data only (`weights_only`: no code runs). Only a regular
    file of at most `limit` bytes, named as the protocol names them, in the worker's folder: a
    pipe would block this process (it is opened without waiting, then refused), a link could
    point anywhere, and a huge file would fill this process's memory."""
    import io

    import torch

    if not isinstance(name, str) or "/" in name or not name.endswith(".pt"):
        raise WorkerReplyError(f"a record named {name!r}")
    try:
        fd = os.open(folder / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise WorkerReplyError(f"a record that cannot be opened ({exc.strerror})") from exc
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise WorkerReplyError(f"a record {name!r} that is not a regular file")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise WorkerReplyError(f"a record of more than {limit} bytes, more than the call's "
                               f"inputs and outputs can fill")
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:  # noqa: BLE001 - whatever is wrong with it, it is not a record
        raise WorkerReplyError(f"an unreadable record ({type(exc).__name__}: {exc})") from exc


def read_record(folder: Path, name, spec, record_cls, watched_cls, with_out: bool, limit: int):
    """A worker's CallRecord file (`load_worker_file`), each field checked for its type: anything
    else is the student's code writing to the grader's files."""
    import torch

    data = load_worker_file(folder, name, limit)
    try:
        watched = watched_cls(**data.pop("watched"))
        record = record_cls(**data, watched=watched)
    except Exception as exc:  # noqa: BLE001 - whatever is wrong with it, it is not a record
        raise WorkerReplyError(f"an unreadable record ({type(exc).__name__}: {exc})") from exc
    tensors = (tuple(record.results or ()) + tuple(record.inputs_after)
               + tuple(record.outputs_after) + tuple(record.guards_after)
               + tuple(watched.stream_snapshot or ()))
    if (not all(isinstance(t, torch.Tensor) and type(t) is torch.Tensor for t in tensors)
            or (record.results is not None and len(record.results) != spec.n_outputs)
            or (with_out and record.error is None and len(record.guards_after) != spec.n_outputs)
            or not isinstance(record.aliases, (tuple, list))
            or not all(isinstance(x, list) and all(isinstance(s, str) for s in x)
                       for x in (watched.forbidden_ops, watched.host_reads,
                                 watched.course_kernels, watched.cuda_kernels,
                                 watched.host_trips))
            or not isinstance(watched.tampered, str)):
        raise WorkerReplyError("a record whose fields are not what a call returns")
    record.results = None if record.results is None else tuple(record.results)
    record.outside_memory = None  # this process's reading only (WorkerCaller.call)
    return record


def record_to_dict(record) -> dict:
    """A CallRecord as plain containers and tensors (what `torch.load(weights_only=True)` reads)."""
    d = {f.name: getattr(record, f.name) for f in dataclasses.fields(record)}
    d["watched"] = {f.name: getattr(record.watched, f.name)
                    for f in dataclasses.fields(record.watched)}
    return d


def worker_env(opts: Options) -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    if opts.cpu or not _on_gpu():
        env["OMP_NUM_THREADS"] = "1"  # the interpreter is single-threaded: more threads contend
    return env
