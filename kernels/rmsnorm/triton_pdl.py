"""Programmatic dependent launch (PDL): an RMSNorm that starts while the GEMM before it runs.

In a model the norm's input is the output of a GEMM (the attention output projection, the MLP's down
projection). Launched normally, the norm cannot start until the GEMM has finished and its writes are
visible: between the GEMM's last program and the norm's first the GPU is partly idle (about a
microsecond, measured in notebook 02, part 10), and the GEMM's last wave of programs leaves SMs
empty. Hopper (sm_90) lets two kernels overlap there, in three parts:

* the second kernel is launched with the launch attribute "programmatic stream serialization"
  (Triton: `kernel[grid](..., launch_pdl=True)`): it may start before the first one has finished;
* the first kernel says when: `tl.extra.cuda.gdc_launch_dependents()` (PTX
  `griddepcontrol.launch_dependents`). The second kernel's programs are launched once every program
  of the first has executed it (or exited);
* the second kernel's programs do what does not depend on the first (the norm loads its weight w),
  then call `tl.extra.cuda.gdc_wait()` (PTX `griddepcontrol.wait`), which returns when the first
  grid has completed and its memory operations are visible. Only then do they read the GEMM's
  output.

Correctness rests on `gdc_wait` alone: the trigger is a scheduling hint, and a dependent that waits
reads the same data wherever the trigger is. So the PDL pair gives the same bits as the plain pair
(the tests and the benchmark check it before timing). What it can save is the gap plus the part of
the norm's start-up that overlaps the GEMM's tail; notebook 02, part 10 measures it.

`griddepcontrol` exists on sm_90 and newer only (ptxas refuses it for an A100 or an RTX 4090),
and the interpreter cannot execute it: where `runtime.has("pdl")` is False (CPU mode, GPUs before
Hopper, `KERNELS_GPU_PROFILE=a100`) the GEMM is compiled without the trigger and the wrappers run
the plain kernels, `pdl=True` included.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import runtime
from kernels.rmsnorm import reference
from kernels.rmsnorm.triton_rmsnorm import rms_norm, tile
from kernels.rmsnorm.validate import check_rmsnorm_args, rows_view
from kernels.runtime import UPCAST
from kernels.testing import TINY, ULP, Comparison, compare, generator, random_tensor
from kernels.validate import check_matmul_args

GROUP_M = 8


def launch_dependents() -> bool:
    """Whether the GEMM carries the trigger: wherever PDL exists, so that the GEMM is the same
    binary in the pair with and without PDL (without a PDL-launched dependent it does nothing)."""
    return runtime.has("pdl")


@triton.jit
def matmul_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    M,
    N,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
    LAUNCH_DEPENDENTS: tl.constexpr,
):
    """c (M, N) = a (M, K) @ b (K, N), row-major; float32 accumulation, rounded once to c's type."""
    pid = tl.program_id(0)
    # Grouped order: GROUP_M row tiles walk the column tiles together, so their rows of a stay in
    # L2.
    m_tiles = tl.cdiv(M, BLOCK_M)
    n_tiles = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * n_tiles
    first_m = pid // per_group * GROUP_M
    group_m = tl.minimum(m_tiles - first_m, GROUP_M)
    m_tile = first_m + (pid % per_group) % group_m
    n_tile = (pid % per_group) // group_m
    rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    # Rows and columns past the edge read row M-1 / column N-1 again (modulo) instead of being
    # masked: the loads of the main loop need no mask, and the store below drops those results.
    a_ptrs = a_ptr + (rows % M)[:, None].to(tl.int64) * K + k[None, :]
    b_ptrs = b_ptr + k[:, None].to(tl.int64) * N + (cols % N)[None, :]
    if LAUNCH_DEPENDENTS:
        # Let a PDL-launched next kernel start now. Its programs are launched once every program of
        # this grid has passed this point, that is once the last wave of the GEMM is on the SMs and
        # streaming: they take the SMs this grid has no more work for, do their prologue (the norm
        # loads w) and wait in gdc_wait until this grid has finished. At the end of the program
        # instead, they would be released when the last program stores its tile: nothing left to
        # overlap but the store.
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_ok = k0 + k < K
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * N
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    tl.store(
        c_ptr + rows[:, None].to(tl.int64) * N + cols[None, :],
        acc.to(c_ptr.dtype.element_ty),
        mask=mask,
    )


# (most rows, BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) on sm_90, by the number of rows
# (tokens). Decode: a weight read; 32 columns per program gives 128 programs for N = 4096 (one per
# SM), each with 5 tiles of b in flight. Prefill: wgmma tiles of 128 rows, 256 columns once there
# are enough rows to fill 132 SMs several times. Compiled offline without spills (PERFORMANCE.md).
GPU_TILES = [
    (16, 16, 32, 128, 4, 6),
    (64, 64, 64, 128, 4, 4),
    (1024, 128, 128, 64, 8, 4),
    (None, 128, 256, 64, 8, 3),
]
CPU_TILE = (32, 64, 64, 1, 1)  # the interpreter: few, large programs


def _tile(m: int) -> tuple[int, int, int, int, int]:
    return gpu_tile(m) if runtime.ON_GPU else CPU_TILE


def gpu_tile(m: int) -> tuple[int, int, int, int, int]:
    """The GPU tile for m rows; on a GPU with less shared memory than sm_90 (an RTX 4090's 99 KiB),
    fewer pipeline stages, each holding a tile of a and one of b in 16-bit elements."""
    block_m, block_n, block_k, num_warps, num_stages = next(
        tile for most, *tile in GPU_TILES if most is None or m <= most
    )
    stage_bytes = (block_m + block_n) * block_k * 2
    num_stages = max(1, min(num_stages, runtime.shared_memory_budget() // stage_bytes))
    return block_m, block_n, block_k, num_warps, num_stages


def matmul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """a (M, K) @ b (K, N) for bf16 or fp16, float32 accumulation: the GEMM before the norm. On the
    GPU its programs trigger a PDL-launched next kernel early (see `matmul_kernel`)."""
    check_matmul_args("matmul", a, b, out, device_type=runtime.DEVICE)
    (m, k), n = a.shape, b.shape[1]
    out = torch.empty(m, n, dtype=a.dtype, device=a.device) if out is None else out
    if not out.numel():
        return out
    if k == 0:
        return out.zero_()
    block_m, block_n, block_k, num_warps, num_stages = _tile(m)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    matmul_kernel[grid](
        a,
        b,
        out,
        m,
        n,
        k,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        GROUP_M=GROUP_M,
        EVEN_K=k % block_k == 0,
        UPCAST=UPCAST,
        LAUNCH_DEPENDENTS=launch_dependents(),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


@triton.jit
def rmsnorm_pdl_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    rows,
    width,
    x_row_stride,
    y_row_stride,
    eps,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """triton_rmsnorm.rmsnorm_fwd_kernel for a PDL launch: the same arithmetic, w loaded first."""
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    col = tl.arange(0, BLOCK)
    mask = (row[:, None] < rows) & (col[None, :] < width)
    # This program may start while the kernel that writes x is still running. w does not depend on
    # that kernel: start loading it, then wait (griddepcontrol.wait) until the previous grid has
    # finished and its writes are visible.
    w = tl.load(w_ptr + col, mask=col < width, other=0.0).to(tl.float32)
    tl.extra.cuda.gdc_wait()
    x = tl.load(x_ptr + row[:, None] * x_row_stride + col[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / width + eps)
    y = x * rstd[:, None] * w[None, :]
    y_offsets = row[:, None] * y_row_stride + col[None, :]
    tl.store(y_ptr + y_offsets, y.to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm_pdl(
    x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6, out: torch.Tensor | None = None
) -> torch.Tensor:
    """triton_rmsnorm.rms_norm launched with programmatic dependent launch, to follow a kernel that
    triggers it early (`matmul`): its programs load w, then wait for that kernel before reading x.
    The same result bit for bit. Without PDL (CPU mode, before sm_90) the plain kernel runs."""
    if not runtime.has("pdl"):
        return rms_norm(x, w, eps, out)
    check_rmsnorm_args("rms_norm_pdl", x, w, eps, out, device_type=runtime.DEVICE)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
    if not x.numel():
        return out
    x2d, y2d = rows_view(x), rows_view(out)
    rows, width = x2d.shape
    rows_per_program, block, num_warps = tile(rows, width)
    rmsnorm_pdl_kernel[(triton.cdiv(rows, rows_per_program),)](
        x2d,
        w,
        y2d,
        rows,
        width,
        x2d.stride(0),
        y2d.stride(0),
        eps,
        ROWS=rows_per_program,
        BLOCK=block,
        num_warps=num_warps,
        launch_pdl=True,
    )
    return out


def gemm_rms_norm(
    a: torch.Tensor,
    b: torch.Tensor,
    w: torch.Tensor,
    eps: float = 1e-6,
    *,
    pdl: bool = False,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """h = a @ b, then y = rmsnorm(h) * w: two kernels; returns (h, y), written into `out` if given.

    With `pdl=True` the norm is launched with programmatic dependent launch: it starts during the
    GEMM's last wave, loads w and waits for h. Same result bit for bit. Where PDL does not exist
    (CPU mode, before sm_90) `pdl` is ignored (see above)."""
    check_matmul_args(
        "gemm_rms_norm", a, b, out[0] if out is not None else None, device_type=runtime.DEVICE
    )
    h = (
        torch.empty(a.shape[0], b.shape[1], dtype=a.dtype, device=a.device)
        if out is None
        else out[0]
    )
    y = torch.empty_like(h) if out is None else out[1]
    # Checked before the GEMM runs, so that a bad w or y raises before anything is launched.
    check_rmsnorm_args("gemm_rms_norm", h, w, eps, y, device_type=runtime.DEVICE)
    matmul(a, b, h)
    (rms_norm_pdl if pdl else rms_norm)(h, w, eps, y)
    return h, y


def check_pair(
    a: torch.Tensor, b: torch.Tensor, w: torch.Tensor, eps: float, h: torch.Tensor, y: torch.Tensor
) -> dict[str, Comparison]:
    """The pair's outputs against float64: h against a @ b, y against the RMSNorm of h returned.

    h: float32 accumulation over K products may be off by K float32 roundings of sum |a||b| (per
    element), then one rounding to the dtype. y normalizes the rounded h, as the next kernel of a
    model would: one rounding of its own, plus float32's error summing the squares."""
    a64, b64 = a.double(), b.double()
    exact = a64 @ b64
    accumulation = a.shape[1] * 2.0**-24 / ULP[h.dtype] * (a64.abs() @ b64.abs())
    y_atol, y_rtol = reference.tolerance(y.dtype)
    return {
        "h = a @ b": compare(
            h, exact, atol=TINY[h.dtype], rtol=ULP[h.dtype], scale=exact.abs() + accumulation
        ),
        "y = rmsnorm(h) * w": compare(
            y, reference.rms_norm_fp64(h, w, eps), atol=y_atol, rtol=y_rtol
        ),
    }


@dataclass
class GemmNormLayers:
    """`layers` GEMM -> RMSNorm pairs chained as in a model: layer i's GEMM reads layer i-1's y.

    For timing: the buffers are fixed, so a CUDA graph can replay the calls, and every layer has its
    own weight b, so each GEMM reads its weight from memory as a model's layers do (a benchmark that
    repeats one GEMM finds its 32 MB weight in L2)."""

    x: torch.Tensor
    b: list[torch.Tensor]
    w: list[torch.Tensor]
    h: list[torch.Tensor]
    y: list[torch.Tensor]
    eps: float = 1e-6

    @classmethod
    def random(
        cls,
        tokens: int,
        hidden: int = 4096,
        layers: int = 8,
        dtype: torch.dtype = torch.bfloat16,
        seed: int = 0,
    ) -> "GemmNormLayers":
        g = generator(seed, runtime.DEVICE)
        x = random_tensor((tokens, hidden), dtype, runtime.DEVICE, g)
        # b scaled by 1/sqrt(hidden) keeps h of the order of x, layer after layer
        b = [
            (random_tensor((hidden, hidden), torch.float32, runtime.DEVICE, g) / hidden**0.5).to(
                dtype
            )
            for _ in range(layers)
        ]
        w = [random_tensor((hidden,), dtype, runtime.DEVICE, g) for _ in range(layers)]
        h = [torch.empty_like(x) for _ in range(layers)]
        return cls(x, b, w, h, [torch.empty_like(x) for _ in range(layers)])

    def input(self, layer: int) -> torch.Tensor:
        return self.x if layer == 0 else self.y[layer - 1]

    def run(self, pdl: bool = False) -> None:
        for i in range(len(self.b)):
            gemm_rms_norm(
                self.input(i), self.b[i], self.w[i], self.eps, pdl=pdl, out=(self.h[i], self.y[i])
            )

    def gemms(self) -> None:
        """The GEMMs alone (each reads the y its layer's input holds from the last `run`)."""
        for i in range(len(self.b)):
            matmul(self.input(i), self.b[i], self.h[i])

    def norms(self) -> None:
        """The norms alone, each launched normally."""
        for i in range(len(self.b)):
            rms_norm(self.h[i], self.w[i], self.eps, self.y[i])

    def outputs(self) -> list[torch.Tensor]:
        return self.h + self.y

    def check(self) -> dict[str, Comparison]:
        """Every layer's h and y against float64, from the layer's own input (after a `run`)."""
        return {
            f"layer {i}: {name}": cmp
            for i in range(len(self.b))
            for name, cmp in check_pair(
                self.input(i), self.b[i], self.w[i], self.eps, self.h[i], self.y[i]
            ).items()
        }
