"""What a notebook check cell prints (`grading.check`): the grader's result as a compact,
colour-coded dtype x shape table, the failures with their error figures, and the status line."""

import re

import grading
from grading.harness import FunctionResult, PerfResult

LAB = "01_elementwise_add"
ANSI = re.compile(r"\033\[[0-9;]*m")


def printed(capsys) -> list[str]:
    return capsys.readouterr().out.splitlines()


def test_failing_function_shows_a_table_and_its_failures(capsys):
    def rejects_everything(a, b, out=None):
        raise ValueError("not today")

    grading.check(LAB, "add", rejects_everything, seed=0)
    lines = printed(capsys)
    plain = [ANSI.sub("", line) for line in lines]
    assert plain[0].split()[:3] == ["add:", "n", "1"] and "1025 strided" in plain[0]
    assert [p.split()[0] for p in plain[1:4]] == ["float32", "float16", "bfloat16"]
    assert all("FAIL" in p for p in plain[1:4])
    assert "\033[31mFAIL\033[0m" in lines[1]  # red
    assert "PASS" in plain[2]  # the strided fp16 view is rejected clearly: that passes
    fails = [p for p in plain if p.startswith("  FAIL  ")]
    assert len(fails) == grading.MAX_FAILURES_SHOWN and "ValueError: not today" in fails[0]
    assert plain[-2].startswith("  ... and ") and plain[-1].startswith("FAIL  add: 0/3 points")
    widths = {len(p) for p in plain[:4]}
    assert len(widths) == 1, plain[:4]  # aligned: colour codes do not count


def test_not_implemented_prints_only_the_status_line(capsys):
    def stub(a, b, out=None):
        raise NotImplementedError()

    grading.check(LAB, "add", stub, seed=0)
    assert [ANSI.sub("", line) for line in printed(capsys)] == [
        "NOT IMPLEMENTED  add: 0/3 points -- not implemented yet"
    ]


def test_performance_table_has_the_report_columns_and_coloured_tiers():
    result = FunctionResult(
        "add",
        "triton",
        "",
        "pass",
        3,
        3,
        perf=[
            PerfResult(
                config="add/fp16/64M",
                student_us=93.1,
                reference_us=93.0,
                torch_us=92.1,
                spread_us=[92.0, 94.0],
                ratio_to_reference=1.0,
                gbps=4321.0,
                percent_of_floor=101.0,
                tier="A",
                expected={"reference_us": 92.99, "status": "measured"},
            ),
            PerfResult(
                config="add/fp32/64M",
                student_us=300.1,
                reference_us=186.0,
                torch_us=184.1,
                spread_us=[299.0, 301.0],
                ratio_to_reference=0.62,
                gbps=2000.0,
                percent_of_floor=62.0,
                tier="F",
                note="output wrong at this size: not credited",
            ),
        ],
    )
    lines = grading.performance_lines(result)
    plain = [ANSI.sub("", line) for line in lines]
    for column in (
        "yours us",
        "p10-p90",
        "reference us",
        "torch us",
        "vs reference",
        "GB/s",
        "% floor",
        "tier",
        "expected ref us",
        "note",
    ):
        assert column in plain[0]
    assert "92.99 (measured)" in plain[1] and "no row" in plain[2] and "not credited" in plain[2]
    assert "\033[32mA\033[0m" in lines[1] and "\033[31mF\033[0m" in lines[2]
