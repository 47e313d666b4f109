"""Module 06 (MoE): router, permutation, grouped GEMM, combine and the whole layer against float64.

Small configurations on the CPU (Triton interpreter): 8 experts (and 6, not a power of two), hidden
128, intermediate 256, 37 and 100 tokens (not multiples of any block), top-1 and top-2, fp16 and
bf16. Routing balanced and skewed (one expert takes most tokens, others none). Every buffer the
kernels allocate is poisoned (NaN, or INT_MAX for integers) by the `poisoned_empty` fixture, so an
element nobody writes shows. The CuPy permutation and the CUDA-graph capture need a GPU and are
skipped on the CPU; permute.cu's compilation is covered by tests/test_cuda_compile.py.
"""

import pytest
import torch

from kernels import runtime
from kernels.moe import (
    moe_layer,
    reference,
    triton_combine,
    triton_grouped_gemm,
    triton_permute,
    triton_router,
)
from kernels.testing import ULP, compare, generator, poison_

DEV = runtime.DEVICE
E, H, I = 8, 128, 256  # noqa: E741 - the usual names: experts, hidden, intermediate
DTYPES = [torch.bfloat16, torch.float16]
needs_gpu = pytest.mark.gpu  # CuPy kernels, CUDA graphs: deselected without a GPU


@pytest.fixture(autouse=True, scope="module")
def one_gemm_config():
    """On the GPU, one grouped-GEMM configuration per case (the benchmark autotunes over all of them
    and checks the result at full size); the CPU has only one."""
    triton_grouped_gemm.TUNING_OVERRIDE = 0
    yield
    triton_grouped_gemm.TUNING_OVERRIDE = None


@pytest.fixture
def poisoned_empty(monkeypatch):
    """torch.empty / empty_like return poisoned memory while the test runs (the kernels allocate
    their own outputs and intermediates: h, y, block counts, ...)."""
    empty, empty_like = torch.empty, torch.empty_like
    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison_(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison_(empty_like(*a, **k)))


def make_problem(tokens, dtype, *, experts=E, skew=False, seed=0):
    g = generator(seed, DEV)
    w = reference.init_weights(experts, H, I, dtype, DEV, g)
    x = torch.randn(tokens, H, device=DEV, generator=g)
    if skew:  # every token leans the same way; expert 0's router row points there, expert 3's away
        x += 0.5
        w.router[0] += 0.1
        w.router[3] -= 0.1
    return x.to(dtype), w


# --------------------------------------------------------------------------------------------------
# Router


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("tokens,experts", [(37, 8), (100, 6), (1, 8)])
def test_router_matches_fp64(tokens, experts, top_k, dtype, poisoned_empty):
    x, w = make_problem(tokens, dtype, experts=experts)
    probs, ids, weights = triton_router.route(x, w.router, top_k)
    p64, ids64, w64 = reference.route(x, w.router, top_k, fp64=True)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids.long(), ids64), "top-k picked other experts"
    # float32 logits of H bf16 products, softmax, a division: a few float32 ulps
    for got, want in ((probs, p64), (weights, w64)):
        c = compare(got, want, atol=1e-7, rtol=64 * ULP[torch.float32])
        assert c.ok, c.reason
    assert torch.allclose(
        weights.sum(-1).double(),
        torch.ones(tokens, dtype=torch.float64, device=weights.device),
        atol=1e-6,
    )


def test_router_weights_are_renormalized():
    """The check that catches a router that forgets to renormalize: the top-2 probabilities of 8
    experts sum to well under 1."""
    x, w = make_problem(37, torch.bfloat16)
    probs, _, weights = triton_router.route(x, w.router, 2)
    top = probs.topk(2, dim=-1).values
    assert (top.sum(-1) < 0.9).all()
    assert not compare(top, reference.route(x, w.router, 2, fp64=True)[2], atol=0, rtol=1e-3).ok


def test_load_balancing_loss_and_utilization():
    tokens, experts = 64, 8
    uniform = torch.full((tokens, experts), 1 / experts, dtype=torch.float64)
    even = torch.full((experts,), tokens * 2 // experts)
    assert reference.load_balancing_loss(uniform, even, 2).item() == pytest.approx(1.0)
    one_hot = torch.zeros(tokens, experts, dtype=torch.float64)
    one_hot[:, 0] = 1
    all_to_0 = torch.zeros(experts, dtype=torch.int64)
    all_to_0[0] = tokens
    assert reference.load_balancing_loss(one_hot, all_to_0, 1).item() == pytest.approx(experts)
    stats = reference.utilization(all_to_0, tokens, 1, capacity_factor=1.0)
    assert stats["capacity"] == 8 and stats["dropped"].item() == tokens - 8
    assert stats["cv"].item() == pytest.approx((experts - 1) ** 0.5)
    assert reference.utilization(even, tokens, 2)["cv"].item() == 0
    # from the kernels: skewed routing shows in every statistic
    x, w = make_problem(100, torch.bfloat16, skew=True)
    probs, ids, _ = triton_router.route(x, w.router, 2)
    stats = triton_router.routing_stats(probs, triton_permute.permute(ids, E, 16).counts, 2)
    assert stats["load_balancing_loss"].item() > 1.5 and stats["dropped"].item() > 0


# --------------------------------------------------------------------------------------------------
# Permutation


def _skewed_ids(tokens, top_k, experts, seed=0):
    """Expert 0 takes most assignments, expert 3 none."""
    logits = torch.randn(tokens, experts, generator=generator(seed, "cpu"))
    logits[:, 0] += 2.0
    logits[:, 3] = -1e9
    return logits.topk(top_k, dim=-1).indices.to(torch.int32).to(DEV)


def check_permutation(perm, ids, experts, block_m):
    """The contract, order within an expert left free (the CUDA version's atomics choose it)."""
    want = triton_permute.permute_reference(ids, experts, block_m)
    assert torch.equal(perm.counts, want.counts)
    assert torch.equal(perm.padded_offsets, want.padded_offsets)
    assert torch.equal(perm.tile_expert, want.tile_expert)
    assert (perm.padded_offsets[:-1] % block_m == 0).all()
    for e in range(experts):
        lo, hi = want.padded_offsets[e].item(), want.padded_offsets[e + 1].item()
        got_rows = perm.sorted_ids[lo:hi]
        assert torch.equal(got_rows.sort().values, want.sorted_ids[lo:hi].sort().values), (
            f"expert {e}'s rows"
        )
    assert (perm.sorted_ids[want.padded_offsets[-1].item() :] == -1).all(), (
        "rows past the end must be padding"
    )
    n = ids.numel()
    assert torch.equal(
        perm.sorted_ids[perm.row_of.long()], torch.arange(n, dtype=torch.int32, device=ids.device)
    )


@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("tokens,experts", [(37, 8), (100, 6), (1000, 8), (3, 8)])
def test_triton_permutation(tokens, experts, top_k, block_m, poisoned_empty):
    ids = _skewed_ids(tokens, top_k, experts)
    perm = triton_permute.permute(ids, experts, block_m)
    check_permutation(perm, ids, experts, block_m)
    assert perm.counts[3].item() == 0 and perm.counts[0].item() > tokens * top_k // experts
    # the Triton version is stable: rows keep the assignments' order, exactly as the sorted
    # reference
    assert torch.equal(
        perm.sorted_ids, triton_permute.permute_reference(ids, experts, block_m).sorted_ids
    )


@needs_gpu
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("tokens,experts", [(37, 8), (100, 6), (65536, 32), (3, 8)])
def test_cuda_permutation(tokens, experts, top_k, poisoned_empty):
    from kernels.moe import cupy_permute

    ids = _skewed_ids(tokens, top_k, experts)
    for block_m in (16, 64, 128):
        check_permutation(cupy_permute.permute(ids, experts, block_m), ids, experts, block_m)


# --------------------------------------------------------------------------------------------------
# Grouped GEMMs and combine, each from exact inputs


def _routed(tokens, top_k, dtype, skew=False):
    x, w = make_problem(tokens, dtype, skew=skew)
    _, ids, weights = reference.route(x, w.router, top_k, fp64=True)
    perm = triton_permute.permute(
        ids.to(torch.int32), E, triton_grouped_gemm.block_m_for(tokens, E, top_k)
    )
    return x, w, ids, weights, perm


def permuted_rows(perm):
    """(rows holding an assignment, their tokens, their experts, padding rows in use)."""
    real = (perm.sorted_ids >= 0).nonzero().flatten()
    tile_of = torch.arange(perm.sorted_ids.numel(), device=DEV) // perm.block_m
    used = tile_of < perm.padded_offsets[-1].item() // perm.block_m
    padding = (used & (perm.sorted_ids < 0)).nonzero().flatten()
    return (
        real,
        perm.sorted_ids[real].long() // perm.top_k,
        perm.tile_expert[tile_of[real]].long(),
        padding,
    )


def check_h(h, x, w, perm, dtype, fused=True):
    """h (permuted rows) against each real row's float64 SwiGLU; padding rows must be zeros."""
    real, token, expert, padding = permuted_rows(perm)
    xs = x.double()[token]
    wg, wu = w.gate.double()[expert], w.up.double()[expert]
    h_ref, scale = reference.swiglu_with_error_scale(
        torch.einsum("rh,rih->ri", xs, wg),
        torch.einsum("rh,rih->ri", xs, wu),
        torch.einsum("rh,rih->ri", xs.abs(), wg.abs()),
        torch.einsum("rh,rih->ri", xs.abs(), wu.abs()),
        fused=fused,
    )
    c = compare(
        h[real], h_ref, atol=1e-6 * h_ref.abs().mean().item(), rtol=2 * ULP[dtype], scale=scale
    )
    assert c.ok, c.reason
    assert (h[padding] == 0).all(), "padding rows must compute zeros"


def check_y(y, h, w, perm, dtype):
    """y (permuted rows) against float64 h @ w_down[expert].T for each real row."""
    real, _, expert, _ = permuted_rows(perm)
    hd, wd = h[real].double(), w.down.double()[expert]
    y_ref = torch.einsum("ri,rhi->rh", hd, wd)
    terms = torch.einsum("ri,rhi->rh", hd.abs(), wd.abs())
    atol, rtol = reference.down_tolerance(dtype)
    c = compare(y[real], y_ref, atol=atol, rtol=rtol, scale=y_ref.abs() + terms * 2**-8)
    assert c.ok, c.reason


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("top_k,skew", [(1, True), (2, False)])
def test_gate_up_and_down(top_k, skew, dtype, fused, poisoned_empty):
    x, w, ids, weights, perm = _routed(100, top_k, dtype, skew)
    gate_up = triton_grouped_gemm.gate_up_swiglu if fused else triton_grouped_gemm.gate_up_unfused
    h = gate_up(x, w.gate, w.up, perm)
    check_h(h, x, w, perm, dtype, fused)
    check_y(triton_grouped_gemm.down(h, w.down, perm), h, w, perm, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("top_k", [1, 2])
def test_combine(top_k, dtype, poisoned_empty):
    tokens = 37
    ids = _skewed_ids(tokens, top_k, E)
    perm = triton_permute.permute(ids, E, 16)
    y = torch.randn(perm.sorted_ids.numel(), H, generator=generator(1, "cpu")).to(dtype).to(DEV)
    weights = torch.rand(tokens, top_k, generator=generator(2, "cpu")).to(DEV)
    out = triton_combine.combine(y, weights, perm)
    rows = perm.row_of.long().view(tokens, top_k)
    want = (weights.double()[..., None] * y.double()[rows]).sum(1)
    terms = (weights.double()[..., None] * y.double()[rows].abs()).sum(1)
    atol, rtol = reference.combine_tolerance(dtype)
    c = compare(out, want, atol=atol, rtol=rtol, scale=terms)
    assert c.ok, c.reason


# --------------------------------------------------------------------------------------------------
# The layer


def check_layer(out, x, w, top_k, dtype):
    ref = reference.moe_loop(x, w, top_k, fp64=True)
    _, ids, weights = reference.route(x, w.router, top_k, fp64=True)
    atol, rtol = reference.layer_tolerance(dtype)
    c = compare(out, ref, atol=atol, rtol=rtol, scale=reference.output_scale(x, w, ids, weights))
    assert c.ok, c.reason


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("tokens,skew", [(37, False), (100, True)])
def test_layer_matches_fp64(tokens, skew, top_k, dtype, poisoned_empty):
    x, w = make_problem(tokens, dtype, skew=skew)
    out, (_, _, _, perm) = moe_layer.moe_forward(x, w, top_k, return_routing=True)
    if skew:
        # an expert without tokens, and most tokens pick expert 0
        assert (perm.counts == 0).any() and perm.counts.max() > tokens * 3 // 4
    check_layer(out, x, w, top_k, dtype)


def test_layer_check_can_fail(poisoned_empty):
    """The layer check rejects a layer that skips renormalizing or the last partial tile."""
    x, w = make_problem(37, torch.bfloat16)
    _, ids, _ = reference.route(x, w.router, 2, fp64=True)
    probs = torch.softmax(x.double() @ w.router.double().T, -1)
    unnormalized = reference.moe_loop(x, w, 2, ids=ids, weights=probs.gather(1, ids)).to(
        torch.bfloat16
    )
    with pytest.raises(AssertionError):
        check_layer(unnormalized, x, w, 2, torch.bfloat16)
    _, (_, _, weights, perm) = moe_layer.moe_forward(x, w, 2, return_routing=True)
    perm.tile_expert[
        (perm.tile_expert >= 0).nonzero().max()
    ] = -1  # the last partial tile is never computed
    y = triton_grouped_gemm.down(
        triton_grouped_gemm.gate_up_swiglu(x, w.gate, w.up, perm), w.down, perm
    )
    with pytest.raises(AssertionError):
        check_layer(triton_combine.combine(y, weights, perm), x, w, 2, torch.bfloat16)


@needs_gpu
@pytest.mark.parametrize("tokens", [37, 1000])
def test_layer_with_cuda_permutation_and_graph_capture(tokens):
    from kernels import bench

    dtype = torch.bfloat16
    x, w = make_problem(tokens, dtype, skew=True)
    out = moe_layer.moe_forward(x, w, 2, permutation="cuda")
    check_layer(out, x, w, 2, dtype)
    for permutation in ("triton", "cuda"):
        result = {}
        graph = bench.capture_graph(
            lambda: result.update(out=moe_layer.moe_forward(x, w, 2, permutation=permutation))
        )
        result["out"].fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check_layer(result["out"], x, w, 2, dtype)


# --------------------------------------------------------------------------------------------------
# Bad input


def test_bad_input_errors():
    x, w = make_problem(8, torch.bfloat16)
    with pytest.raises(TypeError, match="x has dtype float32"):
        triton_router.route(x.float(), w.router, 2)
    with pytest.raises(TypeError, match="w_router"):
        triton_router.route(x, w.router.half(), 2)
    with pytest.raises(ValueError, match="hidden"):
        triton_router.route(x[:, :64].contiguous(), w.router, 2)
    with pytest.raises(ValueError, match="top_k"):
        triton_router.route(x, w.router, 0)
    with pytest.raises(ValueError, match="top_k"):
        triton_router.route(x, w.router, E + 1)
    with pytest.raises(ValueError, match="not contiguous"):
        triton_router.route(x.T.contiguous().T, w.router, 2)
    with pytest.raises(TypeError, match="ids"):
        triton_permute.permute(torch.zeros(8, 2, device=DEV), E, 16)
    with pytest.raises(ValueError, match="power of two"):
        triton_permute.permute(torch.zeros(8, 2, dtype=torch.int32, device=DEV), E, 24)
    with pytest.raises(ValueError, match="w_down"):
        moe_layer.moe_forward(
            x, reference.MoEWeights(w.router, w.gate, w.up, w.down.transpose(1, 2).contiguous()), 2
        )
    with pytest.raises(ValueError, match="permutation"):
        moe_layer.moe_forward(x, w, 2, permutation="numpy")
    with pytest.raises(ValueError, match="weights must be float32"):
        perm = triton_permute.permute(torch.zeros(8, 2, dtype=torch.int32, device=DEV), E, 16)
        triton_combine.combine(
            torch.zeros(perm.sorted_ids.numel(), H, device=DEV), torch.ones(8, 2).half(), perm
        )
