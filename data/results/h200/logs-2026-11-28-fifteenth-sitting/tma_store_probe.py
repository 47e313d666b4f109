"""Scratch (not part of the course): O stored by a TMA copy from the tile's Q buffer (tma_store)
timed beside the default (two Q buffers at D 64 causal and D 128, O stored from registers) and
cuDNN at the four target cases, interleaved in one process; ratios to cuDNN, median of per-round
ratios. Argument: the time per case and function in ms (300). Writes tma-store-probe.json into
$OUT (or here). The float64 checks are the GPU tests' (run before this)."""
import json
import os
import sys

import torch
from torch.nn.attention import SDPBackend

from kernels import bench
from kernels.flash_attention import gluon_flash
from kernels.flash_attention.benchmark import TARGET_SHAPES, _sdpa, attention_flops, make_inputs

TMA = {"tma_store": True}
VARIANTS = {  # (head_dim, causal) -> name -> schedule; "default" is DEFAULT_SCHEDULE
    (64, False): {"TMA store (3 warpgroups)": TMA,
                  "persistent, 2 Q, no turns": {"warpgroups": 2, "persistent": True,
                                                "q_buffers": 2, "pingpong": False},
                  "persistent, 2 Q, no turns, TMA store": {"warpgroups": 2, "persistent": True,
                                                           "q_buffers": 2, "pingpong": False, **TMA}},
    (64, True): {"TMA store": TMA, "TMA store, turns": {**TMA, "pingpong": True}},
    (128, False): {"TMA store": TMA},
    (128, True): {"TMA store": TMA},
}
cudnn = _sdpa(SDPBackend.CUDNN_ATTENTION)
target_ms = float(sys.argv[1]) if sys.argv[1:] else 300.0
rows = []
for b, h, n, d in TARGET_SHAPES:
    for causal in (False, True):
        for dtype in (torch.float16, torch.bfloat16):
            q, k, v = make_inputs(b, h, n, d, dtype)
            fns = {"default": lambda: gluon_flash.gluon_attention_forward(q, k, v, causal)}
            for name, schedule in VARIANTS[d, causal].items():
                fns[name] = (lambda s: lambda: gluon_flash.gluon_attention_forward(
                    q, k, v, causal, **s))(schedule)
            fns["sdpa cudnn"] = lambda: cudnn(q, k, v, causal)
            with torch.no_grad():
                base = fns["default"]()[0].float()
                diffs = {name: (fn()[0].float() - base).abs().max().item()
                         for name, fn in fns.items() if name not in ("default", "sdpa cudnn")}
                timings = bench.benchmark(fns, target_ms=target_ms)
            flops = attention_flops(b, h, n, n, d, causal)
            row = {"shape": [b, h, n, d], "dtype": str(dtype), "causal": causal,
                   "max_abs_diff_vs_default": diffs,
                   **{name: {"tflops": t.tflops(flops),
                             "vs_cudnn": bench.ratio(timings["sdpa cudnn"], t)}
                      for name, t in timings.items()}}
            rows.append(row)
            print(json.dumps(row), flush=True)
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "tma-store-probe.json"), "w"), indent=1)
