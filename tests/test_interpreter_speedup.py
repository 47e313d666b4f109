"""The CPU interpreter's helper-call shortcut (kernels/interpreter_speedup.py): same results, the
language swapped once per launch instead of once per helper call, and restored after the launch."""

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter

pytestmark = pytest.mark.cpu  # the interpreter runs only in CPU mode


@triton.jit
def _scaled(x, scale):
    return x * scale


@triton.jit
def _sum_of_scaled_blocks(x_ptr, out_ptr, n, scale, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n, BLOCK):
        x = tl.load(x_ptr + start + offsets, mask=start + offsets < n, other=0.0)
        total += _scaled(x, scale)  # a helper call on every trip
    tl.store(out_ptr + tl.program_id(0), tl.sum(total, axis=0))


def test_the_language_is_swapped_once_per_launch_not_per_helper_call(monkeypatch):
    swaps = []
    patch_builtin = interpreter._patch_builtin
    monkeypatch.setattr(
        interpreter,
        "_patch_builtin",
        lambda pkg, *rest: (swaps.append(pkg), patch_builtin(pkg, *rest))[1],
    )
    generator = torch.Generator().manual_seed(0)
    swaps_per_launch = {}
    for n in (64, 64, 1000):  # one trip (twice: the first launch may also swap tl.sum's module)
        x = torch.randn(n, generator=generator)
        out = torch.full((1,), float("nan"))
        swaps.clear()
        _sum_of_scaled_blocks[(1,)](x, out, n, 0.5, BLOCK=64)
        swaps_per_launch[n] = len(swaps)
        assert out.item() == pytest.approx(0.5 * x.double().sum().item(), rel=1e-5, abs=1e-5)
    # 16 trips call the helper 16 times; without the shortcut each call swaps the language again.
    assert swaps_per_launch[1000] == swaps_per_launch[64] > 0, swaps_per_launch


def test_the_language_is_restored_after_a_launch():
    x = torch.randn(100, generator=torch.Generator().manual_seed(1))
    out = torch.full((1,), float("nan"))
    _sum_of_scaled_blocks[(1,)](x, out, x.numel(), 2.0, BLOCK=32)
    assert tl.core.is_builtin(tl.load) and tl.core.is_builtin(tl.arange)
    assert out.item() == pytest.approx(2.0 * x.double().sum().item(), rel=1e-5, abs=1e-5)

