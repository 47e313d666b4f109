"""Argument checks shared by every kernel wrapper.

A kernel handed the wrong thing does not fail politely: it reads garbage, writes out of bounds or
crashes the CUDA context. So every wrapper checks its arguments first and raises a `TypeError`
(wrong kind or dtype) or `ValueError` (wrong shape, device or layout) that says what to do instead.
"""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _dtype_names(dtypes) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def check_elementwise(
    op: str,
    tensors: dict[str, torch.Tensor],
    out: torch.Tensor | None = None,
    *,
    dtypes=FLOAT_DTYPES,
    device_type: str | None = None,
) -> None:
    """Check the inputs (and `out`) of an element-wise kernel that works on flat, contiguous memory.

    `tensors` maps argument names to tensors, so messages can name the culprit. `device_type="cuda"`
    is for kernels that can only run on a GPU (CuPy); Triton kernels also run on CPU tensors in
    interpreter mode, so they pass `runtime.DEVICE`.
    """
    args = dict(tensors)
    if out is not None:
        args["out"] = out
    for name, t in args.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in dtypes:
            raise TypeError(
                f"{op}: {name} has dtype {str(t.dtype).removeprefix('torch.')}; "
                f"supported: {_dtype_names(dtypes)}"
            )
    (first_name, first), *rest = args.items()
    for name, t in rest:
        if t.dtype != first.dtype:
            raise TypeError(
                f"{op}: {name} is {str(t.dtype).removeprefix('torch.')} but {first_name} is "
                f"{str(first.dtype).removeprefix('torch.')}; cast one so they match"
            )
        if t.shape != first.shape:
            raise ValueError(
                f"{op}: {name} has shape {tuple(t.shape)} but {first_name} has "
                f"{tuple(first.shape)}; this kernel does not broadcast"
            )
        if t.device != first.device:
            raise ValueError(f"{op}: {name} is on {t.device} but {first_name} is on {first.device}")
    for name, t in args.items():
        if device_type is not None and t.device.type != device_type:
            hint = (
                " (CuPy kernels run on the GPU: move it with .cuda())"
                if device_type == "cuda"
                else ""
            )
            raise ValueError(
                f"{op}: {name} is on {t.device}, expected a {device_type} tensor{hint}"
            )
        if not t.is_contiguous():
            raise ValueError(
                f"{op}: {name} is not contiguous (shape {tuple(t.shape)}, strides {t.stride()}); "
                "this kernel walks flat memory: pass t.contiguous()"
            )


MATMUL_DTYPES = (torch.bfloat16, torch.float16)


def check_matmul_args(
    op: str, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None, *, device_type: str
) -> None:
    """a (M, K) and b (K, N): contiguous, one dtype (bf16 or fp16), one device; out (M, N) alike."""
    for name, t in (("a", a), ("b", b)) + ((("out", out),) if out is not None else ()):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in MATMUL_DTYPES:
            raise TypeError(
                f"{op}: {name} has dtype {str(t.dtype).removeprefix('torch.')}; supported: "
                + ", ".join(str(d).removeprefix("torch.") for d in MATMUL_DTYPES)
            )
        if t.dim() != 2:
            raise ValueError(
                f"{op}: {name} must be a matrix (2 dimensions), got shape {tuple(t.shape)}"
            )
        if t.device.type != device_type:
            raise ValueError(f"{op}: {name} is on {t.device}, expected a {device_type} tensor")
        if not t.is_contiguous():
            raise ValueError(
                f"{op}: {name} is not contiguous (strides {t.stride()}): pass {name}.contiguous()"
            )
    if b.dtype != a.dtype or b.device != a.device:
        raise TypeError(
            f"{op}: b is {str(b.dtype).removeprefix('torch.')} on {b.device} but a is "
            f"{str(a.dtype).removeprefix('torch.')} on {a.device}; they must match"
        )
    if a.shape[1] != b.shape[0]:
        raise ValueError(
            f"{op}: a is {tuple(a.shape)} and b is {tuple(b.shape)}: a's columns must equal b's "
            "rows"
        )
    if out is not None and (
        out.shape != (a.shape[0], b.shape[1]) or out.dtype != a.dtype or out.device != a.device
    ):
        raise ValueError(
            f"{op}: out must be a {(a.shape[0], b.shape[1])} {str(a.dtype).removeprefix('torch.')} "
            f"tensor on {a.device}, got {tuple(out.shape)} {str(out.dtype).removeprefix('torch.')}"
        )
