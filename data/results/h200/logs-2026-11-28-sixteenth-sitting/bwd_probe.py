"""Scratch probe (not part of the course): the Gluon backward beside the Triton backward and SDPA's
cuDNN and FlashAttention-2 backwards, interleaved, at the forward's target shapes.
Usage: python bwd_probe.py [target_ms]. Where kernels/flash_attention/_bwd_previous.py holds an
earlier version, it is timed beside the current one as "gluon (previous)" (row 9 of the README
ran with the first version under the name "gluon v1")."""

import json
import math
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kernels import bench, runtime
from kernels.flash_attention import gluon_flash_backward, triton_flash
from kernels.flash_attention.benchmark import attention_flops, make_inputs
from kernels.testing import generator, random_tensor

target_ms = float(sys.argv[1]) if len(sys.argv) > 1 else 150.0
try:  # an earlier version, where a run puts a copy of it beside the kernel
    from kernels.flash_attention import _bwd_previous as previous
except ImportError:
    previous = None
rows = []
for shape in ((16, 16, 2048, 64), (32, 32, 4096, 128)):
    for dtype in (torch.float16, torch.bfloat16):
        for causal in (False, True):
            b, h, n, d = shape
            q, k, v = make_inputs(b, h, n, d, dtype, requires_grad=True)
            do = random_tensor(q.shape, dtype, "cuda", generator(1, "cuda"))
            scale = 1 / math.sqrt(d)
            with torch.no_grad():
                out, lse = triton_flash.flash_attention_forward(q, k, v, causal)
            fns = {
                "gluon": lambda: gluon_flash_backward.gluon_attention_backward(
                    do, q, k, v, out, lse, causal),
                **({"gluon (previous)": lambda: previous.gluon_attention_backward(
                    do, q, k, v, out, lse, causal)} if previous else {}),
                "triton": lambda: triton_flash.flash_attention_backward(
                    do, q, k, v, out, lse, causal, scale),
            }
            for name, backend in (("sdpa cudnn", SDPBackend.CUDNN_ATTENTION),
                                  ("sdpa flash", SDPBackend.FLASH_ATTENTION)):
                with sdpa_kernel(backend):
                    o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                fns[name] = (lambda o=o: torch.autograd.grad(o, (q, k, v), do, retain_graph=True))
            got = fns["gluon"]()
            want = fns["sdpa cudnn"]()
            err = [((a.float() - b_.float()).abs().max().item(), b_.float().abs().max().item())
                   for a, b_ in zip(got, want)]
            t = bench.benchmark(fns, target_ms=target_ms)
            flops = attention_flops(b, h, n, n, d, causal, True)
            row = {"shape": shape, "dtype": str(dtype)[6:], "causal": causal,
                   "max_abs_err_vs_cudnn(dq,dk,dv)": err,
                   "ms": {k_: t[k_].median_us / 1e3 for k_ in t},
                   "tflops": {k_: t[k_].tflops(flops) for k_ in t},
                   "vs_cudnn": {k_: bench.ratio(t["sdpa cudnn"], t[k_]) for k_ in t}}
            rows.append(row)
            print(shape, row["dtype"], "causal" if causal else "full", "err",
                  [f"{e:.3g}/{m:.3g}" for e, m in err])
            for k_ in t:
                print(f"   {k_:12s} {row['ms'][k_]:8.3f} ms {row['tflops'][k_]:7.1f} TF/s "
                      f"{row['vs_cudnn'][k_]:.3f}x cuDNN", flush=True)
json.dump({"fingerprint": runtime.fingerprint(), "rows": rows}, open("bwd-probe.json", "w"),
          indent=1)
