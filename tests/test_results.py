"""kernels.results: a number is shown with the machine it came from."""

import json

import pytest
import torch

from kernels import results


def _never():
    raise AssertionError("measure() must not run without a GPU")


@pytest.mark.cpu  # the CPU path: the committed run stands in
def test_without_a_gpu_the_named_gpus_committed_run_is_shown_and_named():
    run = results.Run("02_rmsnorm", gpu="h100-80gb-hbm3", by="python -m kernels.rmsnorm.benchmark")
    saved = json.loads((results.RESULTS_DIR / "h100-80gb-hbm3" / "02_rmsnorm.json").read_text())
    forward, copy_gbps, where = run.show("forward", _never)
    assert forward == saved["forward"] and copy_gbps == saved["ceilings"]["copy_gbps"]
    assert where.startswith("recorded on a GPU, not this machine: NVIDIA H100 80GB HBM3, ")
    assert "python -m kernels.rmsnorm.benchmark" in where
    both, _, _ = run.show(("forward", "decode_graph"), _never)
    assert set(both) == {"forward", "decode_graph"}
    ceilings, ceil_where = run.ceilings()
    assert ceilings == saved["ceilings"] and ceil_where == where


@pytest.mark.cpu
def test_a_run_without_ceilings_still_shows_its_sections():
    run = results.Run("05_memory_profiling", gpu="h200", by="kernels.memory_profiling.benchmark")
    ce, copy_gbps, where = run.show("fused_linear_cross_entropy", _never)
    assert "pytorch" in ce["impls"] and copy_gbps is None and "NVIDIA H200" in where
    assert run.ceilings() == (None, None)


@pytest.mark.cpu
def test_a_missing_run_says_how_to_make_it(capsys):
    run = results.Run("no_such_benchmark", gpu="h200", by="python -m kernels.nothing")
    saved, why = run.recorded()
    assert saved is None and "data/results/h200/no_such_benchmark.json" in why
    assert "python -m kernels.nothing" in why
    assert run.show("x", _never) == (None, None, None)
    assert "not measured" in capsys.readouterr().out


def test_an_unknown_gpu_is_refused_with_the_known_ones():
    with pytest.raises(ValueError, match="h100-80gb-hbm3"):
        results.Run("02_rmsnorm", gpu="h300", by="-")


def test_describe_names_gpu_date_and_software():
    fp = {
        "gpu": "NVIDIA H200",
        "date": "2026-11-21T10:00:00",
        "driver": "580",
        "cuda": "13.0",
        "torch": "2.11.0",
        "triton": "3.6.0",
        "cupy": "14.2.0",
    }
    assert results.describe(fp, True, "cmd") == (
        "recorded on this GPU model: NVIDIA H200, 2026-11-21, driver 580, CUDA 13.0, torch 2.11.0, "
        "triton 3.6.0, cupy 14.2.0, by `cmd`"
    )


def test_oplog_counts_the_bytes_of_each_op_on_the_meta_device():
    x = torch.empty(1024, 256, dtype=torch.bfloat16, device="meta")
    with results.OpLog() as log:
        (x * x).sum(dim=-1)
    assert [r["op"].split(".")[0] for r in log.rows] == ["mul", "sum"]
    mul, total = log.rows
    assert mul["MB read"] == pytest.approx(2 * 1024 * 256 * 2 / 1e6)
    assert mul["MB written"] == pytest.approx(1024 * 256 * 2 / 1e6)
    assert total["output shape"] == (1024,)


@pytest.mark.cpu
def test_a_gpu_without_the_feature_shows_the_committed_run_and_says_why(monkeypatch, capsys):
    """An A100 asked for a PDL measurement: the committed H100 run, and a sentence naming pdl."""
    from kernels import runtime

    a100 = runtime.GPU_PROFILES["a100"]
    monkeypatch.setattr(runtime, "ON_GPU", True)
    monkeypatch.setattr(runtime, "features", lambda: a100)
    monkeypatch.setattr(
        runtime,
        "gpu_info",
        lambda: runtime.GpuInfo("NVIDIA A100 80GB", "a100-80gb", "8.0", 108, 80.0, 0),
    )
    run = results.Run("02_rmsnorm", gpu="h100-80gb-hbm3", by="python -m kernels.rmsnorm.benchmark")
    saved = json.loads((results.RESULTS_DIR / "h100-80gb-hbm3" / "02_rmsnorm.json").read_text())
    forward, _, where = run.show("forward", _never, needs="pdl")
    assert forward == saved["forward"] and "NVIDIA H100 80GB HBM3" in where
    said = capsys.readouterr().out
    assert "A100 80GB (sm_80) has no pdl" in said and "H100, H200" in said
