"""FlashAttention forward in CUDA C (flash_attention.cu), launched through CuPy.

The kernel teaches the algorithm one thread at a time (read the .cu file top to bottom); this
wrapper picks the compiled variant (dtype, head dim, causal), checks the arguments, and launches one
block of 128 threads per 16 query rows of every (batch, head). It allocates nothing but `out` and
`lse`: memory grows with N, where the naive version's (N x N) scores grow with N^2.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from kernels import cuda, runtime
from kernels.flash_attention.validate import check_attention_inputs

SUFFIX = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
HEAD_DIMS = (64, 128)  # the .cu file's template instances
BLOCK_M, THREADS = 16, 128  # query rows per block and threads per block, as in flash_attention.cu
LOG2E = math.log2(math.e)


def check_args(q, k, v, scale, out, lse, *, device: str) -> None:
    """Every check the kernel needs before it may touch memory (a separate function, so CPU tests
    can reach the messages; `device` is "cuda" for the kernel)."""
    op = "cupy flash_attention"
    check_attention_inputs(q, k, v, dtypes=tuple(SUFFIX), device=device, op=op)
    b, h, n_q, d = q.shape
    if d not in HEAD_DIMS:
        raise ValueError(
            f"{op}: head_dim {d} is not supported; flash_attention.cu is compiled for "
            + " and ".join(map(str, HEAD_DIMS))
        )
    if scale is not None and not (
        isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0
    ):
        raise ValueError(
            f"{op}: scale must be a positive finite number or None (1/sqrt(head_dim)), "
            f"got {scale!r}"
        )
    if out is not None:
        if tuple(out.shape) != tuple(q.shape) or out.dtype != q.dtype or out.device != q.device:
            raise ValueError(
                f"{op}: out must have q's shape {tuple(q.shape)}, dtype and device, got "
                f"{tuple(out.shape)} {out.dtype} on {out.device}"
            )
        if out.stride(-1) != 1:
            raise ValueError(
                f"{op}: out's last dimension must be contiguous (stride 1), "
                f"got strides {out.stride()}"
            )
    if lse is not None:
        if tuple(lse.shape) != (b, h, n_q) or lse.dtype != torch.float32 or lse.device != q.device:
            raise ValueError(
                f"{op}: lse must be a float32 tensor of shape {(b, h, n_q)} on {q.device}, got "
                f"{tuple(lse.shape)} {lse.dtype} on {lse.device}"
            )
        if not lse.is_contiguous():
            raise ValueError(f"{op}: lse must be contiguous")


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of softmax(scale * q k^T) v. q: (B, Hq, Nq, D); k, v: (B, Hkv, Nk, D), Hq % Hkv ==
    0.

    Any strides with a contiguous last dimension; causal is bottom-right aligned (query i sees keys
    j <= i + Nk - Nq); lse is float32 (B, Hq, Nq), natural log; a query that sees no key gets 0 and
    -inf.
    """
    runtime.require_cupy()
    check_args(q, k, v, scale, out, lse, device="cuda")
    b, n_heads, n_q, d = q.shape
    n_kv_heads, n_k = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    out = torch.empty_like(q, memory_format=torch.contiguous_format) if out is None else out
    lse = (
        torch.empty((b, n_heads, n_q), dtype=torch.float32, device=q.device) if lse is None else lse
    )
    if out.numel() == 0:
        return out, lse
    name = f"flash_attention_fwd_{SUFFIX[q.dtype]}_d{d}_{'causal' if causal else 'full'}"
    kernel = cuda.load_kernel("flash_attention/flash_attention.cu", name)
    grid = -(-n_q // BLOCK_M) * n_heads * b
    strides = [np.int64(s) for t in (q, k, v, out) for s in t.stride()[:3]]
    cuda.launch(
        kernel,
        grid,
        THREADS,
        (
            cuda.pointer(q),
            cuda.pointer(k),
            cuda.pointer(v),
            cuda.pointer(out),
            cuda.pointer(lse),
            np.int32(n_heads),
            np.int32(n_kv_heads),
            np.int32(n_q),
            np.int32(n_k),
            *strides,
            np.float32(scale * LOG2E),
        ),
        q.device,
    )
    return out, lse
