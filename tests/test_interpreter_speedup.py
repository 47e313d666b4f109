"""The CPU interpreter's helper-call shortcut (kernels/interpreter_speedup.py): same results, the
language swapped once per launch instead of once per helper call, and restored after the launch."""

import numpy as np
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


def test_numpy_dtypes_are_the_interpreters_own():
    get_np_dtype = interpreter._get_np_dtype
    scalars = [v for v in vars(tl).values() if isinstance(v, tl.dtype)]
    for dtype in [*scalars, *(tl.block_type(s, [2, 4]) for s in scalars), tl.pointer_type(tl.int8),
                  tl.block_type(tl.pointer_type(tl.float32), [8])]:
        try:
            want = get_np_dtype.__wrapped__(dtype)
        except KeyError:  # no NumPy type for it: the shortcut fails alike
            with pytest.raises(KeyError):
                get_np_dtype(dtype)
            continue
        assert get_np_dtype(dtype) == want, dtype


@pytest.mark.parametrize(
    "shape",
    [[4, 8], [tl.constexpr(4), 8], tl.core.tuple([16, tl.constexpr(1)]), [1], [3, 4], [0],
     [np.int64(4)], [4.0], []],
    ids=str,
)
def test_block_types_are_built_as_triton_builds_them(shape):
    """Twice each, so the second comes from the table of shapes seen; invalid shapes fail alike."""
    init = tl.core.block_type.__init__
    for _ in range(2):
        want = object.__new__(tl.block_type)
        try:
            init.__wrapped__(want, tl.float16, shape)
        except Exception as error:  # noqa: BLE001 - whatever the original raises
            with pytest.raises(type(error)):
                tl.block_type(tl.float16, shape)
            continue
        got = tl.block_type(tl.float16, shape)
        assert got == want and got.name == want.name and got.numel == want.numel
        assert type(got.shape) is tl.core.tuple and got.shape.values == want.shape.values
        assert str(got.shape.type) == str(want.shape.type)
        assert got.shape is not tl.block_type(tl.float16, shape).shape  # never shared
