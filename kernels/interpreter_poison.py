"""CPU mode: a masked `tl.load` without `other=` reads poison, as a GPU may read garbage.

On a GPU, the lanes a mask turns off in `tl.load(ptrs, mask=mask)` hold whatever the registers held:
the value is undefined, and a kernel that lets those lanes into a sum, a maximum or a `tl.dot` is
wrong, however often it happens to pass. Triton's interpreter fills them with zeros, so in CPU mode
such a kernel passes every check: a sum with zeros in its masked lanes is the right sum.

`install` makes the interpreter fill them with poison instead: a NaN with a payload of its own for
floating-point loads, the largest value of the type for integer loads (an index that large points
nowhere). Arithmetic carries a NaN's payload along, so a NaN in an output that is not the plain NaN
PyTorch writes (`computed_nans`) was computed, not left unwritten. A load that gives
`other=` is unchanged, and so is a lane the mask keeps. A kernel whose masked lanes never reach an
output (an element-wise add that stores with the same mask) is unaffected; one that reduces over
them now returns NaN, and its check fails.

Each such load is recorded by where it is in the kernel's source (`unfilled_loads`), so a check
that finds NaN can say which load to give `other=` (0 for a sum, -inf for a maximum).
On a GPU nothing here runs.
"""

from __future__ import annotations

import sys

# Where a masked load without other= ran since the last `clear`: "file:line", in the order seen.
_SITES: dict[str, None] = {}
_INT_OF_SIZE: dict = {}
# One entry per `tl.load` being built: whether it gave `other=`. Triton's semantic layer passes
# `other.handle if other else None` to the builder, so an `other=0.0` arrives as None, like no
# `other` at all: the question is asked one level up, where the two still differ.
_OTHER_GIVEN: list[bool] = []


def clear() -> None:
    """Forget the loads recorded so far (before calling the kernels to be judged)."""
    _SITES.clear()


def unfilled_loads() -> list[str]:
    """'file:line' of each masked `tl.load` without `other=` that ran since `clear`."""
    return list(_SITES)


def hint() -> str:
    """One sentence naming the loads that read masked lanes without `other=`, or ""."""
    sites = unfilled_loads()
    if not sites:
        return ""
    return (
        f"masked lanes read without other= ({', '.join(sites[:3])}): in CPU mode they read NaN, "
        "on a GPU whatever the registers held; give the load other= (0 for a sum, -inf for a max)"
    )


def computed_nans(t) -> int:
    """How many of tensor `t`'s NaNs are not the plain NaN PyTorch fills a buffer with: NaNs
    computed from something (a poisoned lane), not elements a kernel never wrote."""
    import torch

    nans = t[torch.isnan(t)]
    if not nans.numel() or t.element_size() not in _INT_OF_SIZE:
        return 0
    bits = _INT_OF_SIZE[t.element_size()]
    plain = torch.full((1,), float("nan"), dtype=t.dtype).view(bits)
    return int((nans.contiguous().view(bits) != plain).sum())


def _kernel_line() -> str:
    """'file:line' of the innermost frame outside Triton: the `tl.load` in the kernel's source."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if "/triton/" not in name and "interpreter_poison" not in name:
            return f"{name.rsplit('/', 1)[-1]}:{frame.f_lineno}"
        frame = frame.f_back
    return "a kernel"


def _poison(dtype):
    import numpy as np

    if np.issubdtype(dtype, np.floating):  # the payload survives a cast to fp16 and to bfloat16
        return np.array([0x7FF55555], dtype=np.uint32).view(np.float32).astype(dtype)[0]
    if np.issubdtype(dtype, np.integer):
        return np.iinfo(dtype).max
    return None  # booleans: no value is wrong for all uses


def install() -> None:
    """Wrap the interpreter's masked load (calling it again is harmless)."""
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter

    _INT_OF_SIZE.update({2: torch.int16, 4: torch.int32, 8: torch.int64})

    from triton.language.semantic import TritonSemantic

    builder = interpreter.InterpreterBuilder
    masked_load = builder.create_masked_load
    if getattr(masked_load, "poisons", False):
        return
    semantic_load = TritonSemantic.load

    def load_noting_other(self, ptr, mask, other, *rest):
        _OTHER_GIVEN.append(other is not None)
        try:
            return semantic_load(self, ptr, mask, other, *rest)
        finally:
            _OTHER_GIVEN.pop()

    # the options after `other` differ between Triton releases (3.6: cache_modifier,
    # eviction_policy, is_volatile; 3.9: cache_policy, is_volatile, some by name): passed on as they
    # came
    def poisoned_masked_load(self, ptrs, mask, other, *options, **named):
        # Only a tl.load without other= (not an atomic or a descriptor load), with a lane masked.
        unfilled = other is None and _OTHER_GIVEN and not _OTHER_GIVEN[-1]
        if not unfilled or bool(np.all(mask.data)):
            return masked_load(self, ptrs, mask, other, *options, **named)
        dtype_tt = ptrs.get_element_ty()
        dtype_np = interpreter._get_np_dtype(dtype_tt)
        # bfloat16 is held as its 16 bits in NumPy: the top half of the float32 poison
        bf16 = dtype_tt == tl.bfloat16
        poison = np.uint16(0x7FF5) if bf16 else _poison(np.dtype(dtype_np))
        if poison is None:
            return masked_load(self, ptrs, mask, other, *options, **named)
        _SITES.setdefault(_kernel_line())
        fill = interpreter.TensorHandle(np.full(ptrs.data.shape, poison, dtype=dtype_np), dtype_tt)
        return masked_load(self, ptrs, mask, fill, *options, **named)

    poisoned_masked_load.poisons = True
    builder.create_masked_load = poisoned_masked_load
    TritonSemantic.load = load_noting_other
