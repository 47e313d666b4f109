"""One lab, graded in worker processes that are watched from outside.

`grade_lab` runs `python -m grading.worker` for a lab and reads its progress file (grading/worker.py) as
it goes. The worker is stopped (its whole process group killed) when:

* a step that runs the student's code (one correctness case, one performance configuration, importing
  the solution cells) runs past its limit: an infinite loop in Python, or a kernel that never ends;
* the lab as a whole runs past `--timeout`;
* it has printed more than `--output-limit-mib` (its output goes through a pipe that the parent
  drains, keeping only a short tail: a flood cannot fill the parent's memory or a disk);
* its resident memory exceeds the host-memory cap (on a GPU, where RLIMIT_AS cannot be used);
* the run is interrupted (Ctrl-C, SIGTERM): `STOP` is set.

When a worker dies or is stopped while checking a function, that function gets an error with the
reason, and the functions after it are graded in a new worker. A worker that loses its CUDA context
records the function itself and exits with EXIT_CONTEXT_LOST, with the same effect.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from grading.worker import EXIT_CONTEXT_LOST

REPO = Path(__file__).resolve().parents[1]
POLL_S = 0.1
STOP = threading.Event()  # set on Ctrl-C / SIGTERM: running workers are killed, their labs marked interrupted


@dataclass
class Options:
    """How labs are graded; the defaults are `python -m grading`'s."""

    cpu: bool = False
    perf: bool = True
    timeout: float = 900.0  # seconds per lab, all worker processes together
    call_timeout: float = 60.0  # seconds per step that runs student code (one correctness case)
    perf_timeout: float = 300.0  # seconds per performance configuration
    memory_gib: float = 16.0  # host memory a lab may use, on top of what the grader itself needs
    gpu_memory_fraction: float = 0.9  # of the GPU's memory
    output_limit_mib: float = 16.0  # stdout + stderr

    def worker_args(self) -> list[str]:
        args = ["--call-timeout", str(self.call_timeout), "--perf-timeout", str(self.perf_timeout),
                "--memory-gib", str(self.memory_gib), "--gpu-memory-fraction", str(self.gpu_memory_fraction)]
        return args + (["--cpu"] if self.cpu else []) + ([] if self.perf else ["--no-perf"])

    def result_options(self) -> dict:
        """The options that can change a lab's result (part of its content hash)."""
        return {"cpu": self.cpu, "perf": self.perf}


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


class _Events:
    """Reads the JSON lines a worker appends to its progress file (a torn last line waits for the next read)."""

    def __init__(self, path: Path):
        self.path, self.offset, self.partial = path, 0, b""

    def poll(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        self.offset += len(data)
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()
        events = []
        for line in lines:
            try:
                events.append(json.loads(line))
            except ValueError:
                continue
        return events


def rss_bytes(pid: int) -> int | None:
    """Resident memory of a process (Linux /proc), or None where it cannot be read."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _memory_cap(limits: dict | None, opts: Options) -> int:
    """Resident bytes above which the parent stops a worker. With RLIMIT_AS in force (CPU mode) the cap
    sits above anything the limit allows, so the worker's own MemoryError comes first."""
    limits = limits or {}
    base = limits.get("baseline_vm") if limits.get("host_rlimit") else limits.get("baseline_rss")
    return int((base or 2 * 2**30) + opts.memory_gib * 2**30 + 2**29)


@dataclass
class Attempt:
    events: list[dict] = field(default_factory=list)
    returncode: int | None = None
    stopped: str | None = None  # "step" | "lab-timeout" | "output" | "memory" | "interrupted"
    step: dict | None = None  # the last step the worker announced and did not finish
    output_bytes: int = 0
    output_tail: str = ""
    memory_cap: int | None = None

    @property
    def finished(self) -> bool:
        return any(e.get("event") == "done" for e in self.events)


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the worker and anything it started (ptxas, ...)
    except (ProcessLookupError, PermissionError, AttributeError):
        try:
            proc.kill()
        except ProcessLookupError:
            pass


def run_attempt(cmd: list[str], cwd: Path, progress: Path, deadline: float, opts: Options,
                env: dict | None = None) -> Attempt:
    """Run one worker command to its end, stopping it on the conditions in the module docstring."""
    proc = subprocess.Popen(cmd, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env=env, start_new_session=True)
    drain = _OutputTail(proc.stdout)
    drain.start()
    events = _Events(progress)
    attempt = Attempt(memory_cap=_memory_cap(None, opts))
    step_started = time.monotonic()
    try:
        while True:
            try:
                attempt.returncode = proc.wait(timeout=POLL_S)
            except subprocess.TimeoutExpired:
                attempt.returncode = None
            for event in events.poll():
                attempt.events.append(event)
                kind = event.get("event")
                if kind == "step":
                    attempt.step, step_started = event, time.monotonic()
                elif kind == "function":
                    attempt.step = None
                elif kind == "lab":
                    attempt.memory_cap = _memory_cap(event.get("limits"), opts)
            if attempt.returncode is not None:
                break
            now = time.monotonic()
            if STOP.is_set():
                attempt.stopped = "interrupted"
            elif now > deadline:
                attempt.stopped = "lab-timeout"
            elif attempt.step is not None and now - step_started > attempt.step["limit_s"]:
                attempt.stopped = "step"
            elif drain.total > opts.output_limit_mib * 2**20:
                attempt.stopped = "output"
            else:
                rss = rss_bytes(proc.pid)
                if rss is not None and rss > attempt.memory_cap:
                    attempt.stopped = "memory"
            if attempt.stopped:
                _kill(proc)
                attempt.returncode = proc.wait()
                break
    finally:
        if proc.poll() is None:  # an exception in this loop (KeyboardInterrupt): never leave a worker behind
            _kill(proc)
            proc.wait()
        drain.join(timeout=5)
        proc.stdout.close()
    attempt.events += events.poll()
    attempt.output_bytes, attempt.output_tail = drain.total, drain.text()
    return attempt


def death_reason(attempt: Attempt, opts: Options) -> str:
    """Why a worker did not finish, in words a student can act on."""
    if attempt.stopped == "step":
        return (f"did not finish within {attempt.step['limit_s']:g} s: an infinite loop, or a kernel that "
                "never ends?")
    if attempt.stopped == "lab-timeout":
        return f"timed out after {opts.timeout:.0f} s (an infinite loop or a hung kernel?)"
    if attempt.stopped == "output":
        return (f"printed more than {opts.output_limit_mib:g} MiB (print inside a loop?); the grading process "
                "was stopped")
    if attempt.stopped == "memory":
        return (f"used more than {attempt.memory_cap / 2**30:.1f} GiB of host memory; the grading process was "
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
    return (f"the grading process exited with code {rc} before it finished: does the code end the process "
            f"(os._exit, exit in a thread)?{tail}")


# --------------------------------------------------------------------------------------------------
# One lab


def _error_function(fn_spec, seed: int, message: str) -> dict:
    from grading import harness

    return harness.error_result(fn_spec, seed, "error", message)


def _worker_env(opts: Options) -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    from kernels import runtime
    if opts.cpu or not runtime.ON_GPU:
        env["OMP_NUM_THREADS"] = "1"  # the interpreter is single-threaded; more OpenMP threads only contend
    return env


def grade_lab(notebook: Path, lab_id: str, seed: int, opts: Options, source: Path | None = None) -> dict:
    """Grade one notebook; always returns a lab result (never raises for anything the student did)."""
    from grading.labs import get_lab
    from grading.notebooks import source_path_for

    spec = get_lab(lab_id)
    notebook = notebook.resolve()
    source = (source or source_path_for(notebook, lab_id)).resolve()
    lab = {"lab": lab_id, "title": spec.title, "notebook": str(notebook), "source": str(source), "seed": seed,
           "notes": [], "incidents": [], "functions": []}
    if not source.exists():
        lab["error"] = f"the lab's source notebook {source} does not exist"
        lab["functions"] = [_error_function(f, seed, lab["error"]) for f in spec.functions]
        return lab
    done: dict[str, dict] = {}
    started = time.monotonic()
    deadline = started + opts.timeout
    env = _worker_env(opts)
    with tempfile.TemporaryDirectory(prefix=f"grading-{lab_id}-") as tmp:
        progress = Path(tmp) / "progress.jsonl"
        while len(done) < len(spec.functions):
            progress.write_text("")
            cmd = [sys.executable, "-m", "grading.worker", "--notebook", str(notebook), "--source", str(source),
                   "--lab", lab_id, "--seed", str(seed), "--progress", str(progress),
                   "--skip", ",".join(done), *opts.worker_args()]
            attempt = run_attempt(cmd, Path(tmp), progress, deadline, opts, env)
            for event in attempt.events:
                if event.get("event") == "lab" and "fingerprint" not in lab:
                    for key in ("title", "fingerprint", "notes", "locked_cells", "limits", "import_error"):
                        if key in event:
                            lab[key] = event[key]
                elif event.get("event") == "function":
                    done[event["result"]["name"]] = event["result"]
            if attempt.finished:
                break
            step = attempt.step
            if attempt.returncode == EXIT_CONTEXT_LOST and attempt.stopped is None:
                # The worker recorded the function itself (its last event) before leaving.
                last = [e["result"]["name"] for e in attempt.events if e.get("event") == "function"][-1:]
                lab["incidents"].append({"function": last[0] if last else None, "step": None,
                                         "reason": "the CUDA context was lost; the rest of the lab was graded in "
                                                   "a new process", "output_tail": ""})
                continue
            reason = death_reason(attempt, opts)
            fn = step.get("function") if step else None
            lab["incidents"].append({"function": fn, "step": step["step"] if step else None, "reason": reason,
                                     "output_tail": attempt.output_tail[-2000:]})
            if attempt.stopped in ("interrupted", "lab-timeout") or fn is None or fn in done:
                where = f" ({step['step']})" if step else ""
                lab["error"] = reason if attempt.stopped in ("interrupted", "lab-timeout") else f"{reason}{where}"
                if attempt.stopped == "interrupted":
                    lab["interrupted"] = True
                for f in spec.functions:
                    if f.name not in done:
                        done[f.name] = _error_function(f, seed, lab["error"] if f.name != fn else f"{step['step']}: {reason}")
                break
            done[fn] = _error_function(spec.function(fn), seed, f"{step['step']}: {reason}")
    lab["functions"] = [done[f.name] for f in spec.functions]
    lab["elapsed_s"] = round(time.monotonic() - started, 2)
    return lab


def interrupted_lab(notebook: Path, lab_id: str, seed: int) -> dict:
    """The result of a lab that was never started because the run was interrupted."""
    from grading.labs import get_lab

    spec = get_lab(lab_id)
    reason = "not graded: the grading run was interrupted"
    return {"lab": lab_id, "title": spec.title, "notebook": str(notebook.resolve()), "seed": seed, "notes": [],
            "incidents": [], "error": reason, "interrupted": True,
            "functions": [_error_function(f, seed, reason) for f in spec.functions]}


def options_dict(opts: Options) -> dict:
    return asdict(opts)
