"""Probe: FlashAttention's own Hopper kernels written in the CuTe DSL (PyPI `flash-attn-4`
4.0.0b36, `flash_attn.cute`, FlashAttentionForwardSm90 / BackwardSm90: the FlashAttention-3 schedule)
at the course's target shapes, beside cuDNN (SDPA) and the course's Gluon and Triton kernels in the
same process, all timed by the course's timer (kernels.bench: L2 flushed, interleaved, median).
FlashAttention takes (batch, seqlen, heads, dim): it gets its own contiguous copies of the inputs.
Run from the tree's root; one JSON line per result to stdout and to $OUT/fa_cute_probe.jsonl."""
import json, os, sys, time, traceback
import torch
from torch.nn.attention import SDPBackend
from flash_attn.cute import interface as fa
from kernels import bench
from kernels.testing import generator, random_tensor
from kernels.flash_attention import gluon_flash, triton_flash
from kernels.flash_attention.benchmark import _sdpa, attention_flops, make_inputs
from tests.test_flash_attention import check_forward

SINK = open(os.path.join(os.environ.get("OUT", "."), "fa_cute_probe.jsonl"), "a")
PART = sys.argv[1] if len(sys.argv) > 1 else "all"
T0 = time.time()


def log(**row):
    row["t_s"] = round(time.time() - T0, 1)
    line = json.dumps(row)
    print(line, flush=True)
    SINK.write(line + "\n")
    SINK.flush()


def fa_fwd(q, k, v, causal, **cfg):
    """FlashAttention's forward on (b, n, h, d) tensors; cfg: tile_mn, mma_pv_is_rs, intra_wg_overlap."""
    return fa._flash_attn_fwd(q, k, v, causal=causal, **cfg)[0]


def bshd(t):
    return t.transpose(1, 2).contiguous().detach()


cudnn = _sdpa(SDPBackend.CUDNN_ATTENTION)

if PART in ("all", "check"):
    # correctness at odd sizes against the course's fp64 reference (and its tolerance rule)
    for (b, h, n, d) in [(2, 3, 1000, 64), (1, 4, 777, 128), (2, 2, 333, 96)]:
        for dtype in (torch.float16, torch.bfloat16):
            for causal in (False, True):
                g = generator(7, "cuda")
                q, k, v = (random_tensor((b, h, n, d), dtype, "cuda", g) for _ in range(3))
                try:
                    out, lse = fa._flash_attn_fwd(bshd(q), bshd(k), bshd(v), causal=causal,
                                                  return_lse=True)[:2]
                    # the course's rule (tests/test_flash_attention.py): out within a few units
                    # in the last place of the probabilities times |V|, lse to float32 rounding
                    check_forward(out.transpose(1, 2), lse, q, k, v, causal)
                    log(check=[b, h, n, d], dtype=str(dtype), causal=causal, ok=True)
                except Exception as e:
                    log(check=[b, h, n, d], dtype=str(dtype), causal=causal, ok=False,
                        error=repr(e)[:400])

FWD_CASES = []
if PART in ("all", "fwd"):
    FWD_CASES += [((16, 16, 2048, 64), torch.float16, c) for c in (False, True)]
    FWD_CASES += [((32, 32, 4096, 128), torch.float16, c) for c in (False, True)]
    FWD_CASES += [((16, 16, 2048, 64), torch.bfloat16, c) for c in (False, True)]
    FWD_CASES += [((32, 32, 4096, 128), torch.bfloat16, c) for c in (False, True)]
# FlashAttention's D 64 choices: its default (192 x 128, P from registers, softmax beside the
# previous P V), the C++ FA3's non-causal 192 x 192, 128 x 128, and the default without overlap
VARIANTS = {
    64: {"192x192": dict(tile_mn=(192, 192)), "128x128": dict(tile_mn=(128, 128)),
         "no overlap": dict(intra_wg_overlap=False)},
    128: {"128x176": dict(tile_mn=(128, 176)), "no overlap": dict(intra_wg_overlap=False)},
}

for (b, h, n, d), dtype, causal in FWD_CASES:
    flops = attention_flops(b, h, n, n, d, causal)
    q, k, v = make_inputs(b, h, n, d, dtype)
    qs, ks, vs = bshd(q), bshd(k), bshd(v)
    fns = {"sdpa cudnn": lambda: cudnn(q, k, v, causal),
           "gluon (course)": lambda: gluon_flash.gluon_attention_forward(q, k, v, causal),
           "flash-attn cute": lambda: fa_fwd(qs, ks, vs, causal)}
    if dtype == torch.float16:
        for name, cfg in VARIANTS[d].items():
            fns[f"flash-attn cute, {name}"] = (lambda cfg=cfg: fa_fwd(qs, ks, vs, causal, **cfg))
    usable = {}
    for name, fn in fns.items():
        try:
            t = time.time()
            with torch.no_grad():
                fn()
            torch.cuda.synchronize()
            usable[name] = fn
            log(shape=[b, h, n, d], dtype=str(dtype), causal=causal, impl=name,
                first_call_s=round(time.time() - t, 1))
        except Exception as e:
            log(shape=[b, h, n, d], dtype=str(dtype), causal=causal, impl=name, error=repr(e)[:400])
    with torch.no_grad():
        res = bench.benchmark(usable, target_ms=150.0)
    base = res["sdpa cudnn"]
    for name, t in res.items():
        log(shape=[b, h, n, d], dtype=str(dtype), causal=causal, impl=name, direction="fwd",
            median_us=t.median_us, tflops=t.tflops(flops), ratio_to_cudnn=bench.ratio(base, t))
    del q, k, v, qs, ks, vs, usable, fns, res
    torch.cuda.empty_cache()

BWD_CASES = []
if PART in ("all", "bwd"):
    BWD_CASES = [((32, 32, 4096, 128), torch.float16, c) for c in (False, True)]
    BWD_CASES += [((16, 16, 2048, 64), torch.float16, c) for c in (False, True)]
for (b, h, n, d), dtype, causal in BWD_CASES:
    flops = attention_flops(b, h, n, n, d, causal, backward=True)
    q, k, v = make_inputs(b, h, n, d, dtype, requires_grad=True)
    qs, ks, vs = (bshd(t).requires_grad_(True) for t in (q, k, v))
    do = random_tensor(q.shape, dtype, "cuda", generator(1, "cuda"))
    dos = bshd(do)
    outs = {"sdpa cudnn": (cudnn(q, k, v, causal), (q, k, v), do),
            "triton (course)": (triton_flash.flash_attention(q, k, v, causal=causal), (q, k, v), do)}
    try:
        r = fa.flash_attn_func(qs, ks, vs, causal=causal)
        outs["flash-attn cute"] = (r[0] if isinstance(r, tuple) else r, (qs, ks, vs), dos)
    except Exception as e:
        log(shape=[b, h, n, d], causal=causal, impl="flash-attn cute", direction="bwd",
            error=repr(e)[:400])
    fns = {name: (lambda o=o, x=x, g=g: torch.autograd.grad(o, x, g, retain_graph=True))
           for name, (o, x, g) in outs.items()}
    grads = {}
    for name, fn in fns.items():
        t = time.time()
        grads[name] = fn()
        torch.cuda.synchronize()
        log(shape=[b, h, n, d], causal=causal, impl=name, direction="bwd",
            first_call_s=round(time.time() - t, 1))
    if "flash-attn cute" in grads:  # FlashAttention's gradients beside cuDNN's, same inputs
        for i, name in enumerate("qkv"):
            a = grads["flash-attn cute"][i].transpose(1, 2).float()
            e = grads["sdpa cudnn"][i].float()
            log(shape=[b, h, n, d], causal=causal, grad=name,
                max_abs_diff_vs_cudnn=float((a - e).abs().max()), max_abs_cudnn=float(e.abs().max()))
    del grads
    res = bench.benchmark(fns, target_ms=150.0)
    base = res["sdpa cudnn"]
    for name, t in res.items():
        log(shape=[b, h, n, d], dtype=str(dtype), causal=causal, impl=name, direction="bwd",
            median_us=t.median_us, tflops=t.tflops(flops), ratio_to_cudnn=bench.ratio(base, t))
    del q, k, v, qs, ks, vs, outs, fns, res
    torch.cuda.empty_cache()
log(done=PART)
