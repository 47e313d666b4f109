"""Exploration (H100, 2026-11-24): at 32768 tokens, where does the layer lose to dense cuBLAS?

1. The TMA kernel's two products with each GROUP_M pinned (no autotuner), interleaved with cuBLAS on
   the same shapes, on the router's routing and on a routing with every expert at exactly 2048 rows
   (no padding rows: what the ~3% of padded rows cost).
2. The whole layer as the autotuner configures it, then with its 32768-token choices replaced by the
   best pinned GROUP_M of part 1, each interleaved with dense cuBLAS.

Its output: data/results/h100-80gb-hbm3/explore/06_moe_layer_configs.log (an nvidia-smi clock trace
was recorded beside it, .clocks.csv). Run from the repository root:
PYTHONPATH=. python3 tools/explore/06_moe_layer_configs.py"""

import torch
import triton

from kernels import bench
from kernels.moe import moe_layer, reference, triton_combine, triton_permute, triton_router
from kernels.moe import triton_grouped_gemm as pg
from kernels.moe import triton_grouped_gemm_tma as m
from kernels.testing import generator

E, H, I, K, TOKENS = 32, 4096, 11008, 2, 32768  # noqa: E741 - experts, hidden, inter, top-k, tokens
SMS = torch.cuda.get_device_properties(0).multi_processor_count
# BLOCK_N, BLOCK_K, warps, stages: what the autotuner picks for gate_up here
GATE_UP_TILE = (
    128,
    64,
    8,
    4,
)
DOWN_TILE = (256, 64, 8, 3)
GROUPS = (4, 8, 16)

g = generator(0, "cuda")
w = reference.init_weights(E, H, I, torch.bfloat16, "cuda", g)
x = torch.randn(TOKENS, H, device="cuda", generator=g).to(torch.bfloat16)
w1 = m.interleaved_gate_up(w.gate, w.up)
_, ids, weights = triton_router.route(x, w.router, K)
balanced_ids = (torch.arange(TOKENS * K, device="cuda", dtype=torch.int32) % E).view(TOKENS, K)
perms = {
    "router": triton_permute.permute(ids, E, 128),
    "balanced": triton_permute.permute(balanced_ids, E, 128),
}
for name, p in perms.items():
    used = int(p.padded_offsets[E])
    print(
        f"{name}: rows in use {used}, padding {used - TOKENS * K} "
        f"({100 * (used / (TOKENS * K) - 1):.2f}%)"
    )


def launch(a, w_first, w_second, c, p, tile, group_m, *, swiglu):
    bn, bk, nw, ns = tile
    n, k = c.shape[1], a.shape[1]
    descs = [
        m.TensorDescriptor.from_tensor(a, [128, bk]),
        m.TensorDescriptor.from_tensor(w_first.view(-1, k), [2 * bn if swiglu else bn, bk]),
        m.TensorDescriptor.from_tensor(w_second.view(-1, k), [bn, bk]),
        m.TensorDescriptor.from_tensor(c, [128, bn]),
    ]
    grid = (min(p.max_tiles * triton.cdiv(n, bn), SMS),)
    return lambda: m.grouped_gemm_tma_kernel.fn[grid](
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
        FLATTEN=True,
        UPCAST=False,
        num_warps=nw,
        num_stages=ns,
    )


fns, checks = {}, {}
for pname, p in perms.items():
    a = m.gather_rows(x, p)
    h_ref = m.gate_up_swiglu(x, w.gate, w.up, p, variant="persistent_pregathered_interleaved")
    y_ref = m.down(h_ref, w.down, p, variant="persistent_pregathered_interleaved")
    used = (p.sorted_ids >= 0).nonzero().flatten()
    for gm in GROUPS if pname == "router" else (8, 16):
        h = torch.full_like(h_ref, float("nan"))
        y = torch.full_like(y_ref, float("nan"))
        fns[f"{pname} gate_up G{gm}"] = launch(a, w1, w.up, h, p, GATE_UP_TILE, gm, swiglu=True)
        fns[f"{pname} down G{gm}"] = launch(
            h_ref, w.down, w.down, y, p, DOWN_TILE, gm, swiglu=False
        )
        fns[f"{pname} gate_up G{gm}"]()
        fns[f"{pname} down G{gm}"]()
        torch.cuda.synchronize()
        checks[f"{pname} G{gm}"] = max(
            ((h[used].float() - h_ref[used].float()).norm() / h_ref[used].float().norm()).item(),
            ((y[used].float() - y_ref[used].float()).norm() / y_ref[used].float().norm()).item(),
        )
    fns[f"{pname} gather"] = lambda p=p: m.gather_rows(x, p)
print("max rel err of pinned products vs the layer's:", checks)
assert all(v < 1e-2 for v in checks.values()), checks  # NaN fails too
a1 = torch.randn(TOKENS * K, H, device="cuda", generator=g).to(torch.bfloat16)
a2 = torch.randn(TOKENS * K, I, device="cuda", generator=g).to(torch.bfloat16)
w_gate_up, w_down = torch.cat([w.gate[0], w.up[0]]), w.down[0].clone()
fns["cuBLAS gate_up"] = lambda: a1 @ w_gate_up.T
fns["cuBLAS down"] = lambda: a2 @ w_down.T
p = perms["router"]
h_ref = m.gate_up_swiglu(x, w.gate, w.up, p, variant="persistent_pregathered_interleaved")
y_ref = m.down(h_ref, w.down, p, variant="persistent_pregathered_interleaved")
fns["router"] = lambda: triton_router.route(x, w.router, K)
fns["permute"] = lambda: triton_permute.permute(ids, E, 128)
fns["combine"] = lambda: triton_combine.combine(y_ref, weights, p)
t = bench.benchmark(fns, target_ms=4000.0)
flops = {"gate_up": 2 * TOKENS * K * H * 2 * I, "down": 2 * TOKENS * K * I * H}
for name, tm in t.items():
    kind = next((f for f in flops if f in name), None)
    rate = f"{tm.tflops(flops[kind]):6.0f} TF/s" if kind else ""
    lo, hi = tm.spread_us
    print(
        f"{name:24s} {tm.median_us / 1e3:8.3f} ms  p10-p90 {lo / 1e3:.3f}-{hi / 1e3:.3f}  {rate}  "
        f"({len(tm.times_us)} reps)"
    )


# Part 2: the layer, autotuned, then with the best pinned GROUP_M of part 1 written into the
# autotuner's cache.
def dense():
    return a1 @ w_gate_up.T, a2 @ w_down.T


def layer():
    return moe_layer.moe_forward(x, w, K)


layer()
choices = {k: c for k, c in m.grouped_gemm_tma_kernel.cache.items()}
for key, c in choices.items():
    print("autotuned", key[:4], c)
lt = bench.benchmark({"layer (autotuned)": layer, "dense": dense}, target_ms=3000.0)
print(
    f"layer autotuned {lt['layer (autotuned)'].median_us / 1e3:.3f} ms, "
    f"dense {lt['dense'].median_us / 1e3:.3f} ms: "
    f"{100 * lt['dense'].median_us / lt['layer (autotuned)'].median_us:.1f}% of dense"
)
best = {
    kind: min(GROUPS, key=lambda gm: t[f"router {kind} G{gm}"].median_us)
    for kind in ("gate_up", "down")
}
print("best pinned GROUP_M:", best)
for key, c in choices.items():
    kind = "gate_up" if key[3] else "down"  # key: (TOKEN_BUCKET, N, K, SWIGLU, GATHER, ...)
    tile = GATE_UP_TILE if kind == "gate_up" else DOWN_TILE
    m.grouped_gemm_tma_kernel.cache[key] = triton.Config(
        {"BLOCK_N": tile[0], "BLOCK_K": tile[1], "GROUP_M": best[kind], "FLATTEN": True},
        num_warps=tile[2],
        num_stages=tile[3],
        pre_hook=m.set_block_shapes,
    )
out_pinned = layer()
lt = bench.benchmark({"layer (pinned)": layer, "dense": dense}, target_ms=3000.0)
print(
    f"layer pinned {lt['layer (pinned)'].median_us / 1e3:.3f} ms, "
    f"dense {lt['dense'].median_us / 1e3:.3f} ms: "
    f"{100 * lt['dense'].median_us / lt['layer (pinned)'].median_us:.1f}% of dense"
)
naive = reference.moe_loop(x, w, K)
print(
    "pinned layer rel err vs naive:",
    ((out_pinned.float() - naive.float()).norm() / naive.float().norm()).item(),
)
