"""The decoder's attention against the KV cache in one launch (the last program to arrive combines
the splits) against the float64 reference and against the two-launch path (split kernel, then
combine kernel).

CPU: the Triton interpreter runs the programs one after another, so the arrival counters, the
"last program combines" branch and the reset to zero are exercised, but not the memory ordering
between programs running at once. The `gpu` tests do that: many back-to-back calls in a CUDA graph,
every replay bit-for-bit the same, every counter back at zero."""

import pytest
import torch

from kernels import runtime
from kernels.decoder import reference, triton_attention
from kernels.testing import ULP, compare, generator, poison_, random_tensor

DEVICE = runtime.DEVICE
HALF = [torch.bfloat16, torch.float16]


def inputs(batch, hq, hkv, n_q, d, capacity, dtype, draw):
    """q strided as in the model ((B, n_q, Hq, D) transposed), fresh K and V caches."""
    g = generator(draw, DEVICE)
    q = random_tensor((batch, n_q, hq, d), dtype, DEVICE, g).transpose(1, 2)
    k = random_tensor((batch, hkv, capacity, d), dtype, DEVICE, g)
    v = random_tensor((batch, hkv, capacity, d), dtype, DEVICE, g)
    return q, k, v


def attend(q, k, v, positions, ws, fuse):
    out = poison_(torch.empty(q.shape, dtype=q.dtype, device=DEVICE))
    triton_attention.cache_attention(
        q, k, v, positions, out, ws, q.shape[-1] ** -0.5, fuse_combine=fuse
    )
    return out


def check_fp64(out, q, k, v, positions):
    want = reference.attention_fp64(q, k, v, positions)
    result = compare(out, want, atol=2 * ULP[out.dtype], rtol=4 * ULP[out.dtype])
    assert result.ok, result.reason


def check_same_as_two_launches(one, two):
    """Both combine float32 partials in split order and round once: at most an ulp apart."""
    result = compare(one, two.double(), atol=ULP[one.dtype], rtol=ULP[one.dtype])
    assert result.ok, result.reason


def as_positions(rows):
    return torch.tensor(rows, dtype=torch.int32).reshape(-1).to(DEVICE)


# (batch, hq, hkv, n_q, head_dim, capacity, positions per sequence): capacities that are not a
# multiple of the key tile or the split; positions differing per sequence, not contiguous, not in
# order, in the first split, at the last key of the cache, on split boundaries
CASES = {
    "gqa-decode": (3, 8, 2, 1, 32, 200, [[150], [3], [199]]),
    "scattered-queries": (2, 6, 2, 3, 32, 150, [[10, 130, 75], [0, 149, 64]]),
    # 4 query heads per KV head x 20 queries = 80 rows: two row blocks of 64, the second partial
    "two-row-blocks": (1, 8, 2, 20, 16, 90, [list(range(5, 90, 9))[:10] + list(range(70, 10, -6))]),
}


# every case in both half types; float32 (the model's CPU path) once
DTYPE_CASES = [(c, t) for c in CASES for t in HALF] + [("gqa-decode", torch.float32)]


@pytest.mark.parametrize(("case", "dtype"), DTYPE_CASES)
def test_one_launch_matches_fp64_and_two_launches(case, dtype):
    batch, hq, hkv, n_q, d, capacity, rows = CASES[case]
    q, k, v = inputs(batch, hq, hkv, n_q, d, capacity, dtype, draw=list(CASES).index(case))
    positions = as_positions(rows)
    ws = triton_attention.AttentionWorkspace(batch, hq, n_q, capacity, d, DEVICE)
    one = attend(q, k, v, positions, ws, fuse=True)
    assert not ws.arrivals.any(), "the last program of each tile resets its counter"
    check_fp64(one, q, k, v, positions)
    two = attend(q, k, v, positions, ws, fuse=False)
    check_same_as_two_launches(one, two)


@pytest.mark.parametrize("dtype", HALF)
def test_a_second_call_starts_from_clean_counters(dtype):
    """A replay: the same call twice gives the same bits. Then the next steps, with positions that
    moved back (partials of the longer context are still in the workspace and must not be read)
    and forward, on another layer's cache: the counters were reset."""
    batch, hq, hkv, n_q, d, capacity = 2, 8, 2, 1, 32, 170
    q, k, v = inputs(batch, hq, hkv, n_q, d, capacity, dtype, draw=11)
    ws = triton_attention.AttentionWorkspace(batch, hq, n_q, capacity, d, DEVICE)
    positions = as_positions([[169], [100]])
    first = attend(q, k, v, positions, ws, fuse=True)
    second = attend(q, k, v, positions, ws, fuse=True)
    assert torch.equal(first, second)
    check_fp64(second, q, k, v, positions)
    q2, k2, v2 = inputs(batch, hq, hkv, n_q, d, capacity, dtype, draw=12)
    for rows in ([[20], [64]], [[140], [1]]):
        positions = as_positions(rows)
        out = attend(q2, k2, v2, positions, ws, fuse=True)
        assert not ws.arrivals.any()
        check_fp64(out, q2, k2, v2, positions)


def test_split_size_is_the_workspaces():
    """A workspace with longer splits (a sweep's) gives the same answer through both paths."""
    dtype = torch.bfloat16
    batch, hq, hkv, n_q, d, capacity = 1, 4, 1, 2, 32, 300
    q, k, v = inputs(batch, hq, hkv, n_q, d, capacity, dtype, draw=5)
    positions = as_positions([[299, 40]])
    ws = triton_attention.AttentionWorkspace(
        batch, hq, n_q, capacity, d, DEVICE, split_keys=2 * triton_attention.SPLIT_KEYS
    )
    one = attend(q, k, v, positions, ws, fuse=True)
    check_fp64(one, q, k, v, positions)
    check_same_as_two_launches(one, attend(q, k, v, positions, ws, fuse=False))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("batch", [1, 8, 32])
def test_one_launch_in_a_graph_is_deterministic_and_resets(dtype, batch):
    """The Llama-3.2-1B attention (32 query heads, 8 KV heads, head_dim 64) at the model's capacity,
    16 layers back to back in one CUDA graph sharing one workspace, positions differing per
    sequence: every replay gives the same bits (the combine order does not depend on which program
    arrives last, and the last one sees every partial), matches the fp64 reference and the two
    launches, and leaves every counter at 0."""
    layers, hq, hkv, d, capacity = 16, 32, 8, 64, 4144
    g = generator(batch, DEVICE)
    q = random_tensor((layers, batch, 1, hq, d), dtype, DEVICE, g).transpose(2, 3)
    k = random_tensor((layers, batch, hkv, capacity, d), dtype, DEVICE, g)
    v = random_tensor((layers, batch, hkv, capacity, d), dtype, DEVICE, g)
    positions = torch.randint(0, capacity, (batch,), generator=g, device=DEVICE).to(torch.int32)
    positions[0] = 511  # the step the decoder was measured at
    ws = triton_attention.AttentionWorkspace(batch, hq, 1, capacity, d, DEVICE)
    out = poison_(torch.empty(layers, batch, hq, 1, d, dtype=dtype, device=DEVICE))
    two = torch.empty_like(out)

    def step(dst, fuse):
        for layer in range(layers):
            triton_attention.cache_attention(
                q[layer], k[layer], v[layer], positions, dst[layer], ws, d**-0.5, fuse_combine=fuse
            )

    step(two, False)
    step(out, True)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(out, True)
    poison_(out)
    graph.replay()
    first = out.clone()
    for layer in (0, layers - 1):
        check_fp64(first[layer], q[layer], k[layer], v[layer], positions)
    check_same_as_two_launches(first, two)
    for _ in range(50):
        poison_(out)
        graph.replay()
        assert torch.equal(out, first)
    assert not ws.arrivals.any()
    # the next step: every position one further, the same graph
    positions.add_(1).clamp_(max=capacity - 1)
    graph.replay()
    step(two, False)
    check_same_as_two_launches(out, two)
    assert not ws.arrivals.any()
