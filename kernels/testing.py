"""Correctness: compare a kernel's output with a float64 reference, element by element.

The rules every check in the course follows:

* the reference is computed in float64 from the *same* (low-precision) inputs, so the only error
  left is the kernel's own rounding;
* tolerances are stated in units in the last place (ulp) of the output dtype, times the number of
  roundings the computation is allowed, scaled by the magnitude of the terms (so cancellation cannot
  make a correct kernel look wrong);
* outputs are poisoned with NaN before the kernel runs, and NaN never passes, so an element the
  kernel forgot to write is caught;
* inputs are fresh random numbers, never zeros (zeros hide unwritten outputs and wrong indexing).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

# One ulp at 1.0 (2**-mantissa_bits): a correctly rounded result is within half of this, relative;
# the Triton interpreter truncates float32 -> bfloat16 instead of rounding, which stays within one.
ULP = {
    torch.float64: 2.0**-52,
    torch.float32: 2.0**-23,
    torch.float16: 2.0**-10,
    torch.bfloat16: 2.0**-7,
}
# Smallest subnormal: the absolute error floor of a rounding near zero.
TINY = {
    torch.float64: 2.0**-1074,
    torch.float32: 2.0**-149,
    torch.float16: 2.0**-24,
    torch.bfloat16: 2.0**-133,
}


def tolerance(dtype: torch.dtype, roundings: int = 1) -> tuple[float, float]:
    """(atol, rtol) for a result that went through `roundings` roundings to `dtype`."""
    return roundings * TINY[dtype], roundings * ULP[dtype]


@dataclass
class Comparison:
    """The outcome of comparing one output with its reference. `reason` is empty when `ok`."""

    ok: bool
    reason: str
    numel: int
    n_bad: int
    n_nan: int
    n_inf: int
    max_abs_err: float
    max_rel_err: float
    worst_index: list[int] | None
    expected_at_worst: float | None
    actual_at_worst: float | None
    first_bad_index: list[int] | None

    def as_dict(self) -> dict:
        return asdict(self)


def unravel_index(flat_index: int, shape) -> list[int]:
    """The per-dimension index of element `flat_index` of a row-major `shape`.

    The same as numpy.unravel_index, for torch shapes."""
    index = []
    for size in reversed(tuple(shape)):
        index.append(flat_index % size)
        flat_index //= size
    return index[::-1]


def _fmt_index(index: list[int]) -> str:
    return str(index[0]) if len(index) == 1 else str(tuple(index))


def compare(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    atol: float,
    rtol: float,
    scale: torch.Tensor | None = None,
) -> Comparison:
    """Pass if |actual - expected| <= atol + rtol * scale everywhere (scale defaults to |expected|).

    `expected` should be float64. NaN or Inf in `actual` where `expected` is finite always fails; an
    infinity in `expected` is matched only by the same infinity.
    """
    if not isinstance(actual, torch.Tensor):
        return Comparison(
            False,
            f"returned {type(actual).__name__}, expected a tensor",
            expected.numel(),
            expected.numel(),
            0,
            0,
            float("inf"),
            float("inf"),
            None,
            None,
            None,
            None,
        )
    if tuple(actual.shape) != tuple(expected.shape):
        return Comparison(
            False,
            f"wrong shape: got {tuple(actual.shape)}, expected {tuple(expected.shape)}",
            expected.numel(),
            expected.numel(),
            0,
            0,
            float("inf"),
            float("inf"),
            None,
            None,
            None,
            None,
        )
    # Compare in float64 on the tensors' device: a 64M-element GPU output need not travel to the
    # host.
    want = expected.detach().to(torch.float64).flatten()
    got = actual.detach().to(want.device, torch.float64).flatten()
    bound = atol + rtol * (
        want.abs() if scale is None else scale.detach().to(want.device, torch.float64).flatten()
    )
    # An infinity matches only the same infinity (inf - inf would be NaN): attention's log-sum-exp
    # is -inf for a query that sees no key, and a kernel that says so is right.
    err = torch.where(got == want, torch.zeros_like(got), (got - want).abs())
    # (rtol * inf would pass anything)
    bound = torch.where(torch.isinf(want), torch.zeros_like(bound), bound)
    # NaN compares false, so `err <= bound` is False wherever got is NaN: NaN never passes.
    bad = ~(err <= bound)
    n_bad = int(bad.sum())
    n_nan = int(torch.isnan(got).sum())
    n_inf = int(torch.isinf(got).sum())
    numel = want.numel()
    if numel == 0:
        return Comparison(True, "", 0, 0, 0, 0, 0.0, 0.0, None, None, None, None)
    err_for_ranking = torch.where(torch.isnan(err), torch.full_like(err, float("inf")), err)
    worst = int(torch.argmax(err_for_ranking))
    rel = err_for_ranking / want.abs().clamp_min(TINY[torch.float64])
    first_bad = int(torch.nonzero(bad)[0]) if n_bad else None
    shape = expected.shape
    reason = ""
    if n_bad:
        i = first_bad
        reason = (
            f"{n_bad} of {numel} elements wrong; "
            f"first bad index {_fmt_index(unravel_index(i, shape))}: "
            f"expected {want[i].item():.6g}, got {got[i].item():.6g}"
        )
        if n_nan:
            reason += f" ({n_nan} NaN: elements never written, or a NaN produced)"
    return Comparison(
        ok=n_bad == 0,
        reason=reason,
        numel=numel,
        n_bad=n_bad,
        n_nan=n_nan,
        n_inf=n_inf,
        max_abs_err=float(err_for_ranking.max()),
        max_rel_err=float(rel.max()),
        worst_index=unravel_index(worst, shape),
        expected_at_worst=float(want[worst]),
        actual_at_worst=float(got[worst]),
        first_bad_index=unravel_index(first_bad, shape) if first_bad is not None else None,
    )


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill an output buffer with NaN (floats) so unwritten elements cannot pass."""
    if t.dtype.is_floating_point:
        return t.fill_(float("nan"))
    return t.fill_(torch.iinfo(t.dtype).max)


def random_tensor(
    shape, dtype: torch.dtype, device, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Standard-normal values rounded to `dtype`: never zeros, never a constant."""
    return torch.randn(shape, dtype=torch.float32, device=device, generator=generator).to(dtype)


def generator(seed: int, device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def strided_view(t: torch.Tensor) -> torch.Tensor:
    """A non-contiguous view with t's shape and values: every other element of a wider buffer."""
    wide = (
        torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
        if t.dim()
        else None
    )
    if wide is None:
        raise ValueError("a 0-d tensor has no non-contiguous view")
    view = wide[..., ::2]
    view.copy_(t)
    return view
