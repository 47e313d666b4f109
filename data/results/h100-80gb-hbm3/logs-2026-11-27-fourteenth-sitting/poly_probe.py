"""Scratch (not part of the course): the Gluon forward with one exponential in every n computed by
a polynomial on the FMA units (`poly_exp2=n`) against the same kernel with every exponential on the
multi-function unit, interleaved in one process beside cuDNN; ratios to cuDNN, median of per-round
ratios. At D 64 causal also without the turns (`pingpong=False`), with and without the polynomial.
Arguments: the time per case and function in ms (300), and `d64` for the D 64 cases only (the
schedules of D64_SCHEDULES). Writes poly-probe.json into $OUT (or here)."""
import json
import os
import sys

import torch
from torch.nn.attention import SDPBackend

from kernels import bench
from kernels.flash_attention import gluon_flash
from kernels.flash_attention.benchmark import _sdpa, attention_flops, make_inputs

cudnn = _sdpa(SDPBackend.CUDNN_ATTENTION)
SCHEDULES = {
    ((16, 16, 2048, 64), False): [{}, {"poly_exp2": 8}, {"poly_exp2": 4}, {"poly_exp2": 2}],
    ((16, 16, 2048, 64), True): [{}, {"poly_exp2": 8}, {"poly_exp2": 4}, {"pingpong": False},
                                 {"pingpong": False, "poly_exp2": 8},
                                 {"pingpong": False, "poly_exp2": 4}],
    ((32, 32, 4096, 128), False): [{}, {"poly_exp2": 8}, {"poly_exp2": 4}],
    ((32, 32, 4096, 128), True): [{}, {"poly_exp2": 8}, {"poly_exp2": 4}],
}
D64_SCHEDULES = {
    ((16, 16, 2048, 64), False): [{}, {"poly_exp2": 8}],
    ((16, 16, 2048, 64), True): [{}, {"poly_exp2": 8}, {"poly_exp2": 4}, {"pingpong": False},
                                 {"pingpong": False, "poly_exp2": 8}],
}
target_ms = float(sys.argv[1]) if sys.argv[1:] else 300.0
if sys.argv[2:] == ["d64"]:
    SCHEDULES = D64_SCHEDULES
rows = []
for (shape, causal), schedules in SCHEDULES.items():
    b, h, n, d = shape
    for dtype in (torch.float16, torch.bfloat16):
        q, k, v = make_inputs(b, h, n, d, dtype)
        fns = {json.dumps(s): (lambda s=s: gluon_flash.gluon_attention_forward(q, k, v, causal, **s))
               for s in schedules}
        fns["sdpa cudnn"] = lambda: cudnn(q, k, v, causal)
        with torch.no_grad():
            outs = {name: fn()[0].float() for name, fn in fns.items() if name != "sdpa cudnn"}
            ref = cudnn(q, k, v, causal).float()
            timings = bench.benchmark(fns, target_ms=target_ms)
        flops = attention_flops(b, h, n, n, d, causal)
        row = {"shape": list(shape), "dtype": str(dtype), "causal": causal,
               "max_abs_diff_vs_cudnn": {name: (o - ref).abs().max().item() for name, o in outs.items()},
               **{name: {"tflops": t.tflops(flops), "vs_cudnn": bench.ratio(timings["sdpa cudnn"], t)}
                  for name, t in timings.items()}}
        rows.append(row)
        print(json.dumps(row), flush=True)
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "poly-probe.json"), "w"), indent=1)
