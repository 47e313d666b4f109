"""The profiling lesson's tooling (kernels/profiling): the lab's two transposes, the ncu CSV and
Chrome trace readers and the roofline arithmetic, on made-up inputs where the answer is known and on
the profiles committed in data/results/<gpu>/00_profiling/."""

import json

import pytest
import torch

from kernels import runtime
from kernels.profiling import lab, ncu, roofline, trace, transpose, workloads
from kernels.testing import poison_

GPU = lab.profile_gpu()
FOLDER = ncu.results_dir(GPU)
TRANSPOSES = (transpose.transpose_naive, transpose.transpose_tiled)
SHAPES = ((1, 1), (7, 5), (65, 130), (300, 17), (3, 1000), (64, 64))


# --------------------------------------------------------------------------------------------------
# The lab's kernels


@pytest.mark.parametrize("fn", TRANSPOSES, ids=lambda f: f.__name__)
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16), ids=str)
def test_transpose_is_exact(fn, dtype):
    for shape in SHAPES:
        x = torch.randn(shape, device=runtime.DEVICE).to(dtype)
        out = poison_(torch.empty(shape[::-1], device=runtime.DEVICE, dtype=dtype))
        assert fn(x, out) is out
        assert torch.equal(out, x.t()), (fn.__name__, shape)
        assert torch.equal(fn(x), x.t())


@pytest.mark.parametrize("fn", TRANSPOSES, ids=lambda f: f.__name__)
def test_transpose_rejects_what_it_cannot_do(fn):
    x = torch.randn(8, 6, device=runtime.DEVICE)
    with pytest.raises(ValueError, match="contiguous"):
        fn(x.t())
    with pytest.raises(ValueError, match="2-D"):
        fn(x.reshape(2, 4, 6))
    with pytest.raises(TypeError, match="dtype"):
        fn(x.to(torch.int32))
    with pytest.raises(ValueError, match="out must be 6x8"):
        fn(x, torch.empty(8, 6, device=runtime.DEVICE))


@pytest.mark.gpu
@pytest.mark.parametrize("fn", TRANSPOSES, ids=lambda f: f.__name__)
def test_transpose_at_the_profiled_size(fn):
    x = torch.randn(workloads.TRANSPOSE, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(fn(x), x.t())


# --------------------------------------------------------------------------------------------------
# Reading ncu's CSV

RAW = """==PROF== Connected to process 1
"ID","Kernel Name","Block Size","Grid Size","dram__bytes_read.sum","gpu__time_duration.sum","l__x"
"","","","","byte","nsecond",""
"0","k1","(128, 1, 1)","(4, 1, 1)","1,048,576","2,000","n/a"
"1","k2","(256, 1, 1)","(8, 1, 1)","512","8,000.5","3"
"""


def test_parse_csv_reads_values_units_and_text():
    k1, k2 = ncu.parse_csv(RAW)
    assert (k1.name, k1.block, k2.grid) == ("k1", "(128, 1, 1)", "(8, 1, 1)")
    assert k1["dram__bytes_read.sum"] == 1048576.0 and k2["gpu__time_duration.sum"] == 8000.5
    assert k1.units["gpu__time_duration.sum"] == "nsecond"
    assert k1.get("l__x") is None and k2["l__x"] == 3.0
    with pytest.raises(KeyError, match="no numeric value"):
        k1["l__x"]
    assert ncu.main_kernel([k1, k2]).name == "k2"  # the longest
    assert ncu.main_kernel([k1, k2], "k1").name == "k1"
    with pytest.raises(ValueError, match="Kernel Name"):
        ncu.parse_csv('"a","b"\n"1","2"\n')


def test_profile_command_profiles_only_the_marked_call_at_real_clocks(tmp_path):
    cmd = ncu.profile_command("ncu", "add", ["dram__bytes_read.sum"], tmp_path / "r")
    joined = " ".join(cmd)
    assert "--profile-from-start off" in joined and "--clock-control none" in joined
    assert (
        "--metrics dram__bytes_read.sum" in joined
        and "-m kernels.profiling.workloads add" in joined
    )
    assert all(f"--section {s}" in joined for s in ncu.SECTIONS)
    assert ncu.base_name("sm__warps_active.avg.pct_of_peak_sustained_active") == "sm__warps_active"


def test_matmul_profiles_ask_where_the_cycles_went(tmp_path):
    """The missed targets' workloads add the warp-state sections and bank-conflict counters to
    the usual ones, and count their compulsory bytes at their operands' widths."""
    for name in workloads.MATMUL_WHY:
        work = workloads.get(name)
        joined = " ".join(ncu.profile_command("ncu", name, [], tmp_path / "r", work.sections))
        assert all(f"--section {s}" in joined for s in (*ncu.SECTIONS, "WarpStateStats"))
        assert work.tensor_cores and work.flops > 0
        assert any("bank_conflicts" in m for m in work.metrics)
    m, n, k = workloads.MLP_SHAPE
    assert workloads.get("matmul_gluon").bytes == 2 * (m * k + k * n + m * n)
    assert workloads.get("matmul_fp8_block_scaled").bytes == m * k + k * n + 2 * m * n
    assert workloads.get("matmul_fp8_block_scaled").flops == 2 * m * n * k


@pytest.mark.parametrize("name", workloads.PROFILED)
def test_committed_profile_reads_back(name):
    kernels, meta = ncu.load(name, GPU)
    k = ncu.main_kernel(kernels, meta["kernel"])
    assert meta["fingerprint"]["gpu_slug"] == GPU and meta["bytes"] > 0
    assert k["gpu__time_duration.sum"] > 0 and k["dram__bytes_read.sum"] > 0
    for metric in (
        "sm__throughput.avg.pct_of_peak_sustained_elapsed",
        "sm__warps_active.avg.pct_of_peak_sustained_active",
        "launch__registers_per_thread",
    ):
        assert 0 < k[metric] <= 255, metric


# --------------------------------------------------------------------------------------------------
# The roofline


def _profile(duration_ns, read, written, **extra):
    values = {
        "gpu__time_duration.sum": duration_ns,
        "dram__bytes_read.sum": read,
        "dram__bytes_write.sum": written,
        **extra,
    }
    return ncu.KernelProfile("k", "", "", values, {})


CEIL = {"copy_gbps": 1000.0, "matmul_bf16_tflops": 100.0}  # ridge point: 100 flop/byte


def test_memory_bound_placement():
    # 1 GB in 2 ms = 500 GB/s; 1 flop/byte; the memory roof there is 1 TFLOP/s
    p = roofline.place(
        "m", [_profile(2e6, 6e8, 4e8)], required_bytes=int(5e8), flops=int(1e9), ceilings=CEIL
    )
    assert p.duration_us == pytest.approx(2000) and p.achieved_gbps == pytest.approx(500)
    assert p.intensity == pytest.approx(1.0) and p.roof_tflops == pytest.approx(1.0)
    assert p.achieved_tflops == pytest.approx(0.5) and p.fraction_of_roof == pytest.approx(0.5)
    assert p.bound == "memory" and p.bytes_ratio == pytest.approx(2.0)


def test_compute_bound_placement_and_counted_flops():
    k = _profile(
        1e6,
        1e8,
        0.0,
        **{
            "smsp__sass_thread_inst_executed_op_ffma_pred_on.sum": 1e9,
            "sm__ops_path_tensor_src_bf16_dst_fp32.sum": 5e10,
        },
    )
    p = roofline.place("c", [k, k], required_bytes=int(2e8), flops=int(1.6e11), ceilings=CEIL)
    assert p.intensity == pytest.approx(800) and p.bound == "compute"
    assert p.roof_tflops == pytest.approx(100) and p.achieved_tflops == pytest.approx(80)
    assert p.fraction_of_roof == pytest.approx(0.8)
    assert p.counted_flops == pytest.approx(2 * (2e9 + 5e10))
    assert roofline.ridge_point(CEIL) == pytest.approx(100)
    assert list(roofline.roof([1, 100, 1000], CEIL)) == pytest.approx([1, 100, 100])


def test_without_flops_the_point_is_bandwidth():
    p = roofline.place(
        "t", [_profile(1e6, 4e8, 4e8)], required_bytes=int(8e8), flops=0, ceilings=CEIL
    )
    assert p.intensity is None and p.fraction_of_roof == pytest.approx(0.8) and p.bound == "memory"


def test_committed_roofline_is_plausible():
    ceil = json.loads((FOLDER / "timings.json").read_text())["ceilings"]
    for name in workloads.COURSE + workloads.ANCHORS:
        kernels, meta = ncu.load(name, GPU)
        p = roofline.place(name, kernels, meta["bytes"], meta["flops"], ceil)
        assert 0.02 < p.fraction_of_roof < 1.25, (name, p)
        assert p.bytes_ratio > 0.5, (name, p)
    # ncu's durations (one launch) agree with the event timings (median of many) within 10%
    events = json.loads((FOLDER / "timings.json").read_text())["events"]
    for name in workloads.PROFILED:
        kernels, _ = ncu.load(name, GPU)
        ncu_us = sum(k["gpu__time_duration.sum"] for k in kernels) / 1e3
        assert ncu_us == pytest.approx(events[name]["median_us"], rel=0.1), name


def test_the_lab_answer_is_in_the_committed_profile():
    slow, _ = lab.readings(lab.SLOW, GPU)
    fixed, _ = lab.readings(lab.FIXED, GPU)
    # the slow kernel's loads touch many times the bytes they need; the fix's touch about what it
    # needs
    assert slow[lab.ANSWER] > 8 and fixed[lab.ANSWER] < 1.5
    assert slow[0] > 2 * fixed[0]  # and it is the slower one


# --------------------------------------------------------------------------------------------------
# Chrome traces


def _event(cat, name, ts, dur, **args):
    return {
        "ph": "X",
        "cat": cat,
        "name": name,
        "pid": 1,
        "tid": 1,
        "ts": ts,
        "dur": dur,
        "args": args,
    }


SYNTHETIC = {
    "traceEvents": [
        _event("user_annotation", "forward", 0, 100),
        _event("user_annotation", "backward", 100, 100),
        _event("cuda_runtime", "cudaLaunchKernel", 10, 5, correlation=1),
        _event("cuda_runtime", "cudaLaunchKernel", 20, 5, correlation=2),
        _event("cuda_runtime", "cudaLaunchKernel", 150, 5, correlation=3),
        _event("kernel", "sm90_xmma_gemm_bf16", 30, 40, correlation=1),
        _event("kernel", "vectorized_elementwise_kernel", 70, 10, correlation=2),
        _event("kernel", "flash_fwd_kernel", 180, 20, correlation=3),
        {"ph": "i", "cat": "kernel", "name": "instant", "ts": 5},
    ]
}


def test_trace_totals_phases_and_gaps():
    t = trace.parse_trace(SYNTHETIC)
    assert [k.name for k in t.kernels][0] == "sm90_xmma_gemm_bf16" and len(t.kernels) == 3
    totals = trace.kernel_totals(t)
    assert totals["by_category"] == {"attention": 20.0, "matmul": 40.0, "other": 10.0}
    assert trace.category("fmha_cutlassF_f32_aligned_64x64_rf_sm80") == "attention"
    assert totals["total_us"] == 70.0
    assert trace.phase_of_kernels(t) == ["forward", "forward", "backward"]
    phases = trace.phase_totals(t)
    assert phases["forward"] == {"host_us": 100.0, "gpu_us": 50.0, "kernels": 2}
    assert phases["backward"]["gpu_us"] == 20.0 and phases["optimizer"]["kernels"] == 0
    gaps = trace.gpu_gaps(t)
    assert (
        gaps["window_us"] == 170.0 and gaps["busy_us"] == 70.0 and gaps["gaps"] == [(80.0, 100.0)]
    )
    assert trace.summary(t)["gaps_over_10us"] == 1


def test_overlapping_kernels_are_not_counted_twice():
    events = [
        _event("kernel", "a", 0, 10),
        _event("kernel", "b", 5, 10),
        _event("kernel", "c", 20, 5),
    ]
    gaps = trace.gpu_gaps(trace.parse_trace({"traceEvents": events}))
    assert gaps["busy_us"] == 20.0 and gaps["idle_us"] == 5.0


def test_trim_keeps_what_a_timeline_needs():
    raw = {
        "traceEvents": [
            _event("kernel", "k", 0, 1, correlation=7, stream=7, junk="x" * 100),
            _event("python_function", "f", 0, 1),
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 1, "args": {"name": "t"}},
        ],
        "deviceProperties": [{"id": 0}],
    }
    trimmed = trace.trim(raw)
    assert [e.get("cat") for e in trimmed["traceEvents"]] == ["kernel", None]
    assert trimmed["traceEvents"][0]["args"] == {"correlation": 7, "stream": 7}
    assert trimmed["deviceProperties"] == [{"id": 0}]
    with pytest.raises(ValueError, match="no GPU kernels"):
        trace.parse_trace({"traceEvents": [_event("cpu_op", "aten::mm", 0, 1)]})


@pytest.mark.parametrize("label", ("fp32", "bf16"))
def test_committed_trace(label):
    path = FOLDER / f"trace_{label}.json"
    assert path.stat().st_size < 4e6  # small enough to commit
    t = trace.read_trace(path)
    s = trace.summary(t)
    recorded = json.loads((FOLDER / "trace_summary.json").read_text())["summaries"][label]
    assert s["kernels"] == recorded["kernels"] and s["kernel_us"] == pytest.approx(
        recorded["kernel_us"]
    )
    assert s["by_category"]["matmul"] > 0 and s["kernel_us"] <= s["window_us"]
    assert all(s["by_phase"][p]["kernels"] > 0 for p in trace.PHASES)
    assert (
        sum(p["kernels"] for p in s["by_phase"].values()) == s["kernels"]
    )  # every kernel in a phase


def test_profile_step_marks_the_phases():
    from kernels.memory_profiling.gpt import GPTConfig

    cfg = GPTConfig(vocab=64, max_seq=8, d_model=32, layers=1, heads=2)
    prof = trace.profile_step(cfg, 1, 8, warmup=1)
    names = {e.name for e in prof.events()}
    assert {"forward", "backward", "optimizer", "training step"} <= names
    # Every row: which ops lead by host time depends on how busy the machine is.
    assert "aten::mm" in trace.key_averages_table(prof, rows=len(prof.key_averages()))
