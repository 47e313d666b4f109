"""Benchmark of FlashAttention's own Hopper kernels, written in NVIDIA's CuTe DSL (the
FlashAttention-3 schedule: a TMA producer warp, consumer warpgroups in turns, each softmax beside
its own P V), beside the course's kernels and cuDNN at the target shapes, interleaved in one
process. They come from the PyPI package `flash-attn-4` (import name flash_attn.cute), not part of
the course's environment: this benchmark needs it installed (FLASH_ATTN_CUTE_PINS), and records the
versions it ran with. It sets no targets.

    python -m kernels.flash_attention.benchmark_flash_attn_cute
        -> data/results/<gpu>/03_flash_attention_flash_attn_cute.json
"""

from __future__ import annotations

import functools
import sys

import torch

from kernels import bench
from kernels.flash_attention import reference, triton_flash
from kernels.flash_attention.benchmark import (
    DTYPES,
    TARGET_SHAPES,
    attention_flops,
    case_keys,
    make_inputs,
    rates,
    run_to_own_file,
    runs,
    sdpa_backend,
)
from kernels.testing import generator, random_tensor

FLASH_ATTN_CUTE_PINS = "flash-attn-4==4.0.0b36 nvidia-cutlass-dsl[cu13]==4.7.1"


def flash_attn_cute_reference(dtypes=DTYPES, target_ms: float = 150.0) -> dict:
    """The course's kernels beside FlashAttention's CuTe DSL kernels and cuDNN at the target shapes,
    interleaved in one process: forward (Gluon, Triton) and backward (Triton). FlashAttention takes
    (batch, seqlen, heads, dim): it gets its own contiguous copies of the same inputs. First, each
    forward against the float64 reference at odd lengths (max |error|, FlashAttention's beside
    cuDNN's)."""
    from importlib.metadata import version

    from torch.nn.attention import SDPBackend

    from kernels.flash_attention import gluon_flash

    try:
        from flash_attn.cute import interface as fa
    except ImportError as exc:
        needs = f"FlashAttention's CuTe DSL kernels: pip install {FLASH_ATTN_CUTE_PINS}"
        raise RuntimeError(f"this benchmark needs {needs}") from exc
    cudnn = sdpa_backend(SDPBackend.CUDNN_ATTENTION)

    def bshd(t):
        return t.detach().transpose(1, 2).contiguous()

    def fa_forward(q, k, v, causal):  # (b, n, h, d) in and out
        return fa._flash_attn_fwd(q, k, v, causal=causal)[0]

    errors = []
    for shape in [(2, 3, 1000, 64), (1, 4, 777, 128), (2, 2, 333, 96)]:
        for dtype in dtypes:
            for causal in (False, True):
                q, k, v = make_inputs(*shape, dtype, seed=7)
                want, _ = reference.attention_fp64(q, k, v, causal=causal)
                got = {
                    "flash-attn cute": fa_forward(bshd(q), bshd(k), bshd(v), causal).transpose(
                        1, 2
                    ),
                    "sdpa cudnn": cudnn(q, k, v, causal),
                }
                errors.append(case_keys(shape, dtype, causal))
                for name, out in got.items():
                    errors[-1][f"max_abs_err {name}"] = (out.double() - want).abs().max().item()
    forward, backward = [], []
    for shape in TARGET_SHAPES:
        for dtype in dtypes:
            for causal in (False, True):
                b, h, n, d = shape
                q, k, v = make_inputs(b, h, n, d, dtype, requires_grad=True)
                qs, ks, vs = (bshd(t).requires_grad_(True) for t in (q, k, v))
                fns = {
                    "ours (Gluon)": lambda: gluon_flash.gluon_attention_forward(q, k, v, causal),
                    "ours (Triton)": lambda: triton_flash.flash_attention_forward(q, k, v, causal),
                    "flash-attn cute": lambda: fa_forward(qs, ks, vs, causal),
                    "sdpa cudnn": lambda: cudnn(q, k, v, causal),
                }
                with torch.no_grad():
                    fns = {name: fn for name, fn in fns.items() if runs(fn)}
                    timings = bench.benchmark(fns, target_ms=target_ms)
                flops = attention_flops(b, h, n, n, d, causal)
                forward.append(
                    {**case_keys(shape, dtype, causal), "impls": rates(timings, flops, "fwd")}
                )
                # Backward alone: one forward graph each, differentiated again and again.
                do = random_tensor(q.shape, dtype, "cuda", generator(1, "cuda"))
                graphs = {
                    "ours (Triton)": (triton_flash.flash_attention(q, k, v, causal), (q, k, v), do),
                    "flash-attn cute": (
                        fa.flash_attn_func(qs, ks, vs, causal=causal)[0],
                        (qs, ks, vs),
                        bshd(do),
                    ),
                    "sdpa cudnn": (cudnn(q, k, v, causal), (q, k, v), do),
                }
                fns = {
                    name: functools.partial(
                        torch.autograd.grad, out, inputs, grad, retain_graph=True
                    )
                    for name, (out, inputs, grad) in graphs.items()
                }
                timings = bench.benchmark(fns, target_ms=target_ms)
                flops = attention_flops(b, h, n, n, d, causal, backward=True)
                backward.append(
                    {**case_keys(shape, dtype, causal), "impls": rates(timings, flops, "bwd")}
                )
                print(f"  {shape} {dtype} causal={causal}: forward {forward[-1]['impls']}; "
                      f"backward {backward[-1]['impls']}", flush=True)  # fmt: skip
    versions = {name: version(name) for name in ("flash-attn-4", "nvidia-cutlass-dsl")}
    return {
        "versions": versions,
        "errors_vs_fp64": errors,
        "forward": forward,
        "backward": backward,
    }


def targets(cute: dict) -> list[dict]:
    """None: FlashAttention's kernels are a reference to read ours against, not a target."""
    return []


def show(cute: dict) -> None:
    print(f"\nFlashAttention's CuTe DSL kernels {cute['versions']}: max |error| against float64")
    print(bench.table(cute["errors_vs_fp64"], floatfmt=".2e"))
    for direction, key in (("forward", "fwd"), ("backward", "bwd")):
        print(f"\n{direction}: TFLOP/s (ratio to cuDNN)")
        rows = []
        for r in cute[direction]:
            rows.append({"case": f"{tuple(r['shape'])} {r['dtype']}" + " causal" * r["causal"]})
            for name, v in r["impls"].items():
                rows[-1][name] = f"{v[key + '_tflops']:.0f} ({v[key + '_vs_cudnn']:.3f})"
        print(bench.table(rows))


if __name__ == "__main__":
    sys.exit(run_to_own_file("flash_attn_cute", flash_attn_cute_reference, targets, show))
