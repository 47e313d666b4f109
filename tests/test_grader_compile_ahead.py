"""The compile-ahead worker (grading/compile_ahead.py): it calls the student's functions beside the
graded worker, is stopped in time, and never changes a verdict."""

import sys
import time

import pytest

from grading import compile_ahead
from grading.protocol import Options
from grading.runner import grade_lab
from kernels import runtime
from tests.grader_corpus_lab01 import CORPUS
from tests.test_grader_lab01 import LAB, write_submission


def test_its_worker_gets_its_own_share_of_gpu_memory():
    cmd = ["python", "-m", "grading.worker", "--memory-gib", "16", "--gpu-memory-fraction", "0.9"]
    ahead = compile_ahead.ahead_command(cmd)
    assert ahead[ahead.index("--gpu-memory-fraction") + 1] == str(compile_ahead.GPU_MEMORY_FRACTION)
    assert cmd[-1] == "0.9"  # the graded worker's command is left as it was


def test_never_where_it_could_change_a_verdict():
    # unsandboxed, what its student code started could outlive it
    assert not compile_ahead.worth_it(False, Options())
    assert not compile_ahead.worth_it(True, Options(cpu=True))


def _grade(tmp_path, monkeypatch, submission=None) -> dict:
    monkeypatch.setattr(compile_ahead, "worth_it", lambda sandboxed, opts: True)
    notebook = write_submission(tmp_path / "student", submission)
    opts = Options(cpu=not runtime.ON_GPU)  # this process's mode: it makes the inputs
    return grade_lab(notebook, LAB.removesuffix("_lab.ipynb"), 5, opts)


def test_it_calls_ahead_and_the_solution_keeps_its_marks(tmp_path, monkeypatch):
    lab = _grade(tmp_path, monkeypatch)
    assert lab["compiled_ahead"] > 0, lab.get("compiled_ahead")
    statuses = {f["name"]: f["status"] for f in lab["functions"]}
    needs_gpu = {
        f["name"] for f in lab["functions"] if f["backend"] == "cupy" and not runtime.ON_GPU
    }
    assert all(statuses[n] == ("needs a GPU" if n in needs_gpu else "pass") for n in statuses), [
        (f["name"], f["status"], f.get("message")) for f in lab["functions"]
    ]
    assert not lab["incidents"], lab["incidents"]


def test_a_wrong_function_fails_beside_it(tmp_path, monkeypatch):
    """Its calls are never judged: the graded worker's are, and a wrong kernel still fails."""
    lab = _grade(tmp_path, monkeypatch, CORPUS["wrong_on_tail"])  # never writes the last block
    assert lab["compiled_ahead"] > 0, lab.get("compiled_ahead")
    functions = {f["name"]: f for f in lab["functions"]}
    assert functions["add"]["status"] == "fail", functions["add"]
    assert functions["residual_add"]["status"] == "pass", functions["residual_add"]


@pytest.mark.parametrize("where", ["before its worker starts", "inside a call"])
def test_stop_ends_its_worker(tmp_path, where):
    """stop() kills the worker wherever it is (a hung call included) and ends its thread."""
    from grading.labs import get_lab
    from grading.notebooks import SOLUTIONS_DIR, read_notebook, solution_module
    from grading.protocol import worker_env
    from grading.runner import _worker_folder

    lab_id = LAB.removesuffix("_lab.ipynb")
    spec = get_lab(lab_id)
    source = read_notebook(SOLUTIONS_DIR / LAB)
    code, _ = solution_module(source, source)
    if where == "inside a call":  # every function hangs
        code += "".join(
            f"\n\ndef {f.name}(*args, **kwargs):\n    import time\n    time.sleep(600)\n"
            for f in spec.functions
        )
    work = _worker_folder(tmp_path / "work", lab_id, code, False)
    opts = Options(cpu=not runtime.ON_GPU)
    cmd = [
        sys.executable,
        "-m",
        "grading.worker",
        "--lab",
        lab_id,
        "--notebook",
        str(SOLUTIONS_DIR / LAB),
        *opts.worker_args(),
    ]
    ahead = compile_ahead.CompileAhead(
        cmd, work, spec, 5, time.monotonic() + 600, opts, worker_env(opts), sandboxed=False
    )
    ahead.start()
    if where == "inside a call":  # the first call begins once its inputs are written
        end = time.monotonic() + 120
        while not list(work.glob("inputs-*.pt")) and time.monotonic() < end:
            time.sleep(0.2)
        assert list(work.glob("inputs-*.pt")), "the worker never reached a call"
        time.sleep(2)
    started = time.monotonic()
    ahead.stop()
    assert time.monotonic() - started < 10
    assert not ahead._thread.is_alive()
    if ahead._worker is not None:
        assert ahead._worker.proc.poll() is not None
