"""Lab 03: the FlashAttention forward in Triton (out and lse); the backward as extra credit.

A case's shape is the problem's, (batch, q heads, kv heads, Nq, Nk, head_dim): q is (B, Hq, Nq, D),
k and v are (B, Hkv, Nk, D); the outputs are out (B, Hq, Nq, D) in the inputs' dtype and lse (B, Hq,
Nq) in float32. `causal` is a case parameter (bottom-right aligned,
kernels/flash_attention/reference.py).
"""

from __future__ import annotations

import math

import torch

from grading.spec import Case, GradedFunction, LabSpec, PerfConfig
from kernels import runtime
from kernels.flash_attention.reference import attention_fp64, causal_mask
from kernels.testing import TINY, ULP, random_tensor

CAUSAL = (("causal", True),)
# Odd lengths (1, 100, 197, 1000: none a multiple of a block), Nq != Nk (cross-attention, and
# queries at the end of a longer KV cache under the causal mask), GQA (2:1 and 4:1), batch 2 (a
# kernel that mixes batches fails there), both head dims, fp16 and bf16. Small B and H: the
# interpreter pays per program.
CASES = (
    Case((1, 2, 2, 1, 1, 64), torch.float16),
    # q and k 8x larger: scores in the hundreds; exp without the max subtracted overflows
    Case((1, 2, 2, 197, 197, 64), torch.float16, "large_logits"),
    Case((2, 2, 2, 100, 100, 64), torch.float16, params=CAUSAL),
    Case((2, 2, 2, 100, 100, 64), torch.bfloat16, params=CAUSAL),
    Case((2, 4, 2, 100, 197, 64), torch.bfloat16),  # cross-attention (the call without out=)
    Case((1, 4, 2, 197, 197, 128), torch.float16, params=CAUSAL),
    Case((1, 4, 2, 197, 197, 128), torch.bfloat16),
    Case(
        (1, 4, 1, 1, 197, 128), torch.float16, params=CAUSAL
    ),  # decode, GQA 4:1: the query sees every key
    Case(
        (1, 2, 2, 37, 197, 64), torch.bfloat16, params=CAUSAL
    ),  # a chunk at the end of a longer cache
    Case((1, 2, 2, 1000, 1000, 64), torch.float16, params=CAUSAL),
    # (B, N, H, D) tensors transposed to (B, H, N, D): only the head dim is contiguous
    Case((2, 2, 2, 100, 100, 64), torch.float16, "bnhd", params=CAUSAL),
) + runtime.pick(
    gpu=(
        # N = 4096: the N x N scores would take 256 MiB in float32; the budget is O(N)
        # (memory_budget)
        Case((1, 4, 4, 4096, 4096, 64), torch.float16, params=CAUSAL),
    ),
    cpu=(),
)


DTYPES = (torch.float16, torch.bfloat16)


def _causal(rng) -> tuple:
    return CAUSAL if rng.random() < 0.5 else ()


def draw_cases(rng) -> tuple[Case, ...]:
    """Shapes drawn per run from the secret seed, one per class a wrong forward can hide in (the
    same in both modes; head dim 64 but in the smallest, where the interpreter pays for 128):

    * Nq and Nk multiples of 128, so of every BLOCK_M and BLOCK_N the course's kernels use (16 to
      128): the last key block is full, the causal diagonal falls on block boundaries;
    * a long KV cache: Nk from 2049 to 4095 (odd), more than 2**17 elements in k, more keys than
      one tile of 1024 holds, a few queries at its end;
    * long queries over a short cache, causal: Nq from 2050 to 3070 (even, more than 2**17
      elements in q) against Nk < 300, so the first Nq - Nk rows see no key at all (out 0, lse
      -inf, never NaN);
    * q, k and v with strides of their own (batch 2, head dim 64 or 128): q (B, N, H, D)
      transposed, k the first Nk positions of a longer (B, H, capacity, D) cache, v of a
      (B, capacity, H, D) one: the lab promises any strides with a contiguous last dimension.
    """
    long_keys = 2 * rng.randrange(1025, 2048) + 1
    long_queries = 2 * rng.randrange(1025, 1536)
    return (
        Case((1, 2, 1, 128 * rng.randrange(1, 3), 128 * rng.randrange(1, 3), 64),
             rng.choice(DTYPES), params=_causal(rng)),
        Case((1, 1, 1, rng.randrange(1, 40), long_keys, 64), rng.choice(DTYPES),
             params=_causal(rng)),
        Case((1, 1, 1, long_queries, rng.randrange(17, 300), 64), rng.choice(DTYPES),
             params=CAUSAL),
        Case((2, 2, 2, rng.randrange(20, 120), rng.randrange(20, 120), rng.choice((64, 128))),
             rng.choice(DTYPES), "kv cache", params=_causal(rng)),
    )


def draw_backward_cases(rng) -> tuple[Case, ...]:
    """The backward's classes (smaller: it costs three kernels in the interpreter): Nq and Nk
    multiples of 128, causal with Nq > Nk and GQA 4:1 (rows that see no key have lse = -inf: their
    P and gradients are 0, never NaN), and a long KV cache (Nk from 1025 to 1535: more keys than one
    tile of 1024; on a GPU from 2049 to 3069, more than 2**17 elements in k and v)."""
    causal = rng.random() < 0.5
    return (
        Case((1, 2, 1, 128 * rng.randrange(1, 3), 128 * rng.randrange(1, 3), 64),
             rng.choice(DTYPES), **(CAUSAL_BACKWARD if causal else {})),
        Case((1, 4, 1, rng.randrange(100, 200), rng.randrange(10, 60), 64), rng.choice(DTYPES),
             **CAUSAL_BACKWARD),
        Case((1, 1, 1, rng.randrange(1, 40), runtime.pick(gpu=2, cpu=1) * 2 * rng.randrange(
            512, 768) + 1, 64), rng.choice(DTYPES)),
    )


def _attention_inputs(shape, dtype, device, gen):
    b, hq, hkv, n_q, n_k, d = shape
    return (
        random_tensor((b, hq, n_q, d), dtype, device, gen),
        random_tensor((b, hkv, n_k, d), dtype, device, gen),
        random_tensor((b, hkv, n_k, d), dtype, device, gen),
    )


def _layout(layout, inputs):
    if layout == "bnhd":
        return tuple(
            torch.empty(
                t.shape[0], t.shape[2], t.shape[1], t.shape[3], dtype=t.dtype, device=t.device
            )
            .transpose(1, 2)
            .copy_(t)
            for t in inputs
        )
    if layout == "kv cache":
        q, k, v = inputs
        (b, hq, n_q, d), (_, hkv, n_k, _) = q.shape, k.shape
        room = n_k + 37  # the cache holds more positions than are in use
        return (
            torch.empty(b, n_q, hq, d, dtype=q.dtype, device=q.device).transpose(1, 2).copy_(q),
            torch.empty(b, hkv, room, d, dtype=k.dtype, device=k.device)[:, :, :n_k].copy_(k),
            torch.empty(b, room, hkv, d, dtype=v.dtype, device=v.device)
            .transpose(1, 2)[:, :, :n_k]
            .copy_(v),
        )
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
    """A score computed in float32 carries an absolute error of about |s| * 2^-20 at these head
    dims, which exp turns into a relative error of that size in every probability."""
    k = k.double().repeat_interleave(q.shape[1] // k.shape[1], 1)
    s_max = (q.double() @ k.transpose(-1, -2)).abs().max().item() / math.sqrt(q.shape[-1])
    return 2.0**-20 * (1 + s_max)


def _scale(q, k, v, causal=False):
    """What rtol (one ulp of the dtype) multiplies, per output.

    out is a weighted mean of V rows: its error is measured against the magnitude of the terms,
    sum_j p_j |v_j| (the reference attention of |v|), not against |out|, which cancellation can make
    arbitrarily small. Allowed: two roundings to the dtype (P before the P @ V product, out at the
    end) plus the float32 error of the scores. lse is float32: its allowance is the float32 error
    alone, expressed in ulps of the dtype because rtol is one of those.
    """
    ulp = ULP[q.dtype]
    err = _float32_error(q, k)
    magnitude = attention_fp64(q, k, v.abs(), causal=causal)[0]
    return magnitude * (2 + err / ulp), torch.full(
        q.shape[:3], err / ulp, dtype=torch.float64, device=q.device
    )


def _course_forward(q, k, v, causal=False, out=None):
    from kernels.flash_attention import triton_flash

    o, lse = (None, None) if out is None else out
    return triton_flash.flash_attention_forward(q, k, v, causal, out=o, lse=lse)


def _sdpa(q, k, v, causal=False, out=None):
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1]
    )


def _bytes(q, k, v, causal=False):
    return (
        2 * q.numel() * q.element_size() + 2 * k.numel() * k.element_size() + 4 * q[..., 0].numel()
    )


def _flops(q, k, v, causal=False):
    b, h, n_q, d = q.shape
    return 4 * b * h * n_q * k.shape[2] * d / (2 if causal else 1)


def _memory_budget(q, k, v, causal=False):
    # O(N): room for a copy of every input and 1 MiB of small buffers; never the (Nq, Nk) scores
    return 2**20 + sum(t.numel() * t.element_size() for t in (q, k, v))


# ------------------------------------------------------------------------------------------------
# Extra credit: the backward, graded on its own. Its inputs include the forward's o (rounded to the
# dtype) and lse (float32) computed from the float64 reference, so a wrong forward costs the
# backward nothing, and the backward must do what FlashAttention-2's does: recompute P from lse,
# never store it. o and lse depend on the mask, which a case's params do not reach here: a causal
# case also has the layout "causal", from which `_backward_layout` computes them.
CAUSAL_BACKWARD = {"layout": "causal", "params": CAUSAL}
BACKWARD_CASES = (
    Case((1, 2, 2, 1, 1, 64), torch.float16),
    Case((2, 2, 2, 100, 100, 64), torch.float16, **CAUSAL_BACKWARD),
    Case((2, 4, 2, 100, 197, 64), torch.bfloat16),  # cross-attention (the call without out=)
    Case((1, 4, 2, 197, 197, 128), torch.bfloat16, **CAUSAL_BACKWARD),
    Case(
        (1, 2, 1, 37, 197, 64), torch.float16, **CAUSAL_BACKWARD
    ),  # a chunk at the end of a longer cache
)


def _backward_inputs(shape, dtype, device, gen):
    q, k, v = _attention_inputs(shape, dtype, device, gen)
    do = random_tensor(q.shape, dtype, device, gen)
    o, lse = attention_fp64(q, k, v)
    return q, k, v, o.to(dtype), lse.float(), do


def _backward_layout(layout, inputs):
    if layout != "causal":
        return inputs
    q, k, v, _, _, do = inputs
    o, lse = attention_fp64(q, k, v, causal=True)
    return q, k, v, o.to(q.dtype), lse.float(), do


def _backward_outputs(shape, dtype):
    b, hq, hkv, n_q, n_k, d = shape
    return ((b, hq, n_q, d), dtype), ((b, hkv, n_k, d), dtype), ((b, hkv, n_k, d), dtype)


def _backward_reference(q, k, v, o, lse, do, causal=False):
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out, _ = attention_fp64(q64, k64, v64, causal=causal)
    return torch.autograd.grad(out, (q64, k64, v64), do.double())


def _backward_scale(q, k, v, o, lse, do, causal=False):
    """What rtol (one ulp of the dtype) multiplies: four times the magnitude of each gradient's
    terms.

    dS = P * (dP - delta) with dP = dO V^T and delta = rowsum(dO * O); dQ = scale * dS K,
    dK = scale * dS^T Q, dV = P^T dO. A gradient can cancel to (near) zero -- with one key, dQ is
    exactly 0 -- so the error is measured against the same sums of absolute terms, |dS| bounded by
    P * (|dP| + rowsum(|dO| |O|)). Four roundings of terms that size: P and dS rounded to the dtype
    before their products, O rounded before delta, the gradient rounded at the end (the float32
    error of P is far below one of those).
    """
    group = q.shape[1] // k.shape[1]
    scale = 1 / math.sqrt(q.shape[-1])
    q64, o64, do64 = q.double(), o.double(), do.double()
    k64, v64 = (t.double().repeat_interleave(group, 1) for t in (k, v))
    s = q64 @ k64.transpose(-1, -2) * scale
    if causal:
        s = s.masked_fill(~causal_mask(q.shape[2], k.shape[2], q.device), float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    ds = p * ((do64 @ v64.transpose(-1, -2)).abs() + (do64.abs() * o64.abs()).sum(-1, keepdim=True))

    def per_kv_head(t):  # query heads h * group ... h * group + group - 1 share KV head h
        return t.unflatten(1, (k.shape[1], group)).sum(2)

    return (
        4 * scale * ds @ k64.abs(),
        4 * per_kv_head(scale * ds.transpose(-1, -2) @ q64.abs()),
        4 * per_kv_head(p.transpose(-1, -2) @ do64.abs()),
    )


def _course_backward(q, k, v, o, lse, do, causal=False, out=None):
    from kernels.flash_attention import triton_flash

    return triton_flash.flash_attention_backward(
        do, q, k, v, o, lse, causal, 1 / math.sqrt(q.shape[-1])
    )


def _sdpa_backward(q, k, v, o, lse, do, causal=False, out=None):
    """SDPA's forward and backward (PyTorch has no public backward-only call), for timing only."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1]
    )
    return torch.autograd.grad(out, (q, k, v), do)


def _backward_memory_budget(q, k, v, o, lse, do, causal=False):
    # delta is a float32 per query row: within the forward's O(N) budget
    return _memory_budget(q, k, v) + 4 * lse.numel()


def _backward_bytes(q, k, v, o, lse, do, causal=False):
    # read q, k, v, o, do; write dq, dk, dv (lse and delta are a row each)
    return 4 * q.numel() * q.element_size() + 4 * k.numel() * k.element_size()


def _backward_flops(q, k, v, o, lse, do, causal=False):
    return 2.5 * _flops(q, k, v, causal)


BACKWARD = GradedFunction(
    name="flash_attention_backward",
    points=5,
    backend="triton",
    extra_credit=True,
    description="extra credit, Triton: dQ, dK, dV recomputing P from lse (delta pre-pass, dK/dV "
                "and dQ kernels)",
    make_inputs=_backward_inputs,
    prepare=_backward_layout,
    reference_fp64=_backward_reference,
    tolerance=_tolerance,
    scale=_backward_scale,
    n_outputs=3,
    output_names=("dq", "dk", "dv"),
    output_shapes=_backward_outputs,
    course_kernel=_course_backward,
    torch_native=_sdpa_backward,
    bytes_moved=_backward_bytes,
    flops=_backward_flops,
    memory_budget=_backward_memory_budget,
    cases=BACKWARD_CASES,
    draw_cases=draw_backward_cases,
    input_names=("q", "k", "v", "o", "lse", "do"),
    perf=(
        PerfConfig(
            "flash_attention_backward/fp16/16x16x2048x64",
            (16, 16, 16, 2048, 2048, 64),
            torch.float16,
        ),
    ),
    hint="delta = rowsum(dO * O) first; P = exp(scale * q k^T - lse) with the same masks as the "
         "forward; "
    "dV = P^T dO, dS = P * (dO V^T - delta), dK = scale * dS^T Q (summed over the group's query "
    "heads), "
    "dQ = scale * dS K",
)


LAB = LabSpec(
    id="03_flash_attention",
    title="FlashAttention: the tiled forward with an online softmax in Triton",
    functions=(
        GradedFunction(
            name="flash_attention",
            points=10,
            backend="triton",
            description="Triton: tiled forward, online softmax, causal, GQA, any length; returns "
                        "(out, lse)",
            make_inputs=_attention_inputs,
            prepare=_layout,
            reference_fp64=_reference,
            tolerance=_tolerance,
            scale=_scale,
            n_outputs=2,
            output_names=("out", "lse"),
            output_shapes=_outputs,
            course_kernel=_course_forward,
            torch_native=_sdpa,
            bytes_moved=_bytes,
            flops=_flops,
            memory_budget=_memory_budget,
            cases=CASES,
            draw_cases=draw_cases,
            input_names=("q", "k", "v"),
            # the lecture's first benchmark shape; its second, (32, 32, 4096, 128), needs a
            # 128 GiB float64 reference to check every timed round
            perf=(
                PerfConfig(
                    "flash_attention/fp16/16x16x2048x64",
                    (16, 16, 16, 2048, 2048, 64),
                    torch.float16,
                ),
                PerfConfig(
                    "flash_attention/bf16/16x16x2048x64",
                    (16, 16, 16, 2048, 2048, 64),
                    torch.bfloat16,
                ),
            ),
            hint="subtract the running max before exp2, rescale acc and l when the max grows, "
                 "mask keys past "
            "Nk and (causal) past the diagonal in every block, and find a row's batch and head "
            "from "
            "the program id and the strides",
        ),
        BACKWARD,
    ),
)
