"""Scratch (not part of the course): the Gluon forward with one copy of the softmax in the consumer
loop (block 0 taken by branches on j > 0, this tree's gluon_flash.py) against the kernel before it
(block 0 peeled off before the loop: the parent commit's file as gluon_flash_before.py, present
only in the measured tree), interleaved in one process beside cuDNN; ratios to cuDNN, median of
per-round ratios. Argument: the time per case and function in ms (300). Writes
single-copy-probe.json into $OUT (or here)."""
import json
import os
import sys

import torch
from torch.nn.attention import SDPBackend

from kernels import bench
from kernels.flash_attention import gluon_flash, gluon_flash_before
from kernels.flash_attention.benchmark import _sdpa, attention_flops, make_inputs

cudnn = _sdpa(SDPBackend.CUDNN_ATTENTION)
CASES = [((16, 16, 2048, 64), False, {}), ((16, 16, 2048, 64), True, {}),
         ((16, 16, 2048, 64), True, {"pingpong": False}), ((32, 32, 4096, 128), False, {}),
         ((32, 32, 4096, 128), True, {})]
target_ms = float(sys.argv[1]) if sys.argv[1:] else 300.0
rows = []
for (b, h, n, d), causal, schedule in CASES:
    for dtype in (torch.float16, torch.bfloat16):
        q, k, v = make_inputs(b, h, n, d, dtype)
        fns = {"before": lambda: gluon_flash_before.gluon_attention_forward(q, k, v, causal, **schedule),
               "after": lambda: gluon_flash.gluon_attention_forward(q, k, v, causal, **schedule),
               "sdpa cudnn": lambda: cudnn(q, k, v, causal)}
        with torch.no_grad():
            a, c = fns["before"]()[0], fns["after"]()[0]
            timings = bench.benchmark(fns, target_ms=target_ms)
        flops = attention_flops(b, h, n, n, d, causal)
        row = {"shape": [b, h, n, d], "dtype": str(dtype), "causal": causal, "schedule": schedule,
               "max_abs_diff_before_vs_after": (a.float() - c.float()).abs().max().item(),
               **{name: {"tflops": t.tflops(flops), "vs_cudnn": bench.ratio(timings["sdpa cudnn"], t)}
                  for name, t in timings.items()}}
        rows.append(row)
        print(json.dumps(row), flush=True)
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "single-copy-probe.json"), "w"), indent=1)
