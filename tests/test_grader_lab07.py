"""Lab 07's wrong submissions are caught, each with the reason a student can act on; the course's
kernels pass."""
import math
import random
from dataclasses import replace

import pytest

from grading.harness import check_function
from grading.labs import get_lab
from tests.grader_corpus_lab07 import CORPUS, DRAWN_CORPUS, TOKEN_GRID_LIMIT

LAB = get_lab("07_decoder")


@pytest.mark.parametrize("mistake", sorted(CORPUS))
def test_wrong_submission_is_caught(mistake):
    function, submission, phrase = CORPUS[mistake]
    result = check_function(LAB, function, submission, seed=7, perf=False)
    assert result.status == "fail" and result.points == 0
    assert phrase in result.message, result.message


@pytest.mark.parametrize("function", ["rope", "argmax"])
def test_course_kernels_pass(function):
    from kernels.decoder import triton_ops, triton_rope

    kernel = {"rope": triton_rope.rope, "argmax": triton_ops.argmax}[function]
    result = check_function(LAB, function, kernel, seed=7, perf=False)
    assert result.status == "pass", result.message


@pytest.mark.parametrize("mistake", sorted(DRAWN_CORPUS))
def test_only_a_drawn_case_catches(mistake):
    """The fixed cases let the mistake through where none reaches its class (a GPU's argmax cases
    include 200003 columns: they catch the cap too); the cases drawn for the run catch it,
    whatever the seed."""
    function, submission, phrase = DRAWN_CORPUS[mistake]
    spec = LAB.function(function)
    fixed = replace(LAB, functions=(replace(spec, draw_cases=None, graph_capture=False),))
    reached = mistake == "columns_past_2**17_ignored" and any(
        case.shape[1] > 2**17 for case in spec.cases)
    fixed_status = check_function(fixed, function, submission, seed=7, perf=False).status
    assert fixed_status == ("fail" if reached else "pass")
    result = check_function(LAB, function, submission, seed=7, perf=False)
    assert result.status == "fail" and result.points == 0
    assert phrase in result.message, result.message


@pytest.mark.parametrize("shape", [(1, 2), (1, 200003), (3, 2**17 + 1), (4, 4097)])
def test_the_last_row_s_one_maximum_is_in_the_last_column(shape):
    """On the GPU the drawn 2**17-and-more columns once held every row's maximum before the 2**17th
    (the values drawn there differ from a CPU's): a kernel capped at 2**17 columns passed. The
    last row's maximum is now the last column, alone, for every seed and dtype."""
    import torch

    make_inputs = LAB.function("argmax").make_inputs
    for seed, dtype in enumerate([torch.float32, torch.float16, torch.bfloat16] * 3):
        (logits,) = make_inputs(shape, dtype, "cpu", torch.Generator().manual_seed(seed))
        last = logits[-1].double()
        assert int(last.argmax()) == shape[1] - 1
        assert int((last == last.max()).sum()) == 1
        if shape[0] > 1:  # the first row keeps its tie
            first = logits[0].double()
            assert int((first == first.max()).sum()) == 2


def test_every_draw_reaches_past_the_fixed_cases():
    rope, argmax = LAB.function("rope"), LAB.function("argmax")
    for seed in range(300):
        [wide] = rope.draw_cases(random.Random(f"cases {seed}"))
        assert wide.shape[0] > TOKEN_GRID_LIMIT and wide.shape[2] in (24, 64, 80, 128)
        large, _ = argmax.draw_cases(random.Random(f"cases {seed}"))
        assert large.shape[1] > 2**17


@pytest.mark.parametrize("function", ["rope", "argmax"])
def test_a_graph_replay_is_judged_on_the_values_the_grader_made(function):
    """The worker only captures and replays (grading/graph.py): the verdict compares its outputs
    with references of the replay values the judging process made itself. Outputs of the values
    seen at capture (a graph that replays what the host decided then), and a capture that failed,
    both fail; the right outputs pass."""
    from grading.cases import output_shapes, references
    from grading.graph import graph_inputs, judge_replay

    spec = LAB.function(function)
    assert spec.graph_capture
    plain = [c for c in spec.cases if c.layout == "contiguous"]
    case = max(plain, key=lambda c: math.prod(c.shape))  # a 1 x 1 argmax is 0 for any values
    captured, replayed = graph_inputs(spec, case, seed=3)

    def outputs_for(inputs):
        wants, _ = references(spec, inputs, case.kwargs)
        return tuple(w.to(dtype) for w, (_, dtype) in zip(wants, output_shapes(spec, case)))

    assert judge_replay(spec, case, replayed, outputs_for(replayed)) is None
    stale = judge_replay(spec, case, replayed, outputs_for(captured))
    assert not stale.ok and "replayed on new inputs is wrong" in stale.reason
    failed = judge_replay(spec, case, replayed, "could not be captured in a CUDA graph (...)")
    assert not failed.ok and failed.reason.startswith("could not be captured")
