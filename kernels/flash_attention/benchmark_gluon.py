"""Benchmark of the warp-specialized Gluon forward (gluon_flash.py): forward only, at the course's
target shapes, beside the Triton kernel, FlashAttention-2 and cuDNN (SDPA), and the Gluon schedules
beside its default, interleaved in one process.

    python -m kernels.flash_attention.benchmark_gluon
        -> data/results/<gpu>/03_flash_attention_gluon.json
"""

from __future__ import annotations

import functools
import sys

import torch

from kernels import bench
from kernels.flash_attention import triton_flash
from kernels.flash_attention.benchmark import (
    DTYPES,
    TARGET_SHAPES,
    attention_flops,
    case_keys,
    case_label,
    make_inputs,
    passed,
    print_cases,
    rates,
    run_to_own_file,
    runs,
    sdpa_backend,
)

# The Gluon schedules timed beside the default (gluon_flash's docstring and DEFAULT_SCHEDULE): the
# default with one of its choices set either way (where one way is the default, "ours (Gluon)" is
# it), then combinations of warpgroups, overlap and grid, which keep the case's turns and ring depth
# (so "2 warpgroups" has the turns at D = 64 and none at D = 128, as the defaults there).
PERSISTENT_OVERLAP = {"warpgroups": 2, "overlap": True, "persistent": True}
GLUON_SCHEDULES = {
    "ping-pong": {"pingpong": True},
    "no ping-pong": {"pingpong": False},
    "2 stages": {"stages": 2},
    "3 stages": {"stages": 3},
    "2 warpgroups": {"warpgroups": 2, "overlap": False, "persistent": False},
    "S overlap": {"warpgroups": 2, "overlap": True, "persistent": False},
    "3 warpgroups": {"warpgroups": 3, "overlap": False, "persistent": False},
    "3 warpgroups, S overlap": {"warpgroups": 3, "overlap": True, "persistent": False},
    "persistent": {"warpgroups": 2, "overlap": False, "persistent": True},
    "persistent, S overlap": PERSISTENT_OVERLAP,
    "exp2 1 in 8 by polynomial": {"poly_exp2": 8},
    "O from registers": {"tma_store": False},
    # on the persistent grid without O's TMA copy too: the copy is staged in a second Q buffer
    "one Q buffer": {"q_buffers": 1},
    # the persistent grid with S overlap, Q loaded a tile ahead; 2 stages leave Q room at D = 128
    "two Q buffers": {**PERSISTENT_OVERLAP, "stages": 2, "q_buffers": 2},
    "snake": {"tile_plan": False},  # the persistent grid's tiles in the snake, not by the plan
}


def gluon_forward(dtypes=DTYPES, target_ms: float = 150.0) -> list[dict]:
    """Forward only, at the target shapes: the warp-specialized Gluon kernel beside the Triton
    kernel, FlashAttention-2 and cuDNN (SDPA), interleaved; and the largest difference between the
    Gluon and cuDNN outputs (both fp16/bf16 roundings of the same attention)."""
    from torch.nn.attention import SDPBackend

    from kernels.flash_attention import gluon_flash

    flash, cudnn = (
        sdpa_backend(SDPBackend.FLASH_ATTENTION),
        sdpa_backend(SDPBackend.CUDNN_ATTENTION),
    )
    rows = []
    for shape in TARGET_SHAPES:
        for dtype in dtypes:
            for causal in (False, True):
                b, h, n, d = shape
                q, k, v = make_inputs(b, h, n, d, dtype)
                fns = {
                    "ours (Triton)": lambda: triton_flash.flash_attention_forward(q, k, v, causal),
                    "ours (Gluon)": lambda: gluon_flash.gluon_attention_forward(q, k, v, causal),
                }
                default, same_as_default = gluon_flash.resolve_schedule(d, causal), []
                for name, schedule in GLUON_SCHEDULES.items():
                    try:
                        same = gluon_flash.resolve_schedule(d, causal, **schedule) == default
                    except ValueError:  # 3 warpgroups at D = 128: the kernel has no such schedule
                        continue
                    if same:  # a default schedule is timed once, as "ours (Gluon)"
                        same_as_default.append(f"ours (Gluon, {name})")
                    else:
                        fns[f"ours (Gluon, {name})"] = functools.partial(
                            gluon_flash.gluon_attention_forward, q, k, v, causal, **schedule
                        )
                fns["sdpa flash"] = lambda: flash(q, k, v, causal)
                fns["sdpa cudnn"] = lambda: cudnn(q, k, v, causal)
                with torch.no_grad():
                    fns = {name: fn for name, fn in fns.items() if runs(fn)}
                    timings = bench.benchmark(fns, target_ms=target_ms)
                    if "ours (Gluon)" in fns and "sdpa cudnn" in fns:
                        diff = (
                            fns["ours (Gluon)"]()[0].float() - fns["sdpa cudnn"]().float()
                        ).abs()
                        max_diff = diff.max().item()
                    else:
                        max_diff = None
                impls = rates(timings, attention_flops(b, h, n, n, d, causal), "fwd")
                rows.append({**case_keys(shape, dtype, causal), "impls": impls,
                             "gluon_default": gluon_flash.DEFAULT_SCHEDULE[d, causal],
                             "gluon_default_is": same_as_default,
                             "max_abs_diff_gluon_vs_cudnn": max_diff})  # fmt: skip
                print(f"  {shape} {dtype} causal={causal}: "
                      + ", ".join(f"{k} {v['fwd_tflops']:.0f}" for k, v in impls.items()),
                      flush=True)  # fmt: skip
    return rows


def targets(rows: list[dict]) -> list[dict]:
    """Gluon at least cuDNN's rate at (16, 16, 2048, 64), 0.95 of it at (32, 32, 4096, 128)."""
    checks = []
    for row in rows:
        gluon = row["impls"].get("ours (Gluon)", {})
        if "fwd_vs_cudnn" in gluon:
            threshold = 1.0 if row["shape"] == [16, 16, 2048, 64] else 0.95
            target = f"fwd {case_label(row)}: Gluon >= {threshold} x cuDNN"
            checks.append(
                {"target": target, "value": gluon["fwd_vs_cudnn"], "threshold": threshold}
            )
    return passed(checks)


def show(rows: list[dict]) -> None:
    print_cases(
        rows, lambda row: f"forward; max |Gluon - cuDNN| = {row['max_abs_diff_gluon_vs_cudnn']}"
    )


if __name__ == "__main__":
    sys.exit(run_to_own_file("gluon", gluon_forward, targets, show))
