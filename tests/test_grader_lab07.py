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
    """Every fixed case lets the mistake through; the cases drawn for the run catch it, whatever
    the seed."""
    function, submission, phrase = DRAWN_CORPUS[mistake]
    spec = LAB.function(function)
    fixed = replace(LAB, functions=(replace(spec, draw_cases=None, graph_capture=False),))
    assert check_function(fixed, function, submission, seed=7, perf=False).status == "pass"
    result = check_function(LAB, function, submission, seed=7, perf=False)
    assert result.status == "fail" and result.points == 0
    assert phrase in result.message, result.message


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
