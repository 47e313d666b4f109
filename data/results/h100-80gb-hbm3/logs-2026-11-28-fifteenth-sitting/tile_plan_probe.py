"""Scratch (not part of the course): the persistent grid's tiles handed out by the host's plan
(tile_plan=True: longest first within windows of heads, each tile to the least loaded CTA) beside
the snake (the default) and cuDNN at the two causal targets, interleaved in one process; ratios to
cuDNN, median of per-round ratios. Argument: the time per case and function in ms (300). Writes
tile-plan-probe.json into $OUT (or here). The float64 checks are the GPU tests' (run before this)."""
import json
import os
import sys

import torch
from torch.nn.attention import SDPBackend

from kernels import bench
from kernels.flash_attention import gluon_flash
from kernels.flash_attention.benchmark import TARGET_SHAPES, _sdpa, attention_flops, make_inputs

cudnn = _sdpa(SDPBackend.CUDNN_ATTENTION)
target_ms = float(sys.argv[1]) if sys.argv[1:] else 300.0
rows = []
for b, h, n, d in TARGET_SHAPES:
    causal = True
    for dtype in (torch.float16, torch.bfloat16):
        q, k, v = make_inputs(b, h, n, d, dtype)
        fns = {"snake": lambda: gluon_flash.gluon_attention_forward(q, k, v, causal),
               "plan": lambda: gluon_flash.gluon_attention_forward(q, k, v, causal, tile_plan=True),
               "sdpa cudnn": lambda: cudnn(q, k, v, causal)}
        with torch.no_grad():
            diff = (fns["plan"]()[0].float() - fns["snake"]()[0].float()).abs().max().item()
            timings = bench.benchmark(fns, target_ms=target_ms)
        flops = attention_flops(b, h, n, n, d, causal)
        row = {"shape": [b, h, n, d], "dtype": str(dtype), "causal": causal,
               "plan_info": gluon_flash._plan_on_device.cache_info()._asdict(),
               "max_abs_diff_plan_vs_snake": diff,
               **{name: {"tflops": t.tflops(flops), "vs_cudnn": bench.ratio(timings["sdpa cudnn"], t)}
                  for name, t in timings.items()}}
        rows.append(row)
        print(json.dumps(row), flush=True)
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "tile-plan-probe.json"), "w"), indent=1)
