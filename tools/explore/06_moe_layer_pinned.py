"""Exploration (H100, 2026-11-24), after 06_moe_layer_configs: the whole layer at 32768
tokens with the grouped GEMMs' GROUP_M pinned, against the layer as the autotuner configures it and
dense cuBLAS, all interleaved in one run of ~50 rounds (the GPU is held at its 700 W power limit
throughout, at 1300-1400 MHz, so only an interleaved run compares them); then the layer's CUDA graph
replayed interleaved with the same layer called eagerly. Its output:
data/results/h100-80gb-hbm3/explore/06_moe_layer_pinned.log (an nvidia-smi clock trace was recorded
beside it, .clocks.csv). Run from the repository root: PYTHONPATH=. python3
tools/explore/06_moe_layer_pinned.py"""

import torch
import triton

from kernels import bench
from kernels.moe import moe_layer, reference, triton_combine, triton_permute, triton_router
from kernels.moe import triton_grouped_gemm as pg
from kernels.moe import triton_grouped_gemm_tma as m
from kernels.testing import generator

E, H, I, K, TOKENS = 32, 4096, 11008, 2, 32768  # noqa: E741 - experts, hidden, inter, top-k, tokens
SMS = torch.cuda.get_device_properties(0).multi_processor_count
g = generator(0, "cuda")
w = reference.init_weights(E, H, I, torch.bfloat16, "cuda", g)
x = torch.randn(TOKENS, H, device="cuda", generator=g).to(torch.bfloat16)
w1 = m.interleaved_gate_up(w.gate, w.up)


def product(a, w_first, w_second, p, n, tile, group_m, flatten, *, swiglu):
    bn, bk, nw, ns = tile
    k = a.shape[1]
    c = torch.empty(p.sorted_ids.numel(), n, dtype=a.dtype, device="cuda")
    descs = [
        m.TensorDescriptor.from_tensor(a, [128, bk]),
        m.TensorDescriptor.from_tensor(w_first.view(-1, k), [2 * bn if swiglu else bn, bk]),
        m.TensorDescriptor.from_tensor(w_second.view(-1, k), [bn, bk]),
        m.TensorDescriptor.from_tensor(c, [128, bn]),
    ]
    grid = (min(p.max_tiles * triton.cdiv(n, bn), SMS),)
    m.grouped_gemm_tma_kernel.fn[grid](
        a,
        *descs,
        p.sorted_ids,
        p.tile_expert,
        p.padded_offsets,
        E,
        n,
        k,
        pg.token_bucket(p.max_tiles),
        TOP_K=K,
        GATHER=False,
        SWIGLU=swiglu,
        INTERLEAVED=swiglu,
        PERSISTENT=True,
        BLOCK_M=128,
        BLOCK_N=bn,
        BLOCK_K=bk,
        GROUP_M=group_m,
        FLATTEN=flatten,
        UPCAST=False,
        num_warps=nw,
        num_stages=ns,
    )
    return c


def pinned_layer(gate_up_group, down_group, down_flatten=True):
    def layer():
        _, ids, weights = triton_router.route(x, w.router, K)
        p = triton_permute.permute(ids, E, 128)
        h = product(
            m.gather_rows(x, p), w1, w.up, p, I, (128, 64, 8, 4), gate_up_group, True, swiglu=True
        )
        y = product(
            h, w.down, w.down, p, H, (256, 64, 8, 3), down_group, down_flatten, swiglu=False
        )
        return triton_combine.combine(y, weights, p)

    return layer


def autotuned():
    return moe_layer.moe_forward(x, w, K)


fns = {
    "layer (autotuned)": autotuned,
    "pinned G4 / G4": pinned_layer(4, 4),
    "pinned G8 / G8": pinned_layer(8, 8),
    "pinned G16 / G16": pinned_layer(16, 16),
    "pinned G16 / G8 not flat": pinned_layer(16, 8, False),
}
naive = reference.moe_loop(x, w, K)
for name, fn in fns.items():
    out = fn()
    err = ((out.float() - naive.float()).norm() / naive.float().norm()).item()
    print(f"{name}: rel err vs naive {err:.4f}")
    assert err < 2e-2, err  # NaN fails too
for key, c in m.grouped_gemm_tma_kernel.cache.items():
    print("autotuned", key[:4], c)
a1 = torch.randn(TOKENS * K, H, device="cuda", generator=g).to(torch.bfloat16)
a2 = torch.randn(TOKENS * K, I, device="cuda", generator=g).to(torch.bfloat16)
w_gate_up, w_down = torch.cat([w.gate[0], w.up[0]]), w.down[0].clone()
fns["dense"] = lambda: (a1 @ w_gate_up.T, a2 @ w_down.T)
t = bench.benchmark(fns, target_ms=8000.0)
for name, tm in t.items():
    lo, hi = tm.spread_us
    print(
        f"{name:26s} {tm.median_us / 1e3:8.3f} ms  p10-p90 {lo / 1e3:.3f}-{hi / 1e3:.3f}  "
        f"{100 * t['dense'].median_us / tm.median_us:5.1f}% of dense (ratio of medians), "
        f"{100 * bench.ratio(t['dense'], tm):5.1f}% (median of per-round ratios)  "
        f"({len(tm.times_us)} reps)"
    )

graph = bench.capture_graph(autotuned)
t = bench.benchmark(
    {"eager": autotuned, "graph replay": graph.replay, "dense": fns["dense"]}, target_ms=4000.0
)
for name, tm in t.items():
    lo, hi = tm.spread_us
    print(
        f"{name:26s} {tm.median_us / 1e3:8.3f} ms  p10-p90 {lo / 1e3:.3f}-{hi / 1e3:.3f}  "
        f"({len(tm.times_us)} reps)"
    )
print(
    "graph replay, back to back as bench.graph_replay_us times it:",
    f"{bench.graph_replay_us(autotuned).median_us / 1e3:.3f} ms",
)
