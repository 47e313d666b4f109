"""Compile the Hopper matrix-multiply kernels for a GPU this machine does not have.

A kernel that runs on one architecture only (TMA and wgmma: sm_90; fp8: sm_89+) is still checked on
every machine: Triton compiles it for the target (front end, layouts, pipelining, ptxas) without a
driver, and what came out is counted in the PTX and in ptxas's report. The compile runs in a process
of its own, because a process that runs Triton's interpreter (CPU mode) cannot compile.

Each kernel module has `compile_for(arch, **options)` returning the compiled kernel;
`compile_offline(module, variants, arch)` runs it for each options dict and returns the counts.
"""

from __future__ import annotations

import json

from kernels.compile_report import run_compile_script

_SCRIPT = """
import json, re, sys
import importlib
module = importlib.import_module(sys.argv[2])
for options in json.loads(sys.argv[1]):
    kernel = module.compile_for(sys.argv[3], **options)
    sys.stdout.flush()
    ptx = kernel.asm["ptx"]
    wgmma = re.findall(r"wgmma\\.mma_async\\S*", ptx)
    print(json.dumps({
        "warps": kernel.metadata.num_warps, "shared_bytes": kernel.metadata.shared,
        "wgmma": len(wgmma), "wgmma_fp8": sum("e4m3" in w for w in wgmma),
        "mma_sync": ptx.count("mma.sync"), "tma_copies": ptx.count("cp.async.bulk.tensor"),
        "async_copies": len(re.findall(r"cp\\.async\\.c[ag]", ptx)),
        "mbarriers": ptx.count("mbarrier.try_wait"), "f32_adds": ptx.count("add.f32"),
        "register_budgets": sorted({int(n) for n in re.findall(r"setmaxnreg[.a-z0-9]*\\s+(\\d+)",
                                                              ptx)}),
        "target": re.search(r"\\.target\\s+(\\S+)", ptx).group(1)}), flush=True)
"""


def compile_offline(module: str, variants: list[dict], arch: str = "sm_90") -> list[dict]:
    """`module.compile_for(arch, **options)` for each options dict in `variants`, in one fresh
    process: per variant the warps, shared bytes, wgmma instructions (and how many multiply
    fp8 e4m3), mma.sync instructions, TMA copies, cp.async copies (global to shared, the software
    pipeline's without TMA), mbarrier waits, float32 adds (an fp8
    product's promotions into its fp32 accumulator), the `setmaxnreg` register
    budgets, the PTX target, and from ptxas the registers a thread and the bytes spilled."""
    return run_compile_script(
        _SCRIPT, [json.dumps(variants), module, arch], f"compiling {module} for {arch} failed", arch
    )


def compile_triton(
    fn,
    signature: dict,
    constants: dict,
    arch: str,
    num_warps: int,
    num_stages: int = 3,
    gluon: bool = False,
    divisible: tuple[str, ...] = (),
):
    """Compile a @triton.jit (or, with `gluon`, a @gluon.jit) function for `arch` ("sm_90") without
    a GPU. `signature` maps every parameter, in order, to its type string ("constexpr" for those in
    `constants`, a descriptor's from `descriptor_type`). `divisible` names the parameters a launch
    would mark divisible by 16 (16-byte-aligned tensors, integers that are multiples of 16):
    without the mark, the compiler cannot prove a load's alignment, so it issues narrower loads
    and declines cp.async, unlike the launch on a GPU."""
    import triton
    from triton.backends.compiler import GPUTarget

    if gluon:
        from triton.experimental.gluon._runtime import GluonASTSource as Source
    else:
        from triton.compiler import ASTSource as Source

    names = list(signature)
    constexprs = {(names.index(n),): value for n, value in constants.items()}
    target = GPUTarget("cuda", int(arch.removeprefix("sm_")), 32)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    return triton.compile(
        Source(fn, signature, constexprs, attrs),
        target=target,
        options={"num_warps": num_warps, "num_stages": num_stages},
    )


def descriptor_type(desc) -> str:
    """A host descriptor's type string in a kernel signature (Triton 3.6 has no __mangle__)."""
    from triton.runtime.jit import mangle_type

    return desc.__mangle__() if hasattr(desc, "__mangle__") else mangle_type(desc)
