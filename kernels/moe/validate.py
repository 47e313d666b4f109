"""Argument checks of the MoE kernels: a wrong shape would silently read other experts' weights."""

from __future__ import annotations

import torch

MOE_DTYPES = (torch.float16, torch.bfloat16)


def _name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_tensor(op: str, name: str, t, *, dim: int, dtypes=None, device=None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(
            f"{op}: {name} has dtype {_name(t.dtype)}; supported: {', '.join(map(_name, dtypes))}"
        )
    if t.dim() != dim:
        raise ValueError(f"{op}: {name} must have {dim} dimensions, got shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{op}: {name} is on {t.device} but x is on {device}")
    if not t.is_contiguous():
        raise ValueError(
            f"{op}: {name} is not contiguous (strides {t.stride()}): pass {name}.contiguous()"
        )


def check_top_k(op: str, top_k, experts: int) -> None:
    if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= experts:
        raise ValueError(
            f"{op}: top_k must be an int from 1 to the number of experts ({experts}), got {top_k!r}"
        )


def check_router_args(op: str, x, w_router, top_k) -> None:
    check_tensor(op, "x", x, dim=2, dtypes=MOE_DTYPES)
    check_tensor(op, "w_router", w_router, dim=2, dtypes=(x.dtype,), device=x.device)
    if w_router.shape[1] != x.shape[1]:
        raise ValueError(
            f"{op}: w_router is (experts, hidden) = {tuple(w_router.shape)} but x has hidden size "
            f"{x.shape[1]}"
        )
    check_top_k(op, top_k, w_router.shape[0])


def check_ids(op: str, ids, experts: int) -> None:
    """Expert ids (tokens, k), int32 or int64; values trusted in [0, experts) (a check syncs)."""
    check_tensor(op, "ids", ids, dim=2, dtypes=(torch.int32, torch.int64))
    if experts < 1:
        raise ValueError(f"{op}: experts must be >= 1, got {experts}")


def check_expert_weights(op: str, x, gate, up, down) -> None:
    """x (tokens, hidden); gate, up (E, inter, hidden); down (E, hidden, inter); one dtype."""
    check_tensor(op, "x", x, dim=2, dtypes=MOE_DTYPES)
    for name, t in (("w_gate", gate), ("w_up", up), ("w_down", down)):
        check_tensor(op, name, t, dim=3, dtypes=(x.dtype,), device=x.device)
    experts, inter, hidden = gate.shape
    if up.shape != gate.shape:
        raise ValueError(
            f"{op}: w_up has shape {tuple(up.shape)} but w_gate has {tuple(gate.shape)}"
        )
    if down.shape != (experts, hidden, inter):
        raise ValueError(
            f"{op}: w_down must be (experts, hidden, inter) = {(experts, hidden, inter)}, "
            f"got {tuple(down.shape)}"
        )
    if x.shape[1] != hidden:
        raise ValueError(f"{op}: x has hidden size {x.shape[1]} but the experts take {hidden}")
