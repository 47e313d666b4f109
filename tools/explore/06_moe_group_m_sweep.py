"""Exploration, run once on an H100 (2026-11-24): interleaved gate_up (persistent, pregathered)
timed per tile configuration and GROUP_M at 32768 and 8192 tokens, interleaved with cuBLAS on the
same shape. Its output: data/results/h100-80gb-hbm3/explore/06_moe_group_m_sweep.log. Run from the
repository root: PYTHONPATH=. python3 tools/explore/06_moe_group_m_sweep.py"""

import torch
import triton

from kernels import bench
from kernels.moe import reference, triton_permute, triton_router
from kernels.moe import triton_grouped_gemm as pg
from kernels.moe import triton_grouped_gemm_tma as m
from kernels.testing import generator

E, H, I, K = 32, 4096, 11008, 2  # noqa: E741 - experts, hidden, intermediate, top-k
for tokens in (32768, 8192):
    g = generator(0, "cuda")
    w = reference.init_weights(E, H, I, torch.bfloat16, "cuda", g)
    x = torch.randn(tokens, H, device="cuda", generator=g).to(torch.bfloat16)
    _, ids, _ = triton_router.route(x, w.router, K)
    perm = triton_permute.permute(ids, E, 128)
    a = m.gather_rows(x, perm)
    w1 = m.interleaved_gate_up(w.gate, w.up)
    ref = m.gate_up_swiglu(x, w.gate, w.up, perm, variant="persistent_pregathered_interleaved")
    used = (perm.sorted_ids >= 0).nonzero().flatten()
    fns = {}
    configs = [
        (128, 64, 8, 4, True, 8),
        (128, 64, 8, 4, False, 8),
        (128, 64, 8, 3, True, 8),
        (128, 128, 8, 2, True, 8),
        (128, 128, 8, 2, False, 8),
        (128, 64, 8, 4, True, 4),
        (128, 64, 8, 4, True, 16),
        (128, 64, 8, 4, True, 1),
    ]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for bn, bk, nw, ns, flat, gm in configs:
        c = torch.empty(perm.sorted_ids.numel(), I, dtype=x.dtype, device="cuda")
        descs = [
            m.TensorDescriptor.from_tensor(a, [128, bk]),
            m.TensorDescriptor.from_tensor(w1.view(-1, H), [2 * bn, bk]),
            m.TensorDescriptor.from_tensor(w.up.view(-1, H), [bn, bk]),
            m.TensorDescriptor.from_tensor(c, [128, bn]),
        ]
        grid = (min(perm.max_tiles * triton.cdiv(I, bn), sms),)

        def run(descs=descs, grid=grid, bn=bn, bk=bk, nw=nw, ns=ns, flat=flat, gm=gm):
            m.grouped_gemm_tma_kernel.fn[grid](
                a,
                *descs,
                perm.sorted_ids,
                perm.tile_expert,
                perm.padded_offsets,
                E,
                I,
                H,
                pg.token_bucket(perm.max_tiles),
                TOP_K=K,
                GATHER=False,
                SWIGLU=True,
                INTERLEAVED=True,
                PERSISTENT=True,
                BLOCK_M=128,
                BLOCK_N=bn,
                BLOCK_K=bk,
                GROUP_M=gm,
                FLATTEN=flat,
                UPCAST=False,
                num_warps=nw,
                num_stages=ns,
            )

        name = f"N{bn} K{bk} w{nw} s{ns}{' flat' if flat else ''} G{gm}"
        try:
            run()
            torch.cuda.synchronize()
            err = ((c[used].float() - ref[used].float()).norm() / ref[used].float().norm()).item()
            print(name, "rel err vs layer", err, flush=True)
            if err < 1e-2:
                fns[name] = run
        except Exception as exc:
            print(name, "failed", type(exc).__name__, str(exc)[:200], flush=True)
    a1 = torch.randn(tokens * K, H, device="cuda", generator=g).to(torch.bfloat16)
    wgu = torch.cat([w.gate[0], w.up[0]])
    fns["cuBLAS dense gate_up"] = lambda: a1 @ wgu.T
    t = bench.benchmark(fns, target_ms=2000.0)
    flops = 2 * tokens * K * H * 2 * I
    for name, tm in sorted(t.items(), key=lambda kv: kv[1].median_us):
        print(tokens, f"{name:32s} {tm.median_us / 1e3:8.3f} ms {tm.tflops(flops):6.0f} TF/s")
