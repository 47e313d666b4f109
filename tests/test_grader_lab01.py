"""The grader grades itself: the reference solution gets full marks, the untouched lab gets zero,
and every known-wrong submission in the corpus (tests/grader_corpus_lab01.py) is caught with the
reason a student can act on -- in the mode this runs in. GPU-only failures are asserted as the CPU
sees them on a CPU (see `Submission.cpu`), and as the GPU sees them on a GPU:

    KERNELS_MODE=gpu python -m pytest tests/test_grader_lab01.py tests/test_grader_runner.py
    tests/test_grader_harness.py

Everything is graded the way an instructor would: `python -m grading` in a subprocess (on a GPU,
two runs: the kernel audit's where it decides a verdict, the rest without it; see AUDITED).
"""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import nbformat
import pytest

from grading import sandbox
from grading.notebooks import LABS_DIR, SOLUTIONS_DIR, grade_id, role
from grading.protocol import CALL_PARTS
from grading.runner import IN_GRADER
from kernels import runtime
from tests.grader_corpus_lab01 import (
    CORPUS,
    LINKED,
    MALFORMED,
    OUTSIDE_CORPUS,
    PERF_CORPUS,
    Submission,
    add_cell,
)

LAB = "01_elementwise_add_lab.ipynb"
LAB_ID = "01_elementwise_add"
CUPY_STATUS = "pass" if runtime.cupy_status()[0] else "needs a GPU"
SCHEMA = json.loads(
    (Path(__file__).resolve().parents[1] / "grading" / "report.schema.json").read_text()
)
# Every correct step takes well under a second on a CPU once the worker has warmed up (a GPU step
# may compile a kernel or start the profiler): these limits are generous for it and short for the
# hangs.
CALL_TIMEOUT = runtime.pick(gpu=30, cpu=10)
# Host memory: 2 GiB on top of the worker's own on a CPU (RLIMIT_AS); on a GPU the parent watches
# the resident size, which the profiler and kernel compilation raise, so it gets more room there.
# "--sandbox auto": bubblewrap where it works, also for --submissions (which requires it by
# default), so the self-tests run on a machine without it; the sandbox's own tests require it.
LIMITS = [
    "--sandbox",
    "auto",
    "--call-timeout",
    str(CALL_TIMEOUT),
    "--memory-gib",
    str(runtime.pick(gpu=8, cpu=2)),
    "--gpu-memory-fraction",
    "0.3",
]


def tree_hash(folder: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        h.update(str(p.relative_to(folder)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


def write_submission(folder: Path, submission: Submission | None = None, name: str = LAB) -> Path:
    """What a student hands in: the lab (with its nbgrader checksums) with the solution's code in
    the solution cells, then the submission's edits."""
    submission = submission or Submission()
    lab = nbformat.read(LABS_DIR / LAB, as_version=4)
    solution = {
        grade_id(c): c.source
        for c in nbformat.read(SOLUTIONS_DIR / LAB, as_version=4).cells
        if grade_id(c)
    }
    lab.cells = [c for c in lab.cells if grade_id(c) not in submission.delete]
    for cell in lab.cells:
        gid = grade_id(cell)
        if role(cell) == "solution":
            cell.source = solution[gid]
        if gid in submission.cells:
            cell.source = submission.cells[gid]
    folder.mkdir(parents=True)
    path = folder / name
    nbformat.write(lab, path)
    return path


def grade(*args, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "grading", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def strict_json(path: Path):
    def reject(constant):
        raise ValueError(f"{path.name} is not strict JSON: {constant}")

    return json.loads(path.read_text(), parse_constant=reject)


def audit_decides(submission: Submission) -> bool:
    """Whether the kernel audit can change this submission's verdicts on a GPU: an honest one (the
    audit must not fail it) or one that only the audit catches."""
    expected = submission.expected(True).values()
    return all(s == "pass" for s, _ in expected) or any("kernel audit" in p for _, p in expected)


# On a GPU each lab's passing functions are called again under Nsight Compute, in a worker of its
# own (grading/kernel_audit.py): over the whole corpus that is most of the fixture's time, and for
# most submissions it audits again the residual_add that the solution's audit covers. So on a GPU
# the audit runs where it decides something, in a run of its own, and the rest are graded without
# it, more at a time. A CPU has no audit: one run.
AUDITED = {"solution"} | {name for name, s in CORPUS.items() if audit_decides(s)}


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """Grade every submission with `python -m grading`, as an instructor would."""
    root = tmp_path_factory.mktemp("submissions")
    folders = {"solution": root / "solution", "lab": root / "lab"}
    write_submission(folders["solution"])
    folders["lab"].mkdir()
    (folders["lab"] / LAB).write_bytes((LABS_DIR / LAB).read_bytes())
    for name, submission in CORPUS.items():
        folders[name] = root / name
        write_submission(folders[name], submission)
    for name, (edit, _) in MALFORMED.items():
        folders[name] = root / name
        folders[name].mkdir()
        notebook = json.loads((LABS_DIR / LAB).read_text())
        edit(notebook)
        (folders[name] / LAB).write_text(json.dumps(notebook))
    for name in LINKED:
        folders[name] = root / name
        folders[name].mkdir()
        (folders[name] / LAB).symlink_to(SOLUTIONS_DIR / LAB)
    before = tree_hash(root)
    runs = [(list(folders), ["--jobs", "2"])]
    if runtime.ON_GPU:
        runs = [
            ([n for n in folders if n not in AUDITED], ["--jobs", "4", "--no-kernel-audit"]),
            ([n for n in folders if n in AUDITED], ["--jobs", "2"]),
        ]
    graded = {"labs": {}, "seconds": []}
    for names, options in runs:
        out = tmp_path_factory.mktemp("report")
        started = time.monotonic()
        proc = grade(*(folders[n] for n in names), "--out", out, "--seed", "1234", *options,
                     "--no-perf", "--explain", *LIMITS)  # fmt: skip
        graded["seconds"].append(round(time.monotonic() - started, 1))
        assert proc.returncode == 0, proc.stderr[-3000:]
        report = strict_json(out / "report.json")
        graded["labs"].update({Path(lab["notebook"]).parent.name: lab for lab in report["labs"]})
        if "report" not in graded:  # the first run's: it holds every failing submission
            graded.update(report=report, out=out, stdout=proc.stdout)
    print(f"lab 01 corpus graded in {graded['seconds']} s (runs: {[len(n) for n, _ in runs]} labs)")
    graded["unchanged"] = before == tree_hash(root)
    return graded


def functions(lab):
    return {f["name"]: f for f in lab["functions"]}


def test_solution_gets_full_marks(graded):
    lab = graded["labs"]["solution"]
    fs = functions(lab)
    assert fs["add"]["status"] == "pass" and fs["residual_add"]["status"] == "pass"
    assert fs["add_vectorized"]["status"] == CUPY_STATUS
    assert lab["score"]["points"] == lab["score"]["max_points"] > 0
    assert not lab["notes"] and not lab["incidents"] and "error" not in lab
    assert all(c["status"] == "ok" and c["checksum_ok"] for c in lab["locked_cells"])
    if runtime.ON_GPU:  # Nsight Compute listed each passed function's kernels: its own alone
        audit = lab["kernel_audit"]
        assert "error" not in audit, audit
        for name in ("add", "residual_add"):
            assert f"{name}_kernel" in audit["functions"][name]["kernels"], audit
            assert not audit["functions"][name]["library"], audit
    else:
        assert "kernel_audit" not in lab


def test_untouched_lab_gets_zero(graded):
    lab = graded["labs"]["lab"]
    assert lab["score"]["points"] == 0
    assert all(f["status"] in ("not implemented", "needs a GPU") for f in lab["functions"])
    assert "solution cell add is unchanged from the lab (not attempted)" in lab["notes"]


@pytest.mark.parametrize(
    "name", sorted(CORPUS), ids=lambda n: n + ("[gpu-only]" if CORPUS[n].gpu_only else "")
)
def test_corpus_submission_is_classified(graded, name):
    """Status and reason per function, in this mode. `[gpu-only]`: on a CPU this asserts what the
    interpreter shows instead (the submission's `cpu` expectations), on a GPU the real failure."""
    submission = CORPUS[name]
    lab = graded["labs"][name]
    fs = functions(lab)
    for function, (status, phrase) in submission.expected(runtime.ON_GPU).items():
        assert fs[function]["status"] == status, (function, fs[function]["message"])
        assert phrase in fs[function]["message"], fs[function]["message"]
    for phrase in submission.notes:
        assert any(phrase in note for note in lab["notes"]), lab["notes"]
    if submission.diagnosis:
        assert any(submission.diagnosis in f["message"] for f in lab["functions"])
    if any(status != "pass" for status, _ in submission.expected(runtime.ON_GPU).values()):
        assert lab["score"]["points"] < lab["score"]["max_points"]
    else:
        assert lab["score"]["points"] == lab["score"]["max_points"]


@pytest.mark.parametrize("name", sorted(MALFORMED) + sorted(LINKED))
def test_refused_notebook_gets_zero_with_its_reason_and_the_full_maximum(graded, name):
    lab = graded["labs"][name]
    phrase = MALFORMED[name][1] if name in MALFORMED else LINKED[name]
    assert lab["score"]["points"] == 0
    assert lab["score"]["max_points"] == graded["labs"]["solution"]["score"]["max_points"]
    for f in lab["functions"]:
        if f["status"] != "needs a GPU":
            assert f["status"] == "error" and phrase in f["message"], f["message"]
            assert "the grader failed" not in f["message"]


def test_every_failure_says_why(graded):
    for name, lab in graded["labs"].items():
        for f in lab["functions"]:
            if f["status"] in ("fail", "error"):
                assert f["message"].strip(), (name, f["name"])
            for case in f["cases"]:
                assert case["ok"] or case["reason"], (name, f["name"], case["case"])


def test_reports_follow_the_schema(graded):
    jsonschema.validate(graded["report"], SCHEMA)
    assert graded["report"]["partial"] is False
    assert graded["report"]["fingerprint"]["torch"] and graded["report"]["grader_version"]
    # the report folder, where the partial report with every seed lies, is hidden from the workers
    assert graded["report"]["options"]["private"] == [str(graded["out"].resolve())]


def test_each_lab_says_where_its_time_went(graded):
    """The workers' seconds by phase: importing always, the cases wherever a function ran; they
    sum to no more than the lab's time."""
    solution = graded["labs"]["solution"]
    seconds = solution["seconds"]
    assert set(seconds) <= {"worker start and import", "correctness", "performance"}, seconds
    assert seconds["worker start and import"] > 0 and seconds["correctness"] > 0, seconds
    assert sum(seconds.values()) <= solution["elapsed_s"] + 0.05, (seconds, solution["elapsed_s"])
    # The correctness phase by part: every part the worker's calls pass through, summing to it.
    parts = solution["correctness_seconds"]
    assert set(CALL_PARTS.values()) - {CALL_PARTS["other"]} <= set(parts), parts
    assert all(parts[p] > 0 for p in (CALL_PARTS["first"], CALL_PARTS["send"], IN_GRADER)), parts
    assert abs(sum(parts.values()) - seconds["correctness"]) < 0.05, (parts, seconds)


def test_grader_never_writes_into_student_folders(graded):
    assert graded["unchanged"]


def test_markdown_report_lists_failures_with_worst_index(graded):
    text = (graded["out"] / "report.md").read_text()
    assert "| 01_elementwise_add |" in text and "worst index" in text and "first bad index" in text
    assert "incident in add / case 1 float32: did not finish within" in text


def test_explain_prints_the_inputs_and_worst_elements(graded):
    out = graded["stdout"]
    start = out.index("cases fail; first: 98765 float32")
    block = out[start : start + 2000]
    assert "input a: float32 shape (98765,) stride (1,)" in block
    assert "worst elements:" in block and "first wrong elements:" in block
    assert [line.split()[:3] for line in block.splitlines() if line.strip().startswith("index")][
        0
    ] == ["index", "a", "b"]
    first_bad = block[block.index("first wrong elements:") :].splitlines()[2].split()
    assert first_bad[0] == "98304" and first_bad[-1] == "nan"


def test_lab_timeout_costs_that_lab_only(tmp_path):
    """The wall-clock limit of a whole lab (here: hung while importing its solution cells)."""
    hang = write_submission(
        tmp_path / "hang", Submission({"add": "import time\ntime.sleep(600)\n"})
    )
    proc = grade(hang.parent, "--out", tmp_path / "report", "--timeout", "6", "--seed", "1")
    assert proc.returncode == 0, proc.stderr[-2000:]
    [lab] = strict_json(tmp_path / "report" / "report.json")["labs"]
    assert lab["error"] == "timed out after 6 s (an infinite loop or a hung kernel?)"
    assert all(f["status"] in ("error", "needs a GPU") for f in lab["functions"])
    assert lab["score"]["points"] == 0


# --------------------------------------------------------------------------------------------------
# The instructor's workflow


def _students(root: Path) -> None:
    write_submission(root / "alice")
    write_submission(root / "bob", CORPUS["wrong_on_tail"])
    (root / "carol" / "work").mkdir(parents=True)  # a renamed copy of the stub, one level down
    (root / "carol" / "work" / f"{LAB_ID}_lab (1).ipynb").write_bytes((LABS_DIR / LAB).read_bytes())
    (root / "dave").mkdir()  # handed in nothing


def test_submissions_summary_and_resume(tmp_path):
    root, out = tmp_path / "submissions", tmp_path / "reports"
    _students(root)
    before = tree_hash(root)
    first = grade(
        "--submissions",
        root,
        "--out",
        out,
        "--seed",
        "7",
        "--jobs",
        "2",
        "--no-perf",
        "--json",
        *LIMITS,
    )
    assert first.returncode == 0, first.stderr[-2000:]
    summary = json.loads(first.stdout)
    assert summary == strict_json(out / "summary.json")
    jsonschema.validate(summary, SCHEMA)
    rows = {row["student"]: row for row in summary["students"]}
    assert summary["labs"] == [LAB_ID] and set(rows) == {"alice", "bob", "carol", "dave"}
    assert rows["alice"]["points"] == rows["alice"]["max_points"] > 0
    bob_functions = strict_json(out / "students" / "bob" / "report.json")["labs"][0]["functions"]
    assert 0 < rows["bob"]["points"] < rows["bob"]["max_points"], [
        (f["name"], f["status"], f["message"][:300]) for f in bob_functions
    ]
    assert rows["carol"]["points"] == 0 and rows["carol"]["labs"][LAB_ID]["status"] == "graded"
    assert rows["dave"]["labs"][LAB_ID]["status"] == "missing"
    csv_lines = (out / "summary.csv").read_text().splitlines()
    assert csv_lines[0].startswith(
        f"student,{LAB_ID} points,{LAB_ID} max points,{LAB_ID} grade,{LAB_ID} status"
    )
    assert csv_lines[1].startswith(
        f"alice,{rows['alice']['points']},{rows['alice']['max_points']},"
    )
    assert "| bob |" in (out / "summary.md").read_text()
    for student in ("alice", "bob", "carol"):
        report = strict_json(out / "students" / student / "report.json")
        jsonschema.validate(report, SCHEMA)
        assert report["student"] == student and report["labs"][0]["content_hash"]
    assert not (out / "students" / "dave").exists()
    assert tree_hash(root) == before

    # Resumed: nothing changed, nothing is graded again, and the reports stay as they were.
    reports = {
        s: (out / "students" / s / "report.json").read_bytes() for s in ("alice", "bob", "carol")
    }
    second = grade("--submissions", root, "--out", out, "--jobs", "2", "--no-perf", *LIMITS)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "4 students, 0 labs graded, 3 unchanged since the last run (skipped)" in second.stdout
    assert {s: (out / "students" / s / "report.json").read_bytes() for s in reports} == reports
    assert strict_json(out / "summary.json")["students"] == summary["students"]

    # bob fixes his kernel: only his lab is graded again.
    (root / "bob" / LAB).unlink()
    (root / "bob").rmdir()
    write_submission(root / "bob")
    third = grade("--submissions", root, "--out", out, "--jobs", "2", "--no-perf", *LIMITS)
    assert "4 students, 1 labs graded, 2 unchanged since the last run (skipped)" in third.stdout
    bob = strict_json(out / "summary.json")["students"][1]
    assert bob["student"] == "bob" and bob["points"] == bob["max_points"]


def _worker_pids(marker: str, program: str = "grading.worker") -> list[int]:
    """Processes (by default workers, python -m grading.worker) whose command line contains
    `marker`."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
                if program in cmdline and marker in cmdline:
                    pids.append(int(proc.name))
            except OSError:
                pass
    return pids


@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT"])
def test_interrupted_run_writes_a_partial_report(tmp_path, how):
    """Ctrl-C or SIGTERM: the worker is stopped (no orphan), labs not graded are marked
    interrupted and
    the reports are written marked partial; a student's earlier complete report is kept."""
    root, out = tmp_path / "submissions", tmp_path / "reports"
    write_submission(root / "a_done")
    hang = CORPUS["infinite_loop_python"]
    write_submission(root / "b_hangs", hang)
    # An earlier complete report for b_hangs, of a different submission: it must not be overwritten.
    earlier = out / "students" / "b_hangs" / "report.json"
    earlier.parent.mkdir(parents=True)
    earlier.write_text('{"labs": []}')
    cmd = [
        sys.executable,
        "-m",
        "grading",
        "--submissions",
        str(root),
        "--out",
        str(out),
        "--jobs",
        "1",
        "--no-perf",
        "--call-timeout",
        "300",
        "--seed",
        "3",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (out / "students" / "a_done" / "report.json").exists() or not _worker_pids(
        str(root / "b_hangs")
    ):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    time.sleep(1)  # b_hangs is inside its infinite loop now
    proc.send_signal(getattr(signal, how))
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr[-2000:]
    assert "PARTIAL" in stdout
    assert not _worker_pids(str(root / "b_hangs"))
    summary = strict_json(out / "summary.json")
    jsonschema.validate(summary, SCHEMA)
    rows = {row["student"]: row for row in summary["students"]}
    assert summary["partial"] is True
    assert rows["a_done"]["labs"][LAB_ID]["status"] == "graded"
    assert rows["a_done"]["points"] == rows["a_done"]["max_points"] > 0
    assert rows["b_hangs"]["labs"][LAB_ID]["status"] == "interrupted"
    assert earlier.read_text() == '{"labs": []}'
    assert not list(out.rglob("*.tmp"))


def test_killed_run_leaves_a_partial_report_and_no_process(tmp_path):
    """SIGKILL cannot be caught: the report marked partial was written before the labs started,
    and the worker (in bubblewrap: --die-with-parent; else PR_SET_PDEATHSIG) dies with the CLI."""
    hang = write_submission(tmp_path / "hang", CORPUS["infinite_loop_python"])
    out = tmp_path / "report"
    proc = subprocess.Popen(
        [sys.executable, "-m", "grading", str(hang), "--out", str(out), "--call-timeout", "300"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not _worker_pids(str(hang)):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    time.sleep(1)
    proc.kill()
    proc.communicate(timeout=60)
    for _ in range(50):
        if not _worker_pids(str(hang)):
            break
        time.sleep(0.1)
    assert not _worker_pids(str(hang))
    report = strict_json(out / "report.json")
    jsonschema.validate(report, SCHEMA)
    assert report["partial"] is True
    [lab] = report["labs"]
    assert lab["interrupted"] and lab["score"]["grade"] == "interrupted"


def test_interrupted_single_run_marks_the_report_partial(tmp_path):
    hang = write_submission(tmp_path / "hang", CORPUS["infinite_loop_python"])
    out = tmp_path / "report"
    proc = subprocess.Popen(
        [sys.executable, "-m", "grading", str(hang), "--out", str(out), "--call-timeout", "300"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not _worker_pids(str(hang)):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    time.sleep(1)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode == 130
    report = strict_json(out / "report.json")
    jsonschema.validate(report, SCHEMA)
    assert report["partial"] is True
    [lab] = report["labs"]
    assert lab["interrupted"] and lab["score"]["grade"] == "interrupted"
    assert "not graded: the grading run was interrupted" in lab["error"]


# --------------------------------------------------------------------------------------------------
# Performance (GPU): timed repetitions with new inputs each, every output checked


def test_performance_grades_the_solution_and_catches_what_only_timing_can(tmp_path):
    write_submission(tmp_path / "solution")
    for name, submission in PERF_CORPUS.items():
        write_submission(tmp_path / name, submission)
    out = tmp_path / "report"
    proc = grade(
        *[tmp_path / n for n in ["solution", *PERF_CORPUS]], "--out", out, "--seed", "5", *LIMITS
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = strict_json(out / "report.json")
    jsonschema.validate(report, SCHEMA)
    labs = {Path(lab["notebook"]).parent.name: lab for lab in report["labs"]}
    solution, cached = labs["solution"], labs["caches_large_outputs"]
    if not runtime.ON_GPU:
        # No timing on a CPU: the grade says so, and a cache that only large inputs hit
        # goes unnoticed.
        for lab in (solution, cached):
            assert lab["score"]["grade"] == "not measured: no GPU"
            assert all(not f["perf"] for f in lab["functions"])
        assert functions(cached)["add"]["status"] == "pass"
        return
    for f in solution["functions"]:
        assert f["status"] == "pass" and f["perf"], f["name"]
        for p in f["perf"]:
            assert p["correct"] and p["wrong_rounds"] == 0 and p["rounds"] >= 10, p
            assert p["tier"] in "AB" and 50 < p["percent_of_floor"] < 130, p
            assert p["side_streams"] == 0
    assert solution["score"]["grade"] in ("A", "B")
    add = functions(cached)["add"]
    # every correctness case is right: only the timing catches it, and it costs the points
    assert add["status"] == "fail" and add["points"] == 0
    assert "the outputs of timed calls must be right too" in add["message"]
    for p in add["perf"]:
        assert p["tier"] == "F" and not p["correct"] and p["wrong_rounds"] >= p["rounds"] - 1, p
        assert (
            "output wrong in" in p["note"] and "does it cache results between calls?" in p["note"]
        )
    assert cached["score"]["grade"] == "F"


@pytest.mark.gpu
def test_performance_is_judged_from_outside_the_student_s_worker(tmp_path):
    """Each submission is a correct add at a third of the course's speed that looks faster where
    the student's worker times it: a launch hook slowing the course's kernel, a patched
    `torch.cuda.Event.elapsed_time`, forged timing replies, back-to-back calls skipped. The course's
    kernel and the floor are timed in a clean worker, and both sides called back to back on the
    grading process's clock: every one gets F, and the course's kernel runs at its usual speed."""
    for name, (submission, _) in OUTSIDE_CORPUS.items():
        write_submission(tmp_path / name, submission)
    out = tmp_path / "report"
    proc = grade(*[tmp_path / n for n in OUTSIDE_CORPUS], "--out", out, "--seed", "5",
                 "--no-kernel-audit", *LIMITS)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = strict_json(out / "report.json")
    jsonschema.validate(report, SCHEMA)
    labs = {Path(lab["notebook"]).parent.name: lab for lab in report["labs"]}
    for name, (_, phrase) in OUTSIDE_CORPUS.items():
        add = functions(labs[name])["add"]
        assert add["status"] == "pass" and add["perf"], (name, add["message"])
        for p in add["perf"]:
            assert p["tier"] == "F" and phrase in p["note"], (name, p)
            # the course's kernel near the floor, as in the solution's run: not slowed
            assert p["reference_us"] < 1.3 * p["floor_us"], (name, p)
            assert p["outside_reference_us"] < 1.3 * p["floor_us"], (name, p)

def test_reports_are_strict_json(graded):
    """NaN in a comparison (an unwritten element) is written as the string "NaN", never bare."""
    values = [
        c["comparison"]["actual_at_worst"]
        for lab in graded["report"]["labs"]
        for f in lab["functions"]
        for c in f["cases"]
        if c["comparison"] and isinstance(c["comparison"]["actual_at_worst"], str)
    ]
    assert values and set(values) <= {"NaN", "Infinity", "-Infinity"}


# --------------------------------------------------------------------------------------------------
# The sandbox (bubblewrap): what a submission reaches from inside it


@pytest.mark.skipif(not sandbox.status()[0], reason=f"no sandbox here: {sandbox.status()[1]}")
def test_the_sandbox_contains_a_submission(tmp_path):
    """At import the submission writes outside its folder, starts a process that leaves its
    session and would outlive the run, and connects to a port of this machine: none of it works,
    and its (correct) functions still get full marks."""
    import socket

    outside, marker = tmp_path / "outside.txt", f"sleep-{os.getpid()}-{time.monotonic_ns()}"
    outside.write_text("untouched")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    escape = f"""
import os, socket, subprocess
escaped = []
for attempt in (lambda: open({str(outside)!r}, "w").write("rewritten"),
                lambda: socket.create_connection(("127.0.0.1", {port}), timeout=2)):
    try:
        attempt()
        escaped.append(attempt)
    except OSError:
        pass
subprocess.Popen(["setsid", "bash", "-c", "exec -a {marker} sleep 600"])
"""
    notebook = write_submission(tmp_path / "escape", Submission({"add": add_cell(prelude=escape)}))
    proc = grade(
        notebook.parent,
        "--out",
        tmp_path / "report",
        "--seed",
        "5",
        *LIMITS,
        "--sandbox",
        "require",  # after LIMITS' "auto": the last one counts
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    [lab] = strict_json(tmp_path / "report" / "report.json")["labs"]
    assert lab["sandbox"] == "bubblewrap"
    assert (
        functions(lab)["add"]["status"] == "pass"
        and functions(lab)["residual_add"]["status"] == "pass"
    )
    with pytest.raises(OSError):  # nobody connected
        listener.accept()
    assert outside.read_text() == "untouched"
    alive = _worker_pids(marker, program="")
    assert not alive


def test_the_drawn_multiple_of_8192_is_never_one_block():
    import random

    from grading.labs import get_lab

    add = get_lab(LAB_ID).function("add")
    for seed in range(200):
        sizes = {c.shape[0] for c in add.draw_cases(random.Random(seed)) if c.shape}
        multiples = [n for n in sizes if n % 8192 == 0]
        assert multiples and min(multiples) >= 2 * 8192, sizes
