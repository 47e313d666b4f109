"""The TMA / persistent grouped-GEMM variants (kernels/moe/triton_grouped_gemm_tma.py) against float64.

The same checks as tests/test_moe.py's grouped-GEMM test, for every variant: skewed routing with an expert
that gets no tokens, 100 tokens (not a multiple of the block), top-1 and top-2, bf16 and fp16, outputs
poisoned. A second shape (hidden 80, intermediate 144) is a multiple of neither BLOCK_K nor BLOCK_N, so the
descriptors' zero fill past K and clipping past N are exercised, and so is the last weight tile reading
the next expert's rows.
"""
import pytest
import torch

from kernels.moe import moe_layer, reference, triton_grouped_gemm_tma, triton_permute
from kernels.testing import generator
from tests.test_moe import (DEV, DTYPES, E, _check_layer, _problem, _rows, check_h, check_y,  # noqa: F401
                            poisoned_empty)

VARIANTS = list(triton_grouped_gemm_tma.VARIANTS)


@pytest.fixture(autouse=True, scope="module")
def one_variant_config():
    """On the GPU, one configuration per case (the benchmark autotunes and checks at full size)."""
    triton_grouped_gemm_tma.TUNING_OVERRIDE = 0
    yield
    triton_grouped_gemm_tma.TUNING_OVERRIDE = None


def _routed(tokens, top_k, dtype, *, skew, hidden, inter):
    g = generator(0, DEV)
    w = reference.init_weights(E, hidden, inter, dtype, DEV, g)
    x = torch.randn(tokens, hidden, device=DEV, generator=g)
    if skew:  # as tests/test_moe.py: expert 0 takes most tokens, expert 3 none
        x += 0.5
        w.router[0] += 0.1
        w.router[3] -= 0.1
    x = x.to(dtype)
    _, ids, _ = reference.route(x, w.router, top_k, fp64=True)
    perm = triton_permute.permute(ids.to(torch.int32), E, 16)
    if skew:
        assert (perm.counts == 0).any(), "the skewed case must leave an expert without tokens"
    return x, w, perm


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("top_k,skew", [(1, True), (2, False), (2, True)])
@pytest.mark.parametrize("hidden,inter", [(128, 256), (80, 144)])
def test_variant_gate_up_and_down(variant, dtype, top_k, skew, hidden, inter, poisoned_empty):
    x, w, perm = _routed(100, top_k, dtype, skew=skew, hidden=hidden, inter=inter)
    h = triton_grouped_gemm_tma.gate_up_swiglu(x, w.gate, w.up, perm, variant=variant)
    check_h(h, x, w, perm, dtype)
    y = triton_grouped_gemm_tma.down(h, w.down, perm, variant=variant)
    check_y(y, h, w, perm, dtype)


def test_interleaved_gate_up_is_prepared_once_and_again_after_a_change():
    """Row 2j is gate's row j and 2j + 1 up's; the same pair gives the same tensor back (no copy per call);
    an in-place update of either weight, or another pair, gives a fresh one with the new values."""
    g = generator(0, DEV)
    w = reference.init_weights(E, 80, 144, torch.bfloat16, DEV, g)
    first = triton_grouped_gemm_tma.interleaved_gate_up(w.gate, w.up)
    assert first.shape == (E, 2 * 144, 80)
    assert torch.equal(first[:, 0::2], w.gate) and torch.equal(first[:, 1::2], w.up)
    assert triton_grouped_gemm_tma.interleaved_gate_up(w.gate, w.up) is first
    w.up[3, 5] += 1.0
    updated = triton_grouped_gemm_tma.interleaved_gate_up(w.gate, w.up)
    assert updated is not first and torch.equal(updated[:, 1::2], w.up)
    gate_copy = w.gate.clone()
    assert triton_grouped_gemm_tma.interleaved_gate_up(gate_copy, w.up) is not updated


@pytest.mark.parametrize("top_k", [1, 2])
def test_gather_rows(top_k, poisoned_empty):
    x, _, perm = _routed(37, top_k, torch.bfloat16, skew=True, hidden=80, inter=144)
    out = triton_grouped_gemm_tma.gather_rows(x, perm)
    real, token, _, padding = _rows(perm)
    assert torch.equal(out[real], x[token])
    assert (out[padding] == 0).all()


@pytest.mark.parametrize("variant", ["tma", "persistent_pregathered", "persistent_pregathered_interleaved"])
def test_variant_checks_can_fail(variant, poisoned_empty):
    """A kernel that skips the last tile in use (the work bound read on the device, one tile short) leaves
    poisoned rows, and weights of the wrong expert give wrong rows: both must fail the checks."""
    dtype = torch.bfloat16
    x, w, perm = _routed(100, 2, dtype, skew=False, hidden=128, inter=256)
    perm.padded_offsets[-1] -= perm.block_m
    with pytest.raises(AssertionError):
        check_h(triton_grouped_gemm_tma.gate_up_swiglu(x, w.gate, w.up, perm, variant=variant), x, w, perm, dtype)
    perm.padded_offsets[-1] += perm.block_m
    h = triton_grouped_gemm_tma.gate_up_swiglu(x, w.gate, w.up, perm, variant=variant)
    check_h(h, x, w, perm, dtype)
    swapped = w.down.roll(1, dims=0)
    with pytest.raises(AssertionError):
        check_y(triton_grouped_gemm_tma.down(h, swapped, perm, variant=variant), h, w, perm, dtype)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("top_k", [1, 2])
def test_layer_with_variant(variant, top_k, poisoned_empty):
    dtype = torch.bfloat16
    x, w = _problem(37, dtype)
    _check_layer(moe_layer.moe_forward(x, w, top_k, grouped_gemm=variant), x, w, top_k, dtype)


def test_variant_by_rows_per_expert():
    """The seed configuration (32 experts, top-2): 2048 tokens (128 rows an expert) keep the fused gather,
    8192 (512 rows) and more take the persistent TMA kernel on gathered rows, gate and up interleaved."""
    assert moe_layer.grouped_gemm_for(2048, 32, 2) == "pointer"
    assert moe_layer.grouped_gemm_for(4096, 32, 2) == "persistent_pregathered_interleaved"  # 256 rows: the edge
    assert moe_layer.grouped_gemm_for(8192, 32, 2) == "persistent_pregathered_interleaved"


def test_unknown_variant():
    with pytest.raises(ValueError, match="variant"):
        moe_layer.grouped_gemm_functions("wgmma")
