"""A warp-specialized matrix product on Hopper, in Gluon: the schedule of cuBLAS's sm_90 kernels.

    C[m, n] = sum_k A[m, k] * B[k, n]    (float32 accumulator, C rounded once to A's dtype)

Triton's persistent TMA kernel (`triton_matmul_tma.py`) runs one instruction stream per warp: each
warp issues its share of the TMA copies, waits for them, issues wgmma, waits again. Hopper's fastest
GEMMs (cuBLAS, CUTLASS's "warp-specialized cooperative" kernels) instead give warps roles:

* a **producer** warp only issues TMA copies: the A and B tiles of each K step stream into a ring
  of STAGES shared-memory slots, each slot guarded by two mbarriers ("ready": the copy engine has
  written it; "empty": every consumer has read it);
* two **consumer** warpgroups (4 warps each) own 64 rows apiece of a 128 x BLOCK_N output tile and
  only compute: wait for a slot, queue `wgmma` on it, and free the slot of the step before once
  its product has retired (`warpgroup_mma_wait(1)`: one product stays in flight while the next
  is queued, so the tensor cores never wait for the issuing warp);
* the grid is **persistent**: one CTA per SM walks the output tiles in the grouped order, so the
  producer loads the next tile's first K steps while the consumers store this tile;
* the **epilogue** writes each warpgroup's 64 x BLOCK_N tile of C into shared memory and one TMA
  copy stores it (clipped at M and N); the next tile's products run while the copy drains.

This is the schedule of 03h's attention forward (`kernels/flash_attention/gluon_flash.py`) without
the softmax: the same pieces (`gl.warp_specialize`, mbarriers, `tma.async_load`, `warpgroup_mma`)
and the same register arithmetic.

Budget (BLOCK_N = 256): a 64 x 256 fp32 accumulator over a warpgroup's 128 threads is 128 registers
a thread. `setmaxnreg` gives each consumer thread CONSUMER_REGS = 232 and the producer 40: 2 x 128 x
232 + 128 x 40 = 64,512 of the SM's 65,536. Shared memory per stage: A 128 x 64 and B 64 x 256 in
16-bit, 48 KiB; 3 stages and the 2 x 64 x 256 x 2 = 64 KiB epilogue buffer are 208 of 227 KiB.

The fp8 mode (`gluon_fp8_matmul_block_scaled`): the same warps on e4m3 operands with DeepGEMM's
1 x 128 / 128 x 128 scales (`triton_fp8_matmul.py` makes them). Tiles are 128 x 128 and K steps
128 deep, one scale block: each consumer's product of a K step starts from zero on the tensor
cores, then is multiplied by its scales and added into fp32 registers (the promotion), while the
other warpgroup's product runs.

Scope: fp16 and bf16 (and e4m3 in the fp8 mode, W as (N, K)); A row-major (its rows may be
strided), B row-major (K, N) or the transpose of a row-major (N, K) weight (`b = W.T`,
nn.Linear's layout); any M, N, K (an operand whose rows are off TMA's 16-byte boundaries is copied
into a buffer with padded rows, and so is C: `tma_view`, `tma_output`). Needs wgmma (sm_90:
H100, H200): both wrappers raise FeatureMissing anywhere else, before any compilation; the
portable kernels are `triton_matmul.py`'s.
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from kernels import runtime
from kernels.matmul import triton_fp8_matmul
from kernels.matmul.reference import check_matmul_args
from kernels.matmul.triton_matmul_tma import deliver, tma_output, tma_view

# The feature this kernel needs (runtime.FEATURE_GPUS): wgmma and setmaxnreg, sm_90 only.
REQUIRES = "wgmma"
WG_M = gl.constexpr(64)  # output rows per consumer warpgroup (one wgmma M)
NUM_WG = 2  # consumer warpgroups: BLOCK_M = 128
BLOCK_N = 256  # one wgmma N: the largest the instruction takes
BLOCK_K = 64  # 128 bytes of 16-bit values: one 128-byte swizzled row of shared memory
STAGES = 3  # 3 x 48 KiB ring + 64 KiB epilogue buffer = 208 KiB of the 227 a CTA has
# Row tiles that walk the column tiles together (L2 reuse of B): 16 measured 1.020-1.034x cuBLAS
# on the H200 against 1.018-1.032x for 8 (the fp8 mode was timed with 8 only).
GROUP_M = 16
FP8_GROUP_M = 8
# setmaxnreg budgets, registers per thread: 2 x 128 x 232 + 128 x 40 = 64,512 of 65,536.
CONSUMER_REGS = 232
PRODUCER_REGS = 40
SHARED_BYTES = 227 * 1024
# The fp8 block-scaled mode: 128 x 128 tiles (a K step's product and the fp32 total are two
# 64 x 128 accumulators, 128 registers a thread), 128-deep K steps (one scale block, 128 bytes of
# e4m3). A stage is 16 + 16 KiB; 4 stages and the 32 KiB epilogue buffer are 160 KiB.
FP8_BLOCK_N = 128
FP8_STAGES = 4
GL_DTYPES = {
    torch.float16: gl.float16,
    torch.bfloat16: gl.bfloat16,
    torch.float8_e4m3fn: gl.float8e4nv,
}
# TMA copies: `async_load` / `async_store` in newer releases, the long names before.
tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
tma_store = tma.async_store if hasattr(tma, "async_store") else tma.async_copy_shared_to_global


def shared_bytes(block_n: int = BLOCK_N, stages: int = STAGES) -> int:
    """The ring (A: NUM_WG x 64 rows, B: block_n columns, BLOCK_K deep) and C's staging buffer"""
    block_m = NUM_WG * WG_M.value
    return 2 * (stages * (block_m + block_n) * BLOCK_K + block_m * block_n)


@gluon.jit
def _tile_position(tile, num_pid_m, num_pid_n, GROUP_M: gl.constexpr):
    """Output tile `tile` in the grouped order: GROUP_M row tiles walk the column tiles together."""
    per_group = GROUP_M * num_pid_n
    first_m = tile // per_group * GROUP_M
    group_m = gl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile % per_group) % group_m
    pid_n = (tile % per_group) // group_m
    return pid_m, pid_n


@gluon.jit
def _producer(
    a_desc, b_desc, a_smem, b_smem, ready, empty, M, N, K, B_T: gl.constexpr, GROUP_M: gl.constexpr
):
    """One warp: for each of the CTA's tiles, each K step's A (one 64-row copy per consumer) and
    B into the next slot of the ring, once both consumers have freed it."""
    STAGES: gl.constexpr = empty.shape[0]
    NUM_WG: gl.constexpr = a_smem.shape[0] // STAGES
    BLOCK_K: gl.constexpr = a_smem.shape[2]
    BLOCK_N: gl.constexpr = b_smem.shape[1] if B_T else b_smem.shape[2]
    num_pid_m = gl.cdiv(M, NUM_WG * WG_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    k_steps = gl.cdiv(K, BLOCK_K)
    it = 0  # K steps loaded so far, over all tiles: the ring's position
    for tile in range(gl.program_id(0), num_pid_m * num_pid_n, gl.num_programs(0)):
        pid_m, pid_n = _tile_position(tile, num_pid_m, num_pid_n, GROUP_M)
        for ki in range(k_steps):
            slot = it % STAGES
            # A fresh barrier counts as completed for parity 1: the first lap goes straight on.
            mbarrier.wait(empty.index(slot), ((it // STAGES) & 1) ^ 1)
            bar = ready.index(slot)
            mbarrier.expect(bar, NUM_WG * a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            for wg in gl.static_range(NUM_WG):
                tma_load(
                    a_desc,
                    [(pid_m * NUM_WG + wg) * WG_M, ki * BLOCK_K],
                    bar,
                    a_smem.index(slot * NUM_WG + wg),
                )
            if B_T:
                tma_load(b_desc, [pid_n * BLOCK_N, ki * BLOCK_K], bar, b_smem.index(slot))
            else:
                tma_load(b_desc, [ki * BLOCK_K, pid_n * BLOCK_N], bar, b_smem.index(slot))
            it += 1


@gluon.jit
def _consumer(
    WG: gl.constexpr,
    a_smem,
    b_smem,
    ready,
    empty,
    c_desc,
    c_smem,
    a_scale_ptr,
    w_scale_ptr,
    M,
    N,
    K,
    B_T: gl.constexpr,
    GROUP_M: gl.constexpr,
    BLOCK_SCALED: gl.constexpr,
):
    """One warpgroup: rows WG * 64 .. WG * 64 + 63 of each of the CTA's tiles, accumulated by
    wgmma from the ring, stored by TMA. BLOCK_SCALED (fp8): each K step's product (one 128-deep
    scale block) starts from zero, then is scaled and added into the fp32 accumulator; the next
    step's scales are loaded while this step's product runs."""
    STAGES: gl.constexpr = empty.shape[0]
    NUM_WG: gl.constexpr = a_smem.shape[0] // STAGES
    BLOCK_K: gl.constexpr = a_smem.shape[2]
    BLOCK_N: gl.constexpr = b_smem.shape[1] if B_T else b_smem.shape[2]
    # The wgmma accumulator: the 4 warps stacked along M, instruction m64 x n(BLOCK_N) x k(32
    # bytes of the inputs: 16 for 16-bit, 32 for fp8).
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0],
        warps_per_cta=[4, 1],
        instr_shape=[16, BLOCK_N, 256 // a_smem.dtype.primitive_bitwidth],
    )
    num_pid_m = gl.cdiv(M, NUM_WG * WG_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    k_steps = gl.cdiv(K, BLOCK_K)
    staging = c_smem.index(WG)
    zero = gl.zeros([WG_M, BLOCK_N], gl.float32, layout=acc_layout)
    it = 0  # K steps consumed so far, over all tiles, as the producer counts them
    for tile in range(gl.program_id(0), num_pid_m * num_pid_n, gl.num_programs(0)):
        pid_m, pid_n = _tile_position(tile, num_pid_m, num_pid_n, GROUP_M)
        m0 = (pid_m * NUM_WG + WG) * WG_M
        acc = zero
        if BLOCK_SCALED:  # the first step's scales; each step loads the next one's
            scale = _step_scales(a_scale_ptr, w_scale_ptr, m0, pid_n, 0, M, k_steps, acc_layout)
        for ki in range(k_steps):
            slot = it % STAGES
            mbarrier.wait(ready.index(slot), (it // STAGES) & 1)
            a, b = _operands(a_smem, b_smem, slot, WG, NUM_WG, B_T)
            if BLOCK_SCALED:
                part = warpgroup_mma(a, b, zero, use_acc=False, is_async=True)
                following = _step_scales(
                    a_scale_ptr, w_scale_ptr, m0, pid_n, ki + 1, M, k_steps, acc_layout
                )
                part = warpgroup_mma_wait(num_outstanding=0, deps=(part,))
                mbarrier.arrive(empty.index(slot), count=1)
                acc = acc + part * gl.expand_dims(scale, 1)  # the promotion
                scale = following
            else:
                acc = warpgroup_mma(a, b, acc, is_async=True)
                # Products retire in issue order: with one left in flight, the step before is
                # done and its slot can be refilled.
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                if ki > 0:
                    mbarrier.arrive(empty.index((it - 1) % STAGES), count=1)
            it += 1
        if not BLOCK_SCALED:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(empty.index((it - 1) % STAGES), count=1)
        # The epilogue: the last tile's copy must have read the staging buffer before it is
        # overwritten (by now long done: a whole tile of products ran since).
        tma.store_wait(0)
        staging.store(acc.to(c_desc.dtype))
        fence_async_shared()  # the threads' shared-memory writes, before the copy reads them
        tma_store(c_desc, [m0, pid_n * BLOCK_N], staging)
    tma.store_wait(0)


@gluon.jit
def _operands(a_smem, b_smem, slot, WG: gl.constexpr, NUM_WG: gl.constexpr, B_T: gl.constexpr):
    """This consumer's A tile and the B tile of ring slot `slot`, B as a (BLOCK_K, BLOCK_N) view
    (with B_T, of the (N, K) rows TMA copied: wgmma reads either order)."""
    if B_T:
        b = b_smem.index(slot).permute((1, 0))
    else:
        b = b_smem.index(slot)
    return a_smem.index(slot * NUM_WG + WG), b


@gluon.jit
def _step_scales(a_scale_ptr, w_scale_ptr, m0, pid_n, ki, M, k_steps, layout: gl.constexpr):
    """The 64 rows' 1 x 128 activation scales of K block ki times the tile's 128 x 128 weight
    scale (a 128-column tile lies in one weight block: one scalar), as a row vector of the
    accumulator's layout. Loaded right after the step's wgmma is queued, so their latency runs
    under the product. Activation scales are K-block-major ((K / 128, M) viewed as (M, K / 128)),
    weight scales (N / 128, K / 128) row-major."""
    rows = m0 + gl.arange(0, WG_M, layout=gl.SliceLayout(1, layout))
    in_k = ki < k_steps  # a step past the last (prefetched for nothing) reads nothing
    sa = gl.load(a_scale_ptr + ki * M + rows, mask=rows < gl.where(in_k, M, 0), other=0.0)
    return sa * gl.load(w_scale_ptr + pid_n * k_steps + ki, mask=in_k, other=0.0)


@gluon.jit
def _consumer_0(args, B_T: gl.constexpr, GROUP_M: gl.constexpr, BLOCK_SCALED: gl.constexpr):
    _consumer(0, *args, B_T, GROUP_M, BLOCK_SCALED)


@gluon.jit
def _consumer_1(args, B_T: gl.constexpr, GROUP_M: gl.constexpr, BLOCK_SCALED: gl.constexpr):
    _consumer(1, *args, B_T, GROUP_M, BLOCK_SCALED)


@gluon.jit
def gluon_matmul_kernel(
    a_desc,
    b_desc,
    c_desc,
    a_scale_ptr,  # BLOCK_SCALED only (else unread): A's 1 x 128 scales, K-block-major
    w_scale_ptr,  # BLOCK_SCALED only: the weight's 128 x 128 scales, row-major
    M,
    N,
    K,
    B_T: gl.constexpr,
    STAGES: gl.constexpr,
    GROUP_M: gl.constexpr,
    BLOCK_SCALED: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
    PRODUCER_REGS: gl.constexpr,
):
    """One CTA per SM (or per tile, if fewer), each looping over output tiles of 128 x BLOCK_N.
    a_desc: 64 x BLOCK_K tiles of A; b_desc: BLOCK_K x BLOCK_N tiles of B (B_T: BLOCK_N x BLOCK_K
    of its (N, K) buffer); c_desc: 64 x BLOCK_N tiles of C."""
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    NUM_WG: gl.constexpr = 2
    a_smem = gl.allocate_shared_memory(
        a_desc.dtype, [STAGES * NUM_WG, WG_M, BLOCK_K], a_desc.layout
    )
    b_smem = gl.allocate_shared_memory(
        b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout
    )
    c_smem = gl.allocate_shared_memory(
        c_desc.dtype, [NUM_WG] + c_desc.block_type.shape, c_desc.layout
    )
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)  # the producer's expect + the copies' bytes
        mbarrier.init(empty.index(i), count=NUM_WG)  # every consumer frees each slot
    # The kernel's own 4 warps are consumer 0; a second warpgroup is consumer 1; one warp loads.
    # The flags go as arguments of their own: a constexpr inside a tuple reaches the partition
    # as a runtime value.
    args = (a_smem, b_smem, ready, empty, c_desc, c_smem, a_scale_ptr, w_scale_ptr, M, N, K)
    gl.warp_specialize(
        [
            (_consumer_0, (args, B_T, GROUP_M, BLOCK_SCALED)),
            (_consumer_1, (args, B_T, GROUP_M, BLOCK_SCALED)),
            (_producer, (a_desc, b_desc, a_smem, b_smem, ready, empty, M, N, K, B_T, GROUP_M)),
        ],
        [4, 1],
        [CONSUMER_REGS, PRODUCER_REGS],
    )


def _descriptors(a, b_view, b_t: bool, c, block_n: int, block_k: int = BLOCK_K):
    """Gluon TMA descriptors over A (64 x block_k tiles), B or its (N, K) buffer, and C (64 x
    block_n), each in the default swizzled shared-memory layout of its tile."""

    def desc(t, block):
        layout = gl.NVMMASharedLayout.get_default_for(block, GL_DTYPES[t.dtype])
        return TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout)

    return (
        desc(a, [WG_M.value, block_k]),
        desc(b_view, [block_n, block_k] if b_t else [block_k, block_n]),
        desc(c, [WG_M.value, block_n]),
    )


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def check_gluon_args(a, b, out=None, stages: int = STAGES):
    """(M, N, K, A's view, B's view or its (N, K) buffer, whether B is transposed, C) for
    `gluon_matmul`, or a TypeError/ValueError saying what the kernel does not take."""
    M, N, K = check_matmul_args(a, b, out, op="gluon_matmul")
    if stages not in (2, 3):
        raise ValueError(
            f"gluon_matmul: stages {stages}; supported: 2, 3 (the ring and the "
            f"epilogue buffer must fit in {SHARED_BYTES // 1024} KiB)"
        )
    a_view, a_t = tma_view(a, "a", "gluon_matmul")
    if a_t:
        raise ValueError(
            "gluon_matmul: a must have contiguous rows (a transposed a is read by "
            "triton_matmul_tma.matmul_tma); pass a.contiguous()"
        )
    b_view, b_t = tma_view(b, "b", "gluon_matmul")
    return M, N, K, a_view, b_view, b_t, tma_output(out, M, N, a.dtype, a.device)


def _launch(descs, scales, M, N, K, *, b_t, stages, group_m, block_scaled, block_n, device):
    tiles = triton.cdiv(M, NUM_WG * WG_M.value) * triton.cdiv(N, block_n)
    grid = (min(tiles, _sm_count(device.index or 0)),)
    gluon_matmul_kernel[grid](
        *descs,
        *scales,
        M,
        N,
        K,
        B_T=b_t,
        STAGES=stages,
        GROUP_M=group_m,
        BLOCK_SCALED=block_scaled,
        CONSUMER_REGS=CONSUMER_REGS,
        PRODUCER_REGS=PRODUCER_REGS,
        num_warps=4,
    )


def gluon_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    stages: int = STAGES,
    group_m: int = GROUP_M,
) -> torch.Tensor:
    """a @ b (fp16 or bf16, fp32 accumulation) by the warp-specialized kernel; `out` (M, N),
    contiguous, receives C if given. `stages`: the ring's depth (2 or 3: 4 does not fit beside
    the epilogue buffer); `group_m`: row tiles per group of the tile order. FeatureMissing on
    anything but sm_90, before any compilation."""
    runtime.require(REQUIRES, "gluon_matmul")
    M, N, K, a_view, b_view, b_t, c = check_gluon_args(a, b, out, stages)
    descs = _descriptors(a_view, b_view, b_t, c, BLOCK_N)
    _launch(
        descs,
        (c, c),
        M,
        N,
        K,
        b_t=b_t,
        stages=stages,
        group_m=group_m,
        block_scaled=False,
        block_n=BLOCK_N,
        device=a.device,
    )
    return deliver(c, out)


def gluon_fp8_matmul_block_scaled(
    a8,
    a_scales,
    w8,
    w_scales,
    *,
    out=None,
    stages: int = FP8_STAGES,
    group_m: int = FP8_GROUP_M,
) -> torch.Tensor:
    """C (M, N) bf16 = A @ W.T from e4m3 a8 (M, K) with its 1 x 128 scales and w8 (N, K) with
    its 128 x 128 scales (`triton_fp8_matmul.quantize_activation` / `quantize_weight`), by the
    warp-specialized kernel: 128 x 128 tiles, each 128-deep K step's wgmma product promoted into
    fp32 registers with its scales (DeepGEMM's scheme). Rows off
    16-byte boundaries (K or N not a multiple of 16 or 8) go through padded copies
    (`triton_fp8_matmul.tma_operands`, `output`). FeatureMissing off sm_90."""
    op = "gluon_fp8_matmul_block_scaled"
    runtime.require(REQUIRES, op)
    if stages not in range(2, 6):
        raise ValueError(f"{op}: stages {stages}; supported: 2 to 5")
    M, N, K = triton_fp8_matmul.check_fp8_args(op, a8, w8, a_scales, w_scales, block_scaled=True)
    a8, w8 = triton_fp8_matmul.tma_operands(op, a8, w8)
    c = triton_fp8_matmul.output(op, out, M, N, a8.device)
    descs = _descriptors(a8, w8, True, c, FP8_BLOCK_N, triton_fp8_matmul.SCALE_BLOCK)
    _launch(
        descs,
        (a_scales, w_scales),
        M,
        N,
        K,
        b_t=True,
        stages=stages,
        group_m=group_m,
        block_scaled=True,
        block_n=FP8_BLOCK_N,
        device=a8.device,
    )
    return deliver(c, out)


def compile_for(
    arch: str = "sm_90",
    dtype: str = "bfloat16",
    b_t: bool = False,
    stages: int | None = None,
    block_scaled: bool = False,
):
    """The kernel compiled for `arch` without a GPU (`offline.compile_offline` runs this in a
    process of its own); `block_scaled`: the fp8 kernel (e4m3 in, bf16 out, `dtype` unused).
    FeatureMissing for any arch but sm_90, before compiling."""
    from kernels.matmul.offline import compile_triton, descriptor_type

    runtime.require(REQUIRES, "gluon_matmul")
    if block_scaled:
        inputs = torch.empty((128, 128), dtype=triton_fp8_matmul.FP8)
        c = torch.empty((64, 64), dtype=torch.bfloat16)
        descs = _descriptors(inputs, inputs, True, c, FP8_BLOCK_N, triton_fp8_matmul.SCALE_BLOCK)
        b_t, stages = True, stages or FP8_STAGES
    else:
        buffer = torch.empty((64, 64), dtype=getattr(torch, dtype))
        descs = _descriptors(buffer, buffer, b_t, buffer, BLOCK_N)
        stages = stages or STAGES
    constants = {
        "B_T": b_t,
        "STAGES": stages,
        "GROUP_M": FP8_GROUP_M if block_scaled else GROUP_M,
        "BLOCK_SCALED": block_scaled,
        "CONSUMER_REGS": CONSUMER_REGS,
        "PRODUCER_REGS": PRODUCER_REGS,
    }
    signature = {
        "a_desc": descriptor_type(descs[0]),
        "b_desc": descriptor_type(descs[1]),
        "c_desc": descriptor_type(descs[2]),
        "a_scale_ptr": "*fp32",
        "w_scale_ptr": "*fp32",
        "M": "i32",
        "N": "i32",
        "K": "i32",
        **dict.fromkeys(constants, "constexpr"),
    }
    return compile_triton(gluon_matmul_kernel, signature, constants, arch, num_warps=4, gluon=True)
