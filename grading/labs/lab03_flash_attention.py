"""Lab 03: the FlashAttention forward in Triton (out and lse); the backward as extra credit.

A case's shape is the problem's, (batch, q heads, kv heads, Nq, Nk, head_dim): q is (B, Hq, Nq, D), k and
v are (B, Hkv, Nk, D); the outputs are out (B, Hq, Nq, D) in the inputs' dtype and lse (B, Hq, Nq) in
float32. `causal` is a case parameter (bottom-right aligned, kernels/attention/reference.py).
"""
from __future__ import annotations

import math

import torch

from grading.spec import Case, GradedFunction, LabSpec, PerfConfig
from kernels import runtime
from kernels.attention.reference import attention_fp64
from kernels.testing import TINY, ULP, random_tensor

CAUSAL = (("causal", True),)
# Odd lengths (1, 100, 197, 1000: none a multiple of a block), Nq != Nk (cross-attention, and queries at
# the end of a longer KV cache under the causal mask), GQA (2:1 and 4:1), batch 2 (a kernel that mixes
# batches fails there), both head dims, fp16 and bf16. Small B and H: the interpreter pays per program.
CASES = (
    Case((1, 2, 2, 1, 1, 64), torch.float16),
    # q and k 8x larger: scores in the hundreds; exp without the max subtracted overflows
    Case((1, 2, 2, 197, 197, 64), torch.float16, "large_logits"),
    Case((2, 2, 2, 100, 100, 64), torch.float16, params=CAUSAL),
    Case((2, 2, 2, 100, 100, 64), torch.bfloat16, params=CAUSAL),
    Case((2, 4, 2, 100, 197, 64), torch.bfloat16),                    # cross-attention (the call without out=)
    Case((1, 4, 2, 197, 197, 128), torch.float16, params=CAUSAL),
    Case((1, 4, 2, 197, 197, 128), torch.bfloat16),
    Case((1, 4, 1, 1, 197, 128), torch.float16, params=CAUSAL),      # decode, GQA 4:1: the query sees every key
    Case((1, 2, 2, 37, 197, 64), torch.bfloat16, params=CAUSAL),     # a chunk at the end of a longer cache
    Case((1, 2, 2, 1000, 1000, 64), torch.float16, params=CAUSAL),
    # (B, N, H, D) tensors transposed to (B, H, N, D): only the head dim is contiguous
    Case((2, 2, 2, 100, 100, 64), torch.float16, "bnhd", params=CAUSAL),
) + runtime.pick(gpu=(
    # N = 4096: the N x N scores would take 256 MiB in float32; the budget is O(N) (memory_budget)
    Case((1, 4, 4, 4096, 4096, 64), torch.float16, params=CAUSAL),
), cpu=())


def _attention_inputs(shape, dtype, device, gen):
    b, hq, hkv, n_q, n_k, d = shape
    return (random_tensor((b, hq, n_q, d), dtype, device, gen), random_tensor((b, hkv, n_k, d), dtype, device, gen),
            random_tensor((b, hkv, n_k, d), dtype, device, gen))


def _layout(layout, inputs):
    if layout == "bnhd":
        return tuple(torch.empty(t.shape[0], t.shape[2], t.shape[1], t.shape[3], dtype=t.dtype, device=t.device)
                     .transpose(1, 2).copy_(t) for t in inputs)
    if layout == "large_logits":
        q, k, v = inputs
        return q * 8, k * 8, v
    return inputs


def _outputs(shape, dtype):
    b, hq, _, n_q, _, d = shape
    return ((b, hq, n_q, d), dtype), ((b, hq, n_q), torch.float32)


def _reference(q, k, v, causal=False):
    return attention_fp64(q, k, v, causal=causal)


def _tolerance(dtype):
    return TINY[dtype], ULP[dtype]


def _float32_error(q, k):
    """A score computed in float32 carries an absolute error of about |s| * 2^-20 at these head dims,
    which exp turns into a relative error of that size in every probability."""
    k = k.double().repeat_interleave(q.shape[1] // k.shape[1], 1)
    s_max = (q.double() @ k.transpose(-1, -2)).abs().max().item() / math.sqrt(q.shape[-1])
    return 2.0**-20 * (1 + s_max)


def _scale(q, k, v, causal=False):
    """What rtol (one ulp of the dtype) multiplies, per output.

    out is a weighted mean of V rows: its error is measured against the magnitude of the terms,
    sum_j p_j |v_j| (the reference attention of |v|), not against |out|, which cancellation can make
    arbitrarily small. Allowed: two roundings to the dtype (P before the P @ V product, out at the end)
    plus the float32 error of the scores. lse is float32: its allowance is the float32 error alone,
    expressed in ulps of the dtype because rtol is one of those.
    """
    ulp = ULP[q.dtype]
    err = _float32_error(q, k)
    magnitude = attention_fp64(q, k, v.abs(), causal=causal)[0]
    return magnitude * (2 + err / ulp), torch.full(q.shape[:3], err / ulp, dtype=torch.float64, device=q.device)


def _course_forward(q, k, v, causal=False, out=None):
    from kernels.attention import triton_flash

    return triton_flash.flash_attention_forward(q, k, v, causal)


def _sdpa(q, k, v, causal=False, out=None):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                            enable_gqa=q.shape[1] != k.shape[1])


def _bytes(q, k, v, causal=False):
    return 2 * q.numel() * q.element_size() + 2 * k.numel() * k.element_size() + 4 * q[..., 0].numel()


def _flops(q, k, v, causal=False):
    b, h, n_q, d = q.shape
    return 4 * b * h * n_q * k.shape[2] * d / (2 if causal else 1)


def _memory_budget(q, k, v, causal=False):
    # O(N): room for a copy of every input and 1 MiB of small buffers; never the (Nq, Nk) scores
    return 2**20 + sum(t.numel() * t.element_size() for t in (q, k, v))


LAB = LabSpec(
    id="03_flash_attention",
    title="FlashAttention: the tiled forward with an online softmax in Triton",
    functions=(
        GradedFunction(
            name="flash_attention", points=10, backend="triton",
            description="Triton: tiled forward, online softmax, causal, GQA, any length; returns (out, lse)",
            make_inputs=_attention_inputs, prepare=_layout, reference_fp64=_reference, tolerance=_tolerance,
            scale=_scale, n_outputs=2, output_names=("out", "lse"), output_shapes=_outputs,
            course_kernel=_course_forward, torch_native=_sdpa, bytes_moved=_bytes, flops=_flops,
            memory_budget=_memory_budget, cases=CASES, input_names=("q", "k", "v"),
            # seed 003's first configuration; its second, (32, 32, 4096, 128), needs a 128 GiB float64
            # reference to check every timed round
            perf=(PerfConfig("flash_attention/fp16/16x16x2048x64", (16, 16, 16, 2048, 2048, 64), torch.float16),
                  PerfConfig("flash_attention/bf16/16x16x2048x64", (16, 16, 16, 2048, 2048, 64), torch.bfloat16)),
            hint="subtract the running max before exp2, rescale acc and l when the max grows, mask keys past "
                 "Nk and (causal) past the diagonal in every block, and find a row's batch and head from "
                 "the program id and the strides",
        ),
    ),
)
