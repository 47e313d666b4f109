"""Per-thread mbarrier arrives (gluon_flash_arrive, Triton >= 3.9's gl.inline_asm) against the same
kernel with Gluon's warpgroup arrive (gluon_flash), interleaved in one process, fp16, beside cuDNN."""

import functools
import json
import sys

import torch
import triton
from torch.nn.attention import SDPBackend

from kernels import bench, runtime
from kernels.flash_attention import gluon_flash, gluon_flash_arrive
from kernels.flash_attention.benchmark import _sdpa, attention_flops, make_inputs

SCHEDULES = {"default": {}, "persistent, S overlap": {"warpgroups": 2, "overlap": True, "persistent": True},
             "2 warpgroups, S overlap": {"warpgroups": 2, "overlap": True, "persistent": False}}
cudnn = _sdpa(SDPBackend.CUDNN_ATTENTION)
rows = []
for (b, h, n, d) in [(32, 32, 4096, 128), (16, 16, 2048, 64)]:
    for causal in (False, True):
        q, k, v = make_inputs(b, h, n, d, torch.float16)
        fns = {}
        for name, schedule in SCHEDULES.items():
            for label, module in (("warpgroup arrive", gluon_flash), ("per-thread arrive", gluon_flash_arrive)):
                fns[f"{label}, {name}"] = functools.partial(module.gluon_attention_forward, q, k, v, causal, **schedule)
        fns["sdpa cudnn"] = lambda: cudnn(q, k, v, causal)
        with torch.no_grad():
            want = fns["sdpa cudnn"]().float()
            diffs = {name: (fn()[0].float() - want).abs().max().item() for name, fn in fns.items() if name != "sdpa cudnn"}
            t = bench.benchmark(fns, target_ms=150.0)
        flops = attention_flops(b, h, n, n, d, causal)
        row = {"shape": [b, h, n, d], "causal": causal,
               "impls": {name: {"tflops": tm.tflops(flops), "vs_cudnn": bench.ratio(t["sdpa cudnn"], tm),
                                "max_abs_diff_vs_cudnn": diffs.get(name)} for name, tm in t.items()}}
        rows.append(row)
        print((b, h, n, d), "causal" if causal else "", flush=True)
        for name, r in row["impls"].items():
            print(f"   {name:45s} {r['tflops']:6.1f} TFLOP/s  {r['vs_cudnn']:.3f}x cuDNN  diff {r['max_abs_diff_vs_cudnn']}", flush=True)
print(json.dumps({"triton": triton.__version__, "fingerprint": runtime.fingerprint(), "rows": rows}))
