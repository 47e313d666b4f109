"""Lab 08's wrong submissions are caught, each with the reason a student can act on; the course's
implementations and the solution notebook's pass. Everything runs in gloo process groups of CPU
processes (forked: a fraction of a second each)."""

import pytest

from grading.labs import get_lab, lab08_communication
from kernels.communication import ddp as course_ddp
from kernels.communication import ring as course_ring
from tests.grader_corpus_lab08 import DDP, RING, RING_PARTIAL_CHUNKS, RING_PARTIAL_N4, ddp, ring


def test_lab_is_registered():
    assert get_lab("08_communication").id == "08_communication"


def test_course_ring_and_corpus_solution_pass():
    for fn in (course_ring.ring_all_reduce, ring()):
        assert lab08_communication.ring_all_reduce_problems(fn) == {2: [], 4: []}


@pytest.mark.parametrize("mistake", sorted(RING))
def test_wrong_ring_is_caught(mistake, monkeypatch):
    monkeypatch.setattr(lab08_communication, "TIMEOUT_S", 3.0)  # the deadlock: 3 s, not 30
    worlds = (2,) if mistake != "partial_chunks" else (2, 4)
    problems = lab08_communication.ring_all_reduce_problems(ring(mistake), worlds=worlds)
    assert problems[2], problems
    assert RING[mistake] in problems[2][0], problems[2]
    if mistake == "partial_chunks":  # at N = 4 the check names the chunks the ring left unsummed
        assert RING_PARTIAL_N4 in problems[4][0] and RING_PARTIAL_CHUNKS in problems[4][0]


def test_course_ddp_and_corpus_solution_pass():
    for cls in (course_ddp.DataParallel, ddp()):
        assert lab08_communication.data_parallel_problems(cls) == []


@pytest.mark.parametrize("mistake", sorted(DDP))
def test_wrong_ddp_is_caught(mistake):
    problems = lab08_communication.data_parallel_problems(ddp(mistake))
    assert len(problems) == 1 and DDP[mistake] in problems[0], problems


def test_check_cells_print_pass_fail_and_not_implemented(capsys):
    assert lab08_communication.check_ring_all_reduce(ring())
    assert not lab08_communication.check_ring_all_reduce(ring("no_average"))
    assert not lab08_communication.check_ring_all_reduce(ring("stub"))
    assert not lab08_communication.check_data_parallel(ddp("after_backward"))
    out = capsys.readouterr().out
    assert "PASS  ring_all_reduce N=2" in out and "PASS  ring_all_reduce N=4" in out
    assert "FAIL  ring_all_reduce N=2: N=2, shape (1,), average=True: returned the sum" in out
    assert "NOT IMPLEMENTED  ring_all_reduce: not implemented yet" in out
    assert "FAIL  BucketedDDP" in out


def test_untouched_lab_runs_and_says_not_implemented():
    import nbformat
    from nbclient import NotebookClient

    from grading.notebooks import LABS_DIR, role

    nb = nbformat.read(LABS_DIR / "08_communication_lab.ipynb", as_version=4)
    NotebookClient(
        nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(LABS_DIR)}}
    ).execute()
    errors = [
        o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"
    ]
    assert not errors, errors[0]["ename"] if errors else ""
    checks = ["".join(o.get("text", "") for o in c.outputs) for c in nb.cells if role(c) == "check"]
    assert checks == [
        "NOT IMPLEMENTED  ring_all_reduce: not implemented yet\n",
        "NOT IMPLEMENTED  BucketedDDP: not implemented yet\n",
    ]
