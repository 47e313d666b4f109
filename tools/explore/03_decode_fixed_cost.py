"""Exploration, run once on an H100 (2026-11-24): where flash-decoding's fixed cost per call goes.
Batch 1, 32 query heads, 8 KV heads, d 128, fp16, at 4k-32k keys, interleaved (bench.benchmark, L2
flushed):
  empty       a Triton kernel with the split kernel's grid that does nothing: launch and teardown
  stream      the split kernel's grid summing its slice of K and V (same 128-key blocks, 3 stages)
  split only  flash_decode_split_kernel without the combine (partials written, nothing combined)
  two launch  flash_decode(fuse_combine=False): split kernel, then the combine kernel
  fused       flash_decode (the default)
  copy        K and V copied (reads and writes them; two kernels)
Its output: data/results/h100-80gb-hbm3/explore/03_decode_fixed_cost.log. Run from the repository
root: PYTHONPATH=. python3 tools/explore/03_decode_fixed_cost.py"""

import torch
import triton
import triton.language as tl

from kernels import bench
from kernels.flash_attention import triton_decode as td
from kernels.flash_attention.benchmark import make_inputs
from kernels.flash_attention.triton_flash import LOG2E


@triton.jit
def empty_kernel(X):
    pass


@triton.jit
def stream_kernel(
    K, V, OUT, n_k, split_len, n_splits, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr
):
    split = tl.program_id(0)
    head = tl.program_id(1)
    lo = split * split_len
    hi = tl.minimum(lo + split_len, n_k)
    dims = tl.arange(0, HEAD_DIM)
    acc = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    base = head.to(tl.int64) * n_k * HEAD_DIM
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        ok = (cols < hi)[:, None]
        acc += tl.load(K + base + cols[:, None] * HEAD_DIM + dims[None, :], mask=ok, other=0.0).to(
            tl.float32
        )
        acc += tl.load(V + base + cols[:, None] * HEAD_DIM + dims[None, :], mask=ok, other=0.0).to(
            tl.float32
        )
    tl.store(OUT + head * n_splits + split, tl.sum(acc))


for n in (4096, 8192, 16384, 32768):
    q, k, v = make_inputs(1, 32, n, 128, torch.float16, h_kv=8, n_q=1)
    splits = td.default_num_splits(1, 8, n)
    split_len = triton.cdiv(triton.cdiv(n, td.BLOCK_N), splits) * td.BLOCK_N
    splits = triton.cdiv(n, split_len)
    out, lse = torch.empty_like(q), torch.empty(1, 32, 1, device="cuda")
    o_part = torch.empty(1, 32, 1, splits, 128, device="cuda")
    lse_part = torch.empty(1, 32, 1, splits, device="cuda")
    sums = torch.empty(8 * splits, device="cuda")
    k_copy, v_copy = torch.empty_like(k), torch.empty_like(v)

    def split_only():
        td.flash_decode_split_kernel[(splits, 8)](
            q,
            k,
            v,
            o_part,
            lse_part,
            out,
            lse,
            lse_part,
            *q.stride()[:3],
            *k.stride()[:3],
            *v.stride()[:3],
            *out.stride()[:3],
            8,
            4,
            1,
            n,
            split_len,
            splits,
            128**-0.5 * LOG2E,
            HEAD_DIM=128,
            BLOCK_H=16,
            BLOCK_N=td.BLOCK_N,
            CAUSAL=False,
            UPCAST=False,
            FUSE_COMBINE=False,
            BLOCK_R=4,
            BLOCK_S=16,
            num_warps=td.NUM_WARPS,
            num_stages=td.NUM_STAGES,
        )

    fns = {
        "empty": lambda: empty_kernel[(splits, 8)](sums),
        "stream": lambda: stream_kernel[(splits, 8)](
            k,
            v,
            sums,
            n,
            split_len,
            splits,
            HEAD_DIM=128,
            BLOCK_N=td.BLOCK_N,
            num_warps=4,
            num_stages=3,
        ),
        "split only": split_only,
        "two launch": lambda: td.flash_decode(q, k, v, fuse_combine=False),
        "fused": lambda: td.flash_decode(q, k, v),
        "copy": lambda: (k_copy.copy_(k), v_copy.copy_(v)),
    }
    t = bench.benchmark(fns, target_ms=300.0)
    nbytes = td.kv_bytes(k, v)
    print(
        f"KV {n} ({nbytes / 1e6:.1f} MB of K and V, {splits} splits): "
        + ", ".join(f"{name} {tm.median_us:.2f} us" for name, tm in t.items()),
        flush=True,
    )
