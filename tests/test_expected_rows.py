"""Expected rows for any GPU: predicted rows from published rates, calibrated rows measured on the
student's machine (taking precedence), labels wherever they are shown, and the hardware floor's
rate for the dtype timed. CPU only: the GPU is faked by its fingerprint or its `gpu_info`."""

import copy
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import yaml

import grading
from grading import calibrate, cli, devices, expected, performance, student_report
from grading import report as report_mod
from grading.results import PerfResult
from kernels import runtime

from .test_notebook_numbers import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import predict_expected  # noqa: E402

H100_REPORT = ROOT / "data/results/h100-80gb-hbm3/grading/solutions-labs-01-06/report.json"
STUDENT_GPUS = ("a100-sxm4-80gb", "a10", "l4", "geforce-rtx-4090", "tesla-t4", "b200")
RMS = "rms_norm/bf16/32768x4096"


def t4_report() -> dict:
    """The committed H100 grading of solutions/, as if it had been run on a T4."""
    report = json.loads(H100_REPORT.read_text())
    report["fingerprint"].update(gpu="Tesla T4", gpu_slug="tesla-t4", compute_capability="7.5")
    return report


@pytest.fixture
def no_calibration(tmp_path, monkeypatch):
    monkeypatch.setattr(expected, "CALIBRATED_DIR", tmp_path / "calibrated")
    return tmp_path / "calibrated"


@pytest.mark.parametrize("lab_id", sorted(p.stem for p in expected.PREDICTED_DIR.glob("*.yaml")))
def test_the_committed_predictions_are_what_the_script_writes(lab_id):
    committed = yaml.safe_load(expected.path(lab_id, expected.PREDICTED_DIR).read_text())
    written = predict_expected.predict_lab(lab_id, predict_expected.PREDICTED_GPUS)
    assert committed == written, "stale: run `python tools/predict_expected.py`"
    assert set(STUDENT_GPUS) <= set(committed["gpus"])
    for row in committed["gpus"].values():
        assert row["status"] == expected.PREDICTED and row["configs"]
        assert row["basis"]["gpu"] in ("NVIDIA H200", "NVIDIA H100 80GB HBM3")


def test_a_basis_gpu_is_predicted_only_where_it_has_no_measured_row():
    """Lab 02b was measured on the H200 only: the H100 gets a row predicted from it; lab 01 has a
    measured H100 row, which is never overwritten by a prediction."""
    matmul = predict_expected.predict_lab("02b_matmul", predict_expected.PREDICTED_GPUS)
    h100 = matmul["gpus"]["h100-80gb-hbm3"]
    assert h100["status"] == expected.PREDICTED and h100["basis"]["gpu"] == "NVIDIA H200"
    add = predict_expected.predict_lab("01_elementwise_add", predict_expected.PREDICTED_GPUS)
    assert "h100-80gb-hbm3" not in add["gpus"] and "h200" not in add["gpus"]


def test_every_lab_with_a_measured_row_has_predictions():
    measured = {p.stem for p in expected.EXPECTED_DIR.glob("*.yaml")
                if (yaml.safe_load(p.read_text()) or {}).get("gpus")}  # fmt: skip
    predicted = {p.stem for p in expected.PREDICTED_DIR.glob("*.yaml")}
    assert measured and measured == predicted


def test_a_memory_bound_row_scales_with_bandwidth_and_a_compute_bound_one_with_the_peak(
    no_calibration,
):
    h200 = yaml.safe_load(expected.path("02_rmsnorm").read_text())["gpus"]["h200"]["configs"]
    t4 = expected.load("02_rmsnorm", "tesla-t4")["configs"][RMS]
    assert t4["reference_us"] == pytest.approx(h200[RMS]["reference_us"] * 4800 / 320, rel=1e-3)
    forward = "flash_attention/fp16/16x16x2048x64"
    h200 = yaml.safe_load(expected.path("03_flash_attention").read_text())["gpus"]["h200"]
    a100 = expected.load("03_flash_attention", "a100-sxm4-80gb")["configs"][forward]
    expected_us = h200["configs"][forward]["reference_us"] * 989.5 / 312
    assert a100["reference_us"] == pytest.approx(expected_us, rel=1e-3)
    # bf16 has no tensor cores on a T4: its forward is predicted at the CUDA cores' fp32 rate
    t4 = expected.load("03_flash_attention", "tesla-t4")["configs"]
    bf16 = t4["flash_attention/bf16/16x16x2048x64"]
    assert bf16["reference_us"] > 5 * t4[forward]["reference_us"]


def test_a_report_on_a_gpu_without_a_measured_row_shows_the_predicted_times(no_calibration):
    report = t4_report()
    predicted = expected.load("02_rmsnorm", "tesla-t4")
    assert predicted["status"] == expected.PREDICTED
    # the grader's report.md: each configuration's row as the worker recorded it
    for lab in report["labs"]:
        for fn in lab["functions"]:
            for perf in fn["perf"]:
                perf["expected"] = expected.row(expected.load(lab["lab"], "tesla-t4"),
                                                perf["config"])  # fmt: skip
    text = report_mod.markdown(report)
    assert f"{predicted['configs'][RMS]['reference_us']} us (predicted, not measured)" in text
    # the page to hand in
    rows = student_report.rows(report)
    page = student_report.markdown(report, rows, None)
    assert "Against the expected-results table for the Tesla T4" in page
    rms = next(r for r in rows if r["config"] == RMS)
    assert rms["expected_reference_us"] == predicted["configs"][RMS]["reference_us"]
    assert f"{student_report._us(rms['target_us'])} |" in page
    assert "| predicted, not measured |" in page and "`make calibrate`" in page
    assert "the machine, not your kernel, was slow" not in page
    # a check cell's table
    perf = PerfResult(config=RMS, student_us=2000.0, reference_us=1990.0, torch_us=2100.0,
                      spread_us=[1990.0, 2010.0], ratio_to_reference=0.99, gbps=268.0,
                      percent_of_floor=80.0, tier="A", expected=expected.row(predicted, RMS))
    lines = "\n".join(grading.performance_lines(SimpleNamespace(perf=[perf])))
    assert f"{predicted['configs'][RMS]['reference_us']:.2f} (predicted, not measured)" in lines


def test_a_calibrated_row_takes_precedence_and_is_labelled(no_calibration):
    report = t4_report()
    written = calibrate.write_rows(report, H100_REPORT)
    assert {p.parent for p in written} == {no_calibration}
    assert not any(expected.EXPECTED_DIR in p.parents for p in written)
    row = expected.load("02_rmsnorm", "tesla-t4")
    timed = next(p for lab in report["labs"] if lab["lab"] == "02_rmsnorm"
                 for fn in lab["functions"] for p in fn["perf"] if p["config"] == RMS)  # fmt: skip
    assert row["status"] == expected.CALIBRATED == "measured on this machine"
    assert row["configs"][RMS]["reference_us"] == round(timed["reference_us"], 2)
    assert row["fingerprint"]["gpu"] == "Tesla T4"
    page = student_report.markdown(report, student_report.rows(report), None)
    assert "| measured on this machine |" in page and "predicted, not measured" not in page
    # the course's own measured row still comes first for a GPU the course measured
    assert expected.load("02_rmsnorm", "h200")["status"] == expected.MEASURED


def test_a_lab_that_timed_nothing_gets_no_row(no_calibration):
    """Lab 08 times nothing, and a lab whose timed functions failed has no timings: calibrate and
    --write-expected leave such a lab's table as it is."""
    report = t4_report()
    report["labs"] = [{**lab, "functions": [{**f, "perf": []} for f in lab["functions"]]}
                      if lab["lab"] == "02_rmsnorm" else lab for lab in report["labs"]]
    assert not expected.timed_anything(next(lab for lab in report["labs"]
                                            if lab["lab"] == "02_rmsnorm"))
    written = calibrate.write_rows(report, H100_REPORT)
    assert written and not any(p.stem == "02_rmsnorm" for p in written)


def test_a_calibration_needs_a_grading_run_on_a_gpu(no_calibration):
    cpu = copy.deepcopy(t4_report())
    cpu["fingerprint"]["mode"] = "cpu"
    with pytest.raises(ValueError, match="on a GPU"):
        calibrate.write_rows(cpu, H100_REPORT)


@pytest.mark.cpu
def test_calibrate_without_a_gpu_says_it_needs_one(no_calibration, capsys):
    assert cli.main(["calibrate"]) == 2
    err = capsys.readouterr().err
    assert "no CUDA GPU is visible here (CPU mode)" in err and "calibrate" in err
    assert not no_calibration.exists()


@pytest.mark.gpu
def test_calibrate_writes_this_gpus_row_outside_the_repository(tmp_path):
    """`python -m grading calibrate` on the GPU: one lab's row, measured here, where
    KERNELS_CALIBRATED_DIR says, and the repository's tables untouched."""
    before = {p: p.read_bytes() for p in expected.EXPECTED_DIR.rglob("*.yaml")}
    env = {**os.environ, "KERNELS_CALIBRATED_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "grading", "calibrate", "--lab",
                           "01_elementwise_add"], cwd=ROOT, env=env, timeout=1800)  # fmt: skip
    assert done.returncode == 0
    table = yaml.safe_load((tmp_path / "01_elementwise_add.yaml").read_text())
    info = runtime.gpu_info()
    row = table["gpus"][info.slug]
    assert row["status"] == expected.CALIBRATED and row["fingerprint"]["gpu"] == info.name
    assert "add/fp16/64M" in row["configs"] and row["configs"]["add/fp16/64M"]["reference_us"] > 0
    assert {p: p.read_bytes() for p in expected.EXPECTED_DIR.rglob("*.yaml")} == before


def fake_gpu(monkeypatch, slug: str, bf16: bool) -> None:
    monkeypatch.setattr(runtime, "gpu_info", lambda: SimpleNamespace(slug=slug))
    monkeypatch.setattr(runtime, "has", lambda feature: bf16 and feature == "bf16")
    monkeypatch.setattr(performance.bench, "ceilings",
                        lambda: {"copy_gbps": 300.0, "matmul_bf16_tflops": 20.0})  # fmt: skip


@pytest.mark.parametrize(
    "slug, bf16, dtype, tflops",
    [
        ("tesla-t4", False, torch.bfloat16, 65),  # no bf16 tensor cores: its fp16 ones
        ("tesla-t4", False, torch.float16, 65),
        ("h200", True, torch.bfloat16, 989.5),
        ("geforce-rtx-4090", True, torch.float16, 330.3),  # fp16 accumulation, twice as fast
        ("geforce-rtx-4090", True, torch.bfloat16, 330.3),  # bf16 fits in those fp16 products
        ("some-new-gpu", True, torch.bfloat16, 20.0),  # not in the table: the measured rate
    ],
)
def test_the_floor_uses_a_rate_the_gpu_has_for_the_dtype(monkeypatch, slug, bf16, dtype, tflops):
    fake_gpu(monkeypatch, slug, bf16)
    flops = 1e15
    assert performance.floor_us(0, flops, dtype) == pytest.approx(flops / (tflops * 1e12) * 1e6)
    # the bytes' floor is the measured copy bandwidth's, whatever the dtype
    assert performance.floor_us(3e11, 0, dtype) == pytest.approx(1e6)


def test_a_gpu_outside_the_table_without_bf16_is_floored_by_its_bytes_alone(monkeypatch):
    fake_gpu(monkeypatch, "some-old-gpu", bf16=False)
    assert performance.floor_us(3e11, 1e18, torch.float16) == pytest.approx(1e6)


# kernels.runtime.GPU_PROFILES key -> its name in data/gpu_specs.yaml
PROFILE_SLUGS = {"t4": "tesla-t4", "a100": "a100-sxm4-80gb", "a10": "a10",
                 "rtx3090": "geforce-rtx-3090", "l4": "l4", "rtx4090": "geforce-rtx-4090",
                 "h100": "h100-80gb-hbm3", "h200": "h200", "b200": "b200"}  # fmt: skip


def test_the_published_rates_agree_with_the_runtime_feature_table():
    """Every GPU profile of kernels.runtime but the RTX 5090 (whose floor falls back to its
    measured rate) has published rates with a source; bf16 and fp8 rates exactly where the
    feature table says the GPU has them."""
    assert set(PROFILE_SLUGS) == set(runtime.GPU_PROFILES) - {"rtx5090"}
    for key, slug in PROFILE_SLUGS.items():
        profile, row = runtime.GPU_PROFILES[key], devices.spec(slug)
        assert row["source"] and row["bandwidth_gbps"] > 0 and row["memory_gb"] > 0, slug
        assert ("bf16" in row["tflops"]) == profile.bf16, slug
        assert ("fp8" in row["tflops"]) == profile.fp8, slug
