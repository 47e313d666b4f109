"""The correctness and timing helpers: a comparison that a wrong kernel cannot pass, and timers that
say what they measured."""

import math
import time

import pytest
import torch

from kernels import bench, runtime
from kernels.testing import compare, poison_, random_tensor, strided_view, tolerance


def test_poisoned_unwritten_element_fails():
    expected = torch.arange(10, dtype=torch.float64) + 0.5
    out = poison_(torch.empty(10))
    out[:9] = expected[:9].float()
    cmp = compare(out, expected, atol=0, rtol=1e-6)
    assert not cmp.ok and cmp.n_nan == 1 and cmp.first_bad_index == [9]
    assert "first bad index 9" in cmp.reason and "NaN" in cmp.reason


def test_nan_in_both_never_passes():
    expected = torch.tensor([1.0, float("nan")], dtype=torch.float64)
    assert not compare(torch.tensor([1.0, float("nan")]), expected, atol=1, rtol=1).ok


def test_an_infinity_matches_only_the_same_infinity():
    want = torch.tensor([float("-inf"), 1.0, float("inf")], dtype=torch.float64)
    assert compare(torch.tensor([float("-inf"), 1.0, float("inf")]), want, atol=0, rtol=0).ok
    for wrong in (
        [float("inf"), 1.0, float("inf")],
        [-1e30, 1.0, float("inf")],
        [float("nan"), 1.0, float("inf")],
    ):
        cmp = compare(torch.tensor(wrong), want, atol=1e-3, rtol=1e-3)
        assert not cmp.ok and cmp.first_bad_index == [0], cmp.reason
    assert not compare(
        torch.tensor([float("-inf")]), torch.tensor([0.0], dtype=torch.float64), atol=1, rtol=1
    ).ok


def test_one_ulp_error_passes_and_two_fail():
    expected = torch.full((4,), 1.0, dtype=torch.float64)
    atol, rtol = tolerance(torch.float16)
    one_ulp = torch.full((4,), 1.0 + 2**-10, dtype=torch.float16)
    two_ulp = torch.full((4,), 1.0 + 2**-9, dtype=torch.float16)
    assert compare(one_ulp, expected, atol=atol, rtol=rtol).ok
    assert not compare(two_ulp, expected, atol=atol, rtol=rtol).ok


def test_worst_index_is_multidimensional_and_reports_values():
    expected = torch.zeros(3, 4, dtype=torch.float64)
    actual = torch.zeros(3, 4)
    actual[2, 1] = 5.0
    cmp = compare(actual, expected, atol=1e-3, rtol=0)
    assert cmp.worst_index == [2, 1] and cmp.actual_at_worst == 5.0 and cmp.expected_at_worst == 0.0


def test_shape_mismatch_and_non_tensor():
    expected = torch.zeros(3, dtype=torch.float64)
    assert "wrong shape" in compare(torch.zeros(4), expected, atol=1, rtol=1).reason
    assert "returned NoneType" in compare(None, expected, atol=1, rtol=1).reason


def test_random_inputs_are_not_zeros_and_strided_view_keeps_values():
    t = random_tensor((1000,), torch.float16, "cpu")
    assert t.abs().min() >= 0 and (t != 0).float().mean() > 0.99 and t.std() > 0.5
    v = strided_view(t)
    assert not v.is_contiguous() and torch.equal(v, t)


def test_cpu_timings_are_labelled_as_host_timings():
    if runtime.ON_GPU:
        t = bench.benchmark({"noop": lambda: None}, reps=5)["noop"]
        assert t.clock == "cuda-events"
    else:
        t = bench.benchmark({"noop": lambda: None})["noop"]
        assert t.clock == "cpu-host"
        assert bench.ceilings() is None and bench.floor_us(1e9) is None
    assert len(t.times_us) >= 3 and t.median_us >= 0


def test_guard_outlasts_the_host_launch_path():
    assert bench.guard_cycles(0.0) == bench.GUARD_CYCLES  # about 100 us even for the fastest launch
    # twice the host's time at 2 GHz
    assert bench.guard_cycles(400.0) == 2 * 400 * bench.CYCLES_PER_US
    # a 2 s first call (compiling) is not spun for
    assert bench.guard_cycles(2e6) == bench.MAX_GUARD_CYCLES


def test_round_hooks_run_around_every_timed_round():
    """before_round before every round (warm-up included), after_round after every timed one."""
    calls = []
    timings = bench.benchmark(
        {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
        reps=4,
        warmup=2,
        before_round=lambda: calls.append("new inputs"),
        after_round=lambda: calls.append("check"),
    )
    assert len(timings["a"].times_us) == len(timings["b"].times_us) == 4
    assert calls.count("check") == 4
    warmups = 2 if runtime.ON_GPU else 1  # the host timer warms up once
    assert calls.count("new inputs") == 4 + warmups
    first_check = calls.index("check")
    assert calls[first_check - 3] == "new inputs" and sorted(
        calls[first_check - 2 : first_check]
    ) == ["a", "b"]


@pytest.mark.gpu
def test_events_do_not_time_a_slow_host_launch_path():
    """A call that spends 300 us in Python before launching a tiny kernel: the device time is the
    kernel's, not the host's. With a fixed 100 us spin ahead of the start event it read about 200 us
    more."""
    x = torch.randn(1024, device="cuda")

    def slow_host_then_tiny_kernel():
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 300e-6:
            pass
        x.add_(1.0)

    t = bench.benchmark({"slow host": slow_host_then_tiny_kernel}, reps=20)["slow host"]
    assert t.median_us < 50, t.median_us


def test_ratio_pairs_repetitions():
    slow = bench.Timing("a", [10.0, 20.0, 30.0], "cpu-host")
    fast = bench.Timing("b", [5.0, 10.0, 15.0], "cpu-host")
    assert bench.ratio(slow, fast) == 2.0
    assert math.isclose(fast.gbps(1e6), 1e6 / 10e-6 / 1e9)


def test_table_aligns_columns():
    text = bench.table([{"a": 1.234, "b": "x"}, {"a": 10.0, "b": None}])
    lines = text.splitlines()
    assert len({len(line) for line in lines}) == 1 and "1.2" in text


def test_fingerprint_has_the_versions_results_need():
    fp = runtime.fingerprint()
    for key in ("mode", "gpu", "driver", "torch", "triton", "cupy", "cuda", "date"):
        assert key in fp
    assert fp["mode"] == runtime.MODE


def test_gpu_slug():
    assert runtime.gpu_slug("NVIDIA H100 80GB HBM3") == "h100-80gb-hbm3"
    assert runtime.gpu_slug("NVIDIA H200") == "h200"


@pytest.mark.parametrize("value", ["tpu", "GPUU"])
def test_invalid_mode_is_rejected(value, monkeypatch):
    import importlib

    monkeypatch.setenv("KERNELS_MODE", value)
    with pytest.raises(ValueError, match="KERNELS_MODE"):
        importlib.reload(runtime)
    monkeypatch.delenv("KERNELS_MODE")
    importlib.reload(runtime)


def test_results_are_saved_per_gpu_as_strict_json(tmp_path, monkeypatch):
    import json

    monkeypatch.setattr(bench, "RESULTS_DIR", tmp_path)
    path = bench.save_results(
        "99_example", {"fingerprint": {"gpu": "Test GPU"}, "median_us": 1.5}, gpu_slug="testgpu"
    )
    assert path == tmp_path / "testgpu" / "99_example.json"
    assert json.loads(path.read_text()) == {"fingerprint": {"gpu": "Test GPU"}, "median_us": 1.5}
