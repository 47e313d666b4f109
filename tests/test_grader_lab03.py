"""Lab 03: the solution gets full marks, the untouched lab zero, and every wrong forward in the
corpus is caught with the reason a student can act on."""

import json
import random
import subprocess
import sys
from dataclasses import replace

import pytest

from grading.harness import check_function
from grading.labs import get_lab
from grading.notebooks import LABS_DIR, SOLUTIONS_DIR
from kernels import runtime
from tests.grader_corpus_lab03 import (
    BACKWARD_CORPUS,
    BACKWARD_DRAWN_CORPUS,
    CORPUS,
    DRAWN_CORPUS,
    DRAWN_DIAGNOSIS,
    backward_submission,
    submission,
)

LAB = get_lab("03_flash_attention")
SPEC = LAB.function("flash_attention")
BACKWARD = LAB.function("flash_attention_backward")


def lab_up_to(label: str, spec=SPEC):
    """The lab with `spec`'s cases up to and including `label` (seeds follow a case's index, so each
    case gets the inputs it gets in the full run)."""
    labels = [c.label for c in spec.cases]
    assert label in labels, f"no case {label!r} in the spec: {labels}"
    return only(spec, spec.cases[: labels.index(label) + 1])


def only(spec, cases, **changes):
    """The lab with `spec` graded on `cases` alone (no cases drawn from the seed)."""
    return replace(
        LAB, functions=(replace(spec, cases=tuple(cases), draw_cases=None, **changes),)
    )


def drawn(spec, seed: int) -> tuple:
    """The cases `spec` draws for `seed`, as the grader draws them."""
    return spec.draw_cases(random.Random(f"cases {seed}"))


def fixed_cases(spec) -> tuple:
    """The fixed cases of both modes (a GPU adds N = 4096)."""
    return tuple(c for c in spec.cases if c.shape[3] < 4096)


@pytest.mark.parametrize("mistake", sorted(CORPUS))
def test_wrong_forward_is_caught(mistake):
    label, phrase, gpu_only = CORPUS[mistake]
    if gpu_only and not runtime.ON_GPU:
        # the memory budget is a GPU check (PyTorch's CPU allocator keeps no peak) and the N = 4096
        # case is GPU-only: in CPU mode the numbers are right and it passes (up to the first case
        # without parameters, which the grader also calls without out=)
        called_without_out = next(
            c for c in SPEC.cases if c.layout == "contiguous" and min(c.shape) > 1 and not c.params
        )
        result = check_function(
            lab_up_to(called_without_out.label),
            "flash_attention",
            submission(mistake),
            seed=7,
            perf=False,
        )
        assert result.status == "pass", result.message
        return
    result = check_function(
        lab_up_to(label), "flash_attention", submission(mistake), seed=7, perf=False
    )
    assert result.status == "fail" and result.points == 0
    assert result.message.startswith(f"1 of {len(result.cases)} cases fail; first: {label}: "), (
        result.message
    )
    assert phrase in result.message, result.message


@pytest.mark.parametrize("mistake", sorted(BACKWARD_CORPUS))
def test_wrong_backward_is_caught(mistake):
    label, phrase = BACKWARD_CORPUS[mistake]
    lab = LAB if label is None else lab_up_to(label, BACKWARD)
    result = check_function(
        lab, "flash_attention_backward", backward_submission(mistake), seed=7, perf=False
    )
    if label is None:  # the control: the same kernels without the mistake pass
        assert result.status == "pass", result.message
        return
    assert result.status == "fail" and result.points == 0
    assert result.message.startswith(f"1 of {len(result.cases)} cases fail; first: {label}: "), (
        result.message
    )
    assert phrase in result.message, result.message


def test_the_large_logit_case_really_overflows_exp():
    import torch

    from grading.cases import make_inputs
    from kernels.testing import generator

    case = next(c for c in SPEC.cases if c.layout == "large_logits")
    q, k, _ = make_inputs(SPEC, case, generator(0, runtime.DEVICE))
    scores = q.double() @ k.double().transpose(-1, -2) / q.shape[-1] ** 0.5
    assert scores.max().item() > 89, "exp(score) must overflow float32 (and float16 at 11)"
    assert torch.isinf(torch.exp(scores.float())).any()


@pytest.mark.parametrize("mistake", sorted(DRAWN_CORPUS))
def test_wrong_forward_only_a_drawn_case_catches(mistake):
    """Every fixed case lets the mistake through (one call each: the mistakes do not depend on the
    values); the class of cases drawn for it catches it, whatever the seed draws there."""
    index, phrase = DRAWN_CORPUS[mistake]
    fixed = check_function(
        only(SPEC, fixed_cases(SPEC), trials=1), "flash_attention", submission(mistake),
        seed=7, perf=False,
    )
    assert fixed.status == "pass", fixed.message
    case = drawn(SPEC, 7)[index]
    # behind the first fixed case (one token: the harness wants a contiguous case to profile)
    result = check_function(
        only(SPEC, [SPEC.cases[0], case]), "flash_attention", submission(mistake), seed=7,
        perf=False,
    )
    assert result.status == "fail" and result.points == 0
    assert result.message.startswith(f"1 of 2 cases fail; first: {case.label}: "), result.message
    assert phrase in result.message, result.message
    assert DRAWN_DIAGNOSIS.get(mistake, "") in result.message, result.message


@pytest.mark.parametrize("mistake", sorted(BACKWARD_DRAWN_CORPUS))
def test_wrong_backward_only_a_drawn_case_catches(mistake):
    index, phrase = BACKWARD_DRAWN_CORPUS[mistake]
    fixed = check_function(
        only(BACKWARD, BACKWARD.cases, trials=1), "flash_attention_backward",
        backward_submission(mistake), seed=7, perf=False,
    )
    assert fixed.status == "pass", fixed.message
    case = drawn(BACKWARD, 7)[index]
    result = check_function(
        only(BACKWARD, [BACKWARD.cases[0], case]), "flash_attention_backward",
        backward_submission(mistake), seed=7, perf=False,
    )
    assert result.status == "fail" and result.points == 0
    assert result.message.startswith(f"1 of 2 cases fail; first: {case.label}: "), result.message
    assert phrase in result.message, result.message


def test_every_draw_has_every_class():
    """Whatever the seed, each drawn class is there: what the corpus above relies on."""
    for seed in range(300):
        block, long_keys, no_key_rows, strides = drawn(SPEC, seed)
        assert all(n % 128 == 0 for n in block.shape[3:5])
        assert long_keys.shape[4] > 2048 and long_keys.shape[4] * 64 > 2**17
        assert no_key_rows.kwargs["causal"] and no_key_rows.shape[3] > no_key_rows.shape[4]
        assert no_key_rows.shape[3] * 64 > 2**17
        assert strides.layout == "kv cache" and strides.shape[0] == strides.shape[2] == 2
        multiple, backward_no_key_rows, backward_long = drawn(BACKWARD, seed)
        assert all(n % 128 == 0 for n in multiple.shape[3:5])
        assert backward_no_key_rows.kwargs["causal"]
        assert backward_no_key_rows.shape[3] > backward_no_key_rows.shape[4]
        assert backward_long.shape[4] > 1024


def test_the_kv_cache_layout_gives_k_and_v_strides_of_their_own():
    from grading.cases import make_inputs
    from kernels.testing import generator

    case = drawn(SPEC, 7)[3]
    q, k, v = make_inputs(SPEC, case, generator(0, runtime.DEVICE))
    strides = {q.stride(), k.stride(), v.stride()}
    assert len(strides) == 3 and all(t.stride(-1) == 1 for t in (q, k, v)), strides
    assert k.stride(0) != k.shape[1] * k.shape[2] * k.shape[3]  # a longer cache


def grade(notebook):
    proc = subprocess.run(
        [sys.executable, "-m", "grading", str(notebook), "--json", "--no-perf", "--seed", "3"],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (lab,) = json.loads(proc.stdout)["labs"]
    return lab


def test_solution_gets_full_marks_and_the_lab_zero():
    solution = grade(SOLUTIONS_DIR / "03_flash_attention_lab.ipynb")
    messages = [f["message"] for f in solution["functions"]]
    # the forward's 10 points are the lab; the backward's 5 are extra credit, on top
    assert (solution["score"]["points"], solution["score"]["max_points"]) == (15, 10), messages
    assert [f["extra_credit"] for f in solution["functions"]] == [False, True]
    stub = grade(LABS_DIR / "03_flash_attention_lab.ipynb")
    assert (stub["score"]["points"], stub["score"]["max_points"]) == (0, 10)
    assert [f["status"] for f in stub["functions"]] == ["not implemented", "not implemented"]
