"""The lab grade: the worst tier among the functions the lab times; a question it never times has
none, and cannot make the grade "incomplete"."""

import json
from pathlib import Path

from grading import report

ROOT = Path(__file__).resolve().parents[1]


def lab(bottleneck_tier, transpose_tier, mode="gpu"):
    functions = [
        {"name": name, "status": "pass", "points": 1, "max_points": 1, "tier": tier}
        for name, tier in (("bottleneck", bottleneck_tier), ("transpose", transpose_tier))
    ]
    return {"lab": "00_profiling", "functions": functions, "fingerprint": {"mode": mode}}


def test_an_untimed_question_has_no_say_in_the_grade():
    assert report.score_lab(lab(None, "A"))["grade"] == "A"
    assert report.score_lab(lab(None, "C"))["grade"] == "C"


def test_a_timed_function_without_a_tier_leaves_the_grade_incomplete():
    assert report.score_lab(lab(None, None))["grade"] == "incomplete"


def test_without_a_gpu_nothing_is_graded_for_speed():
    assert report.score_lab(lab(None, "A", mode="cpu"))["grade"] == report.NOT_MEASURED


def test_the_report_says_when_the_stack_differs_from_the_expected_tables():
    from grading.expected import stack_differences

    measured_with = {"mode": "gpu", "gpu": "NVIDIA H100 80GB HBM3", "gpu_slug": "h100-80gb-hbm3",
                     "driver": "580.159.04", "cuda": "13.0", "torch": "2.11.0+cu130",
                     "triton": "3.6.0", "cupy": "14.2.0", "python": "3.12.3"}
    assert stack_differences("01_elementwise_add", measured_with) == {}
    newer = {**measured_with, "torch": "2.13.0+cu130", "triton": "3.9.0"}
    assert stack_differences("01_elementwise_add", newer) == {
        "torch": ("2.13.0+cu130", "2.11.0+cu130"), "triton": ("3.9.0", "3.6.0")}
    graded = json.loads((ROOT / "data/results/h100-80gb-hbm3/grading/solutions-all-labs/"
                                 "report.json").read_text())
    assert "differs from the expected table" not in report.markdown(graded)
    text = report.markdown({**graded, "fingerprint": {**graded["fingerprint"], **newer}})
    assert "01_elementwise_add: your software differs" in text
    assert "triton 3.9.0 (table: 3.6.0)" in text


def test_a_lab_that_times_nothing_is_not_timed_not_incomplete():
    """Lab 08 grades correctness only: its solution is not "incomplete" on a GPU."""
    lab08 = {"lab": "08_communication", "fingerprint": {"mode": "gpu"},
             "functions": [{"name": "ring_all_reduce", "status": "pass", "points": 5,
                            "max_points": 5, "tier": None}]}
    assert report.score_lab(lab08)["grade"] == report.CORRECTNESS_ONLY
    assert report.score_lab({**lab08, "fingerprint": {"mode": "cpu"}})["grade"] == (
        report.CORRECTNESS_ONLY)


def test_a_run_without_timing_says_so():
    assert report.score_lab(lab(None, None), perf=False)["grade"] == report.PERF_OFF
    assert report.score_lab(lab(None, None, mode="cpu"), perf=False)["grade"] == report.NOT_MEASURED
    assert report.score_lab(lab(None, "B"), perf=True)["grade"] == "B"
