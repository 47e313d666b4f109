"""The parent side of grading (grading/runner.py), with stand-in worker processes: each stop condition
gives its reason, the whole process group goes, and a torn progress line is read once it is complete.

The host-memory watchdog is what guards a GPU worker (RLIMIT_AS cannot be used with CUDA); a CPU worker
has RLIMIT_AS as well. Here it is exercised on any machine, with a plain Python process.
"""
import os
import sys
import textwrap
import time
from pathlib import Path

import pytest

from grading.runner import Attempt, Options, _Events, death_reason, rss_bytes, run_attempt


def fake_worker(tmp_path: Path, body: str) -> tuple[list[str], Path]:
    """A Python process that writes progress events like grading.worker, then runs `body`."""
    progress = tmp_path / "progress.jsonl"
    progress.write_text("")
    script = tmp_path / "fake_worker.py"
    script.write_text(textwrap.dedent('''
        import json, os, sys, time
        progress = open(sys.argv[1], "a")
        def emit(**event):
            progress.write(json.dumps(event) + "\\n")
            progress.flush()
        def rss():
            for line in open("/proc/self/status"):
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        ''') + textwrap.dedent(body))
    return [sys.executable, str(script), str(progress)], progress


def run(tmp_path, body, **options) -> Attempt:
    cmd, progress = fake_worker(tmp_path, body)
    opts = Options(**options)
    return run_attempt(cmd, tmp_path, progress, time.monotonic() + 60, opts)


def test_finished_worker_reports_its_events(tmp_path):
    attempt = run(tmp_path, '''
        emit(event="step", function="add", step="case 1 float32", kind="call", limit_s=5)
        emit(event="function", result={"name": "add"})
        emit(event="done")
        ''')
    assert attempt.finished and attempt.returncode == 0 and attempt.stopped is None
    assert [e["event"] for e in attempt.events] == ["step", "function", "done"]


def test_a_step_past_its_limit_is_stopped(tmp_path):
    attempt = run(tmp_path, '''
        emit(event="step", function="add", step="case 7 float16", kind="call", limit_s=0.5)
        while True:
            pass
        ''')
    assert attempt.stopped == "step" and attempt.step["step"] == "case 7 float16"
    assert death_reason(attempt, Options()) == \
        "did not finish within 0.5 s: an infinite loop, or a kernel that never ends?"


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc (the watchdog reads it)")
def test_host_memory_watchdog_stops_a_worker_that_grows(tmp_path):
    """What stops a GPU worker that fills host memory: its resident size above baseline + cap."""
    attempt = run(tmp_path, '''
        emit(event="lab", limits={"host_rlimit": False, "baseline_rss": rss(), "baseline_vm": None})
        emit(event="step", function="add", step="case 1 float32", kind="call", limit_s=60)
        hog = []
        while True:
            hog.append(bytearray(64 << 20))  # zero-filled: really resident
            time.sleep(0.01)
        ''', memory_gib=0.25)
    assert attempt.stopped == "memory"
    assert death_reason(attempt, Options(memory_gib=0.25)).startswith("used more than 0.")
    assert "GiB of host memory; the grading process was stopped" in death_reason(attempt, Options())


def test_an_output_flood_is_stopped_and_only_its_tail_kept(tmp_path):
    attempt = run(tmp_path, '''
        emit(event="step", function="add", step="case 1 float32", kind="call", limit_s=60)
        while True:
            print("debug " * 100, flush=True)
        ''', output_limit_mib=1)
    assert attempt.stopped == "output" and attempt.output_bytes > 2**20
    assert len(attempt.output_tail) <= 4096 and "debug" in attempt.output_tail
    assert death_reason(attempt, Options(output_limit_mib=1)) == \
        "printed more than 1 MiB (print inside a loop?); the grading process was stopped"


def test_the_whole_process_group_is_stopped(tmp_path):
    marker = tmp_path / "child.pid"
    attempt = run(tmp_path, f'''
        import subprocess
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        open({str(marker)!r}, "w").write(str(child.pid))
        emit(event="step", function="add", step="case 1 float32", kind="call", limit_s=0.5)
        time.sleep(600)
        ''')
    assert attempt.stopped == "step"
    pid = int(marker.read_text())
    for _ in range(50):  # SIGKILL is delivered at once; reaping by init may take a moment
        if not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the worker's child {pid} survived")


def test_deaths_are_named(tmp_path):
    crashed = run(tmp_path, '''
        emit(event="step", function="add", step="case 1 float32", kind="call", limit_s=60)
        import ctypes
        ctypes.string_at(0)
        ''')
    assert crashed.returncode < 0
    assert death_reason(crashed, Options()) == \
        "the grading process crashed with SIGSEGV: an out-of-bounds memory access?"
    exited = run(tmp_path, '''
        print("last words")
        os._exit(0)
        ''')
    assert death_reason(exited, Options()) == ("the grading process exited with code 0 before it finished: does "
                                               "the code end the process (os._exit, exit in a thread)? "
                                               "(last output: last words)")


def test_lab_deadline(tmp_path):
    cmd, progress = fake_worker(tmp_path, "time.sleep(600)\n")
    attempt = run_attempt(cmd, tmp_path, progress, time.monotonic() + 0.5, Options(timeout=7))
    assert attempt.stopped == "lab-timeout"
    assert death_reason(attempt, Options(timeout=7)) == "timed out after 7 s (an infinite loop or a hung kernel?)"


def test_progress_lines_are_read_whole(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"event": "step", "st')
    events = _Events(path)
    assert events.poll() == []
    with open(path, "a") as f:
        f.write('ep": "x"}\n{"event": "done"}\n')
    assert events.poll() == [{"event": "step", "step": "x"}, {"event": "done"}]


def test_rss_of_this_process():
    if not Path("/proc/self/status").exists():
        assert rss_bytes(os.getpid()) is None
    else:
        assert rss_bytes(os.getpid()) > 10 * 2**20
    assert rss_bytes(2**22 + 12345) is None


def test_extra_credit_adds_points_and_never_lowers_the_grade():
    from grading.report import score_lab

    gpu = {"mode": "gpu"}
    forward = {"name": "forward", "status": "pass", "points": 10, "max_points": 10, "tier": "A"}
    backward = {"name": "backward", "status": "not implemented", "points": 0, "max_points": 5, "tier": None,
                "extra_credit": True}
    score = score_lab({"functions": [forward, backward], "fingerprint": gpu})
    assert (score["points"], score["max_points"], score["grade"]) == (10, 10, "A")
    done = {**backward, "status": "pass", "points": 5, "tier": "C"}  # a slow backward is still a bonus
    score = score_lab({"functions": [forward, done], "fingerprint": gpu})
    assert (score["points"], score["max_points"], score["grade"]) == (15, 10, "A")
    # the same missing function, not extra credit, costs the lab its points and its grade
    score = score_lab({"functions": [forward, {**backward, "extra_credit": False}], "fingerprint": gpu})
    assert (score["points"], score["max_points"], score["grade"]) == (10, 15, "F")
