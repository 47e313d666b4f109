"""Probe: NVIDIA's CuTe DSL Hopper FMHA example (CUTLASS examples/python/CuTeDSL/cute/hopper/kernel/
attention/fmha.py, nvidia-cutlass-dsl 4.7.1) at the course's target shapes, beside cuDNN (SDPA) and
the course's Gluon kernel in the same process. Its own timer (CUDA events, `cute.testing.benchmark`)
for the example; the course's (L2 flush, median) for the others."""
import json, os, sys, time, traceback
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "examples"))
import torch
import cutlass
import fmha
from kernels import bench
from kernels.flash_attention import gluon_flash
from kernels.flash_attention.benchmark import _sdpa, attention_flops, make_inputs
from torch.nn.attention import SDPBackend

out = []
def log(**row):
    out.append(row); print(json.dumps(row), flush=True)

# correctness: the example's own check against its torch reference (atol 0.1 on inputs in [-2, 2])
for d in (64, 128):
    for causal in (False, True):
        for persistent in (False, True):
            try:
                fmha.run((2, 512, 4, d), (2, 512, 4, d), cutlass.Float16, cutlass.Float16, cutlass.Float32,
                         cutlass.Float32, (64, 128), persistent, causal, True, 1.0, 1.0, 1.0, 1.0, 0.0, (-1, -1),
                         0.1, 0, 1, False)
                log(check=[2, 512, 4, d], causal=causal, persistent=persistent, ok=True)
            except Exception as e:
                log(check=[2, 512, 4, d], causal=causal, persistent=persistent, ok=False, error=repr(e)[:300])

cudnn = _sdpa(SDPBackend.CUDNN_ATTENTION)
for (b, h, n, d) in [(16, 16, 2048, 64), (32, 32, 4096, 128)]:
    for causal in (False, True):
        flops = attention_flops(b, h, n, n, d, causal)
        q, k, v = make_inputs(b, h, n, d, torch.float16)
        with torch.no_grad():
            ref = bench.benchmark({"sdpa cudnn": lambda: cudnn(q, k, v, causal),
                                   "ours (Gluon)": lambda: gluon_flash.gluon_attention_forward(q, k, v, causal)},
                                  target_ms=150.0)
        base = {n_: t.median_us for n_, t in ref.items()}
        del q, k, v
        torch.cuda.empty_cache()
        for persistent in (False, True):
            try:
                t0 = time.time()
                us = fmha.run((b, n, h, d), (b, n, h, d), cutlass.Float16, cutlass.Float16, cutlass.Float32,
                              cutlass.Float32, (64, 128), persistent, causal, True, 1.0, 1.0, 1.0, 1.0, 0.0,
                              (-1, -1), 0.1, 10, 50, True, False)
                log(shape=[b, h, n, d], causal=causal, persistent=persistent, cute_us=us,
                    cute_tflops=flops / (us * 1e-6) / 1e12, cudnn_us=base["sdpa cudnn"],
                    gluon_us=base["ours (Gluon)"], cute_vs_cudnn=base["sdpa cudnn"] / us,
                    gluon_vs_cudnn=base["sdpa cudnn"] / base["ours (Gluon)"], seconds=time.time() - t0)
            except Exception as e:
                log(shape=[b, h, n, d], causal=causal, persistent=persistent, error=traceback.format_exc()[-600:])
        torch.cuda.empty_cache()
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "cutlass_dsl_probe.json"), "w"), indent=1)
