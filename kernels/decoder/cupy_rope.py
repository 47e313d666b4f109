"""RoPE in CUDA C (rope.cu), launched through CuPy: the same contract as `triton_rope.rope`."""

from __future__ import annotations

import numpy as np
import torch

from kernels import cuda, runtime
from kernels.decoder.triton_rope import check_rope_args

SUFFIX = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
POSITION_SUFFIX = {torch.int32: "i32", torch.int64: "i64"}
# a token's (head, pair) grid: 8 KV heads x 32 pairs at D = 64 is 256 items, 2 a thread
THREADS = 128


def rope(
    x: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    scale: float = 1.0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x (tokens, heads, head_dim) rotated by RoPE at each token's position (half-split pairs);
    strided tokens and heads are fine, `out=x` rotates in place."""
    runtime.require_cupy()
    check_rope_args("rope_cuda", x, positions, inv_freq, device_type="cuda")
    if out is None:
        out = torch.empty_like(x)
    elif out.shape != x.shape or out.dtype != x.dtype or out.stride(-1) != 1:
        raise ValueError(
            f"rope_cuda: out must match x ({tuple(x.shape)} {x.dtype}), with a "
            f"contiguous last dimension; got {tuple(out.shape)} {out.dtype}"
        )
    tokens, heads, head_dim = x.shape
    if x.numel():
        kernel = cuda.load_kernel(
            "decoder/rope.cu", f"rope_{SUFFIX[x.dtype]}_{POSITION_SUFFIX[positions.dtype]}"
        )
        cuda.launch(
            kernel,
            tokens,
            THREADS,
            (
                cuda.pointer(x),
                cuda.pointer(out),
                cuda.pointer(positions),
                cuda.pointer(inv_freq),
                np.int32(heads),
                np.int32(head_dim // 2),
                np.int64(x.stride(0)),
                np.int64(x.stride(1)),
                np.int64(out.stride(0)),
                np.int64(out.stride(1)),
                np.float32(scale),
            ),
            x.device,
        )
    return out
