"""Lab 08's wrong submissions get zero points, each with the reason a student can act on; the
course's implementations and the solution notebook get full points, in the check cells and
through `python -m grading` (the ranks run in the sandboxed worker; the verdict is made in the
grader). Everything runs in gloo process groups of CPU processes (forked: a fraction of a second
each)."""

import json

import nbformat
import pytest
import torch

from grading import ranks, sandbox
from grading.labs import get_lab, lab08_communication
from grading.notebooks import SOLUTIONS_DIR
from kernels.communication import ddp as course_ddp
from kernels.communication import ring as course_ring
from kernels.communication import ring_pipelined
from tests.grader_corpus_lab08 import ATTACKS, DDP, RING, RING_ALSO, ddp, ring
from tests.grading_cli import grade_solution_and_lab

LAB = get_lab("08_communication")
SEED = 1234


def _grade(name, submission):
    spec = LAB.function(name)
    grade = (
        lab08_communication.grade_ring
        if name == "ring_all_reduce"
        else (lab08_communication.grade_ddp)
    )
    return grade(spec, "function", lab08_communication.local_call(spec, submission), SEED)


def test_lab_grades_both_parts_in_process_groups():
    assert [f.name for f in LAB.functions] == ["ring_all_reduce", "BucketedDDP"]
    assert all(f.grade_group and f.run_group and f.points == 5 for f in LAB.functions)


@pytest.mark.parametrize(
    "submission",
    [course_ring.ring_all_reduce, ring_pipelined.pipelined_ring_all_reduce, ring()],
    ids=["course-ring", "course-pipelined-ring", "corpus-solution"],
)
def test_right_rings_get_full_points(submission):
    result = _grade("ring_all_reduce", submission)
    assert (result.status, result.points) == ("pass", 5), result.message
    # every world size, every case: 8 shapes (0 and 1 element, odd, 2-D, two drawn) x 3 dtypes
    assert [c.case for c in result.cases] == ["N=2: 24 tensors", "N=3: 24 tensors"]


@pytest.mark.parametrize("mistake", sorted(RING))
def test_wrong_ring_gets_zero_with_its_reason(mistake):
    result = _grade("ring_all_reduce", ring(mistake))
    assert (result.status, result.points) == ("fail", 0), result.message
    assert RING[mistake] in result.message, result.message
    assert RING_ALSO.get(mistake, "") in result.message, result.message


def test_ring_cases_cover_what_the_lab_promises():
    for world in lab08_communication.WORLDS:
        cases = lab08_communication.ring_cases(SEED, world)
        sizes = {torch.Size(c["shape"]).numel() for c in cases}
        assert {0, 1} <= sizes and any(n % world for n in sizes) and any(n > 2**16 for n in sizes)
        assert {c["dtype"] for c in cases} == {"float32", "float64", "bfloat16"}
        assert {c["average"] for c in cases} == {False, True}
        assert any(len(c["shape"]) == 2 for c in cases)
        # another seed draws other sizes: no fixed list to learn
        other = lab08_communication.ring_cases(SEED + 1, world)
        assert [c["shape"] for c in other] != [c["shape"] for c in cases]


def test_a_forged_reply_is_not_a_verdict():
    """The grader judges what the ranks sent back: results that are not results, or that claim
    the right answer without it, fail."""
    world = 2
    cases = lab08_communication.ring_cases(SEED, world)
    inputs = lab08_communication.ring_inputs(SEED, world, cases)
    for forged in (
        {"ranks": "all correct", "log": []},
        {"ranks": [{"cases": [{"output": 1}]}] * world, "log": []},
        [],
        None,
    ):
        problem = lab08_communication.judge_ring(world, cases, inputs, forged)
        assert "could not be read" in problem
    unchanged = {
        "ranks": [
            {"cases": [{"output": x, "in_place": True, "returned": "Tensor"} for x in inputs[r]]}
            for r in range(world)
        ],
        "log": [],
    }
    problem = lab08_communication.judge_ring(world, cases, inputs, unchanged)
    assert "the tensor is unchanged: nothing was reduced" in problem


# The DDP verdicts in this process: on a GPU machine the test process may have run a backward pass
# for another test file, after which forked ranks cannot run backward (the test below shows the
# message); there the GPU path is `python -m grading`'s fresh worker, tested further down.
@pytest.mark.cpu
@pytest.mark.parametrize(
    "submission", [course_ddp.DataParallel, ddp()], ids=["course-ddp", "corpus-solution"]
)
def test_right_ddp_gets_full_points(submission):
    result = _grade("BucketedDDP", submission)
    assert (result.status, result.points) == ("pass", 5), result.message


def test_the_reference_training_runs_in_a_process_of_its_own():
    """Its backward pass would otherwise taint this process for every later fork (a check cell
    run a second time would fail on a GPU machine)."""
    weights, batches, _, scales = lab08_communication.ddp_inputs(SEED, 2)
    forked = lab08_communication.ddp_reference_forked(weights[0], batches, 2, scales)
    here = lab08_communication.ddp_reference(weights[0], batches, 2, scales)
    assert len(forked) == len(here) == lab08_communication.STEPS
    # the same training; one thread there, this process's here: sums may round differently
    def same(a, b):
        return torch.allclose(a, b, rtol=1e-5, atol=1e-7)

    for (grads, local), (grads_f, local_f) in zip(here, forked):
        assert len(grads) == len(grads_f) and all(map(same, grads, grads_f))
        assert all(same(a, b) for r, rf in zip(local, local_f) for a, b in zip(r, rf))


def test_with_a_gpu_the_reference_is_spawned_and_gives_the_same_training(monkeypatch):
    """On an H200, `python -m grading solutions` failed BucketedDDP as a grader bug: an earlier
    lab's judge had run a backward pass in the grading process, so the forked reference could not.
    With a GPU present the reference is spawned (its worker imported by name); here the CPU plays
    a GPU machine, and the spawned training must match the forked one exactly."""
    weights, batches, _, scales = lab08_communication.ddp_inputs(SEED, 2)
    forked = lab08_communication.ddp_reference_forked(weights[0], batches, 2, scales)
    methods = []
    real_get_context = lab08_communication.launch.mp.get_context
    monkeypatch.setattr(lab08_communication.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        lab08_communication.launch.mp,
        "get_context",
        lambda method: methods.append(method) or real_get_context(method),
    )
    spawned = lab08_communication.ddp_reference_forked(weights[0], batches, 2, scales)
    assert methods == ["spawn"]
    for (grads, local), (grads_s, local_s) in zip(forked, spawned):
        assert all(map(torch.equal, grads, grads_s))
        assert all(torch.equal(a, b) for r, rs in zip(local, local_s) for a, b in zip(r, rs))


@pytest.mark.gpu
def test_ranks_forked_after_a_backward_here_say_how_to_recover():
    x = torch.ones(3, requires_grad=True, device="cuda")
    (x * 2).sum().backward()  # autograd's device threads start: forked ranks cannot run backward
    result = _grade("BucketedDDP", course_ddp.DataParallel)
    assert result.status == "fail", result.message
    assert "Restart the kernel and run this check before any backward" in result.message


@pytest.mark.cpu
@pytest.mark.parametrize("mistake", sorted(DDP))
def test_wrong_ddp_gets_zero_with_its_reason(mistake):
    result = _grade("BucketedDDP", ddp(mistake))
    assert (result.status, result.points) == ("fail", 0), result.message
    assert DDP[mistake] in result.message, result.message


def test_check_cells_print_pass_fail_and_not_implemented(capsys):
    assert lab08_communication.check_ring_all_reduce(ring())
    assert not lab08_communication.check_ring_all_reduce(ring("no_average"))
    assert not lab08_communication.check_ring_all_reduce(ring("stub"))
    out = capsys.readouterr().out
    assert "PASS  ring_all_reduce N=2: 24 tensors" in out
    assert "PASS  ring_all_reduce N=3: 24 tensors" in out
    assert "FAIL  ring_all_reduce N=2: 24 tensors: N=2, shape (1,) float32, average=True" in out
    assert "NOT IMPLEMENTED  ring_all_reduce: not implemented yet" in out


# On a GPU this worker may already have run a backward pass (the test of the restart message
# does so on purpose); forked ranks then cannot run one and the DDP check cell says to restart
# the kernel. A fresh kernel on a GPU is covered by nbval over the solution.
@pytest.mark.cpu
def test_ddp_check_cell_prints_fail_with_the_reason(capsys):
    assert not lab08_communication.check_data_parallel(ddp("after_backward"))
    out = capsys.readouterr().out
    assert "FAIL  BucketedDDP N=2, buckets of 0.02 MiB and one bucket: N=2, bucket_mb=0.02" in out


def test_untouched_lab_runs_and_says_not_implemented():
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


WRONG_RING = '''def ring_all_reduce(tensor, average=False):
    """Sum (or average) `tensor` over the ranks of the default process group, in place, with
    sends and receives only; return `tensor`."""
    dist.all_reduce(tensor)
    if average:
        tensor.div_(dist.get_world_size())
    return tensor
'''


def _notebook_with(folder, cells: dict[str, str]) -> None:
    """The solution notebook with the cells of `cells` (by grade_id) replaced, in `folder`."""
    nb = nbformat.read(SOLUTIONS_DIR / "08_communication_lab.ipynb", as_version=4)
    for cell in nb.cells:
        cell.source = cells.get(cell.metadata.get("nbgrader", {}).get("grade_id"), cell.source)
    folder.mkdir()
    nbformat.write(nb, folder / "08_communication_lab.ipynb")


def test_python_m_grading_judges_fresh_ranks(tmp_path):
    """The solution: 10 of 10; the untouched lab: not implemented; a ring that calls
    dist.all_reduce: 0 for the ring with the reason, 5 for its (right) BucketedDDP. The attacks
    (ATTACKS: a rank reading the other ranks' inputs from its callers' frames, the garbage
    collector's objects or files through /proc; dummy all-reduces faking the overlap) get 0 for
    the attacked function, with the reason, and their other function its points. Each rank is a
    fresh process given only its own inputs, and the overlap is what the grader's relay saw."""
    _notebook_with(tmp_path / "wrong", {"ring_all_reduce": WRONG_RING})
    for folder, (cells, _) in ATTACKS.items():
        _notebook_with(tmp_path / folder, cells)
    labs = grade_solution_and_lab(tmp_path, "08_communication_lab.ipynb", "wrong", *ATTACKS)
    points = {
        folder: {f["name"]: (f["status"], f["points"], f["max_points"]) for f in lab["functions"]}
        for folder, lab in labs.items()
    }
    assert points["solution"] == {
        "ring_all_reduce": ("pass", 5, 5),
        "BucketedDDP": ("pass", 5, 5),
    }, json.dumps(labs["solution"], indent=1)[:3000]
    assert points["lab"] == {
        "ring_all_reduce": ("not implemented", 0, 5),
        "BucketedDDP": ("not implemented", 0, 5),
    }
    assert points["wrong"] == {"ring_all_reduce": ("fail", 0, 5), "BucketedDDP": ("pass", 5, 5)}
    ring_result = labs["wrong"]["functions"][0]
    assert "uses the library collective dist.all_reduce" in ring_result["message"]
    for folder, (_, verdicts) in ATTACKS.items():
        for function in labs[folder]["functions"]:
            name, message = function["name"], function["message"]
            if name in verdicts:
                assert (function["status"], function["points"]) == ("fail", 0), (folder, message)
                assert verdicts[name] in message, (folder, message)
            else:
                assert (function["status"], function["points"]) == ("pass", 5), (folder, message)
    # Fresh interpreters, each importing PyTorch: 3 for the ring's two groups, 2 for DDP. 23 s for
    # the solution where forked ranks took 17 s, back to back at a load of 4 on two cores.
    assert labs["solution"]["elapsed_s"] < 60
    if sandbox.status()[0]:  # each rank in a sandbox of its own
        assert labs["solution"]["sandbox"] == "bubblewrap"


def test_grading_check_points_a_group_function_to_its_check_cell():
    """`grading.check` runs one process; a process-group function says where it is checked."""
    import grading

    with pytest.raises(ValueError, match="process group of several ranks: use the check cell"):
        grading.check("08_communication", "ring_all_reduce", course_ring.ring_all_reduce)


def _malformed(fn, rank, world, job, inputs):
    ranks.GROUP.tell({"op": "send", "tensor": torch.ones(1)})  # to no one
    return {}


def _flood(fn, rank, world, job, inputs):
    for _ in range(ranks.RELAY_BYTES // 2**24 + 2):  # 16 MiB a message, never received
        ranks.GROUP.tell({"op": "send", "peer": 1 - rank, "tag": 0,
                          "tensor": torch.zeros(2**22)})
    return {}


def test_the_relay_judges_a_rank_s_messages_as_data_and_holds_a_bounded_amount():
    """The relay runs in the grader's process: a malformed message ends its rank with a reason,
    and a group that sends more than the relay would hold is stopped."""
    [found] = ranks.run_forked(_malformed, None, [({}, [None, None], None)])
    assert found["error"].endswith("sent the grader's process group a malformed message")
    [found] = ranks.run_forked(_flood, None, [({}, [None, None], None)])
    assert "MiB or 200000 messages through the grader's process group" in found["error"]
