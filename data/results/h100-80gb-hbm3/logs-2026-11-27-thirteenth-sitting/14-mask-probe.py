"""Scratch (not part of the course): the Gluon forward with one comparison a score in masked blocks
and the unmasked blocks counted per warpgroup (`_row_bounds`, this tree's gluon_flash.py), against
the same kernel before the change (the parent commit's file as gluon_flash_before.py, present only
in the measured tree), interleaved in one process beside cuDNN; ratios to cuDNN, median of per-round
ratios. Cases: the target shapes with the default schedules, and D 64 causal with FlashAttention's
schedule (3 warpgroups, one CTA a tile), whose masked blocks the change touches most. With the
argument `d128`: only (32, 32, 4096, 128) non-causal, fp16 and bf16, timed twice as long."""
import json
import os
import sys

import torch
from torch.nn.attention import SDPBackend

from kernels import bench
from kernels.flash_attention import gluon_flash, gluon_flash_before
from kernels.flash_attention.benchmark import TARGET_SHAPES, _sdpa, attention_flops, make_inputs

cudnn = _sdpa(SDPBackend.CUDNN_ATTENTION)
THREE = dict(warpgroups=3, overlap=True, persistent=False, stages=2)
cases = [(shape, dtype, causal, {}) for shape in TARGET_SHAPES
         for dtype in (torch.float16, torch.bfloat16) for causal in (False, True)]
cases += [((16, 16, 2048, 64), dtype, True, THREE) for dtype in (torch.float16, torch.bfloat16)]
target_ms = 300.0
if sys.argv[1:] == ["d128"]:
    cases = [((32, 32, 4096, 128), dtype, False, {}) for dtype in (torch.float16, torch.bfloat16)]
    target_ms = 600.0
rows = []
for (b, h, n, d), dtype, causal, schedule in cases:
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
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "mask-probe.json"), "w"), indent=1)
