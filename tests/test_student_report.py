"""grading.student_report: the one-page benchmark report a student hands in beside the grade."""

import copy
import json
import shutil

from grading import student_report

from .test_notebook_numbers import ROOT

COMMITTED = ROOT / "data" / "results" / "h100-80gb-hbm3" / "grading" / "solutions-labs-01-06"


def test_the_committed_h100_report_gives_a_page_and_a_plot(tmp_path):
    assert student_report.main([str(COMMITTED), "--out", str(tmp_path)]) == 0
    page = (tmp_path / "benchmark.md").read_text()
    png = (tmp_path / "benchmark.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    report = json.loads((COMMITTED / "report.json").read_text())
    assert "NVIDIA H100 80GB HBM3" in page and "driver 580.159.04" in page
    for lab in report["labs"]:  # every lab's score, and every timed configuration with its ratio
        assert f"| {lab['lab']} | {lab['score']['points']}/{lab['score']['max_points']} |" in page
        for fn in lab["functions"]:
            for perf in fn["perf"]:
                assert f"`{perf['config']}` | " in page
                assert f"{perf['ratio_to_reference']:.2f}×" in page
    # the expected table for this GPU: the flash-attention forward's target time, from data/expected
    assert "Against the expected-results table for the NVIDIA H100 80GB HBM3" in page
    assert "![speed relative to the reference kernel](benchmark.png)" in page


def test_slow_kernels_and_a_slow_machine_are_named(tmp_path):
    report = json.loads((COMMITTED / "report.json").read_text())
    perf = report["labs"][0]["functions"][1]["perf"][0]  # add/fp16/64M
    perf["student_us"], perf["ratio_to_reference"], perf["tier"] = 250.0, 0.52, "D"
    for lab in report["labs"]:
        for fn in lab["functions"]:
            for p in fn["perf"]:
                p["reference_us"] *= 1.5  # a busy machine: each reference 50% over the table
    (tmp_path / "report.json").write_text(json.dumps(report))
    md, png = student_report.write(tmp_path)
    page = md.read_text()
    assert "## Where to look first" in page and "`add/fp16/64M`: 0.52× the reference" in page
    assert "the machine, not your kernel, was slow" in page
    assert png.is_file()


def test_without_a_gpu_the_page_says_not_measured_and_draws_nothing(tmp_path):
    report = json.loads((COMMITTED / "report.json").read_text())
    cpu = copy.deepcopy(report)
    cpu["fingerprint"] = {"mode": "cpu"}
    for lab in cpu["labs"]:
        lab["score"]["grade"] = "not measured: no GPU"
        for fn in lab["functions"]:
            fn["perf"], fn["tier"] = [], None
    (tmp_path / "report.json").write_text(json.dumps(cpu))
    md, png = student_report.write(tmp_path)
    assert png is None and not (tmp_path / "benchmark.png").exists()
    page = md.read_text()
    assert "Not measured: no GPU" in page and "| 01_elementwise_add | 10/10 | not measured" in page


def test_a_folder_without_a_report_is_refused(tmp_path, capsys):
    assert student_report.main([str(tmp_path)]) == 2
    assert "run `python -m grading`" in capsys.readouterr().err
    shutil.rmtree(tmp_path)
