"""The lab grade: the worst tier among the functions the lab times; a question it never times has
none, and cannot make the grade "incomplete"."""

from grading import report


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
