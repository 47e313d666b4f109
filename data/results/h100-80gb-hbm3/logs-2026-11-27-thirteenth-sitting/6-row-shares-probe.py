"""Scratch (not part of the course): the Gluon forward with the row sums kept in per-thread shares
(`_row_shares`, this tree's gluon_flash.py) against the same kernel before the change (a copy of the
parent commit's file, gluon_flash_before.py, present only in the measured tree), interleaved in one
process beside cuDNN at the target shapes; ratios to cuDNN, median of per-round ratios."""
import json
import os

import torch
from torch.nn.attention import SDPBackend

from kernels import bench
from kernels.flash_attention import gluon_flash, gluon_flash_before
from kernels.flash_attention.benchmark import TARGET_SHAPES, _sdpa, attention_flops, make_inputs

cudnn = _sdpa(SDPBackend.CUDNN_ATTENTION)
rows = []
for b, h, n, d in TARGET_SHAPES:
    for dtype in (torch.float16, torch.bfloat16):
        for causal in (False, True):
            q, k, v = make_inputs(b, h, n, d, dtype)
            fns = {"before": lambda: gluon_flash_before.gluon_attention_forward(q, k, v, causal),
                   "row shares": lambda: gluon_flash.gluon_attention_forward(q, k, v, causal),
                   "sdpa cudnn": lambda: cudnn(q, k, v, causal)}
            with torch.no_grad():
                a, c = fns["before"]()[0], fns["row shares"]()[0]
                timings = bench.benchmark(fns, target_ms=300.0)
            flops = attention_flops(b, h, n, n, d, causal)
            row = {"shape": [b, h, n, d], "dtype": str(dtype), "causal": causal,
                   "max_abs_diff_before_vs_after": (a.float() - c.float()).abs().max().item(),
                   **{name: {"tflops": t.tflops(flops), "vs_cudnn": bench.ratio(timings["sdpa cudnn"], t)}
                      for name, t in timings.items()}}
            rows.append(row)
            print(json.dumps(row), flush=True)
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "row-shares-probe.json"), "w"), indent=1)
