"""Compiling the Gluon kernels for Hopper (sm_90) without a GPU: what the CPU tests and notebook 03h
read of the compiler's output (the PTX's wgmma, TMA and setmaxnreg instructions, ptxas's registers
and spills). A kernel module says how to compile its kernel (its `compile_for_hopper(head_dim,
dtype, causal, **schedule)`, built on `compile_sm90`); `compile_offline_many` runs that in a fresh
process, since a process running Triton's interpreter cannot compile Gluon.
"""

from __future__ import annotations

import triton


def compile_sm90(kernel, signature: dict, constants: dict):
    """Compile a Gluon kernel for sm_90 without a GPU: `signature` maps every parameter, in order,
    to its type string (a descriptor's from `descriptor_type`), `constants` the constexpr ones to
    their values. The front end, the layouts, the warp specialization and ptxas all run; returns
    the compiled kernel (its .asm has the PTX)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    names = list(signature)
    constexprs = {(names.index(n),): value for n, value in constants.items()}
    source = GluonASTSource(kernel, signature, constexprs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})


def descriptor_type(desc) -> str:
    """A descriptor's type string in a kernel signature; Triton 3.6 has no __mangle__ method."""
    from triton.runtime.jit import mangle_type

    return desc.__mangle__() if hasattr(desc, "__mangle__") else mangle_type(desc)


_OFFLINE = """
import json, re, sys
import importlib
import torch
module = importlib.import_module(sys.argv[2])
for head_dim, dtype, causal, schedule in json.loads(sys.argv[1]):
    kernel = module.compile_for_hopper(head_dim, getattr(torch, dtype), causal, **schedule)
    sys.stdout.flush()
    ptx = kernel.asm["ptx"]
    regs = sorted({int(n) for n in re.findall(r"setmaxnreg[.a-z0-9]*\\s+(\\d+)", ptx)})
    print(json.dumps({"warps": kernel.metadata.num_warps, "shared_bytes": kernel.metadata.shared,
                      "wgmma": ptx.count("wgmma.mma_async"), "setmaxnreg": ptx.count("setmaxnreg"),
                      "register_budgets": regs, "tma_copies": ptx.count("cp.async.bulk.tensor")}),
          flush=True)
"""


def compile_offline_many(variants: list, module: str) -> list[dict]:
    """`compile_for_hopper` of the module named `module` for each (head_dim, dtype name, causal,
    schedule) in `variants`, all in one fresh process (torch and Triton imported once): for each,
    what the compiler emitted, counted in the PTX (warps, shared bytes, wgmma and TMA instructions,
    `setmaxnreg` instructions and the register counts they set, `register_budgets`), and from
    ptxas's report the registers a thread at launch and the bytes spilled to local memory."""
    import json

    from kernels.compile_report import run_compile_script

    args = [json.dumps(variants), module]
    return run_compile_script(_OFFLINE, args, "compiling for sm_90 failed", "sm_90")
