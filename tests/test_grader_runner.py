"""The parent side of grading (grading/runner.py), with stand-in worker processes: each stop
condition gives its reason, the whole process group goes, a step's limit counts CPU time, and a
reply the student's code forges on the channel is ignored.

The host-memory watchdog is what guards a GPU worker (RLIMIT_AS cannot be used with CUDA); a CPU
worker has RLIMIT_AS as well. Here it is exercised on any machine, with a plain Python process.
"""
import os
import shutil
import socket
import sys
import textwrap
import time
from pathlib import Path

import pytest

from grading import sandbox
from grading.protocol import (
    WALL_FACTOR,
    Options,
    WorkerGone,
    WorkerProcess,
    cpu_seconds,
    death_reason,
    rss_bytes,
    stop_processes_below,
)
from kernels import runtime


def fake_worker(tmp_path: Path, body: str, opts: Options, deadline_s: float = 60,
                sandboxed: bool = False) -> WorkerProcess:
    """A Python process that answers requests as grading.worker does: `reply(**fields)` answers
    the request in `req`; `body` runs once per request."""
    script = tmp_path / "fake_worker.py"
    script.write_text(textwrap.dedent('''
        import json, os, sys, time
        requests = os.fdopen(int(sys.argv[sys.argv.index("--requests") + 1]), "r")
        replies = os.fdopen(int(sys.argv[sys.argv.index("--replies") + 1]), "w")
        def reply(**fields):
            replies.write(json.dumps({**fields, "id": req["id"]}) + "\\n")
            replies.flush()
        def rss():
            for line in open("/proc/self/status"):
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        for line in requests:
            req = json.loads(line)
        ''') + textwrap.indent(textwrap.dedent(body), "    "))
    return WorkerProcess([sys.executable, str(script)], tmp_path, time.monotonic() + deadline_s,
                         opts, sandbox=sandboxed)


def ask(tmp_path, body, limit_s: float = 60, **options) -> tuple[WorkerProcess, dict | WorkerGone]:
    opts = Options(call_timeout=limit_s, **options)
    worker = fake_worker(tmp_path, body, opts)
    worker.set_step("add", "case 7 float16")
    try:
        return worker, worker.request({"op": "call"})
    except WorkerGone as gone:
        return worker, gone
    finally:
        worker.close()


def test_a_worker_answers_requests(tmp_path):
    _, answer = ask(tmp_path, "reply(ok=True)\n")
    assert answer["ok"] is True


def test_a_forged_reply_is_ignored(tmp_path):
    """Only the reply with the request's id counts: a line the student's code writes does not."""
    _, answer = ask(tmp_path, '''
        replies.write(json.dumps({"id": req["id"] + 1, "ok": "forged"}) + "\\n")
        reply(ok=True)
        ''')
    assert answer["ok"] is True


def test_what_a_worker_wrote_before_it_exited_is_read_even_after_it_is_gone(tmp_path):
    """A worker that writes a reply and exits before the request is sent: the request's write
    fails (no reader), and the reply is still read, then the death. Whether the worker died
    before or after the write must not change the verdict (lab 01's forged_replies_then_exit)."""
    script = tmp_path / "writes_then_exits.py"
    script.write_text(textwrap.dedent('''
        import json, os, sys
        replies = int(sys.argv[sys.argv.index("--replies") + 1])
        line = json.dumps({"id": 1, "ok": "written before it exited"}) + "\\n"
        os.write(replies, line.encode())
        os._exit(0)
        '''))
    worker = WorkerProcess([sys.executable, str(script)], tmp_path, time.monotonic() + 60,
                           Options(call_timeout=60))
    try:
        worker.set_step("add", "case 1 float32")
        assert worker.proc.wait(timeout=60) == 0  # gone before the request is written
        assert worker.request({"op": "call"})["ok"] == "written before it exited"
        with pytest.raises(WorkerGone):
            worker.request({"op": "call"})
    finally:
        worker.close()


def test_a_step_past_its_cpu_time_is_stopped(tmp_path):
    _, gone = ask(tmp_path, "while True:\n    pass\n", limit_s=0.5)
    assert isinstance(gone, WorkerGone) and gone.attempt.stopped == "step"
    assert gone.attempt.step["step"] == "case 7 float16" and not gone.attempt.wall
    assert death_reason(gone.attempt, Options()) == \
        "did not finish within 0.5 s of CPU time: an infinite loop, or a kernel that never ends?"


def test_a_step_that_sleeps_is_stopped_by_the_wall_clock(tmp_path):
    started = time.monotonic()
    _, gone = ask(tmp_path, "time.sleep(600)\n", limit_s=0.5)
    assert gone.attempt.stopped == "step" and gone.attempt.wall
    assert time.monotonic() - started < 30
    assert death_reason(gone.attempt, Options()) == (
        f"did not finish within {WALL_FACTOR * 0.5:g} s: an infinite loop, or a kernel that "
        f"never ends?")


def test_waiting_costs_a_step_no_cpu_time(tmp_path):
    """A step's limit is CPU time: a worker that shares the machine is not stopped for waiting."""
    _, answer = ask(tmp_path, "time.sleep(1.0)\nreply(ok=True)\n", limit_s=0.5)
    assert answer["ok"] is True  # 1 s of wall clock, ~0 s of CPU, under the 1.5 s backstop


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_host_memory_watchdog_stops_a_worker_that_grows(tmp_path):
    """What stops a GPU worker that fills host memory: its resident size above baseline + cap."""
    opts = Options(memory_gib=0.25)
    worker = fake_worker(tmp_path, '''
        hog = []
        while True:
            hog.append(bytearray(64 << 20))  # zero-filled: really resident
            time.sleep(0.01)
        ''', opts)
    worker.attempt.memory_cap = int(rss_bytes(worker.pid) + 0.25 * 2**30 + 2**29)
    worker.set_step("add", "case 1 float32")
    with pytest.raises(WorkerGone) as gone:
        worker.request({"op": "call"})
    worker.close()
    assert gone.value.attempt.stopped == "memory"
    assert death_reason(gone.value.attempt, opts).startswith("used more than 0.")
    assert "GiB of host memory; the grading process was stopped" in \
        death_reason(gone.value.attempt, opts)


def test_an_output_flood_is_stopped_and_only_its_tail_kept(tmp_path):
    _, gone = ask(tmp_path, '''
        while True:
            print("debug " * 100, flush=True)
        ''', output_limit_mib=1)
    attempt = gone.attempt
    assert attempt.stopped == "output" and attempt.output_bytes > 2**20
    assert len(attempt.output_tail) <= 4096 and "debug" in attempt.output_tail
    assert death_reason(attempt, Options(output_limit_mib=1)) == \
        "printed more than 1 MiB (print inside a loop?); the grading process was stopped"


def _gone(pid: int) -> bool:
    for _ in range(50):  # SIGKILL is delivered at once; reaping by init may take a moment
        try:
            if "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]:
                return True
        except OSError:  # no such process (any more)
            return True
        time.sleep(0.1)
    return False


def test_the_whole_process_group_is_stopped(tmp_path):
    marker = tmp_path / "child.pid"
    _, gone = ask(tmp_path, f'''
        import subprocess
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        open({str(marker)!r}, "w").write(str(child.pid))
        time.sleep(600)
        ''', limit_s=0.5)
    assert gone.attempt.stopped == "step"
    pid = int(marker.read_text())
    assert _gone(pid), f"the worker's child {pid} survived"


def test_a_process_left_running_under_the_audit_is_stopped_and_ncu_ends(tmp_path):
    """The kernel audit runs the worker under ncu, which waits for every process below it: a process
    the student's code started and left running kept it from ending (on the H200, every function
    failed after a 120 s wait). A stand-in named ncu waits the same way (a child subreaper);
    stop_processes_below stops the leftover, not ncu, which then ends on its own."""
    ncu = tmp_path / "ncu"
    ncu.write_text(f"#!{sys.executable}\n" + textwrap.dedent('''
        import ctypes, os, subprocess, sys
        ctypes.CDLL(None).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER: orphans below are reparented here
        subprocess.Popen(sys.argv[1:], close_fds=False)
        while True:
            try:
                os.wait()
            except ChildProcessError:
                break
        '''))
    ncu.chmod(0o755)
    marker = tmp_path / "left.pid"
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(f'''
        import json, os, subprocess, sys
        requests = os.fdopen(int(sys.argv[sys.argv.index("--requests") + 1]), "r")
        replies = os.fdopen(int(sys.argv[sys.argv.index("--replies") + 1]), "w")
        for line in requests:
            left = subprocess.Popen(["setsid", "sleep", "600"])
            open({str(marker)!r}, "w").write(str(left.pid))
            replies.write(json.dumps({{"id": json.loads(line)["id"]}}) + "\\n")
            replies.flush()
        '''))
    worker = WorkerProcess([sys.executable, str(script)], tmp_path, time.monotonic() + 60,
                           Options(call_timeout=30), prefix=[str(ncu)])
    try:
        worker.set_step(None, "kernel audit")
        worker.request({"op": "mark"})
        assert worker.finish(timeout=3) is None, "the stand-in ended with a process left below it"
        assert stop_processes_below(worker.pid, keep="ncu") == 1
        assert worker.finish(timeout=30) == 0  # ncu itself was not stopped: it ended
        assert _gone(int(marker.read_text()))
    finally:
        worker.close()


@pytest.mark.skipif(not sandbox.status()[0], reason="bubblewrap cannot run here")
def test_the_sandbox_leaves_no_process_and_no_file_behind(tmp_path):
    """In bubblewrap a child that leaves the worker's session (setsid) still goes with it, and
    the course cannot be written (nor anything outside the worker's folder)."""
    work = tmp_path / "work"
    work.mkdir()
    target = Path(__file__).resolve().parents[1] / "grading" / "harness.py"
    before = target.read_bytes()
    heartbeat = work / "heartbeat"
    worker = fake_worker(work, f'''
        import subprocess
        # The child leaves the worker's session and writes a heartbeat into the worker's folder
        # until it is killed; watching the file needs no view of the sandbox's process table.
        beat = "while :; do date +%s%N > heartbeat; sleep 0.05; done"
        subprocess.Popen(["setsid", "sh", "-c", beat])
        try:
            open({str(target)!r}, "a").write("# tampered")
            wrote = "yes"
        except OSError as exc:
            wrote = type(exc).__name__
        reply(wrote=wrote, uid=os.getuid())
        ''', Options(), sandboxed=True)
    worker.set_step("add", "case 1 float32")
    answer = worker.request({"op": "call"})
    assert _wait_for(heartbeat.exists), "the child never started"
    worker.close()
    assert answer["wrote"] == "OSError" and target.read_bytes() == before
    assert _wait_for(lambda: _beats_stopped(heartbeat)), "the worker's child outlived the sandbox"


@pytest.mark.skipif(not sandbox.status()[0], reason="bubblewrap cannot run here")
def test_the_sandbox_shows_no_secret_and_no_host_socket(tmp_path):
    """Inside the sandbox the answer key, the course's history, a report folder (the partial
    report holds every lab's seed), the home folder and a UNIX socket the host listens on are out
    of reach; the course and the Python running the grader are there."""
    course = Path(__file__).resolve().parents[1]
    reports = course / "build" / f"reports-{os.getpid()}"  # a report folder inside the course
    reports.mkdir(parents=True)
    (reports / "report.json").write_text('{"labs": [{"seed": 1234}]}')
    socket_path = Path.home() / f".grading-test-{os.getpid()}.sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(socket_path))
    server.listen()
    try:
        worker = fake_worker(tmp_path, f'''
            import socket
            from pathlib import Path
            course = Path({str(course)!r})
            def look(path):
                try:
                    return sorted(p.name for p in Path(path).iterdir())
                except OSError as exc:
                    return type(exc).__name__
            client = socket.socket(socket.AF_UNIX)
            try:
                client.connect({str(socket_path)!r})
                connected = "yes"
            except OSError as exc:
                connected = type(exc).__name__
            reply(solutions=look(course / "solutions"), reports=look({str(reports)!r}),
                  home=look({str(Path.home())!r}), connected=connected,
                  grading="protocol.py" in look(course / "grading"))
            ''', Options(private=(str(reports),)), sandboxed=True)
        worker.set_step("add", "case 1 float32")
        answer = worker.request({"op": "call"})
        worker.close()
    finally:
        server.close()
        socket_path.unlink()
        shutil.rmtree(reports)
    assert answer["grading"] is True
    assert answer["solutions"] == [] and answer["reports"] == []
    # of the home folder, at most the folders that hold the Python running the grader
    pythons = [Path(p) for p in sandbox.python_paths()]
    assert answer["home"] == "FileNotFoundError" or all(
        any(p.is_relative_to(Path.home() / name) for p in pythons) for name in answer["home"])
    assert answer["connected"] in ("FileNotFoundError", "ConnectionRefusedError"), answer


@pytest.mark.gpu
def test_the_gpu_sandbox_runs_cuda_and_triton_and_hides_the_answer_key(tmp_path):
    """On a GPU the sandbox shows only the system, Python and the course: CUDA, PyTorch and a
    freshly compiled Triton kernel still work there, and solutions/ is still empty."""
    assert sandbox.status()[0], "bubblewrap cannot run here: make sandbox"
    course = Path(__file__).resolve().parents[1]
    worker = fake_worker(tmp_path, f'''
        import torch
        import triton
        import triton.language as tl

        @triton.jit
        def store_one(p):
            tl.store(p, 1.0)

        x = torch.zeros(1, device="cuda")
        store_one[(1,)](x)
        reply(value=float(x.item()), solutions=os.listdir({str(course / "solutions")!r}))
        ''', Options(), sandboxed=True)
    worker.set_step("add", "case 1 float32", "import")
    try:
        answer = worker.request({"op": "call"})
    finally:
        worker.close()
    assert answer == {"value": 1.0, "solutions": [], "id": 1}, answer


@pytest.mark.skipif(not sandbox.status()[0], reason="bubblewrap cannot run here")
def test_the_sandbox_s_shared_memory_counts_against_the_memory_limit(tmp_path):
    """/dev/shm and /tmp are memory: a worker may not fill them past --memory-gib."""
    worker = fake_worker(tmp_path, '''
        try:
            with open("/dev/shm/hoard", "wb") as f:
                for _ in range(96):
                    f.write(b"x" * 2**20)
            wrote = "yes"
        except OSError as exc:
            wrote = type(exc).__name__
        reply(wrote=wrote)
        ''', Options(memory_gib=1 / 16), sandboxed=True)  # 64 MiB
    worker.set_step("add", "case 1 float32")
    try:
        answer = worker.request({"op": "call"})
    except WorkerGone as gone:
        assert gone.attempt.stopped == "memory"
    else:
        assert answer["wrote"] == "OSError", answer
    finally:
        worker.close()


@pytest.mark.parametrize("planted", ["fifo", "huge", "link"])
def test_a_planted_record_is_refused_without_waiting_or_reading_it_whole(tmp_path, planted):
    """The record a reply names is the student's code's file: a pipe (opening it would block the
    grader outside every watchdog), a file larger than the call's tensors could fill (it would be
    loaded whole into the grader's memory) or a link is refused as a forged reply."""
    import torch

    from grading.labs import get_lab
    from grading.protocol import WorkerCaller, WorkerReplyError

    worker = fake_worker(tmp_path, f'''
        name = "record-planted.pt"
        if {planted!r} == "fifo":
            os.mkfifo(name)
        elif {planted!r} == "huge":
            with open(name, "wb") as f:
                f.truncate(512 * 2**20)
        else:
            os.symlink("/etc/hostname", name)
        reply(record=name)
        ''', Options())
    spec = get_lab("01_elementwise_add").function("add")
    caller = WorkerCaller(worker, tmp_path, "add")
    started = time.monotonic()
    try:
        with pytest.raises(WorkerReplyError, match="regular file|more than|cannot be opened"):
            caller.call_allocating(spec, spec.cases[0], (torch.ones(3), torch.ones(3)))
    finally:
        worker.close()
    assert time.monotonic() - started < 10


def _wait_for(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


def _beats_stopped(heartbeat: Path) -> bool:
    """No new beat within 0.5 s, ten times the child's period."""
    first = heartbeat.read_text()
    time.sleep(0.5)
    return heartbeat.read_text() == first


def test_the_audit_s_caches_are_copied_from_the_worker_without_following_its_links(tmp_path):
    """The kernel audit's worker starts with the graded worker's compiled kernels. That folder is
    the student's code's: a link is copied as a link (never followed by the grader), and a pipe,
    which copying would block on, is left out."""
    graded = tmp_path / "graded"
    (graded / ".triton" / "abc").mkdir(parents=True)
    (graded / ".triton" / "abc" / "add_kernel.cubin").write_bytes(b"\x7fELF cubin")
    (graded / ".triton" / "secret").symlink_to("/etc/hostname")
    os.mkfifo(graded / ".cupy")  # not even a folder: skipped
    os.mkfifo(graded / ".triton" / "abc" / "pipe")
    audit = tmp_path / "audit"
    audit.mkdir()
    sandbox.seed_caches(audit, from_worker=graded)
    assert (audit / ".triton" / "abc" / "add_kernel.cubin").read_bytes() == b"\x7fELF cubin"
    assert (audit / ".triton" / "secret").is_symlink()
    assert not (audit / ".triton" / "abc" / "pipe").exists()
    assert not (audit / ".cupy").exists()


def test_deaths_are_named(tmp_path):
    _, crashed = ask(tmp_path, '''
        import ctypes
        ctypes.string_at(0)
        ''')
    assert crashed.attempt.returncode < 0
    assert death_reason(crashed.attempt, Options()) == \
        "the grading process crashed with SIGSEGV: an out-of-bounds memory access?"
    _, exited = ask(tmp_path, '''
        print("last words")
        os._exit(0)
        ''')
    assert death_reason(exited.attempt, Options()) == (
        "the grading process exited with code 0 before it finished: does the code end the "
        "process (os._exit, exit in a thread)? (last output: last words)")


def test_lab_deadline(tmp_path):
    worker = fake_worker(tmp_path, "time.sleep(600)\n", Options(timeout=7), deadline_s=0.5)
    with pytest.raises(WorkerGone) as gone:
        worker.request({"op": "call"})
    worker.close()
    assert gone.value.attempt.stopped == "lab-timeout"
    assert death_reason(gone.value.attempt, Options(timeout=7)) == \
        "timed out after 7 s (an infinite loop or a hung kernel?)"


def test_rss_and_cpu_time_of_this_process():
    if not Path("/proc/self/status").exists():
        assert rss_bytes(os.getpid()) is None and cpu_seconds(os.getpid()) is None
    else:
        assert rss_bytes(os.getpid()) > 10 * 2**20
        assert cpu_seconds(os.getpid()) > 0
    assert rss_bytes(2**22 + 12345) is None and cpu_seconds(2**22 + 12345) is None


def test_extra_credit_adds_points_and_never_lowers_the_grade():
    from grading.report import score_lab

    gpu = {"mode": "gpu"}
    forward = {"name": "forward", "status": "pass", "points": 10, "max_points": 10, "tier": "A"}
    backward = {"name": "backward", "status": "not implemented", "points": 0, "max_points": 5,
                "tier": None,
                "extra_credit": True}
    score = score_lab({"functions": [forward, backward], "fingerprint": gpu})
    assert (score["points"], score["max_points"], score["grade"]) == (10, 10, "A")
    done = {**backward, "status": "pass", "points": 5, "tier": "C"}  # slow, but still a bonus
    score = score_lab({"functions": [forward, done], "fingerprint": gpu})
    assert (score["points"], score["max_points"], score["grade"]) == (15, 10, "A")
    # the same missing function, not extra credit, costs the lab its points and its grade
    required = {**backward, "extra_credit": False}
    score = score_lab({"functions": [forward, required], "fingerprint": gpu})
    assert (score["points"], score["max_points"], score["grade"]) == (10, 15, "F")


def test_a_bug_in_the_parent_s_checks_is_the_grader_s(tmp_path, monkeypatch):
    """An exception in the verdict (here: the judge itself made to fail) is reported as the
    grader's for that function only; the lab's other functions are still graded."""
    from grading import correctness
    from grading.runner import grade_lab
    from tests.test_grader_lab01 import LAB, write_submission

    notebook = write_submission(tmp_path / "student")
    original = correctness.judge

    def judge(j):
        if j.spec.name == "add":
            raise IndexError("the judge's own bug")
        return original(j)

    monkeypatch.setattr(correctness, "judge", judge)
    opts = Options(cpu=not runtime.ON_GPU, perf=False)  # this process's mode: it makes the inputs
    lab = grade_lab(notebook, LAB.removesuffix("_lab.ipynb"), 5, opts)
    functions = {f["name"]: f for f in lab["functions"]}
    assert functions["add"]["status"] == "error"
    assert "the grader failed (a bug in the grader, not in your code): IndexError: the judge's " \
           "own bug" in functions["add"]["message"]
    assert functions["residual_add"]["status"] == "pass", functions["residual_add"]["message"]
