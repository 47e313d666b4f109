"""Argument checks shared by the attention kernels (Triton and CUDA C)."""

from __future__ import annotations

import torch

from kernels import runtime

ATTENTION_DTYPES = (torch.float16, torch.bfloat16)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_attention_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    dtypes=ATTENTION_DTYPES,
    device: str | None = None,
    op: str = "attention",
) -> None:
    """q: (B, Hq, Nq, D); k, v: (B, Hkv, Nk, D) with Hq % Hkv == 0; one dtype from `dtypes`; one
    device.

    Any strides, as long as the last dimension is contiguous (a (B, N, H, D) tensor transposed to
    (B, H, N, D) is fine). `device` is the device type the kernel runs on: "cuda" for CuPy kernels,
    `runtime.DEVICE` (the default) for Triton kernels, which run on CPU tensors in interpreter mode.
    """
    device = runtime.DEVICE if device is None else device
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{op}: {name} must have 4 dimensions (batch, heads, seq, head_dim), "
                f"got shape {tuple(t.shape)}"
            )
        if t.dtype not in dtypes:
            raise TypeError(
                f"{op}: {name} has dtype {_name(t.dtype)}; supported: "
                + ", ".join(_name(d) for d in dtypes)
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"{op}: q, k and v must share a dtype, got {_name(q.dtype)}, {_name(k.dtype)}, "
            f"{_name(v.dtype)}"
        )
    if k.shape != v.shape:
        raise ValueError(
            f"{op}: k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    (b, hq, _, d), (bk, hkv, _, dk) = q.shape, k.shape
    if d != dk:
        raise ValueError(
            f"{op}: q has head_dim {d} but k and v have head_dim {dk}; they must match"
        )
    if b != bk:
        raise ValueError(f"{op}: q has batch {b} but k and v have batch {bk}")
    if hkv == 0 or hq % hkv:
        raise ValueError(
            f"{op}: q has {hq} heads, which is not a multiple of k and v's {hkv} heads "
            "(grouped-query attention needs n_heads % n_kv_heads == 0)"
        )
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.device.type != device:
            hint = {
                "cuda": " (this kernel runs on the GPU: move it with .cuda())",
                "cpu": " (CPU mode runs the Triton interpreter on CPU tensors: "
                "move it with .cpu())",
            }
            raise ValueError(
                f"{op}: {name} is on {t.device}, expected a {device} tensor{hint.get(device, '')}"
            )
        if t.device != q.device:
            raise ValueError(f"{op}: {name} is on {t.device} but q is on {q.device}")
        if t.stride(-1) != 1 and t.shape[-1] > 1:
            raise ValueError(
                f"{op}: {name}'s last dimension (head_dim) must be contiguous (stride 1), got "
                f"strides {t.stride()}: pass {name}.contiguous()"
            )
