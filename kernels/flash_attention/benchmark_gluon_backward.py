"""Benchmark of the Gluon backward (gluon_flash_backward.py): backward only, at the course's target
shapes, beside the Triton backward, FlashAttention-2 and cuDNN (SDPA), interleaved in one process.

    python -m kernels.flash_attention.benchmark_gluon_backward
        -> data/results/<gpu>/03_flash_attention_gluon_backward.json
"""

from __future__ import annotations

import functools
import math
import sys

import torch

from kernels import bench
from kernels.flash_attention import benchmark, triton_flash
from kernels.testing import generator, random_tensor


def gluon_backward(dtypes=benchmark.DTYPES, target_ms: float = 100.0) -> list[dict]:
    """Backward only, at the target shapes: the Gluon backward (also with a ring of 3 for Q and
    dO) beside the Triton backward (both from the same forward's out and lse), FlashAttention-2
    and cuDNN (SDPA, differentiating one forward graph again and again), interleaved; and the
    largest difference between the Gluon and cuDNN gradients."""
    from torch.nn.attention import SDPBackend

    from kernels.flash_attention import gluon_flash_backward

    rows = []
    for shape in benchmark.TARGET_SHAPES:
        for dtype in dtypes:
            for causal in (False, True):
                b, h, n, d = shape
                q, k, v = benchmark.make_inputs(b, h, n, d, dtype, requires_grad=True)
                do = random_tensor(q.shape, dtype, "cuda", generator(1, "cuda"))
                with torch.no_grad():
                    out, lse = triton_flash.flash_attention_forward(q, k, v, causal)
                fns = {
                    "ours (Gluon)": functools.partial(gluon_flash_backward.gluon_attention_backward,
                                                      do, q, k, v, out, lse, causal),
                    "ours (Gluon, 3 stages)": functools.partial(
                        gluon_flash_backward.gluon_attention_backward, do, q, k, v, out, lse,
                        causal, stages=3),
                    "ours (Triton)": functools.partial(triton_flash.flash_attention_backward, do,
                                                       q, k, v, out, lse, causal, 1 / math.sqrt(d)),
                }  # fmt: skip
                for name, backend in (("sdpa flash", SDPBackend.FLASH_ATTENTION),
                                      ("sdpa cudnn", SDPBackend.CUDNN_ATTENTION)):  # fmt: skip
                    o = benchmark.sdpa_backend(backend)(q, k, v, causal)
                    fns[name] = functools.partial(torch.autograd.grad, o, (q, k, v), do,
                                                  retain_graph=True)  # fmt: skip
                fns = {name: fn for name, fn in fns.items() if benchmark.runs(fn)}
                if "ours (Gluon)" in fns and "sdpa cudnn" in fns:
                    pairs = zip(fns["ours (Gluon)"](), fns["sdpa cudnn"]())
                    max_diff = [(a.float() - b_.float()).abs().max().item() for a, b_ in pairs]
                else:
                    max_diff = None
                timings = bench.benchmark(fns, target_ms=target_ms)
                flops = benchmark.attention_flops(b, h, n, n, d, causal, backward=True)
                impls = benchmark.rates(timings, flops, "bwd")
                rows.append({**benchmark.case_keys(shape, dtype, causal), "impls": impls,
                             "max_abs_diff_gluon_vs_cudnn_dq_dk_dv": max_diff})  # fmt: skip
                print(f"  {shape} {dtype} causal={causal}: "
                      + ", ".join(f"{k} {v['bwd_tflops']:.0f}" for k, v in impls.items()),
                      flush=True)  # fmt: skip
                del fns, q, k, v, do, out, lse
    return rows


def targets(rows: list[dict]) -> list[dict]:
    """Gluon at least 0.8 of cuDNN's backward at (32, 32, 4096, 128); the (16, 16, 2048, 64) rows
    are informational."""
    checks = []
    for row in rows:
        gluon = row["impls"].get("ours (Gluon)", {})
        if "bwd_vs_cudnn" in gluon and row["shape"] == [32, 32, 4096, 128]:
            checks.append({"target": f"bwd {benchmark.case_label(row)}: Gluon >= 0.8 x cuDNN",
                           "value": gluon["bwd_vs_cudnn"], "threshold": 0.8})  # fmt: skip
    return benchmark.passed(checks)


def show(rows: list[dict]) -> None:
    def note(row):
        diff = row["max_abs_diff_gluon_vs_cudnn_dq_dk_dv"]
        return f"backward; max |Gluon - cuDNN| of dq, dk, dv = {diff}"

    benchmark.print_cases(rows, note)


if __name__ == "__main__":
    sys.exit(benchmark.run_to_own_file("gluon_backward", gluon_backward, targets, show))
