"""Lab 06: the solution gets full marks, the untouched lab zero, and every wrong submission in the
corpus (tests/grader_corpus_lab06.py) is caught with the reason a student can act on -- in this
mode; the failures only a GPU can show are asserted on a GPU and skipped, saying so, on a CPU."""

import json
import random
from dataclasses import replace

import pytest
import torch

from grading.harness import GRAPH_NOT_CHECKED, check_function
from grading.labs import get_lab
from grading.labs.lab06_moe import HOT_EXPERT, check_layer
from grading.notebooks import LABS_DIR, grade_id, role
from kernels import runtime
from tests.grader_corpus_lab06 import CORPUS, DRAWN_CORPUS, SOLUTION, SOLUTION_CELLS, edit
from tests.grading_cli import grade_solution_and_lab

LAB = get_lab("06_moe")
BOTH_MODES = sorted(CORPUS)


def import_submission(cells: dict[str, str], folder):
    """The graded module the worker would build from the solution notebook with `cells` replaced."""
    return SOLUTION.module(cells, folder)


def assert_classified(name, on_gpu, folder):
    submission = CORPUS[name]
    module = import_submission(submission.cells, folder)
    for function, (status, phrase) in submission.expected(on_gpu).items():
        result = check_function(LAB, function, getattr(module, function), seed=7, perf=False)
        assert result.status == status, (function, result.message)
        assert phrase in result.message, result.message
        if status == "fail":
            assert result.points == 0
            assert submission.diagnosis in result.message, result.message


def test_every_mistake_is_caught_in_both_modes():
    """The corpus has no GPU-only mistake (the op watcher sees the host syncs on the CPU too), so
    the test below runs every one; a GPU-only mistake would need a GPU test of its own."""
    assert [name for name, s in CORPUS.items() if s.gpu_only] == []


@pytest.mark.parametrize("name", BOTH_MODES)
def test_submission_is_classified(name, tmp_path):
    assert_classified(name, runtime.ON_GPU, tmp_path)


def only(name, cases, **changes):
    """The lab with function `name` graded on `cases` alone (no cases drawn from the seed)."""
    spec = replace(LAB.function(name), cases=tuple(cases), draw_cases=None, **changes)
    return replace(LAB, functions=(spec,))


def drawn(name, seed: int) -> tuple:
    """The cases function `name` draws for `seed`, as the grader draws them."""
    return LAB.function(name).draw_cases(random.Random(f"cases {seed}"))


def fixed_cases(name) -> tuple:
    """The fixed cases of both modes (a GPU adds thousands of tokens)."""
    return tuple(c for c in LAB.function(name).cases if c.shape[0] < 2048)


@pytest.mark.parametrize("mistake", sorted(DRAWN_CORPUS))
def test_only_a_drawn_case_catches(mistake, tmp_path):
    """Every fixed case lets the mistake through (one call each: it does not depend on the
    values); the class of cases drawn for it catches it, whatever the seed draws there."""
    cells, name, index, phrase = DRAWN_CORPUS[mistake]
    function = getattr(import_submission(cells, tmp_path), name)
    fixed = check_function(
        only(name, fixed_cases(name), trials=1), name, function, seed=7, perf=False
    )
    assert fixed.status == "pass", fixed.message
    first, case = LAB.function(name).cases[0], drawn(name, 7)[index]
    # behind the first fixed case (the harness wants a contiguous case to profile)
    result = check_function(only(name, [first, case]), name, function, seed=7, perf=False)
    assert result.status == "fail" and result.points == 0
    assert result.message.startswith(f"1 of 2 cases fail; first: {case.label}: "), result.message
    assert phrase in result.message, result.message


def test_every_draw_has_every_class():
    """Whatever the seed, each drawn class is there: what the corpus above relies on."""
    def power_of_two(n):
        return n & (n - 1) == 0

    for seed in range(300):
        multiple, odd, strided = drawn("route_topk", seed)
        assert multiple.shape[0] % 128 == 0
        assert not power_of_two(odd.shape[1]) and not power_of_two(odd.shape[2])
        assert strided.layout == "row stride"
        whole, odd, long = drawn("permute", seed)[:3]
        assert whole.shape[0] * whole.shape[2] % 2048 == 0 and not power_of_two(odd.shape[1])
        assert long.shape[0] * long.shape[2] > runtime.pick(gpu=2**17, cpu=4096)
        tiles, wide = drawn("grouped_gemm", seed)[:2]
        assert tiles.shape[3] % 128 == 0 and tiles.shape[4] % 256 == 0
        assert tiles.shape[2] in (3, 6) and 1024 < wide.shape[3] <= 4096
        assert drawn("grouped_gemm_swiglu", seed)[0] == tiles  # the fused one: the same draws


def test_every_edit_must_match_the_solution():
    with pytest.raises(AssertionError, match="occurs 0 times"):
        edit("permute", "text that is not in the solution", "")


def test_the_routings_are_what_the_lab_says():
    """Skewed: 7 of 8 tokens pick the hot expert first; few tokens over many experts: most idle; a
    token's logits never tie, even in bfloat16."""
    from grading.cases import make_inputs
    from kernels.testing import generator

    router, permute = LAB.function("route_topk"), LAB.function("permute")
    gen = generator(11, runtime.DEVICE)
    skewed = next(c for c in permute.cases if c.layout == "skewed")
    (ids,) = make_inputs(permute, skewed, gen)
    assert (ids[:, 0] == HOT_EXPERT).float().mean() >= 0.85
    assert all(len(set(row)) == len(row) for row in ids.tolist())
    sparse = next(c for c in permute.cases if c.shape == (5, 64, 2))
    (ids,) = make_inputs(permute, sparse, gen)
    assert torch.bincount(ids.flatten().long(), minlength=64).eq(0).sum() >= 54
    for case in router.cases:
        (logits,) = make_inputs(router, case, gen)
        gaps = logits.double().sort(dim=1).values.diff(dim=1)
        assert gaps.min() >= 0.25, (case.label, gaps.min())


def test_layer_check_passes_the_solution_and_fails_a_broken_permutation(tmp_path, capsys):
    solution = import_submission({}, tmp_path)
    pieces = [
        solution.route_topk,
        solution.permute,
        solution.grouped_gemm,
        solution.grouped_gemm_swiglu,
    ]
    assert check_layer(*pieces)
    # experts back to back: a tile's rows of the next expert get the wrong weights, in both modes (a
    # GEMM that drops the last column tile fails on the CPU only: the GPU's BLOCK_N divides the
    # layer's sizes; a router that forgets to renormalize passes, as the reference takes the
    # student's routing)
    broken = import_submission(CORPUS["permute_does_not_pad"].cells, tmp_path)
    assert not check_layer(pieces[0], broken.permute, *pieces[2:])
    out = capsys.readouterr().out
    assert "PASS  layer" in out and "FAIL  layer" in out


def test_solution_gets_full_marks_and_the_untouched_lab_zero(tmp_path):
    """`python -m grading` on the solution notebook, the untouched lab, and the solution with its
    check cells edited to print PASS (restored from the source, and reported), as an instructor runs
    it."""
    name = "06_moe_lab.ipynb"
    edited = json.loads((LABS_DIR / name).read_text())
    for cell in edited["cells"]:
        if role(cell) == "solution":
            cell["source"] = SOLUTION_CELLS[grade_id(cell)]
        if grade_id(cell) == "check_permute":
            cell["source"] = "print('PASS')"
    (tmp_path / "edited").mkdir()
    (tmp_path / "edited" / name).write_text(json.dumps(edited))
    labs = grade_solution_and_lab(tmp_path, name, "edited")
    solution, stub = labs["solution"], labs["lab"]
    messages = [f["message"] for f in solution["functions"]]
    # 3 + 4 + 5 points; the fused SwiGLU's 3 are extra credit, on top
    assert (solution["score"]["points"], solution["score"]["max_points"]) == (15, 12), messages
    assert [f["extra_credit"] for f in solution["functions"]] == [False, False, False, True]
    assert messages == [runtime.pick(gpu="", cpu=GRAPH_NOT_CHECKED)] * 4
    assert (stub["score"]["points"], stub["score"]["max_points"]) == (0, 12)
    assert [f["status"] for f in stub["functions"]] == ["not implemented"] * 4
    assert labs["edited"]["score"]["points"] == 15
    assert (
        "locked cell check_permute was modified (the grader used the original) (its nbgrader "
        "checksum does "
        "not match)"
    ) in labs["edited"]["notes"]
