"""Programmatic dependent launch (PDL) between the decode step's kernels, where the GPU has it.

Inside the CUDA graph a step is about 119 kernels at batch 1, and each boundary costs the gap
between two kernels plus the next kernel's ramp-up behind the previous one's tail
(PERFORMANCE.md, section 5.1). Module 02 (`kernels/rmsnorm/triton_pdl.py`) shows the Hopper
mechanism on one GEMM -> RMSNorm pair; here every decoder kernel of the step takes it:

* launched with `launch_pdl=True`, a kernel may start while the one before it still runs;
* its programs first call `gdc_wait` (PTX `griddepcontrol.wait`), which returns when the previous
  grid has completed and its writes are visible, before any load or store of global memory;
* then `gdc_launch_dependents`, which lets the next PDL kernel's programs be launched once every
  program of this grid has passed it.

Why both at the very start, in that order. Correctness rests on the wait alone, and it must cover
every earlier kernel, not only the previous one: the step's buffers are reused (the graph's memory
pool hands a freed activation to a later kernel, the attention workspace is rewritten every layer),
so a kernel must neither read a value nor overwrite a buffer that any earlier kernel still uses.
A kernel's wait returns when its predecessor has completed, and that predecessor completed only
after its own wait returned, so by induction every earlier kernel has completed: the chain holds
as long as every PDL kernel waits before its first memory access. Triggering after the wait keeps
at most two grids on the SMs (triggered before it, kernel N+2 could be launched while N still
runs, and the step's grids would pile onto the SMs behind it). A kernel launched normally (a
PyTorch kernel, module 02's norm, cuBLAS) waits for everything before it as always; the PDL kernel
after it starts when its programs have exited, an early start of nothing.

What comes before the wait is index arithmetic only: the weights are streamed in the loop, which
needs the activation from its first iteration on. So the saving is the gap and the launch of the
programs (PERFORMANCE.md, 5.1, has the prediction and the measurement). Asking the L2 for the
GEMVs' weights before the wait (`prefetch.global.L2`; the weights are read-only, so it is safe)
was tried and measured slower on an H200 than PDL alone, 0.45 ms a step for whole rows and
0.20 ms for each program's first two tiles (PERFORMANCE.md, 5.2).

`griddepcontrol` exists from sm_90 on and the interpreter cannot run it: `launch_options` gives
the plain launch where `runtime.has("pdl")` is False (CPU mode, before Hopper,
`KERNELS_GPU_PROFILE=a100`, an offline compile for sm_80), so the PDL flag never reaches such a
GPU. The default launch (pdl False) passes nothing: the kernels compile to what they were.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels import runtime


def available() -> bool:
    """Whether this GPU (or the offline compile target) runs PDL: Hopper or newer."""
    return runtime.has("pdl")


def launch_options(pdl: bool) -> dict:
    """The keyword arguments a decoder kernel's launch takes for `pdl`: the wait compiled in and
    the PDL launch attribute where PDL exists, nothing otherwise (the plain kernel)."""
    return {"PDL": True, "launch_pdl": True} if pdl and available() else {}


@triton.jit
def wait_then_release(PDL: tl.constexpr):
    """A decoder kernel's first step under PDL: wait for every earlier kernel (see above), then
    let the next kernel's programs be launched. Compiled out when PDL is False."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
