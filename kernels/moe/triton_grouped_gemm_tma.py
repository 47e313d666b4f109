"""Grouped GEMM, second version: the operands that are contiguous arrive by TMA, and a program may
loop over several output tiles (persistent). Same function as triton_grouped_gemm.py, same
Permutation, same outputs.

Why: on an H100 the pointer-based kernel runs at 530 (gate_up + SwiGLU) and 585 (down) TFLOP/s
against cuBLAS's 750, and no tile configuration closes the gap (PERFORMANCE.md). What cuBLAS does
that it does not:
1. **TMA for the weights.** In the pointer kernel every thread computes 64-bit addresses for its
   share of each (BLOCK_N x BLOCK_K) weight tile and issues `cp.async` copies of 16 bytes; with a
   tensor descriptor one thread hands the whole tile to the copy engine (`cp.async.bulk.tensor`),
   which also zero-fills past the edges (no masks). The weights are (E, N, K), K-contiguous: viewed
   as one (E * N, K) matrix, expert e's tile n starts at row e * N + n * BLOCK_N. When N is not a
   multiple of BLOCK_N the last tile reads the next expert's first rows; they only reach output
   columns >= N, which are never stored.
2. **TMA for A where its rows are contiguous**: the down projection's A (h, already in expert order)
   and, with `pregather`, gate_up's A copied into expert order by `gather_rows` first (TMA on Hopper
   cannot gather rows, so the fused gather must stay a pointer load). The copy writes and reads
   tokens * k * H * 2 bytes (0.54 GB at 32768 tokens, about 0.35 ms on an H100) to free the gate_up
   loop of its address math.
3. **The output tile leaves by TMA** (`c_desc.store`), which clips the columns past N.
4. **Gate and up as one product** (`interleave`): with two weight tiles, each k-step issues two
   wgmma of N = BLOCK_N that read the same A tile from shared memory twice. Hopper's shared memory
   serves about 128 bytes a clock per SM; at BLOCK_M 128 x BLOCK_N 128 with two warpgroups, the two
   products read ~96 bytes a clock while the TMA writes the next stage's tiles (~47), past what it
   serves. With gate and up rows interleaved in one weight (row 2j gate j, row 2j + 1 up j) a tile
   of 2 x BLOCK_N rows feeds one wgmma of N = 2 x BLOCK_N: A is read once (~80 + 47 bytes a clock,
   the same as cuBLAS's 128 x 256 tiles), and in the accumulator's layout each thread holds adjacent
   column pairs, so gate and up come apart in the epilogue without moving data (`tl.split`). The
   interleaved copy of the weights is made once (`interleaved_gate_up`), as an inference engine
   prepares weights at load time. Measured on an H100 at 32768 tokens: gate_up 630 -> 663 TFLOP/s
   (cuBLAS 704), half of what the count predicted (PERFORMANCE.md).
5. **Persistent programs** (`persistent`): one program per SM loops over the work items (M tile, N
   tile) in the grouped order. The loop's bound is the number of tiles in use, read on the device
   (padded_offsets[E] / BLOCK_M): no host sync, and no work item is an empty tile, so the loop can
   be flattened with the K loop (`tl.range(flatten=True)`: the next tile's loads are issued during
   this tile's epilogue). Warp specialization (a producer warp for the TMA loads, consumer
   warpgroups for wgmma, as cuBLAS's sm_90 kernels) is not tried: Triton 3.6 compiled
   `warp_specialize=True` on either loop of this kernel for sm_90 without specializing it (no
   `ttg.warp_specialize` in the TTGIR).
Without `persistent` the same kernel runs one work item per program (grid = the bound on work items;
the programs past the work in use do nothing), which isolates what TMA alone buys.

Descriptors are built on the host (`triton.tools.tensor_descriptor.TensorDescriptor`): they work the
same on Triton 3.6 and 3.9 and in the interpreter, need no device allocator
(`tl.make_tensor_descriptor` in the kernel needs `triton.set_allocator` for its scratch), and cost
nothing per program. Their block shapes depend on the autotuned tile, so each configuration's
pre-hook sets them.
"""

from __future__ import annotations

import functools
import json
import weakref
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels import runtime
from kernels.moe.triton_grouped_gemm import (
    ACC_REGS,
    accumulator_registers,
    pipeline_bytes,
    token_bucket,
)
from kernels.moe.triton_permute import Permutation
from kernels.runtime import UPCAST

# The ways to run the kernel. Each is measured by `python -m kernels.moe.benchmark variants`, and
# any of them can be the layer's grouped GEMM (moe_forward's `grouped_gemm`; by default
# moe_layer.grouped_gemm_for).
VARIANTS = {
    "tma": {"persistent": False, "pregather": False, "interleave": False},
    "tma_pregathered": {"persistent": False, "pregather": True, "interleave": False},
    "persistent": {"persistent": True, "pregather": False, "interleave": False},
    "persistent_pregathered": {"persistent": True, "pregather": True, "interleave": False},
    "persistent_pregathered_interleaved": {
        "persistent": True,
        "pregather": True,
        "interleave": True,
    },
}

# Tiles (BLOCK_N, BLOCK_K, num_warps, num_stages, FLATTEN) for sm_90: the pointer kernel's tiles and
# BLOCK_N 256 with 8 warps (two consumer warpgroups, 128 accumulator registers a thread) for the
# unfused products; the pruner drops what does not fit or apply. GROUP_M (M tiles that walk the N
# tiles together) is offered at 8 for every tile and also at 4 and 16 for the flattened persistent
# ones: on an H100 at 32768 tokens (16 M tiles an expert) a sweep measured interleaved gate_up at
# 688 TF/s with 8, 728 with 4 and 732 with 16; at 8192 tokens 8 was best
# (`tools/explore/06_moe_group_m_sweep.py`, its log in `data/results/h100-80gb-hbm3/explore/`).
GPU_TILES = [
    (128, 64, 8, 4, False),
    (64, 64, 4, 4, False),
    (256, 64, 8, 3, False),
    (128, 64, 4, 4, False),
    (128, 64, 8, 4, True),
    (256, 64, 8, 3, True),
]
# 8 first: every tile's autotuned choice, and the greedy search's first stage
GROUP_M_CHOICES = (8, 4, 16)


def set_block_shapes(nargs):
    """A descriptor's block shape is part of its type: set it from the launched configuration."""
    block_m, block_n, block_k = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_K"]
    nargs["a_desc"].block_shape = [block_m, block_k]
    nargs["w1_desc"].block_shape = [block_n * (2 if nargs["INTERLEAVED"] else 1), block_k]
    nargs["w2_desc"].block_shape = [block_n, block_k]
    nargs["c_desc"].block_shape = [block_m, block_n]


def tile_config(
    block_n: int, block_k: int, num_warps: int, num_stages: int, flatten: bool, group_m: int
) -> triton.Config:
    return triton.Config(
        {"BLOCK_N": block_n, "BLOCK_K": block_k, "GROUP_M": group_m, "FLATTEN": flatten},
        num_warps=num_warps,
        num_stages=num_stages,
        pre_hook=set_block_shapes,
    )


def config_name(c: triton.Config) -> str:
    return (
        f"N{c.kwargs['BLOCK_N']} K{c.kwargs['BLOCK_K']} w{c.num_warps} s{c.num_stages}"
        f"{' flatten' if c.kwargs['FLATTEN'] else ''} G{c.kwargs['GROUP_M']}"
    )


def candidate_configs() -> list[triton.Config]:
    """Every configuration the tuned tables may name: each tile with each GROUP_M."""
    return [tile_config(*tile, group_m) for tile in GPU_TILES for group_m in GROUP_M_CHOICES]


HOPPER_SHARED_BYTES = 227 * 1024
# For GPUs with TMA but less shared memory than sm_90 (an RTX 5090's 99 KiB): two stages of
# narrower tiles, used only where none of the above fits.
SMALL_CONFIGS = [tile_config(64, 64, 4, 2, False, 8), tile_config(32, 64, 4, 2, False, 8)]


def _configs_for_gpu() -> list[triton.Config]:
    return [
        tile_config(*tile, group_m)
        for tile in GPU_TILES
        for group_m in GROUP_M_CHOICES
        if group_m == 8 or tile[4]
    ]


def _configs() -> list[triton.Config]:
    # the interpreter: one configuration (it cannot autotune over several, nor time them)
    if not runtime.ON_GPU:
        return [
            triton.Config(
                {"BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 4, "FLATTEN": False},
                num_warps=1,
                num_stages=1,
                pre_hook=set_block_shapes,
            )
        ]
    return _configs_for_gpu()


def fits(c: triton.Config, *, block_m: int, swiglu: bool, persistent: bool) -> bool:
    """Registers, shared memory, and flattening only where a program loops over tiles."""
    bn, bk = c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"]
    epilogue_bytes = block_m * bn * 2  # the output tile staged in shared memory for the TMA store
    return (
        (persistent or not c.kwargs["FLATTEN"])  # one trip per program: nothing to flatten
        and accumulator_registers(block_m, bn, c.num_warps, swiglu) <= ACC_REGS
        and pipeline_bytes(block_m, bn, bk, c.num_stages, swiglu) + epilogue_bytes
        <= runtime.shared_memory_budget()
    )


# None: the tuned table's choice for this GPU and shape where it has one (`python -m
# kernels.moe.tune`), otherwise autotune over the configurations the pruner keeps; an integer i: the
# i-th kept one alone.
TUNING_OVERRIDE: int | None = None
TUNED_DIR = Path(__file__).with_name("tuned")


def tuning_key(
    token_bucket: int,
    n: int,
    k: int,
    *,
    swiglu: bool,
    gather: bool,
    persistent: bool,
    interleaved: bool,
) -> str:
    """The autotuner's key (`grouped_gemm_tma_kernel`'s `key=`) as the tuned tables write it."""
    return (
        f"bucket={token_bucket} N={n} K={k} swiglu={int(swiglu)} gather={int(gather)} "
        f"persistent={int(persistent)} interleaved={int(interleaved)}"
    )


def load_tuned(path: Path) -> dict[str, triton.Config]:
    """A tuned table: {tuning_key: configuration}, each entry one of `candidate_configs()`."""
    known = {config_name(c): c for c in candidate_configs()}
    try:
        entries = json.loads(path.read_text())["entries"]
    except (ValueError, KeyError, TypeError) as exc:  # not JSON, or no 'entries' in it
        entries = exc
    if not isinstance(entries, dict):
        raise ValueError(
            f"{path}: not a tuned table (a JSON object with 'entries': "
            f"{{key: {{'config': name}}}}): "
            f"{entries!r}"
        )
    table = {}
    for key, entry in entries.items():
        name = entry.get("config") if isinstance(entry, dict) else None
        if name not in known:
            raise ValueError(
                f"{path}: the entry for '{key}' names the configuration {name!r}, which is not one "
                f"this kernel offers ({sorted(known)}): run `python -m kernels.moe.tune` again"
            )
        table[key] = known[name]
    return table


@functools.cache
def _tuned_for_this_gpu() -> dict[str, triton.Config]:
    info = runtime.gpu_info()
    path = TUNED_DIR / f"{info.slug}.json" if info else None
    return load_tuned(path) if path is not None and path.exists() else {}


def prune_configs(configs, named_args, **kwargs):
    """The autotuner's early pruner: the configurations that fit this launch (`fits`), or the
    tuned table's choice or TUNING_OVERRIDE's where one applies."""
    args = {**named_args, **kwargs}
    fit = dict(block_m=args["BLOCK_M"], swiglu=args["SWIGLU"], persistent=args["PERSISTENT"])
    kept = [c for c in configs if fits(c, **fit)]
    if TUNING_OVERRIDE is not None:
        kept = [kept[min(TUNING_OVERRIDE, len(kept) - 1)]] if kept else kept
    else:  # the table is empty in the interpreter and on GPUs nobody tuned for
        key = tuning_key(
            args["TOKEN_BUCKET"],
            args["N"],
            args["K"],
            swiglu=args["SWIGLU"],
            gather=args["GATHER"],
            persistent=args["PERSISTENT"],
            interleaved=args["INTERLEAVED"],
        )
        tuned = _tuned_for_this_gpu().get(key)
        # (a caller's own BLOCK_M may not fit it: autotune then)
        if tuned is not None and fits(tuned, **fit):
            kept = [tuned]
    if not kept and runtime.shared_memory_budget() < HOPPER_SHARED_BYTES:
        kept = [c for c in SMALL_CONFIGS if fits(c, **fit)][:1]
    return kept or configs[:1]


def fitting_configs(block_m: int, swiglu: bool, persistent: bool) -> list[triton.Config]:
    """The GPU configurations the autotuner tries for such a launch here (`prune_configs`)."""
    fit = dict(block_m=block_m, swiglu=swiglu, persistent=persistent)
    kept = [c for c in _configs_for_gpu() if fits(c, **fit)]
    return kept or [c for c in SMALL_CONFIGS if fits(c, **fit)][:1]


@triton.autotune(
    configs=_configs(),
    key=["TOKEN_BUCKET", "N", "K", "SWIGLU", "GATHER", "PERSISTENT", "INTERLEAVED"],
    prune_configs_by={"early_config_prune": prune_configs},
)
@triton.jit
def grouped_gemm_tma_kernel(
    a_ptr,
    a_desc,
    w1_desc,
    w2_desc,
    c_desc,
    sorted_ids_ptr,
    tile_expert_ptr,
    padded_offsets_ptr,
    experts,
    N,
    K,
    TOKEN_BUCKET,
    TOP_K: tl.constexpr,
    GATHER: tl.constexpr,
    SWIGLU: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    PERSISTENT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    FLATTEN: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """c[rows, n] = A[rows] @ w1[expert].T (or silu(A @ w1.T) * (A @ w2.T)); w1, w2 viewed as (E *
    N, K). With INTERLEAVED (SwiGLU only) w1 is the (E * 2N, K) interleaved gate/up weight and w2 is
    unused. A is gathered from a_ptr's token rows (GATHER) or read by a_desc in row order."""
    # tiles holding rows, read on the device
    used_tiles = tl.load(padded_offsets_ptr + experts) // BLOCK_M
    n_tiles = tl.cdiv(N, BLOCK_N)
    work = used_tiles * n_tiles
    per_group = GROUP_M * n_tiles
    for item in tl.range(tl.program_id(0), work, tl.num_programs(0), flatten=FLATTEN):
        # Grouped order, as in the pointer kernel: GROUP_M tiles (one expert's, mostly) walk the N
        # tiles together, so each weight tile is read from HBM once for all of them.
        first_m = item // per_group * GROUP_M
        group_m = min(used_tiles - first_m, GROUP_M)
        tile = first_m + (item % per_group) % group_m
        n0 = (item % per_group) // group_m * BLOCK_N
        expert = tl.load(tile_expert_ptr + tile)
        if INTERLEAVED:
            w_row = expert * 2 * N + 2 * n0
        else:
            w_row = expert * N + n0
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        if GATHER:
            assignment = tl.load(sorted_ids_ptr + rows)
            real = assignment >= 0  # padding rows load zeros and so compute zeros
            a_ptrs = (
                a_ptr
                + tl.where(real, assignment // TOP_K, 0)[:, None].to(tl.int64) * K
                + tl.arange(0, BLOCK_K)[None, :]
            )
        if INTERLEAVED:
            # columns: gate 0, up 0, gate 1, up 1, ...
            acc1 = tl.zeros((BLOCK_M, 2 * BLOCK_N), tl.float32)
        else:
            acc1 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        acc2 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in tl.range(0, K, BLOCK_K):
            if GATHER:
                a = tl.load(
                    a_ptrs,
                    mask=real[:, None] & (k0 + tl.arange(0, BLOCK_K) < K)[None, :],
                    other=0.0,
                )
                a_ptrs += BLOCK_K
            else:
                a = a_desc.load([tile * BLOCK_M, k0])
            # (BLOCK_N or 2 BLOCK_N, BLOCK_K): K-contiguous, as wgmma's B wants
            b1 = w1_desc.load([w_row, k0])
            if UPCAST:
                a = a.to(tl.float32)
                b1 = b1.to(tl.float32)
            acc1 = tl.dot(a, b1.T, acc1)
            if SWIGLU and not INTERLEAVED:
                b2 = w2_desc.load([w_row, k0])
                if UPCAST:
                    b2 = b2.to(tl.float32)
                acc2 = tl.dot(a, b2.T, acc2)
        if INTERLEAVED:
            # (gate, up): each thread's own pairs
            acc1, acc2 = tl.split(tl.reshape(acc1, (BLOCK_M, BLOCK_N, 2)))
        if SWIGLU:
            acc1 = acc1 * tl.sigmoid(acc1) * acc2  # silu(gate) * up
        c_desc.store([tile * BLOCK_M, n0], acc1.to(c_desc.dtype))


@triton.jit
def gather_rows_kernel(
    x_ptr,
    out_ptr,
    sorted_ids_ptr,
    tile_expert_ptr,
    K,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[row] = x[sorted_ids[row] // TOP_K] for rows of tiles in use; padding rows get zeros."""
    tile = tl.program_id(0)
    if tl.load(tile_expert_ptr + tile) >= 0:
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        assignment = tl.load(sorted_ids_ptr + rows)
        real = assignment >= 0
        source = tl.where(real, assignment // TOP_K, 0).to(tl.int64)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            values = tl.load(
                x_ptr + source[:, None] * K + k[None, :],
                mask=real[:, None] & (k < K)[None, :],
                other=0.0,
            )
            tl.store(
                out_ptr + rows[:, None].to(tl.int64) * K + k[None, :], values, mask=(k < K)[None, :]
            )


def gather_rows(x: torch.Tensor, perm: Permutation) -> torch.Tensor:
    """x's rows in the permutation's order (max_rows, hidden): the A of gate_up, made contiguous."""
    hidden = x.shape[1]
    out = torch.empty(perm.sorted_ids.numel(), hidden, dtype=x.dtype, device=x.device)
    if perm.max_tiles:
        gather_rows_kernel[(perm.max_tiles,)](
            x,
            out,
            perm.sorted_ids,
            perm.tile_expert,
            hidden,
            TOP_K=perm.top_k,
            BLOCK_M=perm.block_m,
            BLOCK_K=runtime.pick(gpu=128, cpu=64),
            num_warps=runtime.pick(gpu=8, cpu=1),
        )
    return out


@functools.cache
def _programs_per_launch() -> int:
    """Persistent programs: one per SM on the GPU; two in the interpreter (enough to interleave)."""
    return torch.cuda.get_device_properties(0).multi_processor_count if runtime.ON_GPU else 2


def _descriptor(t: torch.Tensor) -> TensorDescriptor:
    return TensorDescriptor.from_tensor(t, [16, 16])  # block shape placeholder, set by the pre-hook


_INTERLEAVED: dict = {}


def interleaved_gate_up(w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """(E, 2 I, H) with row 2j = w_gate[:, j] and row 2j + 1 = w_up[:, j]: the weight of the
    interleaved product. Prepared once per pair of weights, as at load time: kept for the last pair
    seen (its size is theirs), and made again when either tensor is another one or was changed in
    place (version counter)."""
    stamp = (w_gate._version, w_up._version)
    kept = _INTERLEAVED.get("pair")
    if kept is not None and kept[0]() is w_gate and kept[1]() is w_up and kept[2] == stamp:
        return kept[3]
    if runtime.ON_GPU and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "gate_up_swiglu: call it once before capturing a CUDA graph (it prepares the "
            "interleaved gate/up weight then)"
        )
    _INTERLEAVED.clear()  # free the previous pair's copy before making this one
    experts, inter, hidden = w_gate.shape
    w = torch.stack((w_gate, w_up), dim=2).reshape(experts, 2 * inter, hidden)
    _INTERLEAVED["pair"] = (weakref.ref(w_gate), weakref.ref(w_up), stamp, w)
    return w


def _launch(
    a,
    w1,
    w2,
    perm: Permutation,
    *,
    gather: bool,
    swiglu: bool,
    persistent: bool,
    interleaved: bool = False,
    config: triton.Config | None = None,
) -> torch.Tensor:
    runtime.require("tma", "the TMA grouped GEMM (triton_grouped_gemm_tma)")
    experts, n, k = w2.shape  # w2: gate's shape when w1 is the interleaved weight
    c = torch.empty(perm.sorted_ids.numel(), n, dtype=a.dtype, device=a.device)
    if perm.max_tiles == 0:
        return c

    def grid(meta):
        bound = perm.max_tiles * triton.cdiv(n, meta["BLOCK_N"])
        return (min(bound, _programs_per_launch()) if persistent else bound,)

    args = dict(
        a_ptr=a,
        a_desc=_descriptor(a),
        w1_desc=_descriptor(w1.view(-1, k)),
        w2_desc=_descriptor(w2.view(experts * n, k)),
        c_desc=_descriptor(c),
        sorted_ids_ptr=perm.sorted_ids,
        tile_expert_ptr=perm.tile_expert,
        padded_offsets_ptr=perm.padded_offsets,
        experts=experts,
        N=n,
        K=k,
        TOKEN_BUCKET=token_bucket(perm.max_tiles),
        TOP_K=perm.top_k,
        GATHER=gather,
        SWIGLU=swiglu,
        INTERLEAVED=interleaved,
        PERSISTENT=persistent,
        BLOCK_M=perm.block_m,
        UPCAST=UPCAST,
    )
    if config is None:
        grouped_gemm_tma_kernel[grid](**args)
        return c
    if not fits(config, block_m=perm.block_m, swiglu=swiglu, persistent=persistent):
        raise ValueError(
            f"grouped GEMM: the configuration {config_name(config)} does not fit this launch "
            f"(BLOCK_M {perm.block_m}, swiglu={swiglu}, persistent={persistent})"
        )
    meta = config.all_kwargs()
    config.pre_hook({**args, **meta})
    # past the autotuner: this configuration, untimed
    grouped_gemm_tma_kernel.fn[grid(meta)](**args, **meta)
    return c


def gate_up_swiglu(
    x, w_gate, w_up, perm: Permutation, *, variant: str = "tma", config: triton.Config | None = None
) -> torch.Tensor:
    """h = silu(x_e @ w_gate[e].T) * (x_e @ w_up[e].T) per row, as
    triton_grouped_gemm.gate_up_swiglu. `config` (one of `candidate_configs()`) launches that
    configuration instead of the tuned or autotuned one."""
    options = VARIANTS[variant]
    w1 = interleaved_gate_up(w_gate, w_up) if options["interleave"] else w_gate
    a = gather_rows(x, perm) if options["pregather"] else x
    return _launch(
        a,
        w1,
        w_up,
        perm,
        gather=not options["pregather"],
        swiglu=True,
        persistent=options["persistent"],
        interleaved=options["interleave"],
        config=config,
    )


def down(
    h, w_down, perm: Permutation, *, variant: str = "tma", config: triton.Config | None = None
) -> torch.Tensor:
    """y = h_e @ w_down[e].T per row, as triton_grouped_gemm.down (A by TMA in every variant)."""
    return _launch(
        h,
        w_down,
        w_down,
        perm,
        gather=False,
        swiglu=False,
        persistent=VARIANTS[variant]["persistent"],
        config=config,
    )
