"""The tiled matrix product on Hopper: operands by TMA, one program per SM, the epilogue overlapped.

    C[m, n] = sum_k A[m, k] * B[k, n]    (float32 accumulator, C rounded once to A's dtype)

The tiled Triton kernel (`triton_matmul.py`) computes every address of a tile in every thread and
copies it with `cp.async`, one program per output tile. On Hopper three things change:

1. **TMA descriptors.** A descriptor (`triton.tools.tensor_descriptor.TensorDescriptor`, built on
   the host) holds the operand's base, shape and strides; `desc.load([row, col])` hands a whole
   tile to the copy engine (`cp.async.bulk.tensor` in the PTX), which zero-fills past the edges, so
   the loop has no masks and no address arithmetic. The store clips what lies past M and N.
2. **Persistent programs.** One program per SM loops over the output tiles in the grouped order
   (GROUP_M row tiles walk the column tiles together, so each B tile is read from HBM once for all
   of them). With `FLATTEN` the tile loop and the K loop become one pipelined loop: the loads of
   the next tile are in flight while this tile's accumulator is stored.
3. **The epilogue.** The accumulator goes out through shared memory and a TMA store, in two halves
   of BLOCK_N / 2 columns (`EPILOGUE_SUBTILE`): half the staging buffer, so one more stage of the
   ring fits in the 227 KiB a CTA has.

tl.dot compiles to wgmma on sm_90 (the notebook reads it in the SASS); Triton's pipeliner keeps
`num_stages` K tiles in flight. The kernel is the persistent TMA kernel of Triton's tutorial
`09-persistent-matmul.py`, with transposed operands read through their own descriptor instead of a
copy.

Transposed operands: TMA needs the last dimension contiguous. An A stored as the transpose of a
(K, M) buffer (a.T, say) is read through a descriptor over that buffer, in (BLOCK_K, BLOCK_M) tiles
that the kernel transposes (`A_T`; wgmma reads either order from shared memory); B likewise
(`B_T`: b = W.T of an (N, K) weight, the nn.Linear layout). TMA also needs row strides on
16-byte boundaries: an operand whose rows are not (K or N not a multiple of 8 in 16-bit) is copied
into a buffer with padded rows first, and C is written to one and copied out (`tma_view`,
`tma_output`): any shape works, at the cost of that copy.

Needs TMA (sm_90+): `matmul_tma` refuses other GPUs with FeatureMissing; the portable kernel is
`triton_matmul.py`'s. Descriptors built on the host work the same in Triton 3.6 and 3.9 and in the
CPU interpreter, which runs this kernel at small sizes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels import runtime
from kernels.matmul.reference import check_matmul_args
from kernels.matmul.triton_matmul import GROUP_M, sm_programs, tile_coordinates
from kernels.runtime import UPCAST

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, EPILOGUE_SUBTILE, FLATTEN) for sm_90.
# 128 x 256 with 8 warps is cuBLAS's tile for these shapes: two consumer warpgroups of 64 x 256
# fp32 accumulators, 128 registers a thread. A stage of A and B is (128 + 256) x 64 x 2 bytes =
# 48 KiB; three stages and a halved epilogue buffer (128 x 128 x 2 = 32 KiB) are 176 KiB.
# The feature this kernel needs (runtime.FEATURE_GPUS): TMA, sm_90 and newer; its tiles are
# sm_90's, and on a GPU with less shared memory the autotuner keeps those that fit.
REQUIRES = "tma"
GPU_TILES = [
    (128, 256, 64, 8, 3, True, True),
    (128, 256, 64, 8, 4, True, True),
    (128, 256, 64, 8, 3, True, False),
    (256, 128, 64, 8, 3, True, True),
    (128, 128, 64, 8, 4, False, True),
    (128, 128, 64, 4, 4, False, True),
    (128, 64, 64, 4, 3, True, False),  # 80 KiB: for GPUs with 99 KiB a block (sm_120)
]


def set_block_shapes(nargs):
    """A descriptor's block shape is part of its type: set it from the launched configuration
    (a transposed operand's descriptor is over its buffer: the block's two sides swap)."""
    bm, bn, bk = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_K"]
    nargs["a_desc"].block_shape = [bk, bm] if nargs["A_T"] else [bm, bk]
    nargs["b_desc"].block_shape = [bn, bk] if nargs["B_T"] else [bk, bn]
    half = 2 if nargs["EPILOGUE_SUBTILE"] else 1
    nargs["c_desc"].block_shape = [bm, bn // half]


def tile_config(bm, bn, bk, warps, stages, subtile, flatten) -> triton.Config:
    return triton.Config(
        {
            "BLOCK_M": bm,
            "BLOCK_N": bn,
            "BLOCK_K": bk,
            "GROUP_M": GROUP_M,
            "EPILOGUE_SUBTILE": subtile,
            "FLATTEN": flatten,
        },
        num_warps=warps,
        num_stages=stages,
        pre_hook=set_block_shapes,
    )


def shared_bytes(bm: int, bn: int, bk: int, stages: int, subtile: bool, itemsize: int = 2) -> int:
    """The ring of A and B tiles plus the epilogue's staging buffer."""
    return stages * (bm + bn) * bk * itemsize + bm * bn // (2 if subtile else 1) * itemsize


def _configs() -> list[triton.Config]:
    if not runtime.ON_GPU:  # the interpreter: one small configuration (it cannot time several)
        return [tile_config(32, 32, 32, 1, 1, True, False)]
    budget = runtime.shared_memory_budget()
    return [tile_config(*t) for t in GPU_TILES if shared_bytes(*t[:3], t[4], t[5]) <= budget]


@triton.autotune(configs=_configs(), key=["M", "N", "K", "A_T", "B_T"])
@triton.jit
def matmul_tma_kernel(
    a_desc,  # A (M, K), or with A_T its (K, M) buffer
    b_desc,  # B (K, N), or with B_T its (N, K) buffer
    c_desc,  # C (M, N), contiguous
    M,
    N,
    K,
    NUM_PROGRAMS: tl.constexpr,  # persistent programs: one per SM
    A_T: tl.constexpr,
    B_T: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EPILOGUE_SUBTILE: tl.constexpr,  # store C in two halves of BLOCK_N / 2 columns
    FLATTEN: tl.constexpr,  # one pipelined loop over tiles and K steps
    UPCAST: tl.constexpr,  # the interpreter's tl.dot is wrong on bf16: multiply in fp32 there
):
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    num_tiles = num_pid_m * num_pid_n
    for tile in tl.range(tl.program_id(0), num_tiles, NUM_PROGRAMS, flatten=FLATTEN):
        pid_m, pid_n = tile_coordinates(tile, num_pid_m, num_pid_n, GROUP_M)
        m0 = pid_m * BLOCK_M
        n0 = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            k0 = ki * BLOCK_K
            if A_T:
                a = a_desc.load([k0, m0]).T
            else:
                a = a_desc.load([m0, k0])
            if B_T:
                b = b_desc.load([n0, k0]).T
            else:
                b = b_desc.load([k0, n0])
            if UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc)
        if EPILOGUE_SUBTILE:
            # (BLOCK_M, 2, BLOCK_N / 2) -> two (BLOCK_M, BLOCK_N / 2) halves: columns n0 + j and
            # n0 + BLOCK_N / 2 + j
            halves = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
            left, right = tl.split(halves)
            c_desc.store([m0, n0], left.to(c_desc.dtype))
            c_desc.store([m0, n0 + BLOCK_N // 2], right.to(c_desc.dtype))
        else:
            c_desc.store([m0, n0], acc.to(c_desc.dtype))


def tma_aligned(view: torch.Tensor) -> bool:
    """Whether a descriptor can read `view` as it is: the last dimension contiguous, the row stride
    and the base on 16-byte boundaries (TMA's rules)."""
    size = view.element_size()
    return view.stride(-1) == 1 and (view.stride(0) * size) % 16 == 0 and view.data_ptr() % 16 == 0


def padded_rows(rows: int, cols: int, dtype: torch.dtype, device) -> torch.Tensor:
    """An uninitialized (rows, cols) view of a buffer whose rows are padded to 16 bytes: what TMA
    reads when a tensor's own rows are not on 16-byte boundaries (the padding is never read: the
    descriptor's shape stops at `cols` and TMA zero-fills past it)."""
    step = 16 // torch.empty((), dtype=dtype).element_size()
    return torch.empty((rows, -(-cols // step) * step), dtype=dtype, device=device)[:, :cols]


def tma_view(t: torch.Tensor, name: str, op: str) -> tuple[torch.Tensor, bool]:
    """(the 2-D tensor a descriptor reads, whether it is t's transpose): t itself when its rows
    are contiguous, else t.T when its columns are. When neither orientation has its rows on
    16-byte boundaries (an odd K, say), a copy of t in a buffer with padded rows: one extra pass
    over the operand, small beside the product's K passes. ValueError when neither dimension is
    contiguous. The stride of a dimension of length 1 is never used: it is set to one TMA takes."""
    size = t.element_size()
    for view, transposed in ((t, False), (t.T, True)):
        rows, cols = view.shape
        row_stride = view.stride(0) if rows > 1 else -(-cols * size // 16) * 16 // size
        if view.stride(1) != 1 and cols > 1:
            continue
        view = view.as_strided(view.shape, (row_stride, 1))
        if tma_aligned(view):
            return view, transposed
        padded = padded_rows(rows, cols, t.dtype, t.device)
        return padded.copy_(view), transposed
    raise ValueError(
        f"{op}: {name} has strides {t.stride()}; TMA needs one of its dimensions contiguous "
        f"(stride 1): pass {name}.contiguous()"
    )


def tma_output(out: torch.Tensor | None, M: int, N: int, dtype, device) -> torch.Tensor:
    """The C a kernel's descriptor writes: `out` (or a new (M, N) tensor) when TMA can write its
    rows, else a buffer with padded rows that `deliver` copies into it after the launch."""
    c = torch.empty((M, N), dtype=dtype, device=device) if out is None else out
    return c if tma_aligned(c) else padded_rows(M, N, dtype, device)


def deliver(written: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """C as the caller asked for it: `out` (filled from the padded buffer if that was written)
    or the kernel's own output, contiguous."""
    if out is None:
        return written.contiguous()
    return out if written is out else out.copy_(written)


def descriptor(t: torch.Tensor) -> TensorDescriptor:
    """A host TMA descriptor over t; its block shape is set by the configuration's pre-hook."""
    return TensorDescriptor.from_tensor(t, [16, 16])


def matmul_tma(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    config: triton.Config | None = None,
) -> torch.Tensor:
    """a @ b (fp16 or bf16, fp32 accumulation) by the persistent TMA kernel. `out` (M, N),
    contiguous, receives C if given. `config` (one of `candidate_configs()`) runs that
    configuration instead of the autotuned one. FeatureMissing on a GPU without TMA (sm_90+)."""
    if runtime.features() is not None:  # the interpreter emulates descriptors on the CPU
        runtime.require(REQUIRES, "matmul_tma")
    M, N, K = check_matmul_args(a, b, out, op="matmul_tma")
    a_view, a_t = tma_view(a, "a", "matmul_tma")
    b_view, b_t = tma_view(b, "b", "matmul_tma")
    c = tma_output(out, M, N, a.dtype, a.device)
    args = dict(
        a_desc=descriptor(a_view),
        b_desc=descriptor(b_view),
        c_desc=descriptor(c),
        M=M,
        N=N,
        K=K,
        NUM_PROGRAMS=sm_programs(),
        A_T=a_t,
        B_T=b_t,
        UPCAST=UPCAST,
    )
    launch(matmul_tma_kernel, args, config)
    return deliver(c, out)


def launch(kernel, args: dict, config: triton.Config | None) -> None:
    """The autotuned `kernel` on one program per SM (args["NUM_PROGRAMS"]), or, given `config`,
    that configuration alone, past the autotuner (its pre-hook sets the descriptors' blocks)."""
    grid = (args["NUM_PROGRAMS"],)
    if config is None:
        kernel[grid](**args)
        return
    meta = config.all_kwargs()
    config.pre_hook({**args, **meta})
    kernel.fn[grid](**args, **meta)


def candidate_configs() -> list[triton.Config]:
    """The configurations the autotuner chooses from on sm_90."""
    return [tile_config(*t) for t in GPU_TILES]


def config_name(c: triton.Config) -> str:
    kw = c.kwargs
    return (
        f"{kw['BLOCK_M']}x{kw['BLOCK_N']}x{kw['BLOCK_K']} w{c.num_warps} s{c.num_stages}"
        f"{' subtile' if kw['EPILOGUE_SUBTILE'] else ''}"
        f"{' flatten' if kw['FLATTEN'] else ''}"
    )


def compile_for(
    arch: str = "sm_90",
    dtype: str = "bfloat16",
    a_t: bool = False,
    b_t: bool = False,
    tile: int | None = None,
):
    """The kernel compiled for `arch` without a GPU (`offline.compile_offline` runs this in a
    process of its own), in the tile GPU_TILES[tile]; with no tile named, the first whose
    compiled shared memory fits the arch's (`runtime.shared_memory_budget`: sm_90's choice is
    GPU_TILES[0]). FeatureMissing on an arch without TMA, before compiling."""
    runtime.require(REQUIRES, "matmul_tma")
    if tile is not None:
        return _compile_tile(arch, dtype, a_t, b_t, GPU_TILES[tile])
    for t in GPU_TILES:
        kernel = _compile_tile(arch, dtype, a_t, b_t, t)
        if kernel.metadata.shared <= runtime.shared_memory_budget():
            return kernel
    raise ValueError(f"matmul_tma: no tile of GPU_TILES fits {arch}'s shared memory")


def _compile_tile(arch, dtype, a_t, b_t, tile):
    from kernels.matmul.offline import compile_triton, descriptor_type

    bm, bn, bk, warps, stages, subtile, flatten = tile
    torch_dtype = getattr(torch, dtype)
    buffer = torch.empty((64, 64), dtype=torch_dtype)

    def desc(shape):
        return descriptor_type(TensorDescriptor.from_tensor(buffer, shape))

    constants = {
        "NUM_PROGRAMS": 132,
        "A_T": a_t,
        "B_T": b_t,
        "BLOCK_M": bm,
        "BLOCK_N": bn,
        "BLOCK_K": bk,
        "GROUP_M": GROUP_M,
        "EPILOGUE_SUBTILE": subtile,
        "FLATTEN": flatten,
        "UPCAST": False,
    }
    signature = {
        "a_desc": desc([bk, bm] if a_t else [bm, bk]),
        "b_desc": desc([bn, bk] if b_t else [bk, bn]),
        "c_desc": desc([bm, bn // (2 if subtile else 1)]),
        "M": "i32",
        "N": "i32",
        "K": "i32",
        **dict.fromkeys(constants, "constexpr"),
    }
    return compile_triton(matmul_tma_kernel.fn, signature, constants, arch, warps, stages)
