"""Argument checks shared by every kernel wrapper.

A kernel handed the wrong thing does not fail politely: it reads garbage, writes out of bounds or
crashes the CUDA context. So every wrapper checks its arguments first and raises a `TypeError`
(wrong kind or dtype) or `ValueError` (wrong shape, device or layout) that says what to do instead.
"""

from __future__ import annotations

import torch

from kernels import runtime

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


def check_operands(
    op: str,
    tensors: dict[str, torch.Tensor],
    *,
    device_type: str,
    like: str | None = None,
    dims: dict[str, int] | None = None,
    float32_instead: str = "",
) -> None:
    """What every matmul-shaped wrapper asks of each operand: a tensor, bf16 or fp16, with the
    dtype and device of tensors[like] (the first one if None), on `device_type`, with `dims[name]`
    dimensions (2 for any name not in `dims`). `float32_instead` says what to call for float32
    inputs. The wrapper then checks what its kernel needs of shapes and strides."""
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    first_name = like if like is not None else next(iter(tensors))
    first = tensors[first_name]
    for name, t in tensors.items():
        if t.dtype not in MATMUL_DTYPES:
            instead = f" (for float32, use {float32_instead})" if float32_instead else ""
            raise TypeError(
                f"{op}: {name} has dtype {str(t.dtype).removeprefix('torch.')}; supported: "
                f"{_dtype_names(MATMUL_DTYPES)}{instead}"
            )
        if t.dtype != first.dtype:
            raise TypeError(
                f"{op}: {name} is {t.dtype} but {first_name} is {first.dtype}: cast one to match"
            )
        if t.dtype == torch.bfloat16:
            check_bf16_products(op)
        if t.device.type != device_type:
            raise ValueError(f"{op}: {name} is on {t.device}; this kernel runs on {device_type}")
        if t.device != first.device:
            raise ValueError(f"{op}: {name} is on {t.device} but {first_name} is on {first.device}")
        want = (dims or {}).get(name, 2)
        if t.dim() != want:
            raise ValueError(f"{op}: {name} must be {want}-D, got shape {tuple(t.shape)}")


def check_bf16_products(op: str) -> None:
    """bf16 tensor-core products need sm_80 or newer: a T4 (sm_75) refuses them with a sentence
    (pass float16 there) instead of a compile error from deep inside Triton."""
    try:
        runtime.require("bf16", f"{op} on bfloat16 tensors")
    except runtime.FeatureMissing as missing:
        raise runtime.FeatureMissing(f"{missing} Pass float16 tensors instead.") from None


def check_rows_contiguous(op: str, tensors: dict[str, torch.Tensor]) -> None:
    """Each 2-D tensor's rows are contiguous (last stride 1, unless a row has one element): the
    row stride may be anything, so row-strided views pass."""
    for name, t in tensors.items():
        if t.dim() == 2 and t.stride(1) != 1 and t.shape[1] > 1:
            raise ValueError(
                f"{op}: {name}'s rows must be contiguous (last stride 1, got strides "
                f"{t.stride()}): pass {name}.contiguous()"
            )


def check_matmul_args(
    op: str, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None, *, device_type: str
) -> None:
    """a (M, K) and b (K, N): contiguous, one dtype (bf16 or fp16), one device; out (M, N) alike."""
    named = {"a": a, "b": b} | ({"out": out} if out is not None else {})
    check_operands(op, named, device_type=device_type)
    for name, t in named.items():
        if not t.is_contiguous():
            raise ValueError(
                f"{op}: {name} is not contiguous (strides {t.stride()}): pass {name}.contiguous()"
            )
    if a.shape[1] != b.shape[0]:
        raise ValueError(
            f"{op}: a is {tuple(a.shape)} and b is {tuple(b.shape)}: a's columns must equal b's "
            "rows"
        )
    if out is not None and out.shape != (a.shape[0], b.shape[1]):
        raise ValueError(
            f"{op}: out must have shape {(a.shape[0], b.shape[1])}, got {tuple(out.shape)}"
        )
